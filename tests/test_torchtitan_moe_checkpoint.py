"""torchtitan's checkpointer on its MoE with expert parallelism, through the integration.

The DeepSeek-V3-class MoE of ``tests/titan_moe.py`` at world 2 = ep 2, wrapped by
``parallelize_fn`` (experts ``Shard(0)`` on ``ep``, owned over ``efsdp``), with
``MatrixOptimizersContainer`` (Muon + AdamW), torchtitan's load-balancing pre-hook and its
``LRSchedulersContainer``, saved and loaded by torchtitan's own ``CheckpointManager`` (DCP).
Checked: the wrapped model's ``state_dict()`` is the one-process model's (keys and whole values,
the expert stacks and the persistent ``expert_bias_E`` included); train 2 steps, save, train 2
more; a fresh run (other seed) loads the checkpoint and its 2 steps reproduce the parameters,
the expert biases, the optimizer state and the learning rates bit for bit.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from .checks import full_values
from .dist_utils import run_subtests, run_world

pytest.importorskip("torchtitan")
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, register_moe_load_balancing_hook
from torchtitan.config import CompileConfig, TrainingConfig

from matrixfsdp.integrations.torchtitan import parallelize_fn

from .test_torchtitan_checkpoint import _assert_same, _full
from .test_torchtitan_integration import container_config
from .titan_models import batch, cpu_parallel_dims, shard, sharded_config, token_loss
from .titan_moe import build_moe, tiny_moe_config

VOCAB, ROWS = 256, 8


def _wrapped(world: int, seed: int, folder: str):
    parallelism, dims = cpu_parallel_dims(world, ep=2)
    model = build_moe(sharded_config(tiny_moe_config(), parallelism), seed=seed)
    parallelize_fn(model, parallel_dims=dims, parallelism=parallelism,
                   training=TrainingConfig(mixed_precision_param="float32"),
                   compile_config=CompileConfig(), ac_config=None, dump_folder=folder)
    return model, dims


class _Run:
    """One training run as torchtitan's trainer holds it, saving to ``folder``."""

    def __init__(self, rank: int, world: int, folder: str, seed: int) -> None:
        self.rank, self.world = rank, world
        self.model, dims = _wrapped(world, seed, folder)
        self.optimizers = container_config().build(model_parts=[self.model])
        register_moe_load_balancing_hook(self.optimizers, [self.model], dims)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
            optimizers=self.optimizers, training_steps=10)
        self.checkpointer = CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
            last_save_model_only=False).build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={}, sd_adapter=None, base_folder=folder)

    def train(self, steps: range) -> None:
        for step in steps:
            tokens = batch(step, VOCAB, rows=ROWS)
            local = shard(tokens, self.rank, self.world)
            token_loss(self.model, local, tokens[:, 1:].numel()).backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()

    def snapshot(self) -> dict[str, object]:
        flat = self.optimizers.state_dict()
        out: dict[str, object] = {f"param.{k}": v.clone()
                                  for k, v in full_values(self.model).items()}
        for name, buf in self.model.named_buffers():
            if name.endswith("expert_bias_E"):
                out[f"buffer.{name}"] = _full(buf).clone()
        assert any(v.any() for k, v in out.items() if k.startswith("buffer."))  # it moved
        for key, value in flat.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        out["lrs"] = [g["lr"] for opt in self.optimizers for g in opt.param_groups]
        return out


def _state_dict(world: int) -> None:
    """``state_dict()`` of the wrapped EP model == the one-process model's; and it loads back."""
    ref = build_moe(tiny_moe_config())
    model, _ = _wrapped(world, 0, "/tmp")
    want, got = ref.state_dict(), model.state_dict()
    assert got.keys() == want.keys(), set(got) ^ set(want)
    assert "layers.1.moe.routed_experts.inner_experts.w1_EFD" in got
    for key, value in want.items():
        assert torch.equal(_full(got[key]), value), key
    model.load_state_dict({k: v + 1 for k, v in want.items()})
    for key, value in model.state_dict().items():
        assert torch.equal(_full(value), want[key] + 1), key


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
        "state_dict": functools.partial(_state_dict, world),
        "resume": functools.partial(_resume, rank, world, root),
    })


def test_moe_checkpointer_ep2(tmp_path) -> None:
    run_world(2, _world, str(tmp_path))
