"""Owner-shaped runtime: parameter pairs, group hooks, storage pinning."""

from __future__ import annotations

from .group import GroupState, MatrixGroup
from .matrix_param import MatrixParam
from .pending import PendingWork, WorkKind, WorkQueue
from .state import MatrixFSDPState, in_backward

__all__ = [
    "GroupState",
    "MatrixFSDPState",
    "MatrixGroup",
    "MatrixParam",
    "PendingWork",
    "WorkKind",
    "WorkQueue",
    "in_backward",
]
