"""The data-parallel mesh: flat (1-D) owner sharding, or HSDP (2-D: replicate x shard).

[Note: HSDP mesh]
- A *flat* mesh is 1-D: every rank is in one *shard group*, the matrices are owner-sharded over
  it (see [Note: plan vocabulary]) and the tail is FSDP2 ``Shard(0)`` over it.
- An *HSDP* mesh is 2-D, as FSDP2 takes it: dim 0 *replicates*, dim 1 *shards*
  (``mesh_dim_names=("replicate", "shard")``, or any data-parallel names in that order). Ranks
  with the same dim-0 coordinate form one *replica* (a shard group, e.g. one node); ranks with
  the same dim-1 coordinate form one *replicate group* (one rank per replica).
- Matrices are planned over the shard dim: the plan has ``world_size`` = shard size, and the
  same plan holds in every replica, so the rank with shard coordinate ``s`` owns the same
  matrices in every replica. Gathers and reduce-to-owners run inside the shard group only;
  after its reduce-to-owners, each owner averages its owned gradients over its replicate group
  (one all-reduce per matrix group, see [Note: pending work]). The gradient is then the average
  over all ``R x S`` ranks, bit-identical in every replica, and each replica runs the optimizer
  step on its own copy with zero communication. The tail is stock FSDP2 HSDP on the same mesh.
  Whether the all-reduce carries presence flags: [Note: presence flags] in ``group.py``.
- Collectives always name their mesh dim (``mesh.get_group(1)``): ``mesh.get_group()`` without a
  dim is an error on a 2-D mesh. A flat mesh is HSDP with one replica: shape ``(1, N)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["HSDP_DIM_NAMES", "DataParallelMesh", "init_hsdp_mesh", "resolve_mesh"]

logger = logging.getLogger(__name__)

HSDP_DIM_NAMES = ("replicate", "shard")

# Names of mesh dims that shard or replicate data (torchtitan's and FSDP2's spellings included).
_REPLICATE_NAMES = frozenset({"replicate", "dp_replicate", "ddp", "replica", "hsdp_replicate"})
_SHARD_NAMES = frozenset({"shard", "dp_shard", "dp_shard_cp", "fsdp", "hsdp_shard"})
# Names of model-parallel dims: a mesh with one of these is not a data-parallel mesh.
_MODEL_PARALLEL_NAMES = frozenset({
    "tp", "pp", "cp", "ep", "etp", "sp", "tensor", "pipeline", "context", "expert", "sequence",
    "model", "mp",
})

_FIX = ("pass the data-parallel sub-mesh (e.g. mesh['dp_replicate', 'dp_shard'] or "
        "mesh['dp']), or build one with init_device_mesh(device_type, (replicate, shard), "
        "mesh_dim_names=('replicate', 'shard')) or matrixfsdp.init_hsdp_mesh(replicate=R)")


@dataclass(frozen=True)
class DataParallelMesh:
    """The mesh a model is wrapped on, with its shard and replicate groups (see the Note)."""

    mesh: DeviceMesh  # what fully_shard receives (1-D, or 2-D with named dims)
    replicate_size: int
    shard_size: int
    replica_rank: int  # this rank's coordinate on the replicate dim (0 on a flat mesh)
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None  # None on a flat mesh

    @property
    def shape(self) -> tuple[int, int]:
        """``(replicate, shard)``; a flat mesh is ``(1, N)``."""
        return (self.replicate_size, self.shard_size)

    @property
    def is_hsdp(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def world_size(self) -> int:
        return self.replicate_size * self.shard_size

    def all_ranks_group(self) -> dist.ProcessGroup | None:
        """A process group over every rank of the mesh (``None``: the default group)."""
        if not self.is_hsdp:
            return self.shard_group
        if dist.get_world_size() == self.world_size:
            return None
        flatten = getattr(self.mesh, "_flatten", None)
        if flatten is None:  # pragma: no cover - every supported torch has it
            raise NotImplementedError(
                f"an HSDP mesh of shape {self.shape} over part of the {dist.get_world_size()} "
                f"ranks needs DeviceMesh._flatten (torch {torch.__version__} lacks it); use a "
                "mesh over all ranks"
            )
        return flatten().get_group()


def init_hsdp_mesh(
    replicate: int | None = None, shard: int | None = None, *, device_type: str | None = None
) -> DeviceMesh:
    """``init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))``.

    Give ``replicate`` (replicas, e.g. nodes) or ``shard`` (ranks per replica, e.g. GPUs per
    node) or both; their product must be the world size. ``device_type`` defaults to the default
    process group's device (nccl: cuda, gloo: cpu).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("init_hsdp_mesh needs torch.distributed: call init_process_group() first")
    world = dist.get_world_size()
    replicate, shard = hsdp_shape(world, replicate, shard)
    if device_type is None:
        device_type = backend_device_type()
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=HSDP_DIM_NAMES)


def hsdp_shape(world: int, replicate: int | None, shard: int | None) -> tuple[int, int]:
    """``(replicate, shard)`` over ``world`` ranks, or ``ValueError`` naming the fix."""
    for name, value in (("replicate", replicate), ("shard", shard)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if replicate is None and shard is None:
        raise ValueError("give replicate (the number of replicas) or shard (ranks per replica)")
    size = replicate if replicate is not None else shard
    assert size is not None  # one of them is set (checked above)
    if world % size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        which = "replicate" if replicate is not None else "shard"
        raise ValueError(
            f"cannot build an HSDP mesh of shape (replicate, shard) with {which}={size} over "
            f"{world} ranks: {size} does not divide {world}; choose {which} in {divisors} "
            f"(ranks = replicate x shard)"
        )
    r = replicate if replicate is not None else world // size
    s = shard if shard is not None else world // size
    if r * s != world:
        raise ValueError(
            f"an HSDP mesh of shape (replicate, shard) = ({r}, {s}) holds {r * s} ranks, but "
            f"the world has {world}; choose replicate x shard = {world}"
        )
    return r, s


def backend_device_type() -> str:
    """The device type the default process group communicates on (nccl: cuda, gloo: cpu)."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and ("gloo" not in backend or torch.cuda.is_available()):
        return "cuda"
    if "xccl" in backend:
        return "xpu"
    if "gloo" in backend:
        return "cpu"
    raise ValueError(
        f"cannot tell the device type of process-group backend {backend!r}; pass a mesh built "
        "with init_device_mesh(<device type>, ...)"
    )


def resolve_mesh(mesh: DeviceMesh) -> DataParallelMesh:
    """Validate a user's mesh (see the Note) and find its shard and replicate groups."""
    shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else getattr(mesh, "shape", None)
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"mesh must be a DeviceMesh, got {type(mesh).__name__} with shape {shape}; {_FIX}"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh has shape {shape} ({mesh.ndim} dims); matrixfsdp takes a 1-D data-parallel "
            f"mesh (flat owner sharding) or a 2-D HSDP mesh (replicate, shard): {_FIX}"
        )
    _check_names(mesh, shape)
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not in the mesh of shape {shape}; call "
            "fully_shard_matrix only on the mesh's ranks"
        )
    if mesh.ndim == 1:
        return DataParallelMesh(mesh, 1, mesh.size(), 0, mesh.get_group(0), None)
    if mesh.mesh_dim_names is None:
        # FSDP2 takes dim 0 as replicate and dim 1 as shard but asserts on an unnamed 2-D mesh:
        # name them (a new mesh over the same ranks; collective, like init_device_mesh).
        mesh = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=HSDP_DIM_NAMES)
    return DataParallelMesh(
        mesh=mesh,
        replicate_size=mesh.size(0),
        shard_size=mesh.size(1),
        replica_rank=mesh.get_local_rank(0),
        shard_group=mesh.get_group(1),
        replicate_group=mesh.get_group(0),
    )


def _check_names(mesh: DeviceMesh, shape: object) -> None:
    names = mesh.mesh_dim_names
    if names is None:
        return
    lowered = [n.lower() for n in names]
    model_parallel = [n for n, low in zip(names, lowered, strict=True)
                      if low in _MODEL_PARALLEL_NAMES]
    if model_parallel:
        raise ValueError(
            f"mesh of shape {shape} with dims {tuple(names)} has model-parallel dims "
            f"{tuple(model_parallel)}; matrixfsdp shards and replicates over data-parallel dims "
            f"only: {_FIX}"
        )
    if mesh.ndim == 2 and (lowered[0] in _SHARD_NAMES or lowered[1] in _REPLICATE_NAMES):
        raise ValueError(
            f"mesh of shape {shape} has dims {tuple(names)}: an HSDP mesh replicates over dim 0 "
            "and shards over dim 1 (as FSDP2's fully_shard); build it with the replicate dim "
            "first, mesh_dim_names=('replicate', 'shard')"
        )
