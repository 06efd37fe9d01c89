"""Owner-segment collectives behind one small interface (see [Note: owner segments])."""

from __future__ import annotations

from .base import CommCounter, CommStats, OwnerComm, Pending, Phase, comm_phase, current_phase
from .nvshmem_backend import NvshmemOwnerComm
from .torch_backend import TorchOwnerComm

__all__ = [
    "CommCounter",
    "CommStats",
    "NvshmemOwnerComm",
    "OwnerComm",
    "Pending",
    "Phase",
    "TorchOwnerComm",
    "comm_phase",
    "current_phase",
]
