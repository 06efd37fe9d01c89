"""Expert parallelism composed with owner sharding, against a single-process reference.

``TinyEPMoE`` (top-2 routing, all-to-all token dispatch over ep; ``tests/ep_models.py``) with its
expert stacks distributed ``Shard(0)`` over ``mesh["ep"]`` and wrapped with
``fully_shard_matrix(model, dense_mesh, expert_mesh=mesh["efsdp"])`` at world 4 on gloo, as
efsdp 2 x ep 2, efsdp 1 x ep 4 and HSDP (replicate 2 x efsdp 1 x ep 2). Checked against one process
on the same global batch: every gradient (<= 1e-6 relative), the global gradient norm, and 3 steps of
SGD and of every matrix optimizer (<= 1e-5).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import matrixfsdp as mf

from .checks import assert_close_dicts, full_values, reference_values
from .dist_utils import device_type, run_subtests, run_world
from .ep_models import EXPERT_FQNS, TinyEPMoE, distribute_experts
from .models import global_batch, lm_loss, local_batch

LAYOUTS = {"efsdp2_ep2": (1, 2, 2), "efsdp1_ep4": (1, 1, 4), "hsdp2_efsdp1_ep2": (2, 1, 2)}


def ep_meshes(layout: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dense mesh, expert mesh, ep mesh) of ``layout`` over 4 ranks, rank = dense index."""
    replicate, efsdp, ep = LAYOUTS[layout]
    if replicate == 1:
        mesh = init_device_mesh(device_type(), (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
        dense = init_device_mesh(device_type(), (efsdp * ep,), mesh_dim_names=("dp",))
        return dense, mesh["efsdp"], mesh["ep"]
    mesh = init_device_mesh(device_type(), (replicate, efsdp, ep),
                            mesh_dim_names=("replicate", "efsdp", "ep"))
    dense = init_device_mesh(device_type(), (replicate, efsdp * ep),
                             mesh_dim_names=("replicate", "shard"))
    return dense, mesh["replicate", "efsdp"], mesh["ep"]


def ep_pair(layout: str, **wrap_kwargs) -> tuple[nn.Module, nn.Module]:
    """A reference model and its EP copy, wrapped on ``layout``'s meshes."""
    dense, experts, ep = ep_meshes(layout)
    torch.manual_seed(0)
    ref = TinyEPMoE()
    model = distribute_experts(copy.deepcopy(ref), ep)
    mf.fully_shard_matrix(model, dense, expert_mesh=experts, **wrap_kwargs)
    return ref, model


def _reference_backward(ref: nn.Module, tokens: torch.Tensor, world: int) -> None:
    (sum(lm_loss(ref, local_batch(tokens, r, world)) for r in range(world)) / world).backward()


def _sgd(rank: int, world: int, layout: str) -> None:
    ref, model = ep_pair(layout)
    plan = mf.get_plan(model)
    assert {p.fqn for p in plan.matrices if p.mesh == "expert"} == set(EXPERT_FQNS)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        tokens = global_batch(step)
        _reference_backward(ref, tokens, world)
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        if step == 0:
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), 1e-6,
                               "grad")
            want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in ref.parameters()))
            got = mf.global_grad_norm(model).item()
            assert abs(got - want) <= 1e-6 * want, f"global norm {got} != {want}"
        for o in opts:
            o.step()
            o.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, "param")


def _world(rank: int, world: int, layout: str) -> None:
    run_subtests(rank, {"sgd": functools.partial(_sgd, rank, world, layout)})


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ep_training(layout: str) -> None:
    run_world(4, _world, layout)
