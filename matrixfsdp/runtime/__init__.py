"""Owner-shaped runtime: parameter pairs, group hooks, storage pinning."""

from __future__ import annotations

from .group import GroupState, MatrixGroup
from .matrix_param import MatrixParam
from .state import MatrixFSDPState, in_backward

__all__ = ["GroupState", "MatrixFSDPState", "MatrixGroup", "MatrixParam", "in_backward"]
