"""The optimizer state-dict view of TP matrices (see [Note: optimizer state-dict view]).

[Note: TP optimizer state view]
A TP matrix (see [Note: TP matrices]) has its optimizer state in one of two forms:
- *whole on a step owner*: ``MatrixOptimizer`` steps each TP matrix whole on one tp rank of the
  owner row (``MatrixOptimizer.tp_step_owner``). ``state_dict()`` first copies that entry to
  the other tp ranks of the owner row (one JSON description and one broadcast per tensor in the
  tp group); from there it is an ordinary owned matrix's entry: every tensor becomes a matrix
  DTensor on the dp mesh, the same on every tp rank (torch's ``full_tensor()`` and DCP see one
  whole tensor; DCP writes the tp ranks' identical chunks once). A load gathers the entry to the
  owner row and only the step owner keeps it.
- *per TP shard*: a plain torch optimizer (``torch.optim.SGD(model.parameters())``) keeps state
  shaped like each tp rank's TP shard. Each such tensor is presented like the parameter itself,
  as a DTensor of the global matrix on the dp x tp mesh (``view_layout``); a load cuts it back
  to this tp rank's TP shard. Other shapes cannot be placed and raise ``NotImplementedError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .matrix_param import MatrixParam
from .state_dict_view import StateDictView, gather_tp_to_owner, view_layout

__all__ = ["owner_tp_entry", "share_step_owner_entry", "step_owner_of", "tp_layout_for"]


def step_owner_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int | None:
    """The tp rank holding ``param``'s whole state (``MatrixOptimizer``), or ``None``."""
    lookup = getattr(optimizer, "tp_step_owner", None)
    return None if lookup is None else lookup(param)


def share_step_owner_entry(mp: MatrixParam, step_owner: int,
                           entry: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The step owner's entry on every tp rank of the owner row (collective in the tp group)."""
    assert mp.tp is not None and mp.is_owner  # the owner row's TP matrices only
    group, me = mp.tp.group, mp.tp.tp_rank
    src = dist.get_global_rank(group, step_owner)
    mine = me == step_owner
    device = _group_device(group)
    described = _describe_plain(entry) if mine else None
    data = json.dumps(described).encode() if mine else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    raw = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if mine:
        raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device))
    dist.broadcast(raw, src=src, group=group)
    described = json.loads(bytes(raw.cpu().tolist()))
    if described is None:
        return None
    out: dict[str, Any] = {}
    for name, item in described:
        if "value" in item:
            out[name] = item["value"]
            continue
        value = entry[name] if mine and entry is not None else None
        buffer = (value.detach().to(device) if value is not None else
                  torch.empty(item["shape"], dtype=getattr(torch, item["dtype"]), device=device))
        dist.broadcast(buffer.contiguous(), src=src, group=group)
        out[name] = value if value is not None else buffer.to(item["device"])
    return out


def _describe_plain(entry: Mapping[str, Any] | None) -> list[Any] | None:
    if not entry:
        return None
    out = []
    for name, value in entry.items():
        if isinstance(value, torch.Tensor):
            out.append([name, {"dtype": str(value.dtype).removeprefix("torch."),
                               "shape": list(value.shape), "device": value.device.type}])
        else:
            out.append([name, {"value": value}])
    return out


def _group_device(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tp_layout_for(view: StateDictView | None, mp: MatrixParam, shape: list[int],
                  step_owner: int | None) -> Any:
    """The ``ViewLayout`` of a per-TP-shard state tensor; ``None`` for whole state (and
    ``view=None`` only checks that the tensor can be placed). An expert stack's per-expert
    state is laid out as the stack (see [Note: expert parallelism])."""
    if mp.ep is not None and len(shape):
        return None if view is None else view_layout(view.state, mp, shape)
    if mp.tp is None or step_owner is not None:
        return None
    if tuple(shape) != tuple(mp.shape):
        raise NotImplementedError(
            f"optimizer state of TP matrix {mp.fqn!r} (TP shard {tuple(mp.shape)} of global "
            f"shape {mp.tp.global_shape}) has a tensor of shape {tuple(shape)}: a per-shard "
            "optimizer's state must be shaped like the TP shard; use MatrixOptimizer, which "
            "keeps each TP matrix's state whole"
        )
    return None if view is None else view_layout(view.state, mp)


def owner_tp_entry(view: StateDictView, mp: MatrixParam, entry: Mapping[str, Any],
                   step_owner: int | None, gather: Any) -> dict[str, Any] | None:
    """A TP matrix's incoming entry as this rank keeps it (collective), ``None`` to drop it.

    ``gather(value)`` gathers a dp-mesh matrix DTensor to the owner row (whole state)."""
    assert mp.tp is not None  # TP matrices only
    out: dict[str, Any] = {}
    for name, value in entry.items():
        if step_owner is not None:
            if isinstance(value, DTensor):
                value = gather(value)
        elif isinstance(value, DTensor):
            value = gather_tp_to_owner(view.state, mp, value)
        elif isinstance(value, torch.Tensor) and tuple(value.shape) == mp.tp.global_shape:
            value = mp.tp.slice_of(value.detach(), mp.tp.tp_rank).contiguous()
        out[name] = value
    if not mp.is_owner:
        return None
    if step_owner is not None and step_owner != mp.tp.tp_rank:
        return None
    return out
