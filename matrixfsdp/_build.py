"""Building a wrapped model's pieces: owner comms, matrix groups (dense and expert), FSDP2 units.

Called by ``fully_shard_matrix`` (``api.py``) once per model, in this order: comms, groups, then
the tail's FSDP2 units around the matrices.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .collectives import OwnerComm, ReplicateComm, TorchOwnerComm, TorchReplicateComm
from .planner import Plan
from .runtime import MatrixGroup, MatrixParam
from .runtime.experts import ExpertLayout, ExpertMesh, is_expert_param
from .runtime.mesh import DataParallelMesh
from .runtime.selection import ParamSite
from .runtime.tail import tail_has_unit
from .runtime.tp import TpLayout

logger = logging.getLogger(__name__)

__all__ = [
    "apply_fully_shard",
    "build_expert_groups",
    "build_groups",
    "check_tp_with_experts",
    "fqn_of",
    "nvshmem_comm",
    "torch_comms",
    "warn_idle_ranks",
]


def torch_comms(dp: DataParallelMesh, collectives: str) -> tuple[OwnerComm, ReplicateComm | None]:
    """The torch.distributed owner comm for ``collectives`` (``"nvshmem"`` starts from
    ``"auto"``, its fallback) and, under HSDP with replicas, the replicate all-reduce comm."""
    torch_impl = "auto" if collectives == "nvshmem" else collectives
    comm = TorchOwnerComm(
        dp.shard_group,
        gather_impl="broadcast" if torch_impl == "p2p" else torch_impl,
        reduce_impl="reduce" if torch_impl == "p2p" else torch_impl,
    )
    replicate = (TorchReplicateComm(dp.replicate_group, counter=comm.counter)
                 if dp.replicate_group is not None and dp.replicate_size > 1 else None)
    return comm, replicate


def build_groups(
    model: nn.Module,
    group_modules: Sequence[nn.Module],
    sites: Sequence[ParamSite],
    plan: Plan,
    comm: TorchOwnerComm,
    replicate: ReplicateComm | None,
    mp_policy: MixedPrecisionPolicy | None,
    tp_layouts: Mapping[str, TpLayout | None],
    *,
    replicate_presence_flags: bool = True,
    ep_layouts: Mapping[str, ExpertLayout] | None = None,
    data_parallel_world: int | None = None,
) -> list[MatrixGroup]:
    module_of_group = {fqn_of(model, m): m for m in group_modules}
    compute_dtype = mp_policy.param_dtype if mp_policy is not None else None
    reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else None
    ep_layouts = ep_layouts or {}
    kind = "expert" if ep_layouts else "dense"
    by_group: dict[str, list[MatrixParam]] = {}
    for site in sites:
        placement = plan[site.fqn]
        if placement.role != "matrix" or placement.mesh != kind:
            continue  # tail by the filter or demoted by the planner; experts: their own groups
        by_group.setdefault(site.group, []).append(
            MatrixParam(
                fqn=site.fqn, module=site.module, name=site.name, param=site.param,
                owner_rank=int(placement.owner_rank),  # set for every matrix (Plan validates)
                rank=comm.rank, compute_dtype=compute_dtype, tp=tp_layouts.get(site.fqn),
                ep=ep_layouts.get(site.fqn),
            )
        )
    return make_groups(by_group, module_of_group, comm, replicate, reduce_dtype,
                        replicate_presence_flags, data_parallel_world)


def make_groups(by_group: Mapping[str, list[MatrixParam]], module_of_group: Mapping[str, nn.Module],
                 comm: OwnerComm, replicate: ReplicateComm | None, reduce_dtype: torch.dtype | None,
                 replicate_presence_flags: bool,
                 data_parallel_world: int | None) -> list[MatrixGroup]:
    groups = []
    for name, params in by_group.items():
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise NotImplementedError(
                f"group {name or '<root>'!r} mixes matrix dtypes {sorted(map(str, dtypes))} "
                f"({[p.fqn for p in params]}); cast the model to one dtype before wrapping"
            )
        groups.append(MatrixGroup(name, module_of_group[name], params, comm,
                                  reduce_dtype=reduce_dtype, replicate=replicate,
                                  replicate_presence_flags=replicate_presence_flags,
                                  data_parallel_world=data_parallel_world))
    return groups


def build_expert_groups(model: nn.Module, group_modules: Sequence[nn.Module],
                         sites: Sequence[ParamSite], plan: Plan, experts: ExpertMesh | None,
                         ep_layouts: Mapping[str, ExpertLayout], collectives: str,
                         mp_policy: MixedPrecisionPolicy | None, data_parallel_world: int,
                         replicate_presence_flags: bool) -> list[MatrixGroup]:
    """One group per module for its expert stacks, over the expert mesh, whose gradients are
    the mean over the whole data-parallel world (see [Note: expert parallelism])."""
    if experts is None:
        return []
    comm, replicate = torch_comms(experts.dp, "auto" if collectives == "nvshmem" else collectives)
    expert_sites = [s for s in sites if s.fqn in ep_layouts]
    return build_groups(model, group_modules, expert_sites, plan, comm, replicate, mp_policy, {},
                         replicate_presence_flags=replicate_presence_flags,
                         ep_layouts=ep_layouts, data_parallel_world=data_parallel_world)


def check_tp_with_experts(model: nn.Module, ep_layouts: Mapping[str, ExpertLayout]) -> None:
    """Expert parallelism with TP-parallelized parameters is refused (before TP's own checks)."""
    if not ep_layouts:
        return
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor) and not is_expert_param(param):
            raise NotImplementedError(
                f"the model has expert stacks on an ep mesh ({next(iter(ep_layouts))!r}) and "
                f"parameter {fqn!r} (shape {tuple(param.shape)}) on {param.device_mesh}; tensor "
                "and expert parallelism together are not supported yet: use one of them"
            )


def nvshmem_comm(comm: OwnerComm, groups: Sequence[MatrixGroup], mesh: DeviceMesh) -> OwnerComm:
    """The NVSHMEM communicator for ``groups`` (sized from their segments), else ``comm``."""
    from .collectives.nvshmem_backend import make_nvshmem_comm

    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    chosen = make_nvshmem_comm(comm, groups, device)
    for group in groups:
        group.comm = chosen
    return chosen


def fqn_of(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules(remove_duplicate=False):
        if m is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a submodule of the model")


def apply_fully_shard(
    model: nn.Module,
    group_modules: Sequence[nn.Module],
    ignored: set[nn.Parameter],
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None,
    tail_units: str = "auto",
) -> None:
    """Stock FSDP2 for the tail: groups whose own tail has a unit (see [Note: tail units]),
    innermost first, then the root; matrices ignored."""
    policy = mp_policy or MixedPrecisionPolicy()
    depth = {id(m): fqn_of(model, m).count(".") for m in group_modules}
    inner_first = sorted(
        (m for m in group_modules if m is not model), key=lambda m: -depth[id(m)]
    )
    placed = {id(p) for p in ignored}
    for module in inner_first:
        own = [p for p in module.parameters() if id(p) not in placed]
        if not tail_has_unit(tail_units, sum(p.numel() * p.element_size() for p in own)):
            continue  # its tail joins the root's unit
        fully_shard(
            module, mesh=mesh, reshard_after_forward=reshard_after_forward,
            mp_policy=policy, ignored_params=ignored,
        )
        placed.update(id(p) for p in own)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy,
                ignored_params=ignored)


def warn_idle_ranks(plan: Plan) -> list[int]:
    """Under expert parallelism, warn about shard ranks that own no matrix at all (dense or
    expert): they hold only the tail (an expert rank without dense matrices is fine)."""
    if plan.expert_grid is None:
        return []
    idle = [load.rank for load in plan.rank_loads() if load.num_matrices == 0]
    if idle:
        logger.warning(
            "matrixfsdp: shard ranks %s own no matrix (dense or expert) in the plan of %d "
            "ranks; they take no part in the optimizer step. Use fewer ranks per expert mesh, "
            "or select more matrices", idle, plan.world_size)
    return idle
