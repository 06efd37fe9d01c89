"""Owner-shaped runtime: parameter pairs, group hooks, storage pinning."""

from __future__ import annotations

from .group import GroupState, MatrixGroup
from .matrix_param import MatrixParam
from .mesh import DataParallelMesh, init_hsdp_mesh
from .pending import PendingWork, WorkKind, WorkQueue
from .state import MatrixFSDPState, in_backward

__all__ = [
    "DataParallelMesh",
    "GroupState",
    "MatrixFSDPState",
    "MatrixGroup",
    "MatrixParam",
    "PendingWork",
    "WorkKind",
    "WorkQueue",
    "in_backward",
    "init_hsdp_mesh",
]
