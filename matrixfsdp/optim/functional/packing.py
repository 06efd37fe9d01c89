"""Packed storage for symmetric matrices.

A symmetric ``(*, d, d)`` tensor is stored as its upper triangle in row-major
order, a ``(*, d(d+1)/2)`` tensor, which halves the memory of Kronecker-factor
state. Leading batch dimensions are kept as they are.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["pack_sym", "packed_dim", "packed_size", "unpack_sym"]


def packed_size(d: int) -> int:
    """Number of stored entries for a symmetric ``d x d`` matrix: d(d+1)/2."""
    return d * (d + 1) // 2


def packed_dim(size: int) -> int:
    """Inverse of :func:`packed_size`; raises ``ValueError`` if not triangular."""
    d = (math.isqrt(8 * size + 1) - 1) // 2
    if packed_size(d) != size:
        raise ValueError(f"{size} is not a triangular number d(d+1)/2")
    return d


@lru_cache(maxsize=64)
def _triu_flat(d: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Flat indices (into a d*d row-major matrix) of the upper triangle and its mirror."""
    rows, cols = torch.triu_indices(d, d, device=device)
    return rows * d + cols, cols * d + rows


def pack_sym(x: Tensor) -> Tensor:
    """Pack the upper triangle (diagonal included) of ``x`` of shape ``(*, d, d)``.

    Only the upper triangle is read, so ``x`` should already be symmetric.
    Returns a new contiguous ``(*, d(d+1)/2)`` tensor of the same dtype.
    """
    d = x.shape[-1]
    if x.shape[-2] != d:
        raise ValueError(f"pack_sym expects (*, d, d), got {tuple(x.shape)}")
    upper, _ = _triu_flat(d, x.device)
    return x.reshape(*x.shape[:-2], d * d).index_select(-1, upper)


def unpack_sym(v: Tensor, d: int | None = None) -> Tensor:
    """Rebuild the symmetric ``(*, d, d)`` matrix from its packed upper triangle ``v``.

    ``d`` is inferred from ``v.shape[-1] = d(d+1)/2`` when not given.
    """
    if d is None:
        d = packed_dim(v.shape[-1])
    if v.shape[-1] != packed_size(d):
        raise ValueError(f"unpack_sym: last dim {v.shape[-1]} != d(d+1)/2 for d={d}")
    upper, lower = _triu_flat(d, v.device)
    out = v.new_empty(*v.shape[:-1], d * d)
    out.index_copy_(-1, upper, v)
    out.index_copy_(-1, lower, v)
    return out.reshape(*v.shape[:-1], d, d)
