"""How the matrix optimizer sees each parameter: the ``(out, in)`` orientation and fused blocks.

[Note: matrix views]
- The optimizer steps the *canonical view* of every matrix: the ``(*, out, in)`` weight of the
  equivalent ``nn.Linear`` (see [Note: plan vocabulary]): the tensor itself for ``"out_in"``,
  ``p.mT`` for ``"in_out"`` (Hugging Face ``Conv1D``), ``p.view(out, -1)`` for ``"flatten"``.
  Views write through, so the step functions update the stored parameter in place and every
  shape rule they apply (Muon's learning-rate scale, OKLS/EMA-Gram shape factors, which Kronecker
  factor is left or right) sees the ``(out, in)`` matrix.
- A *split* cuts the canonical matrix into blocks of its output rows: contiguous blocks of given
  sizes (``q | k | v`` of a fused attention projection, ``gate | up`` of a fused MLP or expert
  stack), or any sets of rows (a ``RowLayout``: torchtitan's ``wqkv``, whose q, k and v rows
  interleave per KV group, or one block per head; ``qkv_row_layout``). Each block is stepped as a
  separate matrix with its own state. A block of consecutive rows is stepped through a view;
  the others are gathered (``index_select``) into a contiguous copy of parameter and gradient,
  stepped, and scattered back (``write_back_rows``) by ``step_owned``, batch by batch: their
  transient memory is one copy of one batch's parameters and gradients. No parameter is split unless
  asked (``MatrixOptimizer(..., split=...)``): the default steps the matrix the model defines, as
  ``torch.optim.Muon`` would. A layout of one block is no split.
- Optimizer state is kept in the canonical orientation, one set per block: the step function's
  own keys when unsplit, ``"<key>@<i>"`` for block ``i`` of a split matrix. Checkpoints store
  these tensors as they are; the split is recorded in the matrix param group (``"split"``, see
  *stored split* below) and loading state saved with another split or orientation is refused.
- The *stored split* (``group["split"]``, JSON in checkpoints) maps each split matrix's FQN to
  its block sizes (``[64, 16, 16]``: contiguous blocks, the only form older releases wrote) or,
  for other row layouts, to ``{"rows": [[[start, stop], ...], ...]}``: per block, its rows as
  half-open runs in block order. A layout of contiguous blocks in order is stored as sizes
  whichever form gave it, so equal layouts compare equal.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..planner import Plan
from .row_layout import RowLayout, row_problem

__all__ = [
    "MatrixLayout",
    "RowLayout",
    "SplitSpec",
    "block_row_indices",
    "block_state_key",
    "block_views",
    "canonical_view",
    "describe_split",
    "matrix_layout",
    "refuse_other_split",
    "resolve_split",
    "split_differences",
    "split_key",
    "stored_split_problem",
]

SplitSizes = int | Sequence[int] | Sequence[Sequence[int]] | RowLayout
SplitSpec = Mapping[str, SplitSizes] | Callable[[str, tuple[int, ...]], SplitSizes | None]
StoredBlocks = list[int] | dict[str, list[list[list[int]]]]  # see *stored split* in the Note


class MatrixLayout(NamedTuple):
    """How one parameter is stepped: its stored orientation and its blocks of rows."""

    orientation: str = "out_in"
    split: tuple[int, ...] = ()  # contiguous block sizes; () = one block, the whole matrix
    rows: tuple[tuple[int, ...], ...] = ()  # or: each block's row indices (gathered blocks)


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
    """The canonical view of ``t``, cut into its blocks along the output dim: views for
    contiguous blocks, gathered copies for a row layout (see ``block_row_indices``)."""
    view = canonical_view(t, layout.orientation)
    if layout.rows:
        return [view.index_select(-2, rows) for rows in block_row_indices(layout, view.device)]
    if not layout.split:
        return [view]
    return list(torch.split(view, list(layout.split), dim=-2))


def block_row_indices(layout: MatrixLayout, device: torch.device) -> tuple[Tensor, ...]:
    """Per block of a row layout, its row indices as an int64 tensor on ``device`` (cached)."""
    return _row_indices(layout.rows, torch.device(device))


@functools.lru_cache(maxsize=256)
def _row_indices(rows: tuple[tuple[int, ...], ...], device: torch.device) -> tuple[Tensor, ...]:
    return tuple(torch.tensor(block, dtype=torch.int64, device=device) for block in rows)


def block_state_key(key: str, index: int, num_blocks: int) -> str:
    return key if num_blocks == 1 else f"{key}@{index}"


# -- the stored split ----------------------------------------------------------------------------
def _runs(block: Sequence[int]) -> list[list[int]]:
    """A block's rows as half-open ``[start, stop]`` runs of consecutive increasing rows."""
    runs: list[list[int]] = []
    for row in block:
        if runs and runs[-1][1] == row:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1])
    return runs


def _stored(layout: RowLayout) -> StoredBlocks | None:
    """The stored form of a layout (None: one block, no split)."""
    if len(layout.blocks) == 1:
        return None
    sizes = layout.contiguous_sizes()
    if sizes is not None:
        return list(sizes)
    return {"rows": [_runs(block) for block in layout.blocks]}


def _expand(stored: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r for start, stop in block for r in range(start, stop))
                 for block in stored["rows"])


def matrix_layout(orientation: str, stored: StoredBlocks | None) -> MatrixLayout:
    """The ``MatrixLayout`` of a matrix from its stored split (None or empty: whole)."""
    if not stored:
        return MatrixLayout(orientation)
    if isinstance(stored, Mapping):
        return MatrixLayout(orientation, rows=_expand(stored))
    return MatrixLayout(orientation, tuple(int(s) for s in stored))


def split_key(split: Mapping[str, Any]) -> tuple:
    """A hashable, order-free key of a stored split (to cache the layouts derived from it)."""
    def freeze(value: Any) -> Any:
        if isinstance(value, Mapping):
            return tuple(sorted((k, freeze(v)) for k, v in value.items()))
        if isinstance(value, (list, tuple)):
            return tuple(freeze(v) for v in value)
        return value
    return freeze(dict(split))


def describe_split(stored: StoredBlocks | None) -> str:
    """A short account of one matrix's stored split, for error messages."""
    if not stored:
        return "whole (no split)"
    if isinstance(stored, Mapping):
        sizes = [sum(stop - start for start, stop in block) for block in stored["rows"]]
        return f"row layout of {len(sizes)} blocks of {sizes} rows (not contiguous)"
    return f"contiguous blocks of {list(stored)} rows"


def split_differences(saved: Mapping[str, Any], now: Mapping[str, Any], limit: int = 4) -> str:
    """The matrices whose stored split differs between ``saved`` and ``now``, described (empty
    when the splits are equal)."""
    differ = sorted(f for f in {*saved, *now} if saved.get(f) != now.get(f))
    parts = [f"{f!r}: checkpoint {describe_split(saved.get(f))}, now {describe_split(now.get(f))}"
             for f in differ[:limit]]
    if len(differ) > limit:
        parts.append(f"... and {len(differ) - limit} more")
    return "; ".join(parts)


def refuse_other_split(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """``load_state_dict`` pre-hook: refuse per-block state stepped with another split (torch's
    load would adopt the saved groups' ``split`` and with it another layout, silently)."""
    saved_groups = state_dict.get("param_groups") or []
    for index, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups,
                                               strict=False)):
        if group.get("kind") != "matrix" or "split" not in saved:
            continue
        diff = split_differences(saved.get("split") or {}, group.get("split") or {})
        if diff:
            raise ValueError(
                f"MatrixOptimizer.load_state_dict: param group {index}'s state was stepped with "
                f"another split= ({diff}); build the optimizer with the state dict's split "
                "(the same RowLayout, block sizes or count)"
            )


def stored_split_problem(split: Any) -> str | None:
    """What is wrong with a stored split read from a checkpoint, or None."""
    if not isinstance(split, Mapping):
        return f"split must map matrix FQNs to blocks, got {type(split).__name__}"
    for fqn, stored in split.items():
        if isinstance(stored, list) and all(type(s) is int and s > 0 for s in stored):
            continue
        ok = (isinstance(stored, Mapping) and set(stored) == {"rows"}
              and isinstance(stored["rows"], list)
              and all(isinstance(block, list) and all(
                  isinstance(run, list) and len(run) == 2 and all(type(r) is int for r in run)
                  and 0 <= run[0] < run[1] for run in block) for block in stored["rows"]))
        problem = row_problem(_expand(stored)) if ok else "not block sizes or {'rows': runs}"
        if problem is not None:
            return f"split[{fqn!r}] = {str(stored)[:120]}: {problem}"
    return None


# -- resolving the user's split ------------------------------------------------------------------
def resolve_split(
    split: SplitSpec | None, plan: Plan, fqns: Sequence[str], scope: str = "the model"
) -> dict[str, StoredBlocks]:
    """``fqn -> stored split`` for the matrices ``fqns`` that ``split`` cuts, validated.

    ``split`` maps an FQN or an ``fnmatch`` pattern (``"*.attn.c_attn.weight"``) to a number of
    equal blocks, the block sizes along the canonical output dim, a ``RowLayout`` or a list of
    blocks' row index lists, or is a callable ``(fqn, canonical_shape) -> any of those | None``.
    Patterns that match none of ``fqns`` are errors; ``scope`` names those matrices in them
    (``"the model"``, or a param group).
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
        chosen = _match_patterns(split, plan, shapes, scope)
    else:
        raise ValueError(
            f"MatrixOptimizer.split must be a mapping {{fqn_or_pattern: sizes}} or a callable "
            f"(fqn, shape) -> sizes, got {type(split).__name__}"
        )
    out = {}
    for fqn, sizes in chosen.items():
        stored = _stored(_row_layout(fqn, shapes[fqn], sizes))
        if stored is not None:
            out[fqn] = stored
    return out


def _match_patterns(
    split: Mapping[str, SplitSizes], plan: Plan, shapes: Mapping[str, tuple[int, ...]],
    scope: str = "the model",
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
            raise ValueError(_no_match_message(pattern, plan, shapes, scope))
        for fqn in hits:
            if fqn in chosen and _normalize(chosen[fqn]) != _normalize(sizes):
                raise ValueError(
                    f"MatrixOptimizer.split: {fqn!r} matches {by_pattern[fqn]!r} "
                    f"({_short(chosen[fqn])}) and {pattern!r} ({_short(sizes)}); make the "
                    "patterns disjoint"
                )
            chosen[fqn], by_pattern[fqn] = sizes, pattern
    return chosen


def _normalize(sizes: SplitSizes) -> object:
    if isinstance(sizes, (int, RowLayout)) or not isinstance(sizes, Sequence):
        return sizes
    return tuple(tuple(s) if isinstance(s, Sequence) else s for s in sizes)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _no_match_message(pattern: str, plan: Plan, shapes: Mapping[str, tuple[int, ...]],
                      scope: str = "the model") -> str:
    tail = [p.fqn for p in plan.tail if fnmatch.fnmatchcase(p.fqn, pattern)]
    if tail:
        return (
            f"MatrixOptimizer.split: {pattern!r} matches only tail parameters ({tail[:4]}), which "
            "the tail optimizer steps whole; split applies to matrices (select them with "
            "fully_shard_matrix's matrix_filter) or drop the entry"
        )
    examples = list(shapes)[:4]
    return (
        f"MatrixOptimizer.split: {pattern!r} matches no matrix of {scope}; give a matrix FQN "
        f"or an fnmatch pattern over them (matrices: {examples}"
        f"{' ...' if len(shapes) > 4 else ''})"
    )


def _row_layout(fqn: str, shape: tuple[int, ...], sizes: SplitSizes) -> RowLayout:
    """The user's value for one matrix as a ``RowLayout`` of its rows, or a ``ValueError``
    naming the FQN, the shape and the fix."""
    rows = shape[-2]
    where = (f"MatrixOptimizer.split[{fqn!r}] for the (out, in) matrix of shape {shape} "
             f"({rows} output rows)")
    if isinstance(sizes, RowLayout):
        if sizes.rows != rows:
            raise ValueError(f"{where}: the RowLayout covers {sizes.rows} rows; build it for "
                             f"this matrix's {rows} rows (qkv_row_layout: (n_heads + 2 * "
                             "n_kv_heads) * head_dim rows)")
        return sizes
    if isinstance(sizes, bool):
        raise ValueError(f"{where}: got {sizes!r}; give a number of blocks or their sizes")
    if isinstance(sizes, int):
        if sizes < 1 or rows % sizes:
            raise ValueError(f"{where}: {sizes} equal blocks do not divide {rows} rows; give the "
                             "block sizes instead, e.g. [q_rows, k_rows, v_rows]")
        return RowLayout.from_permutation(range(rows), [rows // sizes] * sizes)
    if (isinstance(sizes, Sequence) and not isinstance(sizes, (str, bytes)) and sizes
            and all(isinstance(b, Sequence) and not isinstance(b, (str, bytes)) for b in sizes)):
        return _explicit_rows(where, rows, sizes)
    try:
        blocks = [int(s) for s in sizes]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {_short(sizes)} is not a number of blocks, a list of sizes, "
                         "a list of row index lists or a RowLayout") from None
    exact = all(b == s for b, s in zip(blocks, sizes, strict=True))  # no silent 2.5 -> 2
    if not exact or any(b < 1 for b in blocks) or sum(blocks) != rows:
        raise ValueError(
            f"{where}: sizes {list(sizes)} must be positive integers summing to {rows}"
        )
    return RowLayout.from_permutation(range(rows), blocks)


def _explicit_rows(where: str, rows: int, blocks: Sequence[Sequence[int]]) -> RowLayout:
    """Row index lists per block, checked against the matrix's ``rows``."""
    try:
        as_tuples = tuple(tuple(block) for block in blocks)
        if any(isinstance(r, bool) or not isinstance(r, int) for b in as_tuples for r in b):
            raise TypeError
    except TypeError:
        raise ValueError(f"{where}: {_short(blocks)}: each block must list int row "
                         "indices") from None
    problem = row_problem(as_tuples, rows)
    if problem is not None:
        raise ValueError(f"{where}: {problem}. Give each of rows 0..{rows - 1} to exactly one "
                         "block (qkv_row_layout builds torchtitan's wqkv layout)")
    return RowLayout(as_tuples)
