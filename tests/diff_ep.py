"""Expert-parallel configurations of the differential harness (``mesh="ep"``, see
[Note: differential configurations] in ``tests/diff_models.py``).

A block of experts under EP sends every token of its rank to every ep rank (an all-to-all with
equal splits), computes its local experts there and returns their outputs (a second all-to-all):
the dense mixture a single process computes, with each expert's gradient summed over the tokens
of every ep peer, as a routed MoE's dispatch leaves it.
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .diff_models import EP_LAYOUTS, DiffConfig

__all__ = ["EP_CI_SEEDS", "EpMeshes", "distribute_experts", "ep_feature_universe",
           "ep_meshes", "experts_over_ep"]

# Expert-parallel seeds (from EP_SEED_BASE): chosen greedily until ``ep_feature_universe`` is
# covered.
EP_CI_SEEDS = (3000043, 3000009, 3000037)


class EpMeshes(NamedTuple):
    dense: DeviceMesh  # the data-parallel mesh of dense matrices and the tail
    experts: DeviceMesh  # the expert mesh (efsdp; (replicate, efsdp) under HSDP)
    ep: DeviceMesh


def experts_over_ep(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Every expert's output for every token of ``h`` (``(b, t, E, d)``), computed over ep."""
    group = block.ep_group
    ep = dist.get_world_size(group)
    b, t, d = h.shape
    flat = h.reshape(-1, d)
    inbound = dist_fn.all_to_all_single(flat.new_empty(ep * flat.shape[0], d),
                                        flat.repeat(ep, 1), group=group)
    w_in, w_out = (w.to_local() if isinstance(w, DTensor) else w for w in (block.w_in, block.w_out))
    inner = F.gelu(torch.einsum("td,edh->teh", inbound, w_in))
    out = torch.einsum("teh,ehd->ted", inner, w_out)  # (ep * T, local experts, d)
    local = out.shape[1]
    back = dist_fn.all_to_all_single(torch.empty_like(out.reshape(ep * flat.shape[0], -1)),
                                     out.reshape(ep * flat.shape[0], -1).contiguous(), group=group)
    # chunk j: ep rank j's experts' outputs for this rank's tokens -> experts in global order
    return back.view(ep, b * t, local, d).permute(1, 0, 2, 3).reshape(b, t, ep * local, d)


def ep_meshes(cfg: DiffConfig, index: int, timeout_s: int) -> tuple[EpMeshes, list]:
    """Config ``index``'s dense, expert and ep meshes on fresh gloo groups (unique dim names,
    see ``_config_mesh``); rank = dense index, layout (replicate, efsdp, ep)."""
    replicate, efsdp, ep = cfg.ep_layout
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = dist.get_rank()
    layout = torch.arange(cfg.world).view(replicate, efsdp, ep)
    dense_layout = layout.reshape(replicate, efsdp * ep)
    mine: dict[str, dist.ProcessGroup] = {}
    made = []
    shapes = {"replicate": (layout, 0), "efsdp": (layout, 1), "ep": (layout, 2),
              "shard": (dense_layout, 1), "flat": (layout.reshape(1, -1), 1)}
    for name, (grid, dim) in shapes.items():  # every rank creates every group, in one order
        for ranks in grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist():
            group = dist.new_group(ranks, timeout=timeout)
            made.append(group)
            if rank in ranks:
                mine[name] = group
    names = {k: f"{k}{index}" for k in ("replicate", "efsdp", "ep", "shard", "dp")}
    ep_mesh = DeviceMesh.from_group(mine["ep"], "cpu", mesh_dim_names=(names["ep"],))
    if replicate == 1:
        dense = DeviceMesh.from_group(mine["flat"], "cpu", mesh_dim_names=(names["dp"],))
        experts = DeviceMesh.from_group(mine["efsdp"], "cpu", mesh_dim_names=(names["efsdp"],))
    else:
        dense = DeviceMesh.from_group([mine["replicate"], mine["shard"]], "cpu",
                                      mesh=dense_layout, mesh_dim_names=(names["replicate"],
                                                                         names["shard"]))
        experts = DeviceMesh.from_group([mine["replicate"], mine["efsdp"]], "cpu",
                                        mesh=_expert_layout(layout, rank),
                                        mesh_dim_names=(names["replicate"], names["efsdp"]))
    return EpMeshes(dense, experts, ep_mesh), made


def _expert_layout(layout: torch.Tensor, rank: int) -> torch.Tensor:
    """The (replicate, efsdp) ranks of this rank's ep coordinate."""
    e = int((layout == rank).nonzero()[0, 2])
    return layout[:, :, e]


def distribute_experts(model: nn.Module, meshes: EpMeshes) -> None:
    """Each block of experts: stacks ``Shard(0)`` over ep, tokens dispatched over its group."""
    for block in model.layers:
        if block.kind != "moe":
            continue
        block.ep_group = meshes.ep.get_group(0)
        for name in ("w_in", "w_out"):
            param = getattr(block, name)
            dt = distribute_tensor(param.detach(), meshes.ep, [Shard(0)])
            block.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def ep_feature_universe() -> set[str]:
    """What the EP CI seeds must cover: every layout, a matrix optimizer and SGD, accumulation,
    checkpointing, several forwards, freezing and mixed precision."""
    return {
        *(f"ep={'x'.join(map(str, layout))}" for layout in EP_LAYOUTS),
        "optimizer=sgd", "optimizer=muon", "accum=2", "checkpoint=block_reentrant",
        "forwards=sum2", "freeze=matrix", "mixed_precision=True",
    }
