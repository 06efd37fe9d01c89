"""torchtitan's ``init_optim_state`` (a zero-gradient, lr=0 step that makes optimizer state for
its checkpointer) on a MatrixOptimizer: every matrix gets its fresh state and nothing steps, so
the next real step is bit for bit the first step of an optimizer that never saw it."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import matrixfsdp as mf

from .checks import FREE_RUNNING_KWARGS, full_optimizer_state, full_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

pytest.importorskip("torchtitan")
from torchtitan.components.optimizer.utils import init_optim_state

OPTIMIZERS = ("muon", "shampoo", "soap", "okls", "emagram")


def _matrix_state(model, opt) -> dict:
    """``{(fqn, name): value}`` of every matrix's optimizer state, whole (collective)."""
    matrices = {p.fqn for p in mf.get_plan(model).matrices}
    return {(fqn, name): value for fqn, entry in full_optimizer_state(model, opt).items()
            if fqn in matrices for name, value in entry.items()}


def _first_step_unchanged(rank: int, world: int, name: str) -> None:
    torch.manual_seed(0)
    base = TinyTransformer()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = []
    for model in models:
        mf.fully_shard_matrix(model)
        opts.append(mf.MatrixOptimizer(model, optimizer=name, lr=0.02,
                                       **FREE_RUNNING_KWARGS.get(name, {})))
    before = full_values(models[0])
    init_optim_state(opts[0])
    assert opts[0].state, "init_optim_state made no state"
    after_init = full_values(models[0])
    assert all(torch.equal(after_init[k], v) for k, v in before.items()), "init step moved a param"
    for model, opt in zip(models, opts, strict=True):
        lm_loss(model, local_batch(global_batch(0), rank, world)).backward()
        opt.step()
        opt.zero_grad()
    got, want = (full_values(m) for m in models)
    matrices = {p.fqn for p in mf.get_plan(models[0]).matrices}
    for fqn in matrices:
        assert torch.equal(got[fqn], want[fqn]), f"{name}: {fqn} differs after the first step"
    got_state, want_state = (_matrix_state(m, o) for m, o in zip(models, opts, strict=True))
    assert want_state and set(want_state) <= set(got_state), sorted(set(want_state) - set(got_state))
    # init_optim_state gives every trainable parameter a zero gradient: a matrix no real
    # backward reaches (``unused``) keeps the fresh state it got there, at step 0.
    extra = {k: v for k, v in got_state.items() if k not in want_state}
    assert all(float(v) == 0.0 for (_, key), v in extra.items() if key == "step"), extra
    for key, value in want_state.items():
        other = got_state[key]
        same = torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
        assert same, f"{name}: state {key} differs after the first step"


def _world(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    run_subtests(rank, {name: functools.partial(_first_step_unchanged, rank, world, name)
                        for name in OPTIMIZERS})


def test_init_optim_state_changes_nothing_of_the_matrices() -> None:
    run_world(2, _world)
