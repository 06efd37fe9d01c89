"""matrixfsdp: owner-shaped ZeRO-3 sharding on PyTorch FSDP2 for matrix optimizers.

Each selected 2-D weight lives whole on one data-parallel rank (its owner) and is empty
elsewhere, so matrix optimizers run locally on owners with no optimizer-step communication.
"""

from __future__ import annotations

from . import planner
from .api import (
    clip_grad_norm_,
    fully_shard_matrix,
    get_plan,
    get_state,
    is_matrix_wrapped,
    set_requires_gradient_sync,
)
from .optim import MatrixOptimizer, register_matrix_optimizer
from .planner import LPTPlanner, Plan

__version__ = "0.1.0"

__all__ = [
    "LPTPlanner",
    "MatrixOptimizer",
    "Plan",
    "__version__",
    "clip_grad_norm_",
    "fully_shard_matrix",
    "get_plan",
    "get_state",
    "is_matrix_wrapped",
    "planner",
    "register_matrix_optimizer",
    "set_requires_gradient_sync",
]
