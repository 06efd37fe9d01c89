"""matrixfsdp: owner-shaped ZeRO-3 sharding on PyTorch FSDP2 for matrix optimizers.

Each selected 2-D weight lives whole on one data-parallel rank (its owner) and is empty
elsewhere, so matrix optimizers run locally on owners with no optimizer-step communication.

Public names resolve lazily, so ``matrixfsdp.planner`` and ``matrixfsdp plan`` stay free of
torch imports (planning a 64-rank layout takes well under a second on a laptop).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "clip_grad_norm_": "matrixfsdp.api",
    "fully_shard_matrix": "matrixfsdp.api",
    "get_plan": "matrixfsdp.api",
    "get_state": "matrixfsdp.api",
    "global_grad_norm": "matrixfsdp.api",
    "init_hsdp_mesh": "matrixfsdp.api",
    "is_matrix_wrapped": "matrixfsdp.api",
    "quiesce": "matrixfsdp.api",
    "set_requires_all_reduce": "matrixfsdp.api",
    "set_requires_gradient_sync": "matrixfsdp.api",
    "MatrixOptimizer": "matrixfsdp.optim",
    "MatrixStepError": "matrixfsdp.optim",
    "register_matrix_optimizer": "matrixfsdp.optim",
    "LPTPlanner": "matrixfsdp.planner",
    "Plan": "matrixfsdp.planner",
}
_SUBMODULES = {
    "api", "checkpoint", "collectives", "memory", "optim", "planner", "runtime", "launch",
}

__all__ = [
    "LPTPlanner",
    "MatrixOptimizer",
    "MatrixStepError",
    "Plan",
    "__version__",
    "checkpoint",
    "clip_grad_norm_",
    "fully_shard_matrix",
    "get_plan",
    "get_state",
    "global_grad_norm",
    "init_hsdp_mesh",
    "is_matrix_wrapped",
    "memory",
    "planner",
    "quiesce",
    "register_matrix_optimizer",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
]

if TYPE_CHECKING:
    from . import checkpoint, memory, planner
    from .api import (
        clip_grad_norm_,
        fully_shard_matrix,
        get_plan,
        get_state,
        global_grad_norm,
        init_hsdp_mesh,
        is_matrix_wrapped,
        quiesce,
        set_requires_all_reduce,
        set_requires_gradient_sync,
    )
    from .optim import MatrixOptimizer, MatrixStepError, register_matrix_optimizer
    from .planner import LPTPlanner, Plan


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
