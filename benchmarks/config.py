"""Frozen configuration of one benchmark invocation (model, batch, optimizer, measurement)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_LR",
    "EXTRA_STRATEGIES",
    "MEMORY_BASELINES",
    "STRATEGIES",
    "STRATEGY_LABELS",
    "BenchConfig",
    "ModelConfig",
    "OptimConfig",
    "add_model_flags",
    "model_from_flags",
]

# Run order inside one round; the timing loop rotates it every round.
STRATEGIES: tuple[str, ...] = (
    "ddp", "fsdp2_recon", "gather_once", "zero1_owner", "matrixfsdp", "matrixfsdp_p2p",
    "fsdp2_adamw", "matrixfsdp_hsdp", "distmuon", "distmuon_hsdp",
)
# Variants run only when named (``--strategies ...``): forms the default "auto" does not pick.
EXTRA_STRATEGIES: tuple[str, ...] = ("matrixfsdp_xreduce", "matrixfsdp_noflags_hsdp",
                                     "matrixfsdp_bcast", "matrixfsdp_unit_tails")
STRATEGY_LABELS: dict[str, str] = {
    "ddp": "DDP + matrix opt",
    "fsdp2_recon": "FSDP2 + reconstruction",
    "gather_once": "FSDP2 + gather-once (all-to-all)",
    "zero1_owner": "ZeRO-1 owner",
    "matrixfsdp": "matrixfsdp",
    "matrixfsdp_p2p": "matrixfsdp (broadcast/reduce)",
    "matrixfsdp_xreduce": "matrixfsdp (broadcast/exchange reduce)",
    "matrixfsdp_bcast": "matrixfsdp (broadcast/rounds for every group)",
    "matrixfsdp_unit_tails": "matrixfsdp (an FSDP2 unit per block tail, broadcast/rounds)",
    "fsdp2_adamw": "FSDP2 + AdamW (floor)",
    "fsdp2_sgdm": "FSDP2 + SGD-momentum (Muon's state size)",
    "matrixfsdp_hsdp": "matrixfsdp HSDP",
    "matrixfsdp_noflags_hsdp": "matrixfsdp HSDP, replicate_presence_flags=False",
    "distmuon": "FSDP2 + owner all-to-all Muon",
    "distmuon_hsdp": "FSDP2 HSDP + owner all-to-all Muon",
    "fsdp2_recon_hsdp": "FSDP2 HSDP + reconstruction",
}
# Measured for memory only (their update is not the matrix optimizer's): peak per phase beside
# the strategies above, e.g. the stock FSDP2 run whose optimizer state has Muon's size.
MEMORY_BASELINES: tuple[str, ...] = ("fsdp2_sgdm",)
DEFAULT_LR: dict[str, float] = {"muon": 0.02, "okls": 0.01}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the benchmark model, the CLI's GPT (see benchmarks.model.build_gpt)."""

    dim: int = 256
    layers: int = 4
    heads: int = 4
    mlp_hidden: int = 512
    vocab: int = 256
    seq_len: int = 128

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "mlp_hidden", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"ModelConfig.dim ({self.dim}) must be divisible by heads ({self.heads})")


_SHAPE_FLAGS = ("dim", "layers", "heads", "mlp_hidden", "seq_len")


def add_model_flags(parser: Any) -> None:
    """``--dim --layers --heads --mlp-hidden --seq-len`` on an ``argparse`` parser."""
    defaults = ModelConfig()
    for name in _SHAPE_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            default=getattr(defaults, name),
                            help=f"model {name} (default {getattr(defaults, name)})")


def model_from_flags(args: Any) -> ModelConfig:
    """The ``ModelConfig`` of parsed ``add_model_flags`` flags."""
    return ModelConfig(**{name: getattr(args, name) for name in _SHAPE_FLAGS})


@dataclass(frozen=True)
class OptimConfig:
    """The matrix optimizer (a matrixfsdp registry name) and the AdamW tail.

    ``weight_decay`` (matrices) must stay 0 for the gather-once baseline: its owners compute the
    update Δ on a zero parameter and ship Δ back, which equals the step only without decay.
    """

    name: str = "muon"
    lr: float | None = None
    weight_decay: float = 0.0
    tail_lr: float = 3e-3
    tail_weight_decay: float = 0.0
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr!r}")
        for name in ("weight_decay", "tail_lr", "tail_weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"OptimConfig.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def matrix_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR.get(self.name, 0.01)

    @property
    def matrix_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)

    @staticmethod
    def for_name(name: str, ns_dtype: str = "float32") -> OptimConfig:
        """Benchmark defaults: fp32 Newton–Schulz for Muon so trajectories compare to ~1e-6."""
        kwargs: tuple[tuple[str, Any], ...] = (("ns_dtype", ns_dtype),) if name == "muon" else ()
        return OptimConfig(name=name, kwargs=kwargs)


@dataclass(frozen=True)
class BenchConfig:
    """One timing world: model, global batch, optimizer, strategies and step counts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    world_size: int = 2
    global_batch: int = 8
    warmup: int = 2
    steps: int = 5
    strategies: tuple[str, ...] = STRATEGIES
    seed: int = 0
    comm_sizes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 22)
    comm_repeats: int = 5
    hsdp_replicate: int = 2  # replicas of the HSDP strategies' (replicate, shard) mesh

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"BenchConfig.world_size must be >= 1, got {self.world_size}")
        if self.global_batch % self.world_size:
            raise ValueError(
                f"BenchConfig.global_batch ({self.global_batch}) must be divisible by "
                f"world_size ({self.world_size})"
            )
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"need steps >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        hsdp = [s for s in self.strategies if s.endswith("_hsdp")]
        if hsdp and (self.hsdp_replicate < 1 or self.world_size % self.hsdp_replicate):
            raise ValueError(
                f"BenchConfig.hsdp_replicate ({self.hsdp_replicate}) must divide world_size "
                f"({self.world_size}) for the HSDP strategies {hsdp}"
            )
        unknown = [s for s in self.strategies if s not in (*STRATEGIES, *EXTRA_STRATEGIES)]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; choose from "
                             f"{[*STRATEGIES, *EXTRA_STRATEGIES]}")

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world_size

    def replace(self, **changes: Any) -> BenchConfig:
        return dataclasses.replace(self, **changes)
