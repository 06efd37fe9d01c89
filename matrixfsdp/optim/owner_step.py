"""The local optimizer step over the matrices this rank owns (no communication).

A rank owns (a) whole matrices placed on it by the plan and (b) the local experts of sharded
stacks (FSDP2 ``Shard(0)`` of an ``(E, m, n)`` stack holds whole experts; see
[Note: plan vocabulary]). Both are stepped from their local tensors, through their canonical
``(out, in)`` views cut into blocks (see [Note: matrix views]); sharded-stack state is kept as
``Shard(0)`` DTensors so checkpoints reshard it like any FSDP2 state.

[Note: owner step transients]
What an owner's step allocates beyond its parameters, gradients and state, and how it is bounded
(measured per rank by ``python -m benchmarks.memory``; ``benchmarks.step_memory``; BENCHMARKS §20):
- One matrix, Muon: the Newton–Schulz input ``X`` in ``ns_dtype`` (in bf16 built from the fp32
  gradient and momentum a chunk of rows at a time: the larger of 1 MiB and a sixteenth of the
  matrix, at least 64 rows; so no fp32 copy of the direction exists),
  normalised in place (in fp32 the Nesterov direction itself); per iteration the Gram ``A`` and
  ``B = bA + cA²``, ``A`` freed, then ``X <- aX + BX`` in place a block of columns at a time
  (block ``j`` of ``BX`` reads only block ``j`` of ``X``; a block holds ``B``'s bytes, at least
  1 MiB and 256 columns); the update is added to the parameter in place, casting as it reads.
  Peak: ``|X| + max(2k², k² + k c)`` elements of ``ns_dtype`` (``k = min(m, n)``, ``c`` the
  block's columns). Matrices that do not split into two blocks (squarer than 1:2, or small), and
  the first iterate of a tall bf16 matrix (a column-major bf16 ``X`` in place would round
  differently from ``torch.optim.Muon``), take a new iterate: ``2|X| + k²``. Against the fp32
  matrix: fp32 1.5× a 1:4 matrix, 2× a 1:2 one, 3× a square one (were 2.25×, 2.5×, 3×; 3.5×,
  4×, 5× before the input was built in place); bf16 0.88× (1:4), 1× (1:2, wide), 1.25× (1:2,
  tall), 1.5× (square).
- A batch (``batch_same_shape``): ``step_owned`` stacks each item's parameter, gradient and
  state into ``(B, *shape)`` copies, then runs the step's own transients on the batch. Batches
  are cut by those stacked bytes (``StepBatching.max_bytes``; default the larger of the largest
  item's and ``DEFAULT_BATCH_BYTES``), not by a count of matrices: one batched Muon call adds
  at most 1.5× the cap with bf16 Newton–Schulz (2× with fp32), whatever the number of
  same-shape matrices (uncapped, it grew with every one: 22× the matrix for four).
- Blocks of a row layout (``RowLayout``: gathered rows) are gathered into copies of parameter and
  gradient by ``step_owned`` for its batch only and scattered back before it returns (they were
  all gathered before the first step: two copies of every such matrix at once); in a batch
  those copies come on top of the stacks, up to 2/3 of the cap more for Muon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .layouts import (
    MatrixLayout,
    block_row_indices,
    block_state_key,
    block_views,
    canonical_view,
)
from .registry import MatrixOptimizerSpec

__all__ = [
    "DEFAULT_BATCH_BYTES", "OwnedMatrix", "StepBatching", "batch_owned", "init_owned_state",
    "local", "owned_blocks", "resolve_batching", "stacked_bytes", "step_owned", "write_back_rows",
]

_WHOLE = MatrixLayout()

DEFAULT_BATCH_BYTES = 16 << 20
"""Floor of the default cap on a batch's stacked bytes (see [Note: owner step transients])."""


class OwnedMatrix(NamedTuple):
    """One parameter's local whole matrices, their gradient and their state tensors."""

    param: Tensor
    grad: Tensor
    state: dict[str, Tensor]  # local views, without "step"
    step: int
    # A block of gathered rows: (parameter view, gradient view, row indices); until step_owned
    # gathers it, ``param`` and ``grad`` are zero-stride placeholders of the block's shape.
    home: tuple[Tensor, Tensor, Tensor] | None = None


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def init_owned_state(
    p: Tensor, spec: MatrixOptimizerSpec, config: Any, layout: MatrixLayout = _WHOLE
) -> dict[str, Tensor]:
    """Fresh state for ``p`` (plus a float32 ``step``), as DTensors for a sharded stack.

    One set of state per block of the canonical view, in that orientation, contiguous.
    """
    blocks = block_views(local(p), layout)
    tensors = {}
    for index, block in enumerate(blocks):
        for key, value in spec.init_state_fn(block, config).items():
            tensors[block_state_key(key, index, len(blocks))] = value.contiguous()
    if isinstance(p, DTensor):
        tensors = {k: _as_stack_dtensor(v, p) for k, v in tensors.items()}
    # A host tensor on every device, as torch.optim keeps it: reading it never syncs a device.
    tensors["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
    return tensors


def _as_stack_dtensor(t: Tensor, like: DTensor) -> DTensor:
    shape = (like.shape[0], *t.shape[1:])
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def owned_blocks(
    p: Tensor, state: dict[str, Tensor], layout: MatrixLayout, grad: Tensor | None = None
) -> list[OwnedMatrix]:
    """The blocks of ``p`` to step: canonical views of parameter and gradient (``grad``, else
    ``p.grad``), with their state."""
    grad = p.grad if grad is None else grad
    assert grad is not None  # the caller steps parameters with gradients only
    step = int(state["step"].item())  # a host tensor (init_owned_state): no device sync
    keys = [k for k in state if k != "step"]
    if layout.rows:
        return _gathered_blocks(p, grad, state, layout, step, keys)
    params = block_views(local(p), layout)
    grads = block_views(local(grad), layout)
    if len(params) == 1:
        return [OwnedMatrix(params[0], grads[0], {k: local(state[k]) for k in keys}, step)]
    n = len(params)
    base = _block_keys(keys, n)
    return [
        OwnedMatrix(param, grad, {k: local(state[block_state_key(k, i, n)]) for k in base}, step)
        for i, (param, grad) in enumerate(zip(params, grads, strict=True))
    ]


def _block_keys(keys: list[str], n: int) -> list[str]:
    first = block_state_key("", 0, n)  # the suffix of block 0's keys
    return [k.removesuffix(first) for k in keys if k.endswith(first)]


def _gathered_blocks(
    p: Tensor, grad: Tensor, state: dict[str, Tensor], layout: MatrixLayout, step: int,
    keys: list[str],
) -> list[OwnedMatrix]:
    """A row layout's blocks, not gathered yet: ``step_owned`` gathers each batch's blocks
    (``index_select`` copies of parameter and gradient) just before stepping them and scatters
    them back right after, so one batch's copies are alive at a time, not every matrix's."""
    pview = canonical_view(local(p), layout.orientation)
    gview = canonical_view(local(grad), layout.orientation)
    rows_of = block_row_indices(layout, pview.device)
    n = len(rows_of)
    base = _block_keys(keys, n) if n > 1 else keys
    items = []
    for i, rows in enumerate(rows_of):
        shape = (*pview.shape[:-2], rows.numel(), pview.shape[-1])
        state_i = {k: local(state[block_state_key(k, i, n) if n > 1 else k]) for k in base}
        items.append(OwnedMatrix(_placeholder(pview, shape), _placeholder(gview, shape), state_i,
                                 step, (pview, gview, rows)))
    return items


def _placeholder(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A zero-stride tensor with ``like``'s dtype and device and ``shape``: what batching and
    staging read (shape, dtype, device, bytes) without the block's bytes."""
    return like.new_empty(()).expand(shape)


def _gather(item: OwnedMatrix) -> OwnedMatrix:
    if item.home is None:
        return item
    pview, gview, rows = item.home
    return item._replace(param=pview.index_select(-2, rows), grad=gview.index_select(-2, rows))


def write_back_rows(items: Sequence[OwnedMatrix]) -> None:
    """Copy each gathered block (a row layout's) into its parameter's rows. ``step_owned``
    does this for the blocks it gathered; placeholders (not gathered) are skipped."""
    for item in items:
        if item.home is not None and any(item.param.stride()):
            pview, _, rows = item.home
            pview.index_copy_(-2, rows, item.param)


@dataclass(frozen=True)
class StepBatching:
    """How an owner groups same-shape matrices into one step call (``(B, m, n)`` stacks).

    ``same_shape``: batch same-shape items at all. ``max_bytes``: the most bytes one batched
    call may stack (each item's parameter, gradient and state tensors; an item above it steps
    alone); ``None`` means ``max(largest item's bytes, DEFAULT_BATCH_BYTES)`` among the items of
    the call. See [Note: owner step transients].
    """

    same_shape: bool = False
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.same_shape, bool):
            raise ValueError(f"StepBatching.same_shape must be a bool, got {self.same_shape!r}")
        cap = self.max_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"StepBatching.max_bytes must be None or an int >= 1, got {cap!r}")

    def cap(self, items: Sequence[OwnedMatrix]) -> int:
        """The byte cap for a step call over ``items``."""
        if self.max_bytes is not None:
            return self.max_bytes
        return max([DEFAULT_BATCH_BYTES, *(stacked_bytes(item) for item in items)])


def resolve_batching(value: bool | StepBatching | None, default: bool) -> StepBatching:
    """``MatrixOptimizer(batch_same_shape=...)`` as a policy: a bool (``None``: ``default``)
    batches under the default cap; a ``StepBatching`` is used as it is."""
    if isinstance(value, StepBatching):
        return value
    return StepBatching(default if value is None else bool(value))


def stacked_bytes(item: OwnedMatrix) -> int:
    """Bytes ``step_owned`` copies to stack ``item`` into a batch: parameter, gradient, state."""
    tensors = (item.param, item.grad, *item.state.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def batch_owned(
    items: Sequence[OwnedMatrix], same_shape: bool | StepBatching
) -> list[list[OwnedMatrix]]:
    """Items grouped by (shape, dtypes, device, step count), in order, each group cut into
    batches of at most the policy's stacked bytes; singletons if batching is disabled."""
    policy = same_shape if isinstance(same_shape, StepBatching) else StepBatching(bool(same_shape))
    if not policy.same_shape:
        return [[item] for item in items]
    groups: dict[tuple, list[OwnedMatrix]] = {}
    for item in items:
        key = (tuple(item.param.shape), item.param.dtype, item.grad.dtype, item.param.device,
               item.step, tuple(sorted(item.state)))
        groups.setdefault(key, []).append(item)
    cap = policy.cap(items)
    batches: list[list[OwnedMatrix]] = []
    for group in groups.values():
        per_item = stacked_bytes(group[0])  # one shape and dtype per group
        size = max(1, cap // max(1, per_item))
        batches += [group[i:i + size] for i in range(0, len(group), size)]
    return batches


def step_owned(spec: MatrixOptimizerSpec, batch: Sequence[OwnedMatrix], hyper: dict[str, Any]) -> None:
    """One step on a batch: a direct call for one item, else on ``(B, *shape)`` stacks.

    Stacking copies each item's parameter, gradient and state (``stacked_bytes``), which
    ``batch_owned`` caps per call (see [Note: owner step transients]). Blocks of a row layout are
    gathered here and scattered back before it returns.
    """
    gathered = [_gather(item) for item in batch]
    _step_batch(spec, gathered, hyper)
    write_back_rows(gathered)


def _step_batch(spec: MatrixOptimizerSpec, batch: Sequence[OwnedMatrix], hyper: dict[str, Any]) -> None:
    step = batch[0].step
    if len(batch) == 1:
        item = batch[0]
        spec.step_fn(item.param, item.grad, item.state, step=step, **hyper)
        return
    keys = list(batch[0].state)
    param = torch.stack([item.param for item in batch])
    grad = torch.stack([item.grad for item in batch])
    stacked = {k: torch.stack([item.state[k] for item in batch]) for k in keys}
    spec.step_fn(param, grad, stacked, step=step, **hyper)
    for i, item in enumerate(batch):
        item.param.copy_(param[i])
        for k in keys:
            item.state[k].copy_(stacked[k][i])
