"""Per-matrix optimizer-step cost models (FLOPs), used to balance owners.

Each model returns the floating-point operations of one optimizer step on one matrix of shape
``(m, n)``; a 3-D stack ``(E, m, n)`` costs ``E`` times that. Only ratios matter to the planner,
but the numbers are real FLOP counts so reports can quote them (GEMM of ``a×b @ b×c`` = 2abc).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["COST_MODELS", "matrix_cost"]


def _bytes(m: int, n: int) -> float:  # placeholder; the planner uses nbytes for "bytes"
    return float(m * n)


def _muon(m: int, n: int, ns_steps: int = 5) -> float:
    small, large = min(m, n), max(m, n)
    # per step: A = X Xᵀ (2 s² l), A·A (2 s³), B·X (2 s² l)
    return float(ns_steps * (4 * small * small * large + 2 * small**3))


def _kronecker_grams(m: int, n: int) -> float:
    # G Gᵀ, Gᵀ G and the two-sided preconditioning L·M·R
    return float(4 * m * n * (m + n))


def _eigh(d: int) -> float:
    return 9.0 * d**3  # dense symmetric eigensolver, a commonly quoted ~9 d³ constant


def _shampoo(m: int, n: int) -> float:
    return _kronecker_grams(m, n) + _eigh(m) + _eigh(n) + 4.0 * (m**3 + n**3)


def _soap(m: int, n: int) -> float:
    # grams + two rotations in and out (8 m n (m + n)) + refresh (amortised eigh/QR)
    return _kronecker_grams(m, n) + 8.0 * m * n * (m + n) + _eigh(m) + _eigh(n)


def _okls(m: int, n: int) -> float:
    # Scaled CANS: 27 GEMMs per factor, plus factor EMA (with roots) and whitening
    return 54.0 * (m**3 + n**3) + 8.0 * m * n * (m + n)


def _emagram(m: int, n: int) -> float:
    return _kronecker_grams(m, n) + _eigh(m) + _eigh(n) + 4.0 * (m**3 + n**3)


COST_MODELS: dict[str, Callable[[int, int], float]] = {
    "bytes": _bytes,
    "muon": _muon,
    "shampoo": _shampoo,
    "soap": _soap,
    "okls": _okls,
    "emagram": _emagram,
}


def matrix_cost(shape: Sequence[int], model: str) -> float:
    """FLOPs of one optimizer step of ``model`` on a ``(m, n)`` or ``(E, m, n)`` parameter."""
    if model not in COST_MODELS:
        raise ValueError(f"unknown cost model {model!r}; choose one of {sorted(COST_MODELS)}")
    if len(shape) < 2:
        raise ValueError(f"a matrix cost needs at least 2 dims, got shape {tuple(shape)}")
    *batch, m, n = shape
    return math.prod(batch) * COST_MODELS[model](m, n)
