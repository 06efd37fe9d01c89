"""Matrices that tensor parallelism already split: their TP layout over the tp mesh.

[Note: TP matrices]
- A *TP matrix* is a matrix parameter that ``parallelize_module`` made a DTensor on a 1-D tp mesh
  with one ``Shard(dim)`` placement (``ColwiseParallel``: ``Shard(0)`` of an ``(out, in)``
  weight; ``RowwiseParallel``: ``Shard(1)``). Each tp rank stores its *TP shard*, a contiguous
  slice along ``shard_dim`` with ``torch.chunk`` sizes (DTensor's rule, uneven sizes included).
- Owner sharding applies to the TP shard as if it were the matrix: the plan (made from global
  shapes, so every tp rank plans alike) names a dp owner; the TP shards of a matrix live on the
  tp ranks of the owner's dp coordinate (the *owner row*) and are empty on every other row.
  Gathers and reductions run in the dp group of each tp rank, so TP's own collectives are
  untouched, and the module computes on ``DTensor.from_local(unsharded TP shard)`` with the
  original placements (the local shard stays the autograd leaf).
- The optimizer needs the whole matrix: within the owner row's tp group, each TP matrix has a
  *step owner* (a tp rank) that receives every TP shard of parameter and gradient, steps the
  whole matrix and sends the updated shards back (``matrixfsdp.optim.tp_step``). No optimizer
  bytes cross dp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .experts import is_expert_param

__all__ = ["TpLayout", "model_tp_mesh", "tp_layout_of", "tp_norm_weight"]


@dataclass(frozen=True)
class TpLayout:
    """How one TP matrix is split over its tp mesh (see [Note: TP matrices])."""

    mesh: DeviceMesh  # 1-D tp mesh
    shard_dim: int  # the dim of the stored tensor split across tp ranks
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    local_sizes: tuple[int, ...]  # size along shard_dim on each tp rank (torch.chunk rule)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(0)

    @property
    def tp_size(self) -> int:
        return self.mesh.size()

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank(0)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shape_on(self.tp_rank)

    def shape_on(self, tp_rank: int) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.shard_dim] = self.local_sizes[tp_rank]
        return tuple(shape)

    def offset_of(self, tp_rank: int) -> int:
        return sum(self.local_sizes[:tp_rank])

    def slice_of(self, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Rank ``tp_rank``'s TP shard of a global-shaped tensor (a view)."""
        return full.narrow(self.shard_dim, self.offset_of(tp_rank), self.local_sizes[tp_rank])

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's TP shard) as the global DTensor; differentiable to ``local``."""
        return DTensor.from_local(local, self.mesh, (Shard(self.shard_dim),), run_check=False,
                                  shape=torch.Size(self.global_shape), stride=self.global_stride)


def _chunk_sizes(size: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``torch.chunk(range(size), parts)`` padded with zeros to ``parts`` entries."""
    chunk = -(-size // parts) if size else 0
    sizes = []
    for i in range(parts):
        start = min(i * chunk, size)
        sizes.append(min(chunk, size - start))
    return tuple(sizes)


def tp_layout_of(fqn: str, param: torch.Tensor, dp_mesh: DeviceMesh) -> TpLayout | None:
    """The TP layout of a DTensor matrix, ``None`` for a plain tensor; else a clear error."""
    if not isinstance(param, DTensor):
        return None
    shape = tuple(param.shape)
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or len(placements) != 1:
        raise NotImplementedError(
            f"matrix {fqn!r} (shape {shape}) is a DTensor on a {mesh.ndim}-D mesh with placements "
            f"{placements}; matrixfsdp takes TP matrices from parallelize_module on a 1-D tp mesh "
            "(mesh['tp']); apply fully_shard_matrix to the plain or TP-parallelized model"
        )
    placement = placements[0]
    if isinstance(placement, Replicate):
        raise NotImplementedError(
            f"matrix {fqn!r} (shape {shape}) is replicated over the tp mesh; a TP matrix must be "
            "Shard(0) (ColwiseParallel) or Shard(1) (RowwiseParallel); leave it un-parallelized "
            "(a plain tensor) or exclude it with matrix_filter"
        )
    if not isinstance(placement, Shard) or type(placement) is not Shard or param.ndim != 2:
        raise NotImplementedError(
            f"matrix {fqn!r} (shape {shape}) has TP placement {placement}; matrixfsdp supports "
            "2-D weights with Shard(0) (ColwiseParallel) or Shard(1) (RowwiseParallel) on the "
            "tp mesh; shard 3-D expert stacks with expert parallelism instead, or exclude the "
            "parameter with matrix_filter"
        )
    _check_meshes(fqn, shape, mesh, dp_mesh)
    dim = placement.dim % param.ndim
    return TpLayout(mesh=mesh, shard_dim=dim, global_shape=shape,
                    global_stride=tuple(param.stride()),
                    local_sizes=_chunk_sizes(shape[dim], mesh.size()))


def _check_meshes(fqn: str, shape: tuple[int, ...], tp_mesh: DeviceMesh,
                  dp_mesh: DeviceMesh) -> None:
    """The tp mesh and the dp mesh must be disjoint dims of one root mesh, tp innermost."""
    dp_ranks = set(dp_mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    if dp_ranks & tp_ranks != {dist.get_rank()}:
        raise ValueError(
            f"matrix {fqn!r} (shape {shape}) is TP-sharded over ranks {sorted(tp_ranks)}, which "
            f"overlap the data-parallel mesh's ranks {sorted(dp_ranks)} beyond this rank; build "
            "one mesh init_device_mesh(type, (dp, tp), mesh_dim_names=('dp', 'tp')) and pass "
            "mesh['tp'] to parallelize_module and mesh['dp'] to fully_shard_matrix"
        )
    tp_list = sorted(tp_ranks)
    if tp_list != list(range(tp_list[0], tp_list[0] + len(tp_list))):
        raise NotImplementedError(
            f"matrix {fqn!r} (shape {shape}) is TP-sharded over ranks {tp_list}, which are not "
            "consecutive: the tp dim must be the innermost mesh dim (mesh_dim_names=('dp', 'tp'), "
            "tp last) so TP stays inside a node"
        )


def model_tp_mesh(model: nn.Module, dp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The one tp mesh of a model that ``parallelize_module`` has touched, else ``None``.

    Meshes are compared by value (``DeviceMesh.__eq__``/``__hash__``): each ``mesh["tp"]`` call
    returns an equal but distinct object, so blocks parallelized one call each share one mesh.
    """
    meshes: dict[DeviceMesh, tuple[str, DeviceMesh]] = {}
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor) and not is_expert_param(param):  # experts: runtime/experts
            meshes.setdefault(param.device_mesh, (fqn, param.device_mesh))
    if not meshes:
        return None
    if len(meshes) > 1:
        found = ", ".join(f"{fqn!r} on {mesh}" for fqn, mesh in meshes.values())
        raise NotImplementedError(
            f"the model's DTensor parameters live on {len(meshes)} meshes ({found}); matrixfsdp "
            "composes with one 1-D tp mesh: parallelize every module on the same mesh['tp']"
        )
    fqn, mesh = next(iter(meshes.values()))
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter {fqn!r} is a DTensor on a {mesh.ndim}-D mesh; matrixfsdp composes with "
            "parallelize_module on a 1-D tp mesh (mesh['tp']) and applies its own dp sharding"
        )
    _check_meshes(fqn, tuple(model.get_parameter(fqn).shape), mesh, dp_mesh)
    return mesh


def tp_norm_weight(state: Any, param: torch.Tensor, matrix: Any | None) -> float:
    """How much a gradient counts in a norm summed over the tp group: 1 for a tensor split over
    the tp ranks, ``1 / tp`` for one that every tp rank holds alike (a plain matrix, a norm)."""
    tp_mesh = state.tp_mesh
    if tp_mesh is None:
        return 1.0
    if matrix is not None:
        return 1.0 if matrix.tp is not None else 1.0 / tp_mesh.size()
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        for name, placement in zip(names, param.placements, strict=False):
            if name in (tp_mesh.mesh_dim_names or ()) and isinstance(placement, Shard):
                return 1.0
    return 1.0 / tp_mesh.size()
