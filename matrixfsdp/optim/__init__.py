"""Matrix optimizers on owners (pure step functions) and the ``MatrixOptimizer`` wrapper."""

from __future__ import annotations

from .agreement import MatrixStepError
from .defaults import (
    RecommendedHyperparameters,
    recommended_hyperparameters,
    recommended_optimizer_names,
)
from .matrix_optimizer import MatrixOptimizer, state_bytes
from .owner_step import StepBatching
from .registry import (
    MatrixOptimizerSpec,
    get_matrix_optimizer,
    matrix_optimizer_names,
    register_matrix_optimizer,
)
from .row_layout import RowLayout, fused_qkv_split, qkv_row_layout

__all__ = [
    "MatrixOptimizer",
    "MatrixOptimizerSpec",
    "MatrixStepError",
    "RecommendedHyperparameters",
    "RowLayout",
    "StepBatching",
    "fused_qkv_split",
    "get_matrix_optimizer",
    "matrix_optimizer_names",
    "qkv_row_layout",
    "recommended_hyperparameters",
    "recommended_optimizer_names",
    "register_matrix_optimizer",
    "state_bytes",
]
