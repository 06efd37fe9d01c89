"""``matrixfsdp.integrations.torchtitan``: its parallelize_fn and optimizer container on CPU.

torchtitan's trainer needs CUDA, so the pieces it calls run here as it calls them: the model is
built from torchtitan's config (with the sharding declarations ``update_from_config`` sets),
``parallelize_fn`` gets torchtitan's ``ParallelDims`` / ``TrainingConfig`` / ``ParallelismConfig``
/ ``CompileConfig`` / AC config, the optimizer is ``MatrixOptimizersContainer.Config(...).build(
model_parts=[model])``, and the loss is the trainer's: a sum over local tokens divided by the
global token count, with gradient division off (``parallelize_fn`` turns it off as torchtitan's
``apply_fsdp`` does). 3 free-running Muon steps equal one process (mean loss over the global
batch, functional Muon + torch AdamW) at world 2 (the debug model) and at dp 2 x tp 2 (Llama3's
classes at toy size with GQA, torchtitan's own TP with sequence parallelism, and full
activation checkpointing).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import matrixfsdp as mf

from .checks import full_values, reference_values
from .dist_utils import run_subtests, run_world

pytest.importorskip("torchtitan")
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.llama3 import model_registry

from matrixfsdp.integrations.torchtitan import (
    MatrixOptimizersContainer,
    data_parallel_meshes,
    parallelize_fn,
)

from .titan_models import (
    LR,
    MUON,
    TAIL,
    TAIL_LR,
    WD,
    MuonReference,
    batch,
    build_llama3,
    cpu_parallel_dims,
    expected_matrices,
    shard,
    sharded_config,
    tiny_llama3_config,
    token_loss,
)

# Measured (largest relative error over all parameters, 3 free-running steps): world 2 debug
# model: params 1.1e-6 / 1.7e-6 / 1.9e-6; dp2 x tp2 toy model: 7.4e-7 / 1.2e-6 / 1.5e-6.
PARAM_RTOL = 1e-5
GRAD_RTOL = 1e-5
FP32 = TrainingConfig(mixed_precision_param="float32")


def container_config(**changes) -> MatrixOptimizersContainer.Config:
    return MatrixOptimizersContainer.Config(
        lr=LR, weight_decay=WD, kwargs=dict(MUON), tail_lr=TAIL_LR, tail_weight_decay=WD,
        tail_kwargs=dict(TAIL), implementation="for-loop", **changes)


def _canonical(values: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {canonical_fqn(k): v for k, v in values.items()}


def _max_error(got: dict, want: dict) -> float:
    got = _canonical(got)
    assert got.keys() == want.keys(), set(got) ^ set(want)
    worst = 0.0
    for fqn, w in want.items():
        g = got[fqn]
        assert (g is None) == (w is None), fqn
        if w is not None:
            worst = max(worst, ((g.double() - w.double()).norm() / w.double().norm()).item())
    return worst


def _parallelize(model: nn.Module, parallelism, dims, ac=None) -> nn.Module:
    return parallelize_fn(model, parallel_dims=dims, training=FP32, parallelism=parallelism,
                          compile_config=CompileConfig(), ac_config=ac, dump_folder="/tmp")


def _train(ref: nn.Module, model: nn.Module, dp_rank: int, dp: int, vocab: int,
           steps: int = 3, qkv_split: str = "none") -> list[float]:
    """Free-running steps: the trainer's loss and container vs one process."""
    reference = MuonReference(ref, expected_matrices(ref), qkv=qkv_split == "qkv")
    optimizers = container_config(qkv_split=qkv_split).build(model_parts=[model])
    errors = []
    for step in range(steps):
        tokens = batch(step, vocab)
        token_loss(ref, tokens).backward()
        token_loss(model, shard(tokens, dp_rank, dp), tokens[:, 1:].numel()).backward()
        grad_err = _max_error(full_values(model, "grad"), reference_values(ref, "grad"))
        assert grad_err <= GRAD_RTOL, f"grads of step {step + 1}: {grad_err:.2e}"
        reference.step()
        optimizers.step()
        optimizers.zero_grad()
        errors.append(_max_error(full_values(model), reference_values(ref)))
        assert errors[-1] <= PARAM_RTOL, f"params after step {step + 1}: {errors[-1]:.2e}"
    return errors


def _check_selected(ref: nn.Module, model: nn.Module) -> None:
    selected = {canonical_fqn(f) for f in mf.get_plan(model).selection().matrices}
    assert selected == expected_matrices(ref), selected ^ expected_matrices(ref)


# -- world 2: the debug model ----------------------------------------------------------------------
def _container(rank: int, world: int, model: nn.Module) -> None:
    """torchtitan's contract: param_names on every group, every trainable parameter once."""
    optimizers = container_config().build(model_parts=[model])
    assert len(optimizers) == 1 and isinstance(optimizers.optimizers[0], mf.MatrixOptimizer)
    names = [n for g in optimizers.optimizers[0].param_groups for n in g["param_names"]]
    assert sorted(names) == sorted(canonical_fqn(n) for n, _ in model.named_parameters())
    flat = optimizers.state_dict()  # torchtitan's init_optim_state, then its flat dict
    wqkv = "layers.0.attention.qkv_linear.wqkv.weight"
    assert f"state.{wqkv}.momentum_buffer" in flat
    assert "state.tok_embeddings.weight.exp_avg" in flat
    assert flat[f"param_groups.{wqkv}.lr"] == LR
    with pytest.raises(ValueError, match="param_groups must be empty"):
        MatrixOptimizersContainer.Config(param_groups=[object()]).build(model_parts=[model])


def _world2(rank: int, world: int) -> None:
    parallelism, dims = cpu_parallel_dims(world)
    ref = build_llama3("debugmodel")
    model = copy.deepcopy(ref)
    _parallelize(model, parallelism, dims)
    mesh, expert_mesh = data_parallel_meshes(dims)
    assert mesh.mesh_dim_names == ("fsdp",) and expert_mesh is None
    run_subtests(rank, {
        "selected": functools.partial(_check_selected, ref, model),
        "train": functools.partial(_train, ref, model, rank, world, 2048),
        "container": functools.partial(_container, rank, world, model),
        "qkv_split": functools.partial(_qkv_split, rank, world, parallelism, dims),
        "refusals": functools.partial(_refusals, world),
        "clip": functools.partial(_clip, rank, world),
    })


def _qkv_split(rank: int, world: int, parallelism, dims) -> None:
    """``qkv_split="qkv"``: each GQA ``wqkv`` steps as torchtitan's own wq / wk / wv."""
    ref = build_llama3(config=tiny_llama3_config())
    model = _parallelize(copy.deepcopy(ref), parallelism, dims)
    split = container_config(qkv_split="qkv").build(model_parts=[model]).optimizers[0]
    wqkv = {f for f in expected_matrices(ref) if f.endswith("wqkv.weight")}
    assert set(split.param_groups[0]["split"]) == wqkv, split.param_groups[0]["split"]
    _train(ref, model, rank, world, 256, steps=2, qkv_split="qkv")


def _refusals(world: int) -> None:
    parallelism, dims = cpu_parallel_dims(world)
    config = model_registry("debugmodel").model
    for setting, change in (("context_parallel", {"cp": 2}), ("pipeline_parallel", {"pp": 2})):
        bad = copy.copy(dims)
        for attr, value in change.items():
            object.__setattr__(bad, attr, value)
        with torch.device("meta"):
            model = config.build()
        with pytest.raises(NotImplementedError, match=setting):
            _parallelize(model, parallelism, bad)


def _clip(rank: int, world: int) -> None:
    """MatrixTrainer's stand-in for torchtitan's clip_grad_norm_: the one-process norm."""
    from matrixfsdp.integrations.torchtitan_configs import matrix_clip_grad_norm

    parallelism, dims = cpu_parallel_dims(world)
    ref = build_llama3(config=tiny_llama3_config())
    model = _parallelize(copy.deepcopy(ref), parallelism, dims)
    tokens = batch(9, 256)
    token_loss(ref, tokens).backward()
    token_loss(model, shard(tokens, rank, world), tokens[:, 1:].numel()).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    clip = matrix_clip_grad_norm([model])
    got = clip(list(model.parameters()), 1e9, foreach=True, pp_mesh=None, ep_enabled=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    with pytest.raises(NotImplementedError, match="pipeline"):
        matrix_clip_grad_norm([model, model])([], 1.0)


def test_module_config() -> None:
    """``--module matrixfsdp.integrations.torchtitan_configs --config llama3_debugmodel`` parses
    through torchtitan's ConfigManager (tyro) into a MatrixTrainer config with our pieces."""
    from torchtitan.config import ConfigManager

    from matrixfsdp.integrations.torchtitan_configs import MatrixTrainer

    config = ConfigManager().parse_args([
        "--module", "matrixfsdp.integrations.torchtitan_configs", "--config", "llama3_debugmodel",
        "--optimizer.lr", "0.01", "--optimizer.qkv_split", "qkv"])
    assert isinstance(config, MatrixTrainer.Config) and config._owner is MatrixTrainer
    assert config.model_spec.parallelize_fn is parallelize_fn
    assert isinstance(config.optimizer, MatrixOptimizersContainer.Config)
    assert config.optimizer.lr == 0.01 and config.optimizer.qkv_split == "qkv"
    assert config.parallelism.spmd_backend == "partial_dtensor"
    assert config.training.disable_cuda_graphs


def test_world2_debugmodel() -> None:
    run_world(2, _world2)


# -- dp 2 x tp 2: torchtitan's TP (sequence parallel) and full AC ----------------------------------
def _dp2_tp2(rank: int, world: int) -> None:
    parallelism, dims = cpu_parallel_dims(world, dp_shard=2, tp=2)
    ref = build_llama3(config=tiny_llama3_config())
    model = build_llama3(config=sharded_config(tiny_llama3_config(), parallelism))
    _parallelize(model, parallelism, dims, FullAC.Config())
    assert mf.get_state(model).tp_mesh is not None
    _check_selected(ref, model)
    dp_rank = dims.get_mesh("fsdp").get_local_rank()
    errors = _train(ref, model, dp_rank, 2, 256)
    assert max(errors) <= PARAM_RTOL, errors


def test_dp2_tp2() -> None:
    run_world(4, _dp2_tp2)
