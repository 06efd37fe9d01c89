"""Owner-shaped runtime: parameter pairs, group hooks, storage pinning."""

from __future__ import annotations

from .group import GradHandoff, GroupState, MatrixGroup
from .matrix_param import MatrixParam
from .mesh import DataParallelMesh, init_hsdp_mesh
from .pending import PendingWork, WorkKind, WorkQueue
from .state import MatrixFSDPState, in_backward
from .streams import InFlight, RuntimeStreams

__all__ = [
    "DataParallelMesh",
    "GradHandoff",
    "GroupState",
    "InFlight",
    "MatrixFSDPState",
    "MatrixGroup",
    "MatrixParam",
    "PendingWork",
    "RuntimeStreams",
    "WorkKind",
    "WorkQueue",
    "in_backward",
    "init_hsdp_mesh",
]
