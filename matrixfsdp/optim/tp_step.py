"""The exact optimizer step of TP matrices: the whole matrix is stepped on one tp rank.

[Note: TP step exchange]
Vocabulary (*TP matrix*, *TP shard*, *owner row*: [Note: TP matrices] in ``runtime/tp.py``):
- The optimizer must see the whole matrix (Muon's Newton-Schulz on a TP shard is another
  algorithm), so within the owner row each TP matrix has a *step owner*, a tp rank that steps it
  whole. Every tp rank of the row lists the row's TP matrices in plan order and assigns step
  owners alike from global shapes only (``assign_step_owners``): LPT over ``step_cost`` of the
  global shape, longest first onto the least-loaded tp rank, ties by list index, then rank.
- ``step_cost``: the planner's FLOP model of the optimizer when it has one (``muon``,
  ``shampoo``, ``soap``, ``okls``, ``emagram``), ``m*n`` for ``adamw`` (elementwise), else the
  proxy ``m*n*min(m, n)`` (a Gram or Newton-Schulz product) for a user-registered optimizer.
- A *wave* holds the j-th largest matrix of every step owner; a *bucket* is a run of
  consecutive waves in which no step owner's whole parameter and gradient bytes pass
  ``TP_STEP_BUCKET_BYTES`` (a wave of larger matrices is a bucket alone; ``bucket_plan``), so
  every step owner has work in every bucket, however large the matrices. Per bucket:
  - the *gather exchange*, one ``all_to_all_single`` in the tp group: every tp rank sends its
    TP shard of parameter and gradient of each matrix to the matrix's step owner; the step owner
    keeps its own shards in place and concatenates all of them along ``shard_dim`` into the
    *whole* parameter and gradient;
  - the step owner steps its whole matrices with the owner machinery (state init, offload
    staging, blocks of ``split``, ``batch_same_shape``: ``WholeStepper``) and writes its own
    slice back into its TP shard;
  - the *return exchange*, one ``all_to_all_single``: the step owner sends every other tp rank
    its slice of the updated parameter, copied into that rank's TP shard.
- Overlap: bucket k+1's gather exchange is issued (``async_op=True``) before bucket k is stepped
  and bucket k's return exchange is completed after bucket k+1 is stepped, so both hide behind
  the step math; at most three buckets' exchange buffers are alive at once.
- Wire format: one ``uint8`` buffer per exchange, so parameters and gradients of any dtypes
  travel together. A rank's chunk for one peer is its segments in bucket order (parameter then
  gradient per matrix for the gather exchange, the parameter slice for the return exchange),
  each segment starting at a multiple of its element size, the chunk padded to the bucket's
  widest element size: with one dtype nothing is padded. ``TpStepStats.bytes_sent`` counts the
  bytes this rank sends to other tp ranks: per step owner, the gradient and parameter shards of
  the other tp ranks in and their parameter slices out.
- State: the step owner keeps the whole matrix's state (as if it owned the matrix whole), keyed
  by its own TP shard parameter; the other tp ranks keep none (like non-owners).
- No byte crosses dp: both exchanges run in the tp group of the owner row.
- Agreement: every tp rank of the row must list the same matrices, i.e. agree on which have a
  gradient. They do when they run the same SPMD module code (TP's forward); a tp rank whose TP
  shard is empty (``torch.chunk`` sizes) and got no gradient sends an empty one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from ..planner import COST_MODELS, matrix_cost
from .agreement import StepFailures
from .layouts import MatrixLayout
from .offload import OnDevice, StatePlacement
from .owner_step import (
    OwnedMatrix,
    StepBatching,
    batch_owned,
    init_owned_state,
    owned_blocks,
    step_owned,
    write_back_rows,
)
from .registry import MatrixOptimizerSpec

if TYPE_CHECKING:  # annotations only: the optimizer does not import the runtime's TP module
    from ..runtime.tp import TpLayout

__all__ = [
    "TP_STEP_BUCKET_BYTES",
    "TpMatrix",
    "TpStepStats",
    "WholeMatrix",
    "WholeStepper",
    "assign_step_owners",
    "bucket_plan",
    "step_cost",
    "step_tp_matrices",
    "tp_step_owners",
]

logger = logging.getLogger(__name__)

# Whole parameter + gradient bytes per bucket (see [Note: TP step exchange]): large enough that
# an exchange moves a useful amount, small enough that a few buckets overlap a step.
TP_STEP_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class TpMatrix:
    """One TP matrix of this rank's owner row, as the step exchange sees it."""

    fqn: str
    param: Tensor  # this tp rank's TP shard (its ``.grad`` the shard's gradient); the state key
    tp: TpLayout
    step_owner: int  # tp rank that steps the whole matrix (``assign_step_owners``)
    layout: MatrixLayout = field(default_factory=MatrixLayout)  # whole matrix: orientation, blocks

    def grad(self) -> Tensor:
        grad = self.param.grad
        if grad is not None:
            return grad.detach()
        if self.param.numel() == 0:  # an empty TP shard: nothing to send
            return torch.empty_like(self.param.detach())
        raise ValueError(
            f"TP matrix {self.fqn!r} (TP shard {tuple(self.param.shape)} of global shape "
            f"{self.tp.global_shape}) has no gradient on tp rank {self.tp.tp_rank}; list only "
            "matrices with gradients, alike on every tp rank of the owner row"
        )

    def grad_dtype(self) -> torch.dtype:
        grad = self.param.grad
        return self.param.dtype if grad is None else grad.dtype


class WholeMatrix(NamedTuple):
    """A TP matrix made whole on its step owner: the step updates ``param`` in place."""

    matrix: TpMatrix
    param: Tensor  # global shape, stored orientation
    grad: Tensor


StepWhole = Callable[[Sequence[WholeMatrix]], None]


@dataclass
class TpStepStats:
    """What one ``step_tp_matrices`` call did on this rank."""

    bytes_sent: int = 0  # bytes sent to other tp ranks, both exchanges
    buckets: int = 0
    stepped: list[str] = field(default_factory=list)  # FQNs this rank stepped whole


# -- step owners ----------------------------------------------------------------------------------
def step_cost(shape: Sequence[int], optimizer: str) -> float:
    """Cost of one step of ``optimizer`` on a matrix of ``shape`` (see [Note: TP step exchange])."""
    m, n = int(shape[-2]), int(shape[-1])
    if optimizer in COST_MODELS:
        return matrix_cost(shape, optimizer)
    if optimizer == "adamw":
        return matrix_cost(shape, "bytes")
    return float(math.prod(shape[:-2]) * m * n * min(m, n))


def assign_step_owners(costs: Sequence[float], tp_size: int) -> list[int]:
    """LPT: each matrix (longest first, ties by index) onto the least-loaded tp rank (ties by
    rank). Deterministic, so every tp rank computes the same assignment."""
    if tp_size < 1:
        raise ValueError(f"assign_step_owners: tp_size must be >= 1, got {tp_size}")
    loads = [0.0] * tp_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(tp_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def tp_step_owners(matrices: Sequence[tuple[str, TpLayout]], optimizer: str) -> list[int]:
    """Step owners of an owner row's TP matrices ``(fqn, layout)``, listed in plan order:
    ``assign_step_owners`` within each tp group over ``step_cost`` of the global shapes."""
    owners = [0] * len(matrices)
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (_, tp) in enumerate(matrices):
        groups.setdefault(tuple(dist.get_process_group_ranks(tp.group)), []).append(index)
    for indices in groups.values():
        tp_size = matrices[indices[0]][1].tp_size
        costs = [step_cost(matrices[i][1].global_shape, optimizer) for i in indices]
        for index, owner in zip(indices, assign_step_owners(costs, tp_size), strict=True):
            owners[index] = owner
    return owners


# -- stepping whole matrices on the step owner ----------------------------------------------------
@dataclass
class WholeStepper:
    """Steps whole matrices as ``MatrixOptimizer`` steps the matrices it owns.

    ``state`` maps a TP shard parameter to its whole matrix's state (``MatrixOptimizer.state``);
    ``hyper`` holds ``lr``, ``weight_decay``, ``initial_lr`` and ``config``.
    """

    spec: MatrixOptimizerSpec
    hyper: Mapping[str, Any]
    state: MutableMapping[Tensor, dict[str, Any]]
    placement: StatePlacement = field(default_factory=OnDevice)
    batch_same_shape: bool | StepBatching = False
    failures: StepFailures | None = None  # agree_on_error: record, let the exchange go on
    # Default: drops wholes whose gradient is not finite (they go back unchanged).
    on_nonfinite: Callable[[list[str], list[WholeMatrix]], list[WholeMatrix]] | None = None

    def __call__(self, wholes: Sequence[WholeMatrix]) -> None:
        if self.failures is None:
            if self.on_nonfinite is not None:
                wholes = self.on_nonfinite([w.matrix.fqn for w in wholes], list(wholes))
            self._step(wholes)
            return
        grads = [w.grad for w in wholes]
        self.failures.watch([w.matrix.fqn for w in wholes], grads)
        try:
            self._step(wholes)
        except Exception as exc:  # agreed on every rank after the exchange (agree_on_step)
            self.failures.record([w.matrix.fqn for w in wholes], exc, grads)

    def _step(self, wholes: Sequence[WholeMatrix]) -> None:
        items: list[OwnedMatrix] = []
        for whole in wholes:
            state = self.state.setdefault(whole.matrix.param, {})
            if not state:
                state.update(init_owned_state(whole.param, self.spec, self.hyper["config"],
                                              whole.matrix.layout))
            self.placement.adopt(state)
            state["step"] += 1
            items += owned_blocks(whole.param, state, whole.matrix.layout, grad=whole.grad)
        for batch in self.placement.staged(batch_owned(items, self.batch_same_shape)):
            step_owned(self.spec, batch, dict(self.hyper))
        write_back_rows(items)  # a row layout's gathered blocks, before the return exchange


# -- the exchange ---------------------------------------------------------------------------------
class _Segment(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _chunk(segments: Sequence[_Segment], align: int) -> tuple[list[int], int]:
    """Byte offsets of ``segments`` in one peer's chunk and the chunk's padded size."""
    offsets, pos = [], 0
    for seg in segments:
        size = seg.dtype.itemsize
        pos = -(-pos // size) * size
        offsets.append(pos)
        pos += seg.nbytes
    return offsets, -(-pos // align) * align


class _InFlight:
    """One ``all_to_all_single`` of a bucket: issued at construction, read by ``wait``."""

    def __init__(self, group: dist.ProcessGroup, send: Sequence[Sequence[Tensor]],
                 recv: Sequence[Sequence[_Segment]], align: int, device: torch.device,
                 label: str) -> None:
        send_layouts = [_chunk([_Segment(tuple(t.shape), t.dtype) for t in ts], align)
                        for ts in send]
        recv_layouts = [_chunk(segs, align) for segs in recv]
        in_splits = [size for _, size in send_layouts]
        out_splits = [size for _, size in recv_layouts]
        inp = torch.empty(sum(in_splits), dtype=torch.uint8, device=device)
        base = 0
        for tensors, (offsets, size) in zip(send, send_layouts, strict=True):
            for t, off in zip(tensors, offsets, strict=True):
                if t.numel():
                    inp[base + off:base + off + t.numel() * t.element_size()].view(
                        t.dtype).view(t.shape).copy_(t)
            base += size
        self.out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        self.recv, self.recv_layouts, self.bytes_sent = recv, recv_layouts, sum(in_splits)
        self._inp = inp  # alive until the exchange completes
        with record_function(label):
            self.work = dist.all_to_all_single(self.out, inp, out_splits, in_splits,
                                               group=group, async_op=True)

    def wait(self) -> list[list[Tensor]]:
        """Per source tp rank, its segments as typed views of the receive buffer."""
        self.work.wait()
        self._inp = None
        views, base = [], 0
        for segs, (offsets, size) in zip(self.recv, self.recv_layouts, strict=True):
            views.append([
                self.out[base + off:base + off + seg.nbytes].view(seg.dtype).view(seg.shape)
                if seg.nbytes else torch.empty(seg.shape, dtype=seg.dtype, device=self.out.device)
                for seg, off in zip(segs, offsets, strict=True)
            ])
            base += size
        return views


def _bucket_align(bucket: Sequence[TpMatrix]) -> int:
    return max(max(m.param.dtype.itemsize, m.grad_dtype().itemsize) for m in bucket)


def _start_gather(bucket: Sequence[TpMatrix], group: dist.ProcessGroup, me: int,
                  size: int) -> _InFlight:
    """Every TP shard of parameter and gradient to its matrix's step owner."""
    send: list[list[Tensor]] = [[] for _ in range(size)]
    recv: list[list[_Segment]] = [[] for _ in range(size)]
    for m in bucket:
        if m.step_owner != me:
            send[m.step_owner] += [m.param.detach(), m.grad()]
            continue
        for src in range(size):
            if src != me:
                shape = m.tp.shape_on(src)
                recv[src] += [_Segment(shape, m.param.dtype), _Segment(shape, m.grad_dtype())]
    return _InFlight(group, send, recv, _bucket_align(bucket), bucket[0].param.device,
                     "matrixfsdp::tp_step_exchange")


def _wholes(bucket: Sequence[TpMatrix], gathered: list[list[Tensor]], me: int,
            size: int) -> list[WholeMatrix]:
    """The step owner's matrices of ``bucket``, concatenated from the received TP shards."""
    cursor = [0] * size
    wholes = []
    for m in bucket:
        if m.step_owner != me:
            continue
        params, grads = [], []
        for src in range(size):
            if src == me:
                params.append(m.param.detach())
                grads.append(m.grad())
            else:
                params.append(gathered[src][cursor[src]])
                grads.append(gathered[src][cursor[src] + 1])
                cursor[src] += 2
        dim = m.tp.shard_dim
        wholes.append(WholeMatrix(m, torch.cat(params, dim), torch.cat(grads, dim)))
    return wholes


def _start_return(bucket: Sequence[TpMatrix], wholes: Sequence[WholeMatrix],
                  group: dist.ProcessGroup, me: int, size: int) -> _InFlight:
    """The updated parameter slices from each step owner to every other tp rank."""
    send: list[list[Tensor]] = [[] for _ in range(size)]
    for whole in wholes:
        for dst in range(size):
            if dst != me:
                send[dst].append(whole.matrix.tp.slice_of(whole.param, dst))
    recv: list[list[_Segment]] = [[] for _ in range(size)]
    for m in bucket:
        if m.step_owner != me:
            recv[m.step_owner].append(_Segment(tuple(m.param.shape), m.param.dtype))
    return _InFlight(group, send, recv, _bucket_align(bucket), bucket[0].param.device,
                     "matrixfsdp::tp_step_return")


def _finish_return(bucket: Sequence[TpMatrix], returning: _InFlight, me: int, size: int) -> None:
    received = returning.wait()
    cursor = [0] * size
    for m in bucket:
        if m.step_owner != me:
            m.param.detach().copy_(received[m.step_owner][cursor[m.step_owner]])
            cursor[m.step_owner] += 1


# -- driver ---------------------------------------------------------------------------------------
def _buckets(matrices: Sequence[TpMatrix], bucket_bytes: int) -> list[list[TpMatrix]]:
    """The matrices cut into waves (see [Note: TP step exchange]), via ``bucket_plan``."""
    nbytes = [math.prod(m.tp.global_shape) * (m.param.dtype.itemsize + m.grad_dtype().itemsize)
              for m in matrices]
    costs = [float(n) for n in nbytes]
    plan = bucket_plan(nbytes, [m.step_owner for m in matrices], costs, bucket_bytes)
    return [[matrices[i] for i in bucket] for bucket in plan]


def bucket_plan(nbytes: Sequence[int], owners: Sequence[int], costs: Sequence[float],
                bucket_bytes: int) -> list[list[int]]:
    """Buckets of matrix indices: *waves*, wave j holding the j-th largest (by ``costs``) matrix
    of every step owner, consecutive waves merged while no step owner's whole bytes in the
    bucket pass ``bucket_bytes``. Every step owner computes in every bucket it has work for, so
    the pipeline keeps all tp ranks busy even when each matrix is larger than a bucket."""
    mine: dict[int, list[int]] = {}
    for index, owner in enumerate(owners):
        mine.setdefault(owner, []).append(index)
    for indices in mine.values():
        indices.sort(key=lambda i: (-costs[i], i))
    depth = max((len(v) for v in mine.values()), default=0)
    waves = [[v[j] for _, v in sorted(mine.items()) if j < len(v)] for j in range(depth)]
    buckets: list[list[int]] = []
    load: dict[int, int] = {}
    for wave in waves:
        if buckets and all(load.get(owners[i], 0) + nbytes[i] <= bucket_bytes for i in wave):
            buckets[-1] += wave
        else:
            buckets.append(list(wave))
            load = {}
        for i in wave:
            load[owners[i]] = load.get(owners[i], 0) + nbytes[i]
    return buckets


def _by_tp_group(matrices: Sequence[TpMatrix]) -> Iterator[list[TpMatrix]]:
    """The matrices of each tp group (keyed by its ranks), in first-seen order."""
    groups: dict[tuple[int, ...], list[TpMatrix]] = {}
    for m in matrices:
        groups.setdefault(tuple(dist.get_process_group_ranks(m.tp.group)), []).append(m)
    yield from groups.values()


def _check(matrices: Sequence[TpMatrix]) -> None:
    for m in matrices:
        if tuple(m.param.shape) != m.tp.local_shape:
            raise ValueError(
                f"TP matrix {m.fqn!r}: this tp rank ({m.tp.tp_rank}) holds a tensor of shape "
                f"{tuple(m.param.shape)}, not its TP shard {m.tp.local_shape} of global shape "
                f"{m.tp.global_shape}; list only the owner row's TP shards"
            )
        if not 0 <= m.step_owner < m.tp.tp_size:
            raise ValueError(
                f"TP matrix {m.fqn!r} (global shape {m.tp.global_shape}): step owner "
                f"{m.step_owner} is not a tp rank of a tp group of {m.tp.tp_size}"
            )


@torch.no_grad()
def step_tp_matrices(matrices: Sequence[TpMatrix], step_whole: StepWhole, *,
                     bucket_bytes: int = TP_STEP_BUCKET_BYTES) -> TpStepStats:
    """Step every listed TP matrix whole on its step owner (see [Note: TP step exchange]).

    Collective over the tp group of the matrices: every tp rank of the owner row calls it with
    the same matrices in the same order. ``step_whole`` updates the whole parameters in place
    (``WholeStepper``); each rank's TP shard then holds its slice of the result.
    """
    _check(matrices)
    stats = TpStepStats()
    for group_matrices in _by_tp_group(matrices):
        _step_group(group_matrices, step_whole, bucket_bytes, stats)
    return stats


def _step_group(matrices: Sequence[TpMatrix], step_whole: StepWhole, bucket_bytes: int,
                stats: TpStepStats) -> None:
    tp = matrices[0].tp
    group, me, size = tp.group, tp.tp_rank, tp.tp_size
    buckets = _buckets(matrices, bucket_bytes)
    gathering = _start_gather(buckets[0], group, me, size)
    returning: tuple[list[TpMatrix], _InFlight] | None = None
    for k, bucket in enumerate(buckets):
        gathered = gathering.wait()
        stats.bytes_sent += gathering.bytes_sent
        if k + 1 < len(buckets):  # in flight while this bucket steps
            gathering = _start_gather(buckets[k + 1], group, me, size)
        wholes = _wholes(bucket, gathered, me, size)
        with record_function("matrixfsdp::tp_step"):
            if wholes:
                step_whole(wholes)
            for whole in wholes:
                whole.matrix.param.detach().copy_(whole.matrix.tp.slice_of(whole.param, me))
        stats.stepped += [whole.matrix.fqn for whole in wholes]
        current = _start_return(bucket, wholes, group, me, size)
        stats.bytes_sent += current.bytes_sent
        if returning is not None:
            _finish_return(*returning, me, size)
        returning = (bucket, current)
    assert returning is not None  # there is at least one bucket
    _finish_return(*returning, me, size)
    stats.buckets += len(buckets)
    logger.debug("matrixfsdp: TP step of %d matrices in %d buckets: %d bytes sent, stepped %s",
                 len(matrices), len(buckets), stats.bytes_sent, stats.stepped)
