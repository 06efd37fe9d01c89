"""Owner-segment collectives behind one small interface (see [Note: owner segments])."""

from __future__ import annotations

from .base import CommCounter, CommStats, OwnerComm, Pending, Phase, comm_phase, current_phase
from .torch_backend import TorchOwnerComm

__all__ = [
    "CommCounter",
    "CommStats",
    "OwnerComm",
    "Pending",
    "Phase",
    "TorchOwnerComm",
    "comm_phase",
    "current_phase",
]
