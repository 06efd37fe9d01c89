"""Row layouts: blocks of a fused matrix that are any sets of its output rows.

``MatrixOptimizer(split={pattern: RowLayout(...)})`` steps each block as a separate matrix (see
[Note: matrix views] in ``matrixfsdp.optim.layouts``). A ``RowLayout`` lists, per block, the
row indices of the ``(out, in)`` matrix that form it, in the order the block sees them; every row
belongs to exactly one block. ``qkv_row_layout`` builds the layout of torchtitan's fused ``wqkv``,
whose rows interleave per KV group: for each of the ``n_kv_heads`` groups, the group's
``n_heads // n_kv_heads`` q heads, then one k head, then one v head, ``head_dim`` rows each;
``fused_qkv_split`` finds every such module of a model and gives the ``split=`` mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["RowLayout", "fused_qkv_split", "qkv_row_layout"]


@dataclass(frozen=True)
class RowLayout:
    """Blocks of output rows: ``blocks[i]`` holds the row indices of block ``i``, in order.

    The rows of all blocks together are ``0 .. rows - 1``, each exactly once (``rows`` is the
    matrix's output dim, checked when ``MatrixOptimizer`` resolves the split). A block of
    consecutive rows in increasing order is stepped through a view; any other block is gathered
    into a contiguous copy for the step and scattered back after it.
    """

    blocks: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        blocks = _as_blocks(self.blocks, "RowLayout.blocks")
        object.__setattr__(self, "blocks", blocks)
        problem = row_problem(blocks)
        if problem is not None:
            raise ValueError(f"RowLayout.blocks: {problem}")

    @property
    def rows(self) -> int:
        """The number of rows the layout covers: the matrix's output dim."""
        return sum(len(block) for block in self.blocks)

    @classmethod
    def from_permutation(cls, perm: Sequence[int], sizes: Sequence[int]) -> RowLayout:
        """Rows ``perm[0:sizes[0]]`` form block 0, the next ``sizes[1]`` block 1, and so on."""
        order = _as_blocks([perm], "RowLayout.from_permutation perm")[0]
        counts = _as_blocks([sizes], "RowLayout.from_permutation sizes")[0]
        if any(s < 1 for s in counts) or sum(counts) != len(order):
            raise ValueError(f"RowLayout.from_permutation sizes: {list(counts)} must be positive "
                             f"and sum to len(perm) = {len(order)}")
        blocks, start = [], 0
        for size in counts:
            blocks.append(order[start:start + size])
            start += size
        return cls(tuple(blocks))

    def contiguous_sizes(self) -> tuple[int, ...] | None:
        """Block sizes when the blocks are consecutive row ranges in order (a plain split)."""
        expected = 0
        for block in self.blocks:
            if block != tuple(range(expected, expected + len(block))):
                return None
            expected += len(block)
        return tuple(len(block) for block in self.blocks)


def _as_blocks(value: object, where: str) -> tuple[tuple[int, ...], ...]:
    """``value`` as a tuple of tuples of ints, or a ``ValueError`` naming ``where``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{where} must be a sequence of row index sequences, got "
                         f"{type(value).__name__}")
    blocks = []
    for i, block in enumerate(value):
        if isinstance(block, (str, bytes)) or not isinstance(block, Sequence):
            raise ValueError(f"{where}[{i}] must be a sequence of row indices, got "
                             f"{type(block).__name__}")
        for j, row in enumerate(block):
            if isinstance(row, bool) or not isinstance(row, int):
                raise ValueError(f"{where}[{i}][{j}] = {row!r} is not an int row index")
        blocks.append(tuple(int(row) for row in block))
    return tuple(blocks)


def row_problem(blocks: tuple[tuple[int, ...], ...], rows: int | None = None) -> str | None:
    """What is wrong with ``blocks`` as a partition of rows ``0 .. rows - 1`` (``rows``: their
    count when None), or None."""
    total = sum(len(block) for block in blocks)
    rows = total if rows is None else rows
    if not blocks:
        return "no blocks; give at least one block of rows"
    empty = [i for i, block in enumerate(blocks) if not block]
    if empty:
        return f"blocks {empty} are empty; every block needs at least one row"
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for row in block:
            if not 0 <= row < rows:
                return (f"block {i} holds row {row}, out of range for {rows} rows "
                        f"(indices 0..{rows - 1})")
            if row in owner:
                where = "twice" if owner[row] == i else f"and block {owner[row]} holds it too"
                return f"block {i} holds row {row} {where}; each row belongs to one block"
            owner[row] = i
    if total != rows:
        missing = [r for r in range(rows) if r not in owner]
        shown = missing[:8] + (["..."] if len(missing) > 8 else [])
        return (f"rows {shown} ({len(missing)} of {rows}) are in no block; every row belongs "
                "to one block")
    return None


def qkv_row_layout(
    n_heads: int, n_kv_heads: int, head_dim: int, per: Literal["qkv", "head"] = "qkv"
) -> RowLayout:
    """The blocks of torchtitan's fused ``wqkv`` (``FusedQKVLinear``), ``(out, in)`` rows.

    Its rows are ``(n_kv_heads, n_heads // n_kv_heads + 2, head_dim)``: per KV group the
    group's q heads, one k head, one v head. ``per="qkv"``: three blocks, the rows of
    ``wq``, ``wk`` and ``wv`` in the order of torchtitan's unfused weights (what its state-dict
    hook writes), so each block is stepped as the unfused matrix would be. ``per="head"``: one
    block of ``head_dim`` rows per head, in storage order (block ``i`` is group
    ``i // (n_heads // n_kv_heads + 2)``; within a group the q heads, then k, then v).
    """
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"qkv_row_layout: {name} must be a positive int, got {value!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"qkv_row_layout: n_heads={n_heads} is not a multiple of "
                         f"n_kv_heads={n_kv_heads} (torchtitan's FusedQKVLinear needs one)")
    per_group = n_heads // n_kv_heads + 2
    heads = [tuple(range(h * head_dim, (h + 1) * head_dim))
             for h in range(n_kv_heads * per_group)]
    if per == "head":
        return RowLayout(tuple(heads))
    if per != "qkv":
        raise ValueError(f"qkv_row_layout: per must be 'qkv' or 'head', got {per!r}")
    q, k, v = [], [], []
    for g in range(n_kv_heads):
        group = heads[g * per_group:(g + 1) * per_group]
        for head in group[:-2]:
            q.extend(head)
        k.extend(group[-2])
        v.extend(group[-1])
    return RowLayout((tuple(q), tuple(k), tuple(v)))


def fused_qkv_split(model: Any, per: Literal["qkv", "head"] = "qkv") -> dict[str, RowLayout]:
    """``{"<module>.wqkv.weight": qkv_row_layout(...)}`` for every torchtitan-style fused QKV
    module of ``model`` (wrapped or not), ready for ``MatrixOptimizer(split=...)``.

    A fused QKV module is one with a ``wqkv`` linear and torchtitan ``FusedQKVLinear``'s
    ``head_dim``, ``heads_per_kv`` and ``r_dim`` (``heads_per_kv + 2``) attributes; its KV group
    count comes from ``wqkv.out_features`` (the global row count, also under TP or FSDP2).
    Empty when the model has none.
    """
    split = {}
    for name, module in model.named_modules():
        wqkv = getattr(module, "wqkv", None)
        head_dim = getattr(module, "head_dim", None)
        per_kv, r_dim = getattr(module, "heads_per_kv", None), getattr(module, "r_dim", None)
        if wqkv is None or not all(isinstance(v, int) for v in (head_dim, per_kv, r_dim)):
            continue
        rows = getattr(wqkv, "out_features", None)
        fqn = f"{name}.wqkv.weight" if name else "wqkv.weight"
        if r_dim != per_kv + 2 or not isinstance(rows, int) or rows % (r_dim * head_dim):
            raise ValueError(
                f"fused_qkv_split: {fqn!r} ({rows} rows) is not a fused QKV of head_dim="
                f"{head_dim}, heads_per_kv={per_kv}, r_dim={r_dim} (rows must be n_kv_heads * "
                "r_dim * head_dim with r_dim = heads_per_kv + 2); give its RowLayout explicitly"
            )
        n_kv = rows // (r_dim * head_dim)
        split[fqn] = qkv_row_layout(per_kv * n_kv, n_kv, head_dim, per=per)
    return split
