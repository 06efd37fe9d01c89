"""3-D expert stacks (E, m, n) owned whole by one rank: runtime and optimizer parity."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import matrixfsdp as mf
from matrixfsdp.optim import get_matrix_optimizer

from .checks import (
    FREE_RUNNING_KWARGS,
    assert_close_dicts,
    float64_rtols,
    full_optimizer_state,
    full_values,
    reference_values,
)
from .dist_utils import run_subtests, run_world
from .models import VOCAB, global_batch, local_batch
from .references import make_reference
from .test_optim_dist import _library_basis


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


def _wrap(model: nn.Module, stacks: str) -> None:
    mf.fully_shard_matrix(model, matrix_filter=_stacks_and_gates,
                          planner=mf.LPTPlanner(stacks=stacks))
    plan = mf.get_plan(model)
    role = "sharded_stack" if stacks == "slices" and plan.world_size > 1 else "matrix"
    assert plan["layers.0.w_in"].role == role and plan["layers.0.w_in"].shape == (4, 16, 24)
    assert plan["layers.0.gate.weight"].role == "matrix"


def _sgd(rank: int, world: int, stacks: str) -> None:
    ref, model = _pair()
    _wrap(model, stacks)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in (ref, model)]
    for step in range(3):
        tokens = global_batch(step)
        _loss(ref, tokens).backward()
        _loss(model, local_batch(tokens, rank, world)).backward()
        if step == 0:
            rtols = float64_rtols(ref, lambda m, t=tokens: _loss(m, t).backward())
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), rtols,
                               "grad")
        for o in opts:
            o.step()
            o.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, "param")


def _optimizer(rank: int, world: int, name: str, stacks: str) -> None:
    """An owned stack steps as the float64 reference steps each of its E experts.

    The reference is the formulas of tests/references.py, one matrix per expert; that a
    (E, m, n) step equals E per-slice steps is also tested on the pure functions
    (tests/test_optim_functional.py). SOAP runs in float64 and adopts the library's step-1
    eigenbases after checking them (see ReferenceStepper in test_optim_dist.py).
    """
    ref, model = _pair(torch.float64 if name == "soap" else torch.float32)
    _wrap(model, stacks)
    kwargs = FREE_RUNNING_KWARGS.get(name, {})
    opt = mf.MatrixOptimizer(model, name, lr=0.01, tail_lr=1e-2, batch_same_shape=False, **kwargs)
    hyper = dataclasses.asdict(get_matrix_optimizer(name).make_config(kwargs))
    matrices = {f: p for f, p in ref.named_parameters() if _stacks_and_gates(f, p)}
    tail = torch.optim.AdamW([p for f, p in ref.named_parameters() if f not in matrices], lr=1e-2,
                             weight_decay=0.0)
    library_state: dict = {}
    refs = {}
    for fqn, p in matrices.items():
        extra = {}
        if name == "soap":
            extra["pick_basis"] = functools.partial(_library_basis, library_state.copy, fqn)
        refs[fqn] = make_reference(name, tuple(p.shape), **hyper, **extra)
    for step in range(3):
        tokens = global_batch(step)
        _loss(ref, tokens).backward()
        _loss(model, local_batch(tokens, rank, world)).backward()
        opt.step()
        if name == "soap" and step == 0:
            library_state.update(full_optimizer_state(model, opt))
        with torch.no_grad():
            for fqn, p in matrices.items():
                p.copy_(refs[fqn].step(p.double(), p.grad, lr=0.01, weight_decay=0.0,
                                       initial_lr=0.01))
        tail.step()
        for o in (tail, opt):
            o.zero_grad()
        ref.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, f"{name} stacks")
    if stacks == "slices" and world > 1:  # state of a sliced stack: DTensors, experts local
        w_in = dict(model.named_parameters())["layers.0.w_in"]
        local_experts = w_in.to_local().shape[0]
        for value in opt.state.get(w_in, {}).values():
            if value.ndim:
                assert value.shape[0] == 4 and value.to_local().shape[0] == local_experts


def _checkpoint_reshards_slices(rank: int, world: int, root: str, phase: str) -> None:
    """Save sliced stacks + OKLS state at one world size, load at another: values survive."""
    torch.manual_seed(1)
    model = TinyMoE()
    _wrap(model, "slices")
    opt = mf.MatrixOptimizer(model, "okls", lr=0.01, tail_lr=1e-2)
    if phase == "save":
        for step in range(2):
            _loss(model, local_batch(global_batch(step), rank, world)).backward()
            opt.step()
            opt.zero_grad()
        mf.checkpoint.save(f"{root}/ckpt", model, opt, step=2)
        saved = {"params": full_values(model), "state": full_optimizer_state(model, opt)}
        if rank == 0:
            torch.save(saved, f"{root}/saved.pt")
        return
    mf.checkpoint.load(f"{root}/ckpt", model, opt)
    saved = torch.load(f"{root}/saved.pt", weights_only=True)
    assert_close_dicts(full_values(model), saved["params"], 0.0, "loaded params")
    state = full_optimizer_state(model, opt)
    for fqn in ("layers.0.w_in", "layers.2.w_out"):
        for key, value in saved["state"][fqn].items():
            assert torch.equal(state[fqn][key], value), (fqn, key)


def _world(rank: int, world: int) -> None:
    subtests = {}
    for stacks in ("whole", "slices") if world > 1 else ("whole",):
        subtests[f"sgd_{stacks}"] = functools.partial(_sgd, rank, world, stacks)
        for name in ("muon", "okls", "shampoo", "soap", "emagram"):
            subtests[f"optimizer_{name}_{stacks}"] = functools.partial(
                _optimizer, rank, world, name, stacks
            )
    run_subtests(rank, subtests)


@pytest.mark.parametrize("world", [1, 3])
def test_expert_stacks(world: int) -> None:
    run_world(world, _world)


@pytest.mark.parametrize("save_world,load_world", [(3, 2), (1, 3), (3, 1)])
def test_stack_checkpoints_across_world_sizes(tmp_path, save_world: int, load_world: int) -> None:
    """Sliced <-> sliced, whole (1 rank) -> sliced, sliced -> whole: a reshard, not a mismatch."""
    run_world(save_world, _checkpoint_reshards_slices, str(tmp_path), "save")
    run_world(load_world, _checkpoint_reshards_slices, str(tmp_path), "load")
