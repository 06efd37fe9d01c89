"""The benchmark model (the CLI's GPT, :mod:`matrixfsdp.launch.model`) and synthetic data.

One model definition serves ``matrixfsdp train`` and the benchmarks; :func:`build_gpt` maps the
benchmark's :class:`~benchmarks.config.ModelConfig` onto it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matrixfsdp.launch.config import ModelConfig as GPTConfig
from matrixfsdp.launch.model import GPT

from .config import ModelConfig

__all__ = ["GPT", "build_gpt", "global_tokens", "lm_loss", "local_tokens"]


def build_gpt(cfg: ModelConfig) -> GPT:
    """The CLI's GPT with the benchmark's shape (``mlp_hidden`` is its ``hidden``)."""
    return GPT(GPTConfig(dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, hidden=cfg.mlp_hidden,
                         vocab=cfg.vocab, seq_len=cfg.seq_len))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy through ``model(...)`` (so DDP/FSDP2 wrappers see the forward);
    ``tokens`` is (batch, seq_len + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def global_tokens(cfg: ModelConfig, step: int, batch: int, seed: int = 0) -> torch.Tensor:
    """The global batch of step ``step``: (batch, seq_len + 1) tokens, same on every rank.

    A noisy periodic pattern, so the loss falls and trajectories are meaningful to compare.
    """
    gen = torch.Generator().manual_seed(10_000 * seed + step)
    period = torch.randint(2, 9, (batch, 1), generator=gen)
    base = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    idx = torch.arange(cfg.seq_len + 1)
    tokens = (base + (idx % period) * 7) % cfg.vocab
    noise = torch.rand(tokens.shape, generator=gen) < 0.2
    random = torch.randint(0, cfg.vocab, tokens.shape, generator=gen)
    return torch.where(noise, random, tokens)


def local_tokens(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tokens.shape[0] // world
    return tokens[rank * per : (rank + 1) * per]
