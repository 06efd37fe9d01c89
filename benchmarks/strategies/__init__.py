"""The strategies compared by the benchmark, by name (see ``benchmarks.config.STRATEGIES``)."""

from __future__ import annotations

from torch import nn

from .base import Strategy, StrategyContext, owner_plan, planner_for, tensor_bytes
from .hsdp import (
    DistMuonHSDPStrategy,
    DistMuonStrategy,
    MatrixFSDPHSDPNoFlagsStrategy,
    MatrixFSDPHSDPStrategy,
)
from .replicated import DDPStrategy, Zero1OwnerStrategy
from .sharded import (
    FSDP2AdamWStrategy,
    FSDP2SGDMomentumStrategy,
    GatherOnceStrategy,
    MatrixFSDPBroadcastRoundsStrategy,
    MatrixFSDPExchangeReduceStrategy,
    MatrixFSDPP2PStrategy,
    MatrixFSDPStrategy,
    MatrixFSDPUnitTailsStrategy,
    ReconstructionStrategy,
)

__all__ = [
    "STRATEGY_CLASSES",
    "Strategy",
    "StrategyContext",
    "build_strategy",
    "owner_plan",
    "planner_for",
    "strategies_for",
    "tensor_bytes",
]

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (DDPStrategy, ReconstructionStrategy, GatherOnceStrategy, Zero1OwnerStrategy,
                MatrixFSDPStrategy, MatrixFSDPP2PStrategy, FSDP2AdamWStrategy,
                FSDP2SGDMomentumStrategy, MatrixFSDPHSDPStrategy, DistMuonStrategy,
                DistMuonHSDPStrategy, MatrixFSDPExchangeReduceStrategy,
                MatrixFSDPHSDPNoFlagsStrategy, MatrixFSDPBroadcastRoundsStrategy,
                MatrixFSDPUnitTailsStrategy)
}
# Strategies that implement one matrix optimizer only (the others run with every optimizer).
ONLY_FOR: dict[str, str] = {"distmuon": "muon", "distmuon_hsdp": "muon"}


def strategies_for(optimizer: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` less the strategies that cannot run ``optimizer``."""
    return tuple(n for n in names if ONLY_FOR.get(n, optimizer) == optimizer)


def build_strategy(name: str, model: nn.Module, ctx: StrategyContext) -> Strategy:
    """Wrap the plain ``model`` (a private copy) as strategy ``name``."""
    return STRATEGY_CLASSES[name](model, ctx)
