"""Checkpoints of pipeline stages: saved at pp 2 x dp 2, loaded at pp 2 x dp 1 (each stage with
``checkpoint.load``) and into the whole model at dp 3 without pipelining
(``checkpoint.load_stages``); training continues exactly (see [Note: stage checkpoints]).

Two Muon steps at pp 2 x dp 2, a save of each stage with its optimizer, then the third step at
each layout equals one process taking three steps (parameters ≤ 1e-5): weights and momentum came
back. Stage FQNs are the whole model's, so nothing names a stage prefix.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import matrixfsdp as mf
from matrixfsdp import checkpoint as mfc

from .checks import (
    RegisteredStepReference,
    assert_close_dicts,
    full_optimizer_state,
    full_values,
    reference_values,
)
from .dist_utils import run_subtests, run_world
from .models import global_batch, lm_loss, local_batch
from .pp_models import Pipeline, PPTransformer, build_pipeline, pp_meshes

BATCH = 24  # 12 rows per rank at dp 2 (3 per microbatch), 8 at dp 3
MICRO = 4
HYPER = {"lr": 0.02, "weight_decay": 0.1}
MUON = {"ns_dtype": "float32"}  # bf16 Newton-Schulz amplifies fp32 reduction-order noise
TAIL = {"tail_lr": 1e-2, "tail_weight_decay": 0.1}
PARAM_RTOL = 1e-5


def _reference(ref: nn.Module) -> RegisteredStepReference:
    named = dict(ref.named_parameters())
    fqns = {f for f, p in named.items() if f.startswith("layers.") and p.ndim == 2}
    tail = torch.optim.AdamW([p for f, p in named.items() if f not in fqns], lr=1e-2,
                             weight_decay=0.1)
    return RegisteredStepReference({f: named[f] for f in fqns}, tail, name="muon", config=MUON,
                                   **HYPER)


def _opts(modules: list[nn.Module]) -> list[mf.MatrixOptimizer]:
    return [mf.MatrixOptimizer(m, "muon", **HYPER, **TAIL, **MUON) for m in modules]


def _pipe_step(pipe: Pipeline, opts: list, step: int, dp_rank: int, dp_size: int) -> None:
    pipe.step(local_batch(global_batch(step, batch=BATCH), dp_rank, dp_size))
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _stage_path(root: Path, stage: int) -> Path:
    return root / f"stage{stage}"


def _compare(modules: list[nn.Module], ref: nn.Module, what: str) -> None:
    want = reference_values(ref)
    got: dict = {}
    for m in modules:
        got.update(full_values(m))
    assert_close_dicts(got, {k: want[k] for k in got}, PARAM_RTOL, what)


def _all_values(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's parameters over the world, by FQN (each rank has its own stages')."""
    mine: dict = {}
    for m in modules:
        mine.update(full_values(m))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return {k: v for row in rows for k, v in row.items()}


def _all_states(modules: list[nn.Module], opts: list) -> dict[str, dict]:
    mine: dict = {}
    for m, o in zip(modules, opts, strict=True):
        mine.update(full_optimizer_state(m, o))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return {k: v for row in rows for k, v in row.items()}


def _assert_state_equal(got: dict[str, dict], want: dict[str, dict], what: str) -> None:
    for fqn, entry in got.items():
        assert entry.keys() == want[fqn].keys(), f"{what}: {fqn}: {entry.keys()} != {want[fqn].keys()}"
        for key, value in entry.items():
            assert torch.equal(value, want[fqn][key]), f"{what}: {fqn} {key} differs"


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for fqn, value in got.items():
        assert torch.equal(value, want[fqn]), f"{what}: {fqn} differs from the saved value"


def _round_trip(rank: int, world: int, root: str, schedule: str) -> None:
    root_path = Path(root) / schedule
    torch.manual_seed(0)
    full = PPTransformer()
    ref = copy.deepcopy(full)
    reference = _reference(ref)
    for step in range(3):  # the one-process run: 3 steps
        lm_loss(ref, global_batch(step, batch=BATCH)).backward()
        reference.step()
    # pp 2 x dp 2: two steps, then each stage saves itself.
    meshes = pp_meshes(2, (2,))
    pipe = build_pipeline(full, meshes, schedule, MICRO)
    opts = _opts(pipe.modules)
    for step in range(2):
        _pipe_step(pipe, opts, step, meshes.dp_rank, meshes.dp_size)
    for module, opt, stage in zip(pipe.modules, opts, pipe.stages, strict=True):
        mfc.save(_stage_path(root_path, stage), module, opt, step=2)
    saved = _all_values(pipe.modules)
    saved_state = _all_states(pipe.modules, opts)
    # pp 2 x dp 1 on ranks 0 and 2: each stage loads its own checkpoint, takes step 3.
    small = pp_meshes(2, (1,), ranks=[0, 2])
    if small is not None:
        pipe1 = build_pipeline(full, small, schedule, MICRO)
        opts1 = _opts(pipe1.modules)
        for module, opt, stage in zip(pipe1.modules, opts1, pipe1.stages, strict=True):
            assert mfc.load(_stage_path(root_path, stage), module, opt)["step"] == 2
            _assert_equal(full_values(module), saved, "pp2xdp1 after load")
            _assert_state_equal(full_optimizer_state(module, opt), saved_state, "pp2xdp1 state")
        _pipe_step(pipe1, opts1, 2, 0, 1)
        _compare(pipe1.modules, ref, f"{schedule}: pp2xdp2 -> pp2xdp1, step 3")
    # dp 3 without pipelining on ranks 0-2: the whole model loads every stage's checkpoint.
    groups = [dist.new_group([0, 1, 2]), dist.new_group([3])]
    if rank < 3:
        mesh = DeviceMesh.from_group(groups[0], "cpu", mesh_dim_names=("dp",))
        model = copy.deepcopy(full)
        mf.fully_shard_matrix(model, mesh)
        (opt,) = _opts([model])
        n_stages = 2 if len(pipe.stages) == 1 else 4
        paths = [_stage_path(root_path, s) for s in range(n_stages)]
        assert mfc.load_stages(paths, model, opt)["step"] == 2
        _assert_equal(full_values(model), saved, "dp3 after load_stages")
        _assert_state_equal(full_optimizer_state(model, opt), saved_state, "dp3 state")
        lm_loss(model, local_batch(global_batch(2, batch=BATCH), rank, 3)).backward()
        opt.step()
        _compare([model], ref, f"{schedule}: pp2xdp2 -> dp3, step 3")
        with pytest.raises(mfc.CheckpointMismatchError, match="no stage holds"):
            mfc.load_stages(paths[:1], model, opt)


def _refusals(rank: int, world: int, root: str) -> None:
    """A stage checkpoint of another model, or two holding the same entries, are refused."""
    root_path = Path(root) / "ScheduleGPipe"
    groups = [dist.new_group([0, 1, 2]), dist.new_group([3])]
    if rank >= 3:
        return
    mesh = DeviceMesh.from_group(groups[0], "cpu", mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = mf.fully_shard_matrix(PPTransformer(layers=2), mesh)
    with pytest.raises(mfc.CheckpointMismatchError, match="entries the model lacks"):
        mfc.load_stages([_stage_path(root_path, 1)], model, strict=False)
    torch.manual_seed(0)
    model = mf.fully_shard_matrix(PPTransformer(), mesh)
    paths = [_stage_path(root_path, s) for s in (0, 0, 1)]
    with pytest.raises(mfc.CheckpointMismatchError, match="both hold"):
        mfc.load_stages(paths, model, weights_only=True)


def _world(rank: int, world: int, root: str) -> None:
    run_subtests(rank, {
        "gpipe": functools.partial(_round_trip, rank, world, root, "ScheduleGPipe"),
        "interleaved": functools.partial(_round_trip, rank, world, root,
                                         "ScheduleInterleaved1F1B"),
        "refusals": functools.partial(_refusals, rank, world, root),
    })


def test_pp_checkpoints() -> None:
    with tempfile.TemporaryDirectory() as root:
        run_world(4, _world, root)
