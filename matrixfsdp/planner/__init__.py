"""Owner planning: pure Python, importable and testable without a process group."""

from __future__ import annotations

from .assign import LPTPlanner, make_plan
from .costs import COST_MODELS, matrix_cost
from .plan import (
    PLAN_FORMAT_VERSION,
    ParamPlacement,
    ParamSpec,
    Plan,
    RankLoad,
    Selection,
    canonical_shape,
    dtype_itemsize,
)

__all__ = [
    "COST_MODELS",
    "PLAN_FORMAT_VERSION",
    "LPTPlanner",
    "ParamPlacement",
    "ParamSpec",
    "Plan",
    "RankLoad",
    "Selection",
    "canonical_shape",
    "dtype_itemsize",
    "make_plan",
    "matrix_cost",
]
