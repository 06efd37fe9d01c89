"""torchtitan's checkpointer path through ``matrixfsdp.integrations.torchtitan`` at world 2.

torchtitan's own ``CheckpointManager`` (DCP, synchronous) saves and loads what its trainer hands
it: ``ModelWrapper(model_parts)`` (``module.state_dict()``, with ``FusedQKVLinear``'s hooks
renaming ``wqkv`` to ``wq``/``wk``/``wv``), the optimizer container's flat ``param_names``-keyed
state (after torchtitan's ``init_optim_state``: a zero-gradient, lr=0 step) and its
``LRSchedulersContainer``. Checked: the wrapped model's state dict is the unwrapped model's (keys
and values); the lr=0 step changes no parameter and leaves the state at its initial values;
train 2 steps, save, train 2 more; a fresh model (other seed) loads the checkpoint and its 2
steps reproduce the parameters, the optimizer state and the learning rates bit for bit.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from .checks import full_values
from .dist_utils import run_subtests, run_world

pytest.importorskip("torchtitan")
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.config import CompileConfig, TrainingConfig

from matrixfsdp.integrations.torchtitan import parallelize_fn

from .test_torchtitan_integration import container_config
from .titan_models import (
    batch,
    build_llama3,
    cpu_parallel_dims,
    shard,
    tiny_llama3_config,
    token_loss,
)

VOCAB = 256


class _Run:
    """One training run as torchtitan's trainer holds it: model part, optimizers, schedulers,
    checkpointer (saving to ``folder``)."""

    def __init__(self, rank: int, world: int, folder: str, seed: int) -> None:
        parallelism, dims = cpu_parallel_dims(world)
        self.rank, self.world = rank, world
        self.model = build_llama3(config=tiny_llama3_config(), seed=seed)
        parallelize_fn(self.model, parallel_dims=dims, parallelism=parallelism,
                       training=TrainingConfig(mixed_precision_param="float32"),
                       compile_config=CompileConfig(), ac_config=None, dump_folder=folder)
        self.optimizers = container_config().build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
            optimizers=self.optimizers, training_steps=10)
        self.checkpointer = CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
            last_save_model_only=False).build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={}, sd_adapter=None, base_folder=folder)

    def train(self, steps: range) -> None:
        for step in steps:
            tokens = batch(step, VOCAB)
            local = shard(tokens, self.rank, self.world)
            token_loss(self.model, local, tokens[:, 1:].numel()).backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()

    def snapshot(self) -> dict[str, object]:
        flat = self.optimizers.state_dict()
        out: dict[str, object] = {f"param.{k}": v.clone() for k, v in full_values(self.model).items()}
        for key, value in flat.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        out["lrs"] = [g["lr"] for opt in self.optimizers for g in opt.param_groups]
        return out


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: {set(got) ^ set(want)}"
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{what}: {key} differs"
        else:
            assert g == w, f"{what}: {key}: {g!r} != {w!r}"


def _state_dict_names(rank: int, world: int) -> None:
    """The wrapped model's ``state_dict()`` is the unwrapped one's: ``wq``/``wk``/``wv``."""
    parallelism, dims = cpu_parallel_dims(world)
    ref = build_llama3(config=tiny_llama3_config())
    model = copy.deepcopy(ref)
    parallelize_fn(model, parallel_dims=dims, parallelism=parallelism,
                   training=TrainingConfig(mixed_precision_param="float32"),
                   compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    want, got = ref.state_dict(), model.state_dict()
    assert got.keys() == want.keys(), set(got) ^ set(want)
    assert "layers.0.attention.qkv_linear.wk.weight" in got
    for key, value in want.items():
        assert torch.equal(_full(got[key]), value), key
    # and back: the unfused keys load into the fused, owner-sharded wqkv
    model.load_state_dict({k: v + 1 for k, v in want.items()})
    for key, value in model.state_dict().items():
        assert torch.equal(_full(value), want[key] + 1), key


def _init_optim_state(rank: int, world: int, root: str) -> None:
    """torchtitan's zero-gradient, lr=0 step (run by the container's ``state_dict()``)."""
    run = _Run(rank, world, os.path.join(root, "init"), seed=0)
    before = {k: v.clone() for k, v in full_values(run.model).items()}
    lrs = [g["lr"] for opt in run.optimizers for g in opt.param_groups]
    flat = run.optimizers.state_dict()
    _assert_same(full_values(run.model), before, "params after init_optim_state")
    assert all(p.grad is None for p in run.model.parameters())
    states = {k: _full(v) for k, v in flat.items() if k.startswith("state.")}
    assert any(k.endswith(".momentum_buffer") for k in states)
    for key, value in states.items():
        if not key.endswith(".step"):  # moments: their initial zeros
            assert not value.any(), f"{key} changed by the lr=0 step"
    assert [g["lr"] for opt in run.optimizers for g in opt.param_groups] == lrs


def _resume(rank: int, world: int, root: str) -> None:
    folder = os.path.join(root, "resume")
    first = _Run(rank, world, folder, seed=0)
    first.train(range(2))
    assert first.checkpointer.save(curr_step=2)
    first.train(range(2, 4))
    want = first.snapshot()
    second = _Run(rank, world, folder, seed=5)
    assert second.checkpointer.load(step=2)
    second.train(range(2, 4))
    _assert_same(second.snapshot(), want, "resumed run")


def _world(rank: int, world: int, root: str) -> None:
    run_subtests(rank, {
        "state_dict_names": functools.partial(_state_dict_names, rank, world),
        "init_optim_state": functools.partial(_init_optim_state, rank, world, root),
        "resume": functools.partial(_resume, rank, world, root),
    })


def test_checkpointer_world2(tmp_path) -> None:
    run_world(2, _world, str(tmp_path))

