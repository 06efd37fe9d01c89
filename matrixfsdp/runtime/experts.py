"""Routed experts that expert parallelism (EP) already split over an ``ep`` mesh dim.

[Note: expert parallelism]
- An *expert parameter* is a 3-D stack ``(E, out, in)`` (or ``(E, in, out)``) that was
  distributed before wrapping as a DTensor ``Shard(0)`` over a 1-D mesh whose dim is named
  ``ep`` (or ``expert``, optionally numbered: ``ep0``) (torchtitan's ``ExpertParallel``, or ``distribute_tensor(stack, mesh["ep"],
  [Shard(0)])``). Each ep rank stores its *local experts*, ``E / ep`` whole experts.
- Two data-parallel meshes share the ranks: the *dense mesh* (``mesh=``) over which dense
  matrices and the tail are sharded, and the *expert mesh* (``expert_mesh=``, torchtitan's
  ``efsdp``): the ranks that hold the same experts. Within each replica the dense shard ranks
  are exactly the expert-mesh ranks times the ep ranks (``shard = efsdp x ep``); under HSDP both
  meshes replicate over the same replicate groups.
- Owner sharding applies to each ep rank's local stack as if it were the stack: the plan (made
  from local shapes, equal on every ep rank) names an owner on the expert mesh, and the local
  stacks of that owner's efsdp coordinate hold the experts on every ep rank. Gathers and
  reductions run over the expert mesh's shard group, so the model's own token dispatch (an
  all-to-all over ep) is untouched; the module computes on ``DTensor.from_local(unsharded local
  stack)`` with the original placement (the local stack stays the autograd leaf).
- An expert's gradient on one ep rank already sums the tokens routed to it from every ep peer,
  so the owner's reduced sum is divided by the whole data-parallel world (the dense mesh's
  ranks times its replicas), not by the expert mesh's size.
- The optimizer steps every local expert as its own matrix, locally: no optimizer-step bytes
  cross any rank. Each element of every expert lives on one rank of each replica, so norms sum
  the owners' local gradients over the dense shard group as they do for dense matrices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..planner import ParamSpec
from .mesh import DataParallelMesh, resolve_mesh
from .selection import ParamSite

__all__ = [
    "EXPERT_DIM_NAMES",
    "ExpertLayout",
    "ExpertMesh",
    "expert_layout_of",
    "expert_layouts",
    "expert_params",
    "is_expert_param",
    "resolve_expert_mesh",
    "with_expert_rows",
]

# Mesh dim names that mark a DTensor parameter as an expert stack (torchtitan names it "ep"),
# optionally numbered ("ep0", "ep_1") where several meshes live in one process.
EXPERT_DIM_NAMES = frozenset({"ep", "expert"})
_EXPERT_DIM = re.compile(r"^(ep|expert)(_?\d+)?$")

_FIX = ("build one mesh init_device_mesh(type, (efsdp, ep), mesh_dim_names=('efsdp', 'ep')) "
        "over the dense data-parallel ranks, distribute each expert stack with "
        "distribute_tensor(stack, mesh['ep'], [Shard(0)]) and pass mesh['efsdp'] as expert_mesh")


def is_expert_param(param: torch.Tensor) -> bool:
    """True for a DTensor on a mesh with a dim named ``ep`` (see [Note: expert parallelism])."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(_EXPERT_DIM.match(name.lower()) for name in names)


def expert_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's expert parameters by FQN, in registration order."""
    return {fqn: p for fqn, p in model.named_parameters() if is_expert_param(p)}


@dataclass(frozen=True)
class ExpertLayout:
    """How one expert stack is split over its ep mesh (see [Note: expert parallelism])."""

    mesh: DeviceMesh  # the 1-D ep mesh
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]

    @property
    def ep_size(self) -> int:
        return self.mesh.size()

    @property
    def ep_rank(self) -> int:
        return self.mesh.get_local_rank(0)

    @property
    def local_experts(self) -> int:
        return self.global_shape[0] // self.ep_size

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.local_experts, *self.global_shape[1:])

    def experts_on(self, ep_rank: int) -> range:
        """Global expert indices stored by ``ep_rank``."""
        return range(ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts)

    def slice_of(self, full: torch.Tensor, ep_rank: int) -> torch.Tensor:
        """Rank ``ep_rank``'s local experts of a global-shaped tensor (a view)."""
        return full.narrow(0, ep_rank * self.local_experts, self.local_experts)

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's experts) as the global DTensor; differentiable to ``local``."""
        return DTensor.from_local(local, self.mesh, (Shard(0),), run_check=False,
                                  shape=torch.Size(self.global_shape), stride=self.global_stride)


@dataclass(frozen=True)
class ExpertMesh:
    """The expert data-parallel mesh, the ep mesh and how they tile the dense shard ranks."""

    dp: DataParallelMesh  # the expert mesh (efsdp; 2-D (replicate, efsdp) under HSDP)
    ep_mesh: DeviceMesh
    grid: tuple[int, ...]  # the expert-mesh shard index of each dense shard index

    @property
    def ep_size(self) -> int:
        return self.ep_mesh.size()


def expert_layout_of(fqn: str, param: torch.Tensor, ep_mesh: DeviceMesh) -> ExpertLayout:
    """The layout of one expert stack; a ``ValueError`` naming the FQN for any other layout."""
    shape = tuple(param.shape)
    assert isinstance(param, DTensor)  # only called for is_expert_param(param)
    mesh, placements = param.device_mesh, tuple(param.placements)
    where = f"expert parameter {fqn!r} (shape {shape}, placements {placements} on {mesh})"
    if mesh.ndim != 1:
        raise ValueError(
            f"{where} lives on a {mesh.ndim}-D mesh; matrixfsdp takes expert stacks distributed "
            f"over a 1-D ep mesh (mesh['ep']), and shards them over expert_mesh itself: {_FIX}"
        )
    if len(shape) != 3 or placements != (Shard(0),):
        raise ValueError(
            f"{where} must be a 3-D stack (E, out, in) placed Shard(0) over ep (whole experts "
            f"on each ep rank); leave other parameters plain tensors: {_FIX}"
        )
    if not _same_mesh(mesh, ep_mesh):
        raise ValueError(
            f"{where} is on another ep mesh than the model's other experts ({ep_mesh}); "
            "distribute every expert stack over the same mesh['ep']"
        )
    if shape[0] % mesh.size():
        raise ValueError(
            f"{where} has {shape[0]} experts, not a multiple of the ep size {mesh.size()}; use "
            "an ep size that divides the expert count"
        )
    return ExpertLayout(mesh=mesh, global_shape=shape, global_stride=tuple(param.stride()))


def _same_mesh(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Meshes compared by value: ``mesh['ep']`` returns an equal, distinct object each call."""
    return (a.device_type == b.device_type and a.mesh_dim_names == b.mesh_dim_names
            and torch.equal(a.mesh, b.mesh))


def resolve_expert_mesh(model: nn.Module, dense: DataParallelMesh,
                        expert_mesh: DeviceMesh | None) -> ExpertMesh | None:
    """Validate ``expert_mesh`` against the model's expert stacks and the dense mesh.

    ``None`` when the model has no expert parameters and no ``expert_mesh`` was given. The
    checks that depend on other ranks' meshes read one all-gather over the dense shard group,
    so every rank of it raises alike.
    """
    experts = expert_params(model)
    if not experts:
        if expert_mesh is not None:
            raise ValueError(
                "expert_mesh was given but no parameter of the model is a DTensor on an 'ep' mesh "
                f"dim; distribute the expert stacks before wrapping ({_FIX}), or drop expert_mesh"
            )
        return None
    fqn, first = next(iter(experts.items()))
    if expert_mesh is None:
        raise ValueError(
            f"expert parameter {fqn!r} (shape {tuple(first.shape)}) is distributed over "
            f"{first.device_mesh}, but no expert_mesh was given; pass the expert data-parallel "
            f"mesh: fully_shard_matrix(model, mesh['dp'], expert_mesh=mesh['efsdp']) ({_FIX})"
        )
    ep_mesh = first.device_mesh
    for name, param in experts.items():
        expert_layout_of(name, param, ep_mesh)
    if ep_mesh.device_type != dense.mesh.device_type:
        raise ValueError(
            f"expert parameter {fqn!r} is on a {ep_mesh.device_type} ep mesh but the data-parallel "
            f"mesh is {dense.mesh.device_type}; build both meshes on one device type"
        )
    try:
        edp = resolve_mesh(expert_mesh)
    except ValueError as exc:
        raise ValueError(f"expert_mesh: {exc}") from None
    if edp.replicate_size != dense.replicate_size or edp.shard_size * ep_mesh.size() != dense.shard_size:
        raise ValueError(
            f"expert_mesh of shape {edp.shape} (replicate, efsdp) with ep size {ep_mesh.size()} "
            f"does not tile the data-parallel mesh of shape {dense.shape} (replicate, shard): "
            f"it needs the same replicas and efsdp x ep = shard ({_FIX})"
        )
    grid = _tiling_grid(fqn, dense, edp, ep_mesh)
    return ExpertMesh(dp=edp, ep_mesh=ep_mesh, grid=grid)


def _tiling_grid(fqn: str, dense: DataParallelMesh, edp: DataParallelMesh,
                 ep_mesh: DeviceMesh) -> tuple[int, ...]:
    """Each dense shard index's expert-mesh shard index, after checking over the dense shard
    group that the ep and efsdp groups cross each other there (every rank raises alike)."""
    shard_ranks = dist.get_process_group_ranks(dense.shard_group)
    size = len(shard_ranks)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if "nccl" in str(dist.get_backend(dense.shard_group)) else torch.device("cpu")
    ep_ranks = dist.get_process_group_ranks(ep_mesh.get_group(0))
    efsdp_ranks = dist.get_process_group_ranks(edp.shard_group)
    same_replicas = (edp.replicate_group is None or sorted(dist.get_process_group_ranks(
        edp.replicate_group)) == sorted(dist.get_process_group_ranks(dense.replicate_group)))
    row = [edp.mesh.get_local_rank(edp.mesh.ndim - 1), ep_mesh.get_local_rank(0), int(same_replicas)]
    row += _padded(ep_ranks, size) + _padded(efsdp_ranks, size)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(size)]
    if size > 1:
        dist.all_gather(table, mine, group=dense.shard_group)
    else:
        table = [mine]
    rows = [t.cpu().tolist() for t in table]
    coords = [(r[0], r[1]) for r in rows]
    problem = ""
    if not all(r[2] for r in rows):
        problem = "the expert mesh's replicate groups differ from the data-parallel mesh's"
    elif len(set(coords)) != size:
        problem = f"(efsdp, ep) coordinates {coords} repeat over the dense shard ranks {shard_ranks}"
    else:
        for rank, (f, e), r in zip(shard_ranks, coords, rows, strict=True):
            want_ep = sorted(s for s, c in zip(shard_ranks, coords, strict=True) if c[0] == f)
            want_efsdp = sorted(s for s, c in zip(shard_ranks, coords, strict=True) if c[1] == e)
            if sorted(x for x in r[3:3 + size] if x >= 0) != want_ep or \
                    sorted(x for x in r[3 + size:] if x >= 0) != want_efsdp:
                problem = (f"rank {rank}'s ep group and expert_mesh group are not the dense "
                           "shard ranks that share its efsdp and ep coordinates")
                break
    if problem:
        raise ValueError(
            f"expert parameter {fqn!r}: the ep mesh and expert_mesh do not tile the "
            f"data-parallel mesh's ranks {shard_ranks}: {problem}; {_FIX}"
        )
    return tuple(f for f, _ in coords)


def _padded(ranks: list[int], size: int) -> list[int]:
    return sorted(ranks) + [-1] * (size - len(ranks))


def expert_layouts(sites: Sequence[ParamSite], experts: ExpertMesh | None) -> dict[str, ExpertLayout]:
    """The layout of every expert stack among ``sites``; each must be selected as a matrix."""
    if experts is None:
        return {}
    layouts = {}
    for site in sites:
        if not is_expert_param(site.param):
            continue
        if not site.is_matrix:
            raise NotImplementedError(
                f"expert parameter {site.fqn!r} (shape {tuple(site.param.shape)}) is not selected "
                f"as a matrix ({site.why_tail or 'by matrix_filter'}); expert stacks distributed "
                "over ep must be matrices: select them in matrix_filter, or keep this parameter "
                "a plain tensor (not distributed over ep)"
            )
        layouts[site.fqn] = expert_layout_of(site.fqn, site.param, experts.ep_mesh)
    return layouts


def with_expert_rows(specs: Sequence[ParamSpec],
                     layouts: Mapping[str, ExpertLayout]) -> list[ParamSpec]:
    """``specs`` with each expert stack planned as its local stack on the expert mesh."""
    return [s._replace(shape=layouts[s.fqn].local_shape, mesh="expert") if s.fqn in layouts
            else s for s in specs]
