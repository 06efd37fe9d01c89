"""3-D expert stacks (E, m, n) owned whole by one rank: runtime and optimizer parity."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import matrixfsdp as mf
from matrixfsdp.optim import get_matrix_optimizer

from .checks import FREE_RUNNING_KWARGS, assert_close_dicts, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .models import VOCAB, global_batch, local_batch


class MoEBlock(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 24, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weights = F.softmax(self.gate(h), dim=-1)  # dense mixture: every expert, weighted
        inner = F.gelu(torch.einsum("btd,edh->bteh", h, self.w_in))
        out = torch.einsum("bteh,ehd->bted", inner, self.w_out)
        return x + (weights.unsqueeze(-1) * out).sum(dim=2)


class TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(MoEBlock() for _ in range(3))
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _stacks_and_gates(fqn: str, p: nn.Parameter) -> bool:
    return p.ndim == 3 or fqn.endswith("gate.weight")


def _pair(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    ref = TinyMoE().to(dtype)
    return ref, copy.deepcopy(ref)


def _sgd(rank: int, world: int) -> None:
    ref, model = _pair()
    mf.fully_shard_matrix(model, matrix_filter=_stacks_and_gates)
    plan = mf.get_plan(model)
    assert plan["layers.0.w_in"].role == "matrix" and plan["layers.0.w_in"].shape == (4, 16, 24)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (ref, model)]
    for step in range(3):
        tokens = global_batch(step)
        _loss(ref, tokens).backward()
        _loss(model, local_batch(tokens, rank, world)).backward()
        if step == 0:
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), 1e-6, "grad")
        for o in opts:
            o.step()
            o.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, "param")


def _optimizer(rank: int, world: int, name: str) -> None:
    """An owned stack is stepped exactly as one process steps the whole (E, m, n) tensor.

    That a (E, m, n) step equals E per-slice steps is tested on the pure functions
    (tests/test_optim_functional.py). SOAP runs in float64 here: Adam in an eigenbasis is not
    invariant to rotations inside near-degenerate eigenspaces, so fp32 reduction-order noise
    across world sizes picks different bases (see test_optim_dist.py).
    """
    ref, model = _pair(torch.float64 if name == "soap" else torch.float32)
    mf.fully_shard_matrix(model, matrix_filter=_stacks_and_gates)
    kwargs = FREE_RUNNING_KWARGS.get(name, {})
    opt = mf.MatrixOptimizer(model, name, lr=0.01, tail_lr=1e-2, batch_same_shape=False, **kwargs)
    spec = get_matrix_optimizer(name)
    config = spec.make_config(kwargs)
    matrices = {f: p for f, p in ref.named_parameters() if _stacks_and_gates(f, p)}
    tail = torch.optim.AdamW([p for f, p in ref.named_parameters() if f not in matrices], lr=1e-2,
                             weight_decay=0.0)
    states = {f: spec.init_state_fn(p, config) for f, p in matrices.items()}
    for step in range(3):
        tokens = global_batch(step)
        _loss(ref, tokens).backward()
        _loss(model, local_batch(tokens, rank, world)).backward()
        with torch.no_grad():
            for fqn, p in matrices.items():
                spec.step_fn(p, p.grad, states[fqn], lr=0.01, weight_decay=0.0, step=step + 1,
                             initial_lr=0.01, config=config)
        tail.step()
        opt.step()
        for o in (tail, opt):
            o.zero_grad()
        ref.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, f"{name} stacks")


def _world(rank: int, world: int) -> None:
    subtests = {"sgd": functools.partial(_sgd, rank, world)}
    for name in ("muon", "okls", "shampoo", "soap", "emagram"):
        subtests[f"optimizer_{name}"] = functools.partial(_optimizer, rank, world, name)
    run_subtests(rank, subtests)


@pytest.mark.parametrize("world", [1, 3])
def test_expert_stacks(world: int) -> None:
    run_world(world, _world)
