"""Expert stacks in checkpoints: stored as global stacks, read at any (efsdp, ep) shape.

[Note: experts in checkpoints]
- An expert stack (see [Note: expert parallelism] in ``runtime/experts.py``) is saved under
  ``model.<fqn>`` as its *global* stack ``(E, ...)``: every ep rank of the owner (in replica 0)
  writes its local experts as its chunk of a DTensor ``Shard(0)`` on the ep mesh, so DCP's
  metadata holds one tensor of the global shape cut into ep chunks (no gather at save). Reading
  is DCP's resharding: an owner without EP asks for the whole stack, an EP owner for its own
  local experts (any ep size that divides E). The layout's entry ``shape`` is the global one, so
  an EP model and its plain twin have the same entries.
- Optimizer state follows each expert: a state tensor of a local stack has the local experts on
  dim 0 (``(E / ep, ...)``: momentum, Kronecker factors, eigenbases per expert) and is stored
  the same way, as a global ``(E, ...)`` tensor in ep chunks; 0-d state (``step``) is written by
  every ep rank alike (DCP keeps one). Loading into any layout reads the experts it holds.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from ..runtime.matrix_param import MatrixParam
from . import _tp
from .errors import CheckpointError

__all__ = ["chunk", "state_chunk", "state_target"]


def chunk(mp: MatrixParam, local: torch.Tensor) -> torch.Tensor:
    """What DCP writes or fills for a matrix's tensor: a TP shard's or an ep rank's chunk of
    the global tensor (a DTensor sharing ``local``'s storage), else ``local`` itself."""
    if mp.tp is not None:
        return _tp.tp_chunk(mp.tp, local)
    if mp.ep is not None:
        return _ep_chunk(mp, local, mp.ep.global_shape)
    return local


def _ep_chunk(mp: MatrixParam, local: torch.Tensor, global_shape: tuple[int, ...]) -> DTensor:
    assert mp.ep is not None
    return DTensor.from_local(local.detach(), mp.ep.mesh, (Shard(0),), run_check=False,
                              shape=torch.Size(global_shape),
                              stride=_tp._contiguous_stride(global_shape))


def _not_per_expert(mp: MatrixParam, key: str, shape: tuple[int, ...], where: str) -> CheckpointError:
    assert mp.ep is not None
    return CheckpointError(
        f"optimizer state {key!r} of expert stack {mp.fqn!r} (global shape "
        f"{mp.ep.global_shape}, {mp.ep.local_experts} experts on ep rank {mp.ep.ep_rank}) has "
        f"shape {list(shape)} {where}: only state with the experts on dim 0 (or 0-d) can follow "
        "each expert across ep sizes; save and load with optimizer=None or weights_only=True"
    )


def state_chunk(mp: MatrixParam, key: str, value: torch.Tensor) -> torch.Tensor:
    """An expert stack's state tensor as DCP stores it (see the Note)."""
    assert mp.ep is not None
    if value.ndim == 0:
        return value
    if value.shape[0] != mp.ep.local_experts:
        raise _not_per_expert(mp, key, tuple(value.shape), "on this rank")
    return _ep_chunk(mp, value.contiguous(), (mp.ep.global_shape[0], *value.shape[1:]))


def state_target(mp: MatrixParam, key: str, md: TensorStorageMetadata) -> DTensor:
    """This ep rank's experts of one saved (global) state tensor, as a DTensor target."""
    assert mp.ep is not None
    size, dtype = tuple(md.size), md.properties.dtype
    if size[0] != mp.ep.global_shape[0]:
        raise _not_per_expert(mp, key, size, "in the checkpoint")
    local = torch.empty((mp.ep.local_experts, *size[1:]), dtype=dtype, device=mp.sharded.device)
    return _ep_chunk(mp, local, size)
