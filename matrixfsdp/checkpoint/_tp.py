"""TP matrices in checkpoints: stored as whole matrices, read at any (dp, tp) shape.

[Note: TP matrices in checkpoints]
- Whole matrices are the unit of the checkpoint. A TP matrix (see [Note: TP matrices] in
  ``runtime/tp.py``) is saved under ``model.<fqn>`` as its *global* matrix: every tp rank of the
  owner row (in replica 0) writes its TP shard as its chunk of a DTensor on the tp mesh, so DCP's
  metadata holds one tensor of the global shape cut into tp chunks (no gather at save). Reading
  it is DCP's ordinary resharding: a plain matrix's owner (no TP, or tp 1) asks for the whole
  tensor, a TP matrix's owner row asks for each tp rank's TP shard (as a DTensor on its own tp
  mesh, any tp size, either shard dim); DCP reads the overlapping parts of the saved chunks.
- The layout records each TP matrix's split (``TensorEntry.tp``: shard dim, tp size, per-rank
  sizes) and the saving tp size (``CheckpointLayout.tp_size``); the entry's ``shape`` is the
  global one, so a TP model and its plain twin have the same entries.
- Optimizer state of a TP matrix under ``MatrixOptimizer`` is whole on its *step owner* (see
  [Note: TP step exchange] in ``optim/tp_step.py``). The step owner (in replica 0) writes it as
  an owner writes a plain matrix's state: plain tensors ``optim.state.<fqn>.<key>``, whole. On
  load the new step owner (as the loading optimizer names it: ``MatrixOptimizer.tp_step_owner``)
  reads it whole; the other tp ranks read nothing. A TP matrix's state and a plain
  matrix's are therefore stored alike: TP <-> plain and any tp size <-> any tp size.
- A plain torch optimizer over a TP model steps TP shards, so its state is per shard: tensors
  shaped like the TP shard are written as chunks of the global tensor (like the parameter) and
  read back as this rank's TP shard; 0-d ones (``step``) are written by every tp rank alike (DCP
  keeps one). A state tensor of any other shape cannot be cut into TP shards: a clear error.
- DCP's process group spans every rank of the (replicate,) dp x tp mesh.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from ..runtime import MatrixFSDPState
from ..runtime.matrix_param import MatrixParam
from ..runtime.state_dict_view import dp_tp_mesh
from ..runtime.tp import TpLayout
from .errors import CheckpointError
from .layout import TpEntry

__all__ = [
    "StateMode",
    "dp_tp_group",
    "shard_state_target",
    "shard_state_value",
    "state_mode",
    "step_owned",
    "tp_chunk",
    "tp_entry",
]

logger = logging.getLogger(__name__)

StateMode = Literal["whole", "shards"]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def tp_entry(tp: TpLayout) -> TpEntry:
    return TpEntry(shard_dim=tp.shard_dim, tp_size=tp.tp_size, local_sizes=tp.local_sizes)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def tp_chunk(tp: TpLayout, local: torch.Tensor) -> DTensor:
    """``local`` (this tp rank's TP shard, or a tensor shaped like it) as its chunk of the global
    tensor: a DTensor on the tp mesh sharing ``local``'s storage (DCP writes and fills it)."""
    if tuple(local.shape) != tp.local_shape:
        raise RuntimeError(f"tp rank {tp.tp_rank} holds shape {tuple(local.shape)}, not its TP "
                           f"shard {tp.local_shape} of {tp.global_shape}")
    return DTensor.from_local(local.detach(), tp.mesh, (Shard(tp.shard_dim),), run_check=False,
                              shape=torch.Size(tp.global_shape),
                              stride=_contiguous_stride(tp.global_shape))


def dp_tp_group(runtime: MatrixFSDPState) -> dist.ProcessGroup | None:
    """A process group over every rank of the model's dp x tp mesh (``None``: the default)."""
    assert runtime.tp_mesh is not None  # called for TP models only
    mesh = dp_tp_mesh(runtime.dp_mesh.mesh, runtime.tp_mesh)
    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
    if len(ranks) == dist.get_world_size():
        return None
    if ranks not in _GROUPS:  # every rank of the mesh gets here in its first save or load
        _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[ranks]


# -- optimizer state -------------------------------------------------------------------------------
def state_mode(optimizer: torch.optim.Optimizer) -> StateMode:
    """How TP matrices' state is held: whole on step owners (``MatrixOptimizer``, which steps
    TP matrices whole) or per TP shard on every tp rank of the owner row (a torch optimizer)."""
    from ..optim import MatrixOptimizer  # lazily: the optimizer imports the runtime

    return "whole" if isinstance(optimizer, MatrixOptimizer) else "shards"


def step_owned(runtime: MatrixFSDPState, optimizer: torch.optim.Optimizer) -> set[str]:
    """FQNs of the TP matrices whose whole state this rank keeps: those ``MatrixOptimizer``
    names this tp rank the step owner of (``tp_step_owner``; see [Note: TP step exchange])."""
    from ..optim import MatrixOptimizer

    assert isinstance(optimizer, MatrixOptimizer)  # state_mode() == "whole"
    return {mp.fqn for mp in runtime.params.values() if mp.tp is not None and mp.is_owner
            and optimizer.tp_step_owner(mp.sharded) == mp.tp.tp_rank}


def _not_shardable(mp: MatrixParam, key: str, shape: tuple[int, ...],
                   where: str) -> CheckpointError:
    assert mp.tp is not None
    return CheckpointError(
        f"optimizer state {key!r} of TP matrix {mp.fqn!r} (global shape {mp.tp.global_shape}, "
        f"TP shard {tuple(mp.shape)} on tp rank {mp.tp.tp_rank} of {mp.tp.tp_size}) has shape "
        f"{list(shape)} {where}: a torch optimizer steps TP shards, and only state shaped like "
        "the TP shard (or 0-d) can be stored as the whole matrix's and cut again at another tp "
        "size. Use MatrixOptimizer (it steps and stores TP matrices whole), or save and load "
        "with optimizer=None / load with weights_only=True"
    )


def shard_state_value(mp: MatrixParam, key: str, value: torch.Tensor) -> torch.Tensor:
    """A torch optimizer's per-shard state tensor as what DCP stores (see the Note)."""
    assert mp.tp is not None
    if value.ndim == 0:
        return value
    if tuple(value.shape) == tuple(mp.shape):
        return tp_chunk(mp.tp, value)
    raise _not_shardable(mp, key, tuple(value.shape), "on this rank")


def shard_state_target(mp: MatrixParam, key: str, md: TensorStorageMetadata) -> DTensor:
    """This rank's TP shard of one saved (global) state tensor of a torch optimizer's TP matrix,
    as a DTensor target (see the Note); 0-d state is the caller's."""
    assert mp.tp is not None
    size, dtype = tuple(md.size), md.properties.dtype
    if size == mp.tp.global_shape:
        return tp_chunk(mp.tp, torch.empty(mp.tp.local_shape, dtype=dtype,
                                           device=mp.sharded.device))
    raise _not_shardable(mp, key, size, "in the checkpoint")
