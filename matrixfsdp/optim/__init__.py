"""Matrix optimizers on owners (pure step functions) and the ``MatrixOptimizer`` wrapper."""

from __future__ import annotations

from .defaults import (
    RecommendedHyperparameters,
    recommended_hyperparameters,
    recommended_optimizer_names,
)
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
    "RecommendedHyperparameters",
    "get_matrix_optimizer",
    "matrix_optimizer_names",
    "recommended_hyperparameters",
    "recommended_optimizer_names",
    "register_matrix_optimizer",
    "state_bytes",
]
