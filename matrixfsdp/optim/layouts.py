"""How the matrix optimizer sees each parameter: the ``(out, in)`` orientation and fused blocks.

[Note: matrix views]
- The optimizer steps the *canonical view* of every matrix: the ``(*, out, in)`` weight of the
  equivalent ``nn.Linear`` (see [Note: plan vocabulary]): the tensor itself for ``"out_in"``,
  ``p.mT`` for ``"in_out"`` (Hugging Face ``Conv1D``), ``p.view(out, -1)`` for ``"flatten"``.
  Views write through, so the step functions update the stored parameter in place and every
  shape rule they apply (Muon's learning-rate scale, OKLS/EMA-Gram shape factors, which Kronecker
  factor is left or right) sees the ``(out, in)`` matrix.
- A *split* cuts the canonical matrix into blocks of given sizes along its output dim (rows:
  ``q | k | v`` of a fused attention projection, ``gate | up`` of a fused MLP or expert stack);
  each block is stepped as a separate matrix with its own state. Blocks are contiguous row
  ranges: an interleaved fusion (gate and up rows alternating) cannot be split. No parameter is
  split unless asked (``MatrixOptimizer(..., split=...)``): the default steps the matrix the model
  defines, as ``torch.optim.Muon`` would.
- Optimizer state is kept in the canonical orientation, one set per block: the step function's
  own keys when unsplit, ``"<key>@<i>"`` for block ``i`` of a split matrix. Checkpoints store
  these tensors as they are; the split is recorded in the matrix param group (``"split"``) and
  loading state saved with another split or orientation is refused.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..planner import Plan

__all__ = [
    "MatrixLayout",
    "SplitSpec",
    "block_state_key",
    "block_views",
    "canonical_view",
    "resolve_split",
]

SplitSizes = int | Sequence[int]
SplitSpec = Mapping[str, SplitSizes] | Callable[[str, tuple[int, ...]], SplitSizes | None]


class MatrixLayout(NamedTuple):
    """How one parameter is stepped: its stored orientation and its block sizes (rows)."""

    orientation: str = "out_in"
    split: tuple[int, ...] = ()  # () = one block, the whole matrix


def canonical_view(t: Tensor, orientation: str) -> Tensor:
    """The ``(*, out, in)`` view of a stored tensor (see [Note: matrix views])."""
    if orientation == "out_in":
        return t
    if orientation == "in_out":
        return t.mT
    if orientation == "flatten":
        return t.view(t.shape[0], -1)
    raise ValueError(f"unknown orientation {orientation!r}")


def block_views(t: Tensor, layout: MatrixLayout) -> list[Tensor]:
    """The canonical view of ``t``, cut into its blocks along the output dim."""
    view = canonical_view(t, layout.orientation)
    if not layout.split:
        return [view]
    return list(torch.split(view, list(layout.split), dim=-2))


def block_state_key(key: str, index: int, num_blocks: int) -> str:
    return key if num_blocks == 1 else f"{key}@{index}"


# -- resolving the user's split ------------------------------------------------------------------
def resolve_split(
    split: SplitSpec | None, plan: Plan, fqns: Sequence[str]
) -> dict[str, list[int]]:
    """``fqn -> block sizes`` for the matrices ``fqns`` that ``split`` cuts, validated.

    ``split`` maps an FQN or an ``fnmatch`` pattern (``"*.attn.c_attn.weight"``) to a number of
    equal blocks or to the block sizes along the canonical output dim, or is a callable
    ``(fqn, canonical_shape) -> sizes | int | None``. Patterns that match no matrix are errors.
    """
    if split is None:
        return {}
    shapes = {fqn: plan[fqn].matrix_shape for fqn in fqns}
    chosen: dict[str, SplitSizes] = {}
    if callable(split):
        for fqn, shape in shapes.items():
            sizes = split(fqn, shape)
            if sizes is not None:
                chosen[fqn] = sizes
    elif isinstance(split, Mapping):
        chosen = _match_patterns(split, plan, shapes)
    else:
        raise ValueError(
            f"MatrixOptimizer.split must be a mapping {{fqn_or_pattern: sizes}} or a callable "
            f"(fqn, shape) -> sizes, got {type(split).__name__}"
        )
    out = {}
    for fqn, sizes in chosen.items():
        blocks = _block_sizes(fqn, shapes[fqn], sizes)
        if len(blocks) > 1:
            out[fqn] = blocks
    return out


def _match_patterns(
    split: Mapping[str, SplitSizes], plan: Plan, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, SplitSizes]:
    chosen: dict[str, SplitSizes] = {}
    by_pattern: dict[str, str] = {}
    for pattern, sizes in split.items():
        if not isinstance(pattern, str):
            raise ValueError(
                f"MatrixOptimizer.split keys must be FQNs or patterns, got {pattern!r}"
            )
        hits = [pattern] if pattern in shapes else fnmatch.filter(shapes, pattern)
        if not hits:
            raise ValueError(_no_match_message(pattern, plan, shapes))
        for fqn in hits:
            if fqn in chosen and _normalize(chosen[fqn]) != _normalize(sizes):
                raise ValueError(
                    f"MatrixOptimizer.split: {fqn!r} matches {by_pattern[fqn]!r} "
                    f"({chosen[fqn]!r}) and {pattern!r} ({sizes!r}); make the patterns disjoint"
                )
            chosen[fqn], by_pattern[fqn] = sizes, pattern
    return chosen


def _normalize(sizes: SplitSizes) -> object:
    return sizes if isinstance(sizes, int) else tuple(sizes)


def _no_match_message(pattern: str, plan: Plan, shapes: Mapping[str, tuple[int, ...]]) -> str:
    tail = [p.fqn for p in plan.tail if fnmatch.fnmatchcase(p.fqn, pattern)]
    if tail:
        return (
            f"MatrixOptimizer.split: {pattern!r} matches only tail parameters ({tail[:4]}), which "
            "the tail optimizer steps whole; split applies to matrices (select them with "
            "fully_shard_matrix's matrix_filter) or drop the entry"
        )
    examples = list(shapes)[:4]
    return (
        f"MatrixOptimizer.split: {pattern!r} matches no matrix of the model; give a matrix FQN "
        f"or an fnmatch pattern over them (matrices: {examples}"
        f"{' ...' if len(shapes) > 4 else ''})"
    )


def _block_sizes(fqn: str, shape: tuple[int, ...], sizes: SplitSizes) -> list[int]:
    rows = shape[-2]
    where = (f"MatrixOptimizer.split[{fqn!r}] for the (out, in) matrix of shape {shape} "
             f"({rows} output rows)")
    if isinstance(sizes, bool):
        raise ValueError(f"{where}: got {sizes!r}; give a number of blocks or their sizes")
    if isinstance(sizes, int):
        if sizes < 1 or rows % sizes:
            raise ValueError(f"{where}: {sizes} equal blocks do not divide {rows} rows; give the "
                             "block sizes instead, e.g. [q_rows, k_rows, v_rows]")
        return [rows // sizes] * sizes
    try:
        blocks = [int(s) for s in sizes]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {sizes!r} is not a number of blocks or a list of sizes") from None
    exact = all(b == s for b, s in zip(blocks, sizes, strict=True))  # no silent 2.5 -> 2
    if not exact or any(b < 1 for b in blocks) or sum(blocks) != rows:
        raise ValueError(
            f"{where}: sizes {list(sizes)} must be positive integers summing to {rows}"
        )
    return blocks
