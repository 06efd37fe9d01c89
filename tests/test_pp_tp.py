"""Pipeline parallelism with tensor parallelism inside each stage, against one process.

A ``(pp, dp, tp)`` device mesh (rank-major, one ``init_device_mesh``, as torchtitan lays out
``pp x dp_shard x tp``): each stage is cut from the whole model (``tests/pp_models.py``), its
MLPs ``parallelize_module``'d on ``mesh["tp"]`` (``up``: ``ColwiseParallel``, ``down``:
``RowwiseParallel``, as ``tests/test_tp.py``) by ``build_pipeline(prepare=...)`` before
``fully_shard_matrix(stage, mesh["dp"])``; the pipeline runs over ``mesh["pp"]`` (a stage's tp
ranks each send their own, equal, activations to the next stage's tp ranks). Checked: every
stage matrix is a TP matrix of matrixfsdp's plan, step-0 gradients (<= 1e-6 relative) and the
parameters after 3 Muon steps (<= 1e-5) equal one process on the global batch
(``tests/test_pp.py``'s ``_steps``).

CI: pp 2 x tp 2 at world 4 (dp 1) with 1F1B and a zero-bubble schedule (whose split backward
exposes the TP matrices' local leaves, see [Note: zero-bubble schedules] in
``matrixfsdp/runtime/pipelining.py``). ``MATRIXFSDP_PP_TP8=1``: pp 2 x dp 2 x tp 2 at world 8
with every schedule, and pp 2 x HSDP (2 replicas x 1 shard) x tp 2 (issue 28: a sweep, not CI).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp as mf

from .dist_utils import run_subtests, run_world
from .models import global_batch, local_batch
from .pp_models import MULTI, SINGLE, ZERO_BUBBLE, PPMeshes, PPTransformer, build_pipeline
from .test_pp import _steps

MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
WORLD8_ENV = "MATRIXFSDP_PP_TP8"


def pp_tp_meshes(pp: int, dp: tuple[int, ...], tp: int) -> tuple[PPMeshes, DeviceMesh]:
    """``PPMeshes`` over ``mesh["pp"]`` and the data-parallel dims of one (pp, *dp, tp) mesh
    (``dp``: ``(n,)`` flat, ``(replicate, shard)`` HSDP), and its ``mesh["tp"]``."""
    names = ("dp",) if len(dp) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", (pp, *dp, tp), mesh_dim_names=("pp", *names, "tp"))
    pp_rank, *dp_coords, _ = mesh.get_coordinate()
    dp_rank = dp_coords[0] if len(dp) == 1 else dp_coords[0] * dp[1] + dp_coords[1]
    meshes = PPMeshes(mesh["pp"].get_group(), mesh[names], pp_rank, dp_rank, math.prod(dp))
    return meshes, mesh["tp"]


def _parallelize(tp: DeviceMesh, stages: list[nn.Module], module: nn.Module) -> None:
    """``prepare`` of ``build_pipeline``: TP on every block's MLP of the stage."""
    for block in module.layers.values():
        parallelize_module(block, tp, MLP_PLAN)
        assert isinstance(block.up.weight, DTensor) and isinstance(block.down.weight, DTensor)
    stages.append(module)


def _tp_steps(meshes: PPMeshes, tp: DeviceMesh, schedule: str, name: str = "muon") -> None:
    stages: list[nn.Module] = []
    _steps(meshes, schedule, name, wrap_kwargs={"prepare": functools.partial(_parallelize, tp,
                                                                              stages)})
    shape = tuple(meshes.dp_mesh.shape) if meshes.dp_mesh.ndim == 2 else (1, meshes.dp_size)
    for module in stages:  # wrapped in place: the stage matrices are matrixfsdp's TP matrices
        assert tuple(mf.get_state(module).mesh_shape) == shape, mf.get_state(module).mesh_shape
        params = mf.get_state(module).params
        mlp = {f for f in params if f.endswith((".up.weight", ".down.weight"))}
        assert mlp and all(params[f].tp is not None for f in mlp), sorted(mlp)
        assert all(params[f].tp is None for f in set(params) - mlp), sorted(params)


def _world(rank: int, world: int, pp: int, dp: tuple[int, ...], tp: int,
           schedules: tuple[str, ...]) -> None:
    meshes, tp_mesh = pp_tp_meshes(pp, dp, tp)
    run_subtests(rank, {f"muon_{s}": functools.partial(_tp_steps, meshes, tp_mesh, s)
                        for s in schedules})


def test_pp_tp_world4() -> None:
    """pp 2 x tp 2 (dp 1): 1F1B and InterleavedZeroBubble, 3 Muon steps == one process."""
    run_world(4, _world, 2, (1,), 2, ("Schedule1F1B", "ScheduleInterleavedZeroBubble"))


def _one_stage_fails(rank: int, world: int) -> None:
    """agree_on_error under pp 2 x tp 2: rank 0's owner-local step raises; the ranks of its stage
    (tp peers) all raise the same MatrixStepError at once, the other stage's ranks step on."""
    meshes, tp_mesh = pp_tp_meshes(2, (1,), 2)
    torch.manual_seed(0)
    pipe = build_pipeline(PPTransformer(), meshes, "Schedule1F1B", 4,
                          prepare=functools.partial(_parallelize, tp_mesh, []))
    opts = [mf.MatrixOptimizer(m, "muon", lr=0.02, agree_on_error=True) for m in pipe.modules]
    pipe.step(local_batch(global_batch(0, batch=16), meshes.dp_rank, meshes.dp_size))
    if rank == 0:  # an unforeseen owner-local failure (a bug, an out-of-memory)
        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("simulated owner-local failure")
        opts[0]._spec = dataclasses.replace(opts[0]._spec, step_fn=broken)
    outcome = "stepped"
    try:
        for opt in opts:
            opt.step()
    except mf.MatrixStepError as exc:
        assert "simulated owner-local failure" in str(exc) and "rank 0:" in str(exc), exc
        outcome = "raised"
    assert outcome == ("raised" if meshes.pp_rank == 0 else "stepped"), (rank, outcome)


def test_pp_tp_agreement_stays_in_the_failing_stage() -> None:
    """The failure's messages are exchanged over the stage's dp x tp ranks only: the other
    stage never enters that exchange, and nobody waits for a timeout."""
    run_world(4, _one_stage_fails, timeout=120.0)


@pytest.mark.skipif(os.environ.get(WORLD8_ENV) != "1", reason=f"{WORLD8_ENV}=1 runs it (world 8)")
def test_pp_dp_tp_world8() -> None:
    """pp 2 x dp 2 x tp 2: every schedule, 3 Muon steps == one process."""
    run_world(8, _world, 2, (2,), 2, (*SINGLE, *MULTI, *ZERO_BUBBLE), timeout=3600.0)


@pytest.mark.skipif(os.environ.get(WORLD8_ENV) != "1", reason=f"{WORLD8_ENV}=1 runs it (world 8)")
def test_pp_hsdp_tp_world8() -> None:
    """pp 2 x HSDP (2 replicas x 1 shard) x tp 2: GPipe and Interleaved1F1B, 3 Muon steps ==
    one process (the replicas' all-reduce of TP matrix gradients)."""
    run_world(8, _world, 2, (2, 1), 2, ("ScheduleGPipe", "ScheduleInterleaved1F1B"),
              timeout=3600.0)
