"""The MoE of the EP step benchmark (``benchmarks/ep_step.py``, [Note: EP step benchmark])."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["STRATEGIES", "EPBenchConfig", "EPBenchMoE", "loss_of", "tokens_at"]

STRATEGIES = ("matrixfsdp", "fsdp2_recon", "transient_owner")


@dataclass(frozen=True)
class EPBenchConfig:
    efsdp: int = 2
    ep: int = 2
    layers: int = 2
    dim: int = 256
    hidden: int = 512
    experts: int = 8
    vocab: int = 512
    global_batch: int = 8
    seq_len: int = 64
    reps: int = 9
    warmup: int = 2
    strategies: tuple[str, ...] = STRATEGIES
    ns_dtype: str = "float32"

    @property
    def world(self) -> int:
        return self.efsdp * self.ep

    def __post_init__(self) -> None:
        problems = []
        if self.experts % self.ep:
            problems.append(f"experts={self.experts} is not a multiple of ep={self.ep}")
        for name in ("dim", "hidden"):
            if getattr(self, name) % self.world:
                problems.append(f"{name}={getattr(self, name)} is not a multiple of the world "
                                f"size {self.world} (the benchmark needs even FSDP2 shards)")
        if self.experts % self.world or self.global_batch % self.world:
            problems.append(f"experts={self.experts} and global_batch={self.global_batch} must "
                            f"be multiples of the world size {self.world}")
        unknown = set(self.strategies) - set(STRATEGIES)
        if unknown:
            problems.append(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
        if problems:
            raise ValueError("; ".join(problems))


# -- the model ------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        from tests.ep_models import MoEBlock

        super().__init__()
        self.mix = nn.Linear(dim, dim, bias=False)
        self.moe = MoEBlock(dim, hidden, experts)

    def forward(self, x: Tensor) -> Tensor:
        return self.moe(x + F.gelu(self.mix(x)))


class EPBenchMoE(nn.Module):
    """Embedding, ``layers`` x (dense ``mix`` + routed-expert ``moe``), head."""

    def __init__(self, cfg: EPBenchConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(_Block(cfg.dim, cfg.hidden, cfg.experts)
                                    for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tokens_at(cfg: EPBenchConfig, step: int, rank: int) -> Tensor:
    gen = torch.Generator().manual_seed(4242 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq_len + 1), generator=gen)
    per = cfg.global_batch // cfg.world
    return tokens[rank * per:(rank + 1) * per]
