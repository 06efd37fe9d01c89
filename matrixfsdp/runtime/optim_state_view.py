"""What an optimizer's ``state_dict()`` and ``load_state_dict`` show of matrices' state.

[Note: optimizer state-dict view]
- A matrix's optimizer state lives on its owner only (non-owners step an empty placeholder, or
  nothing). torch's state-dict API needs the same keys on every rank and DTensors it can gather
  or hand to DCP, so ``optimizer.state_dict()`` (a post-hook) rewrites each matrix's entry on
  every rank: a tensor of one or more dims becomes a matrix DTensor scattered from the owner (see
  [Note: state-dict view]); a 0-d tensor (``step``) and a JSON value are copied from the owner
  and stay plain, identical on every rank. Non-owners learn the entry's keys, dtypes, shapes and
  scalars from the owner in one exchange of JSON bytes per state dict (never pickle). A matrix
  without state on its owner has no entry anywhere. Entries are ordered by parameter position,
  so every rank gathers (``full_state_dict``) in the same order.
- ``load_state_dict`` (a pre-hook) gathers each DTensor of a matrix's entry to the owner; plain
  tensors of one or more dims (a full state dict, the owner's own dict) are the owner's as they
  are. The owner keeps the entry, every other rank drops it.
- ``MatrixOptimizer`` keeps its state's dtypes through a load (``keep_dtypes``): torch's
  ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype, which would turn
  fp32 state of a bf16 model into bf16; a post-hook puts the loaded dtypes back. A plain torch
  optimizer keeps torch's cast.
- ``MatrixOptimizer`` installs the hooks in its ``__init__``. A plain torch optimizer over a
  wrapped model (``torch.optim.AdamW(model.parameters())``) gets them at its first step, from a
  process-wide step pre-hook that ``fully_shard_matrix`` registers once; torch's state-dict API
  steps every optimizer without state once first (``_init_optim_state``), so its calls are
  covered. ``state_dict()`` of such an optimizer before any step shows its (owner-only) state
  as it is.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .matrix_param import MatrixParam
from .state_dict_view import (
    StateDictView,
    exchange_json,
    gather_experts_to_owner,
    gather_to_owner,
    live_views,
)
from .state_dict_view import comm_device as _comm_device
from .state_dict_view import scatter_from_owner as _scatter
from .tp_optim_view import owner_tp_entry, share_step_owner_entry, step_owner_of, tp_layout_for

__all__ = ["ensure_optimizer_step_hook", "install_optimizer_state_view"]

logger = logging.getLogger(__name__)

_HOOKS_ATTR = "_matrixfsdp_state_view"  # in an optimizer's __dict__: True once decided
_with_hooks: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_step_hook_registered = False
_ERROR = "error"  # a description's key for an owner's unsupported state (never a position)

_Matrices = dict[int, tuple[torch.Tensor, StateDictView, MatrixParam]]  # position -> ...


def install_optimizer_state_view(optimizer: torch.optim.Optimizer, *, keep_dtypes: bool = False
                                 ) -> None:
    """Register the view's hooks on ``optimizer`` (see the Note); idempotent."""
    if optimizer.__dict__.get(_HOOKS_ATTR):
        return
    optimizer.__dict__[_HOOKS_ATTR] = True
    view = _OptimizerView(keep_dtypes)
    optimizer.register_state_dict_post_hook(view.present)
    optimizer.register_load_state_dict_pre_hook(view.receive)
    if keep_dtypes:
        optimizer.register_load_state_dict_post_hook(view.restore_dtypes)
    _with_hooks.add(optimizer)


def ensure_optimizer_step_hook() -> None:
    """Register, once per process, the step pre-hook that equips plain torch optimizers."""
    global _step_hook_registered
    if not _step_hook_registered:
        register_optimizer_step_pre_hook(_on_first_step)
        _step_hook_registered = True


def _on_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _HOOKS_ATTR in optimizer.__dict__:
        return
    optimizer.__dict__[_HOOKS_ATTR] = False
    # An inner optimizer of a MatrixOptimizer shares its state dict: the outer one speaks for it.
    if any(other.state is optimizer.state for other in _with_hooks):
        return
    matrices = _matrix_ids()
    if any(id(p) in matrices for group in optimizer.param_groups for p in group["params"]):
        del optimizer.__dict__[_HOOKS_ATTR]
        install_optimizer_state_view(optimizer)


def _matrix_ids() -> dict[int, tuple[StateDictView, MatrixParam]]:
    return {id(mp.sharded): (view, mp) for view in live_views()
            for mp in view.state.params.values()}


def _matrices(optimizer: torch.optim.Optimizer, packed_groups: Iterable[Mapping[str, Any]]
              ) -> tuple[list[tuple[Any, torch.Tensor]], _Matrices]:
    """Every ``(state key, parameter)`` of ``packed_groups`` (the state dict's groups, matched
    to the optimizer's in order, as torch matches them) by position, and the matrices."""
    known = _matrix_ids()
    seen: set[Any] = set()
    index: list[tuple[Any, torch.Tensor]] = []
    matrices: _Matrices = {}
    for packed, group in zip(packed_groups, optimizer.param_groups, strict=False):
        for key, param in zip(packed["params"], group["params"], strict=False):
            if key in seen:
                continue
            seen.add(key)
            if id(param) in known:
                matrices[len(index)] = (param, *known[id(param)])
            index.append((key, param))
    return index, matrices


def _by_view(matrices: _Matrices) -> list[tuple[StateDictView, list[int]]]:
    """Matrix positions grouped by model, in position order (the same on every rank)."""
    out: dict[int, tuple[StateDictView, list[int]]] = {}
    for position in sorted(matrices):
        view = matrices[position][1]
        out.setdefault(id(view), (view, []))[1].append(position)
    return list(out.values())


class _OptimizerView:
    """One optimizer's hooks (see the Note)."""

    def __init__(self, keep_dtypes: bool) -> None:
        self.keep_dtypes = keep_dtypes
        self._loaded: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []

    # state_dict(): owners' entries -> the same keys on every rank, matrix DTensors
    def present(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
                ) -> dict[str, Any] | None:
        index, matrices = _matrices(optimizer, state_dict["param_groups"])
        if not matrices:
            return None
        positions = {key: position for position, (key, _) in enumerate(index)}
        state = dict(state_dict["state"])
        owners = _step_owners(optimizer, matrices)
        for position, step_owner in owners.items():  # see [Note: TP optimizer state view]
            key, mp = index[position][0], matrices[position][2]
            if step_owner is not None and mp.is_owner:
                shared = share_step_owner_entry(mp, step_owner, state.get(key))
                if shared is None:
                    state.pop(key, None)
                else:
                    state[key] = shared
        for view, view_positions in _by_view(matrices):
            try:
                mine = {str(p): _describe(matrices[p][2], state.get(index[p][0]), owners.get(p))
                        for p in view_positions if matrices[p][2].is_owner}
            except NotImplementedError as exc:  # raised on every rank below, not only here
                mine = {_ERROR: str(exc)}
            described: dict[str, Any] = {}
            for payload in exchange_json(view.state, mine):
                if _ERROR in payload:
                    raise NotImplementedError(payload[_ERROR])
                described.update(payload)
            for position in view_positions:
                key, mp = index[position][0], matrices[position][2]
                spec = described.get(str(position))
                if spec is None:
                    state.pop(key, None)
                    continue
                entry = state.get(key) if mp.is_owner else None
                state[key] = {name: _rebuild(view, mp, name, item, entry, owners.get(position))
                              for name, item in spec}
        order = len(positions)
        state_dict["state"] = dict(sorted(state.items(),
                                          key=lambda kv: positions.get(kv[0], order)))
        return state_dict

    # load_state_dict(): anything -> the owner's entry; non-owners drop it
    def receive(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
                ) -> dict[str, Any] | None:
        index, matrices = _matrices(optimizer, state_dict["param_groups"])
        state = dict(state_dict["state"])
        owners = _step_owners(optimizer, matrices)
        _agree_on_names(index, matrices, state)
        for position, (key, _) in enumerate(index):  # the same order on every rank
            if position not in matrices or not isinstance(state.get(key), Mapping):
                continue
            _, view, mp = matrices[position]
            if mp.tp is not None:
                entry = owner_tp_entry(
                    view, mp, state[key], owners.get(position),
                    lambda value, view=view, mp=mp: gather_to_owner(view.state, mp.owner_rank,
                                                                    value))
            else:
                entry = _owner_entry(view, mp, state[key])
            if entry is None:
                state.pop(key)
            else:
                state[key] = entry
        if self.keep_dtypes:
            self._loaded = _kept_dtypes(state, index)
        return {**state_dict, "state": state}

    def restore_dtypes(self, optimizer: torch.optim.Optimizer) -> None:
        """Undo torch's cast of loaded state to the parameter's dtype (``keep_dtypes``)."""
        loaded, self._loaded = self._loaded, []
        for param, values in loaded:
            entry = optimizer.state.get(param)
            if entry is None:
                continue
            for name, value in values.items():
                current = entry.get(name)
                if isinstance(current, torch.Tensor) and current.dtype != value.dtype:
                    entry[name] = value.to(device=current.device)


def _step_owners(optimizer: torch.optim.Optimizer, matrices: _Matrices) -> dict[int, int | None]:
    """Each TP matrix's step owner (``None``: state per TP shard), by position."""
    return {position: step_owner_of(optimizer, param)
            for position, (param, _, mp) in matrices.items() if mp.tp is not None}


def _describe(mp: MatrixParam, entry: Mapping[str, Any] | None,
              step_owner: int | None = None) -> list[Any] | None:
    """The owner's entry as JSON: ``[name, item]`` pairs in its order (None: no state)."""
    if not entry:
        return None
    out = []
    for name, value in entry.items():
        if mp.tp is not None and isinstance(value, torch.Tensor) and value.ndim:
            tp_layout_for(None, mp, list(value.shape), step_owner)  # raises if it cannot place
        if isinstance(value, DTensor) or not isinstance(name, str):
            raise NotImplementedError(
                f"optimizer state of matrix {mp.fqn!r} (shape {tuple(mp.shape)}) has {name!r} = "
                f"{type(value).__name__}; the state-dict view supports str keys and plain tensors"
            )
        if isinstance(value, torch.Tensor):
            item = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                    "device": value.device.type}
            if value.ndim == 0:
                raw = value.detach().cpu().reshape(1).view(torch.uint8)
                item["bytes"] = bytes(raw.tolist()).hex()
        elif value is None or isinstance(value, (bool, int, float, str)):
            item = {"value": value}
        else:
            raise NotImplementedError(
                f"optimizer state of matrix {mp.fqn!r} (shape {tuple(mp.shape)}) has {name!r} of "
                f"type {type(value).__name__}; only tensors and JSON scalars are supported"
            )
        out.append([name, item])
    return out


def _rebuild(view: StateDictView, mp: MatrixParam, name: str, item: Mapping[str, Any],
             entry: Mapping[str, Any] | None, step_owner: int | None = None) -> Any:
    """One value of a matrix's state on this rank, from the owner's description."""
    if "value" in item:
        return item["value"]
    dtype = getattr(torch, item["dtype"])
    owned = entry[name] if entry is not None else None
    if item["shape"]:
        layout = tp_layout_for(view, mp, item["shape"], step_owner)
        return _scatter(view.state, mp.owner_rank, owned, item["shape"], dtype, layout)
    if owned is not None:
        return owned
    device = torch.device("cpu") if item["device"] == "cpu" else _comm_device(view.state)
    raw = torch.tensor(list(bytes.fromhex(item["bytes"])), dtype=torch.uint8)
    return raw.view(dtype).reshape(()).to(device)


def _owner_entry(view: StateDictView, mp: MatrixParam, entry: Mapping[str, Any]
                 ) -> dict[str, Any] | None:
    """The owner's entry from any incoming one (collective for its DTensors); None elsewhere."""
    out: dict[str, Any] = dict.fromkeys(entry)  # the entry's order, gathers in name order
    for name in sorted(entry, key=str):
        value = entry[name]
        if isinstance(value, DTensor):
            value = (gather_experts_to_owner(view.state, mp, value) if mp.ep is not None
                     else gather_to_owner(view.state, mp.owner_rank, value))
        elif (mp.ep is not None and isinstance(value, torch.Tensor) and value.ndim
              and value.shape[0] == mp.ep.global_shape[0]):  # a full state dict: our experts
            value = mp.ep.slice_of(value.detach(), mp.ep.ep_rank).contiguous()
        out[name] = value
    return out if mp.is_owner else None


def _agree_on_names(index: list[tuple[Any, torch.Tensor]], matrices: _Matrices,
                    state: Mapping[Any, Any]) -> None:
    """Raise the same ``ValueError`` on every rank, before any gather, where the ranks of a
    shard group hold matrix DTensors under different names for one matrix (each would enter
    other gathers: a hang). One exchange of JSON per model."""
    for view, positions in _by_view(matrices):
        mine = {}
        for position in positions:
            entry = state.get(index[position][0])
            if isinstance(entry, Mapping):
                mine[str(position)] = sorted(str(name) for name, value in entry.items()
                                             if isinstance(value, DTensor))
        everyone = exchange_json(view.state, mine)
        for position in positions:
            seen = [payload.get(str(position), []) for payload in everyone]
            if all(names == seen[0] for names in seen):
                continue
            mp = matrices[position][2]
            by_rank = {rank: names for rank, names in enumerate(seen)}
            raise ValueError(
                f"optimizer state of matrix {mp.fqn!r} (shape {tuple(mp.shape)}, owner rank "
                f"{mp.owner_rank} of its shard group) arrives with other DTensor entries on each "
                f"rank of the shard group: {by_rank}. Every rank must load the same state dict. "
                "torch's flatten_optimizer_state_dict=True rebuilds entries from each rank's own "
                "optimizer.state, which holds nothing for a matrix the rank does not own: load "
                "with the default (nested) optimizer state dict, or step the matrices with a "
                "registered optimizer name (MatrixOptimizer(model, 'muon'), see [Note: flat "
                "optimizer state])"
            )


def _kept_dtypes(state: Mapping[Any, Any], index: list[tuple[Any, torch.Tensor]]
                 ) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Loaded tensors torch's load would cast (floating parameter, other dtype; not ``step``)."""
    kept = []
    for key, param in index:
        entry = state.get(key)
        if not isinstance(entry, Mapping) or not param.is_floating_point():
            continue
        values = {name: value for name, value in entry.items()
                  if name != "step" and isinstance(value, torch.Tensor)
                  and value.dtype != param.dtype}
        if values:
            kept.append((param, values))
    return kept
