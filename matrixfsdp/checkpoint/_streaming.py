"""Which part of each full tensor this rank reads, and the copy into the wrapped model.

[Note: what each rank reads in a full-weight load]
- A matrix (whole-owned 2-D weight or 3-D stack): its owner reads it whole into the owned
  parameter; every other rank reads nothing. A TP matrix's owner row: each tp rank reads its TP
  shard (its ``torch.chunk`` range along the TP shard dim) of the whole matrix.
- A DTensor (the FSDP2 tail, sharded expert stacks): the global index range of this rank's local
  shard, derived from the placements and the mesh coordinate (``Shard(d)`` splits dim ``d`` as
  ``torch.chunk`` does: chunks of ``ceil(n / size)``, an uneven or empty last one; FSDP2's
  padding lies outside ``to_local()``). Only that range is read.
- Anything else (buffers, plain parameters): every rank reads it whole.
Every read is copied straight into the target (casting the dtype if it differs) and dropped, so
a load holds at most one source tensor at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..runtime import MatrixFSDPState
from ..runtime.state_dict_view import owner_state_dict
from ..runtime.tp import TpLayout
from .sources import Index, TensorSource

__all__ = ["TensorRead", "alias_groups", "copy_reads", "local_index", "plan_reads"]


class TensorRead(NamedTuple):
    """One read of a load: ``source[source_key][index]`` into ``target``."""

    key: str  # the model's state-dict key
    source_key: str
    index: Index | None  # None: the whole tensor
    target: torch.Tensor


def local_index(target: DTensor, fqn: str) -> Index:
    """The global slice of ``target``'s full tensor that this rank's local shard holds."""
    mesh = target.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise NotImplementedError(f"{fqn!r}: this rank is not in the mesh of its DTensor")
    if any(type(p).__name__ == "_StridedShard" for p in target.placements):
        bounds = _strided_bounds(target)  # FSDP2 over a TP-sharded dim: _StridedShard
    else:
        bounds = _shard_bounds(target, coordinate, fqn)
    index = tuple(slice(lo, hi) for lo, hi in bounds)
    local_shape = tuple(hi - lo for lo, hi in bounds)
    if local_shape != tuple(target.to_local().shape):
        raise NotImplementedError(
            f"{fqn!r}: local shard shape {tuple(target.to_local().shape)} differs from the "
            f"{local_shape} its placements {target.placements} give; uneven custom sharding is "
            "not supported by streaming loads"
        )
    return index


def _shard_bounds(target: DTensor, coordinate: list[int], fqn: str) -> list[tuple[int, int]]:
    bounds = [(0, n) for n in target.shape]
    for mesh_dim, placement in enumerate(target.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:  # Partial, custom placements
            raise NotImplementedError(
                f"{fqn!r}: cannot read the local shard of placement {placement} (only Shard(d), "
                "FSDP2's _StridedShard and Replicate are supported); load a mapping from a full "
                "state dict instead"
            )
        dim = placement.dim
        lo, hi = bounds[dim]
        length, parts = hi - lo, target.device_mesh.size(mesh_dim)
        chunk = -(-length // parts)
        start = min(coordinate[mesh_dim] * chunk, length)
        bounds[dim] = (lo + start, lo + min(start + chunk, length))
    return bounds


def _strided_bounds(target: DTensor) -> list[tuple[int, int]]:
    """The local shard's global range as DCP computes it (``_StridedShard`` included)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                          target.placements)
    return [(o, o + n) for o, n in zip(offset, shape, strict=True)]


def _tp_index(tp: TpLayout) -> Index:
    """The global slice of a TP matrix that this tp rank's TP shard holds."""
    start = tp.offset_of(tp.tp_rank)
    index = [slice(0, n) for n in tp.global_shape]
    index[tp.shard_dim] = slice(start, start + tp.local_sizes[tp.tp_rank])
    return tuple(index)


def alias_groups(model: nn.Module) -> dict[str, list[str]]:
    """``state-dict key -> every key naming the same parameter`` (tied weights), else itself."""
    by_param: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(fqn)
    return {fqn: fqns for fqns in by_param.values() for fqn in fqns}


def plan_reads(
    model: nn.Module, runtime: MatrixFSDPState, sources: Mapping[str, str]
) -> list[TensorRead]:
    """This rank's reads for ``sources`` (model key -> source key); see the Note."""
    reads = []
    for key, target in owner_state_dict(model, runtime).items():
        source_key = sources.get(key)
        if source_key is None:
            continue
        mp = runtime.params.get(key)
        if mp is not None and not mp.is_owner:
            continue
        if isinstance(target, DTensor):
            local = target.to_local()
            if local.numel():
                reads.append(TensorRead(key, source_key, local_index(target, key), local))
        elif mp is not None and mp.tp is not None:
            reads.append(TensorRead(key, source_key, _tp_index(mp.tp), target))
        elif mp is not None and mp.ep is not None:  # this ep rank's experts of the stack
            experts = mp.ep.experts_on(mp.ep.ep_rank)
            index = (slice(experts.start, experts.stop), *(slice(0, n) for n in mp.shape[1:]))
            reads.append(TensorRead(key, source_key, index, target))
        else:
            reads.append(TensorRead(key, source_key, None, target))
    return reads


@torch.no_grad()
def copy_reads(source: TensorSource, reads: list[TensorRead]) -> None:
    """Read each tensor (or slice) and copy it into its target, one at a time."""
    for read in reads:
        value = source.read(read.source_key, read.index)
        if tuple(value.shape) != tuple(read.target.shape):
            raise RuntimeError(  # validated before: a source that changed under us
                f"{source.name}: read {read.source_key!r}{_show(read.index)} as shape "
                f"{tuple(value.shape)}, expected {tuple(read.target.shape)} for {read.key!r}"
            )
        read.target.copy_(value)
        del value


def _show(index: Index | None) -> str:
    if index is None:
        return ""
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in index) + "]"
