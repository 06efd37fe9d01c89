"""A small GPT-style decoder and its synthetic data (deterministic per step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

__all__ = ["GPT", "global_tokens", "lm_loss", "local_tokens"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + down(gelu(up(ln2(x))))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks in ``self.blocks``, final norm, LM head.

    The 2-D ``nn.Linear`` weights inside ``blocks`` are the matrices; embeddings, norms and the
    head form the tail (AdamW).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; ``tokens`` is (batch, seq_len + 1)."""
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
