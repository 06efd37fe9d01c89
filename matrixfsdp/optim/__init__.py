"""Matrix optimizers on owners (pure step functions) and the ``MatrixOptimizer`` wrapper."""

from __future__ import annotations

from .matrix_optimizer import MatrixOptimizer, state_bytes
from .registry import (
    MatrixOptimizerSpec,
    get_matrix_optimizer,
    matrix_optimizer_names,
    register_matrix_optimizer,
)

__all__ = [
    "MatrixOptimizer",
    "MatrixOptimizerSpec",
    "get_matrix_optimizer",
    "matrix_optimizer_names",
    "register_matrix_optimizer",
    "state_bytes",
]
