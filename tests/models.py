"""Tiny models for the distributed tests: a transformer with every kind of parameter.

Models and batches are built on the CPU (the same values on every device) and moved to the
rank's test device (``dist_utils.test_device()``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .dist_utils import test_device

VOCAB = 23


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)  # non-square
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=True)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int = 2, kv_heads: int = 1) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.norm2 = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.unused = nn.Linear(dim, dim, bias=False)  # used only when use_unused is set
        self.use_unused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.use_unused:
            x = x + 0.5 * self.unused(x)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(
        self, dim: int = 16, hidden: int = 40, layers: int = 3, checkpointing: bool = False,
        tie: bool = False, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([Block(dim, hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.checkpointing = checkpointing
        self.reentrant = False  # with checkpointing: torch.utils.checkpoint's use_reentrant
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
            elif "bias" in name:
                nn.init.normal_(p, std=0.1)
        # Built on the CPU, then moved: the same values on every device. Under a device
        # context (``with torch.device("meta")``) the model stays where the context put it.
        if device is None and torch.get_default_device().type == "cpu":
            device = test_device()
        if device is not None and torch.device(device).type != "cpu":
            self.to(device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = (checkpoint(layer, x, use_reentrant=self.reentrant) if self.checkpointing
                 else layer(x))
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def global_batch(step: int, batch: int = 12, seq: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch, seq), generator=g).to(test_device())


def local_batch(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tokens.shape[0] // world
    return tokens[rank * per : (rank + 1) * per]


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int,
                world: int) -> None:
    """One optimizer step per step of ``steps`` on data rank ``rank``'s share of its global batch."""
    for step in steps:
        lm_loss(model, local_batch(global_batch(step), rank, world)).backward()
        opt.step()
        opt.zero_grad()
