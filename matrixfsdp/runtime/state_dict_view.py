"""What ``model.state_dict()`` and ``load_state_dict`` show of a wrapped model's matrices.

[Note: state-dict view]
- ``model.state_dict()`` presents every matrix as a DTensor of its full shape on the model's
  mesh with FSDP2's placements: ``(Shard(0),)`` on a flat mesh, ``(Replicate(), Shard(0))`` on an
  HSDP mesh. Its local chunks are the rows ``torch.chunk`` gives each rank of the shard group
  (``ceil(rows / N)`` each, a shorter or empty one at the end), *scattered from the owner's whole
  matrix* (the *matrix DTensor*); under HSDP each replica scatters its own owner's copy. Because
  this is exactly how FSDP2 presents a parameter, torch's state-dict API works unchanged:
  ``get_model_state_dict(full_state_dict=True)`` gathers it with ``DTensor.redistribute``, DCP
  saves, loads and reshards the chunks, and a stock FSDP2 model loads them. The price:
  ``state_dict()`` is collective (every rank of the mesh must call it, as with FSDP1) and holds a
  copy of one chunk of every matrix (``1/N`` of the matrix bytes per rank).
- ``load_state_dict`` turns whatever arrives for a matrix into what the module holds before
  ``nn.Module`` copies it (a pre-hook on each module with matrices): a matrix DTensor is gathered
  to the owner (another DTensor layout through ``full_tensor()``); a plain tensor of the full
  shape (a single-process state dict, torch's full-state-dict load) is taken by the owner as it
  is. Every non-owner gets an empty tensor of the placeholder shape, so shapes match and nothing
  is copied. A placeholder-shaped tensor (the owner view below) passes through. A plain full
  tensor for an FSDP2 parameter (the tail) becomes this rank's shard of it, without
  communication, so a single-process state dict loads into the wrapped model as it is.
- ``dcp.load`` fills the matrix DTensors of a state dict, not the matrices: follow it with
  ``model.load_state_dict(sd)`` or ``set_model_state_dict`` (torch's documented flow).
- The *owner view* (``owner_view``/``owner_state_dict``): inside it, ``state_dict()`` returns
  what the module holds, the whole matrix on its owner and the empty placeholder elsewhere, and
  communicates nothing. ``matrixfsdp.checkpoint`` uses it to write whole matrices from owners.
- Optimizer state follows the same rule: [Note: optimizer state-dict view] in
  ``optim_state_view.py``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .matrix_param import MatrixParam
from .state import MatrixFSDPState

__all__ = [
    "StateDictView",
    "exchange_json",
    "gather_experts_to_owner",
    "gather_to_owner",
    "install_state_dict_view",
    "live_views",
    "owner_state_dict",
    "owner_view",
    "scatter_from_owner",
]

logger = logging.getLogger(__name__)

# Every wrapped model's view, by its runtime state (dropped with the model).
_VIEWS: weakref.WeakKeyDictionary[MatrixFSDPState, StateDictView] = weakref.WeakKeyDictionary()


# -- the matrix DTensor: scatter from the owner, gather back ----------------------------------------
def matrix_placements(state: MatrixFSDPState) -> tuple[Placement, ...]:
    """FSDP2's placements on the model's mesh: ``Shard(0)`` over the shard dim."""
    return (Replicate(), Shard(0)) if state.mesh.ndim == 2 else (Shard(0),)


class ViewLayout(NamedTuple):
    """Where a matrix DTensor lives: its mesh and placements, the dim its shard-group chunks cut,
    and its global shape (the owner's tensor is that shape, its TP shard or its local experts);
    ``group``: the shard group the chunks are cut over (``None``: the model's)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    dim: int
    global_shape: tuple[int, ...]
    group: dist.ProcessGroup | None = None


def view_layout(state: MatrixFSDPState, mp: MatrixParam,
                local_shape: Sequence[int] | None = None) -> ViewLayout:
    """A plain matrix: ``Shard(0)`` over the shard dim. A TP matrix (see [Note: TP matrices]):
    the shard dim cuts the other dim of the TP shard, over the dp dims and tp together, so the
    DTensor is the global matrix and ``full_tensor()`` needs no strided placements."""
    if mp.ep is not None:  # over the expert mesh, cutting each expert's rows (dim 1)
        shape = tuple(mp.shape if local_shape is None else local_shape)
        if len(shape) < 2:
            raise NotImplementedError(
                f"a tensor of shape {shape} for expert stack {mp.fqn!r} has no per-expert rows "
                "to cut over the expert mesh; the state-dict view needs 2+ dims per stack"
            )
        edp = state.experts.dp
        dp = (Replicate(), Shard(1)) if edp.mesh.ndim == 2 else (Shard(1),)
        return ViewLayout(dp_tp_mesh(edp.mesh, mp.ep.mesh), (*dp, Shard(0)), 1,
                          (mp.ep.global_shape[0], *shape[1:]), edp.shard_group)
    if mp.tp is None:
        return ViewLayout(state.mesh, matrix_placements(state), 0, tuple(mp.shape))
    dim = 1 - mp.tp.shard_dim
    dp: tuple[Placement, ...] = (Replicate(), Shard(dim)) if state.mesh.ndim == 2 else (Shard(dim),)
    return ViewLayout(dp_tp_mesh(state.mesh, mp.tp.mesh), (*dp, Shard(mp.tp.shard_dim)), dim,
                      mp.tp.global_shape)


def dp_tp_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dims and the tp dim of one root mesh, as one mesh (no new groups)."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    try:
        if concatenate is not None:
            return concatenate([dp_mesh, tp_mesh])
        names = (*(dp_mesh.mesh_dim_names or ()), *(tp_mesh.mesh_dim_names or ()))
        root = _root_mesh(dp_mesh)  # older torch: slice the dp mesh's root by name
        combined = root[names]
        if combined[tp_mesh.mesh_dim_names] == tp_mesh:
            return combined
    except (RuntimeError, KeyError, ValueError, TypeError):
        pass
    raise ValueError(
        f"the data-parallel mesh (dims {dp_mesh.mesh_dim_names}) and the tp mesh (dims "
        f"{tp_mesh.mesh_dim_names}) must be disjoint named dims of one mesh: build it with "
        "init_device_mesh(type, (dp, tp), mesh_dim_names=('dp', 'tp'))"
    )


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        return get_root()
    from torch.distributed.device_mesh import _mesh_resources  # older torch

    return _mesh_resources.get_root_mesh(mesh)


def comm_device(state: MatrixFSDPState) -> torch.device:
    """Where the shard group's collectives run and DTensor chunks live (the mesh's device)."""
    if state.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(state.mesh.device_type)


def _shard_group(state: MatrixFSDPState) -> dist.ProcessGroup:
    return state.dp_mesh.shard_group


def _layout_group(state: MatrixFSDPState, layout: ViewLayout | None) -> dist.ProcessGroup:
    return layout.group if layout is not None and layout.group is not None else _shard_group(state)


def _row_bounds(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of chunk ``index`` when ``torch.chunk`` cuts ``rows`` into ``parts``."""
    size = -(-rows // parts)
    lo = min(index * size, rows)
    return lo, min(lo + size, rows)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def _as_dtensor(local: torch.Tensor, state: MatrixFSDPState, shape: Sequence[int],
                layout: ViewLayout | None = None) -> DTensor:
    if layout is None:
        return DTensor.from_local(local, state.mesh, matrix_placements(state), run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))
    if layout.dim:  # chunks travel as rows of the transposed tensor
        local = local.transpose(0, layout.dim).contiguous()
    return DTensor.from_local(local, layout.mesh, layout.placements, run_check=False,
                              shape=torch.Size(layout.global_shape),
                              stride=_contiguous_stride(layout.global_shape))


def scatter_from_owner(state: MatrixFSDPState, owner_rank: int, whole: torch.Tensor | None,
                       shape: Sequence[int], dtype: torch.dtype,
                       layout: ViewLayout | None = None) -> DTensor:
    """The matrix DTensor of a tensor of ``shape`` that the owner holds whole (see the Note).

    Collective over the shard group. ``whole`` is the owner's tensor (``None`` elsewhere). Row
    chunks are padded to one size for the scatter (gloo needs equal sizes); at a shard size of
    one the owner's tensor is the chunk (no copy, as FSDP2's one-rank shards). ``layout``: a TP
    matrix's (``view_layout``); its chunks cut ``layout.dim``.
    """
    shape = tuple(shape)
    if layout is not None and layout.dim:
        swapped = list(shape)
        swapped[0], swapped[layout.dim] = swapped[layout.dim], swapped[0]
        shape = tuple(swapped)
        whole = None if whole is None else whole.transpose(0, layout.dim)
    group = _layout_group(state, layout)
    parts, me = dist.get_world_size(group), dist.get_rank(group)
    device = comm_device(state)
    if parts == 1:
        assert whole is not None  # one rank in the shard group: it owns every matrix
        return _as_dtensor(whole.detach().to(device), state, shape, layout)
    size = -(-shape[0] // parts)
    lo, hi = _row_bounds(shape[0], parts, me)
    if math.prod(shape) == 0:  # nothing to move
        return _as_dtensor(torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=device),
                           state, shape, layout)
    received = torch.empty((size, *shape[1:]), dtype=dtype, device=device)
    chunks = None
    if whole is not None:
        rows = whole.detach().to(device)
        chunks = []
        for index in range(parts):
            start, stop = _row_bounds(shape[0], parts, index)
            chunk = rows[start:stop]
            if stop - start < size:  # the short last chunk(s): padded
                chunk = torch.cat([chunk, chunk.new_zeros((size - (stop - start), *shape[1:]))])
            chunks.append(chunk.contiguous())
    dist.scatter(received, chunks, src=dist.get_global_rank(group, owner_rank), group=group)
    local = received[: hi - lo]
    return _as_dtensor(local if hi - lo == size else local.clone(), state, shape, layout)


def _is_matrix_layout(value: DTensor, state: MatrixFSDPState, shape: Sequence[int]) -> bool:
    """Whether ``value`` is laid out as ``scatter_from_owner`` lays a tensor of ``shape`` out."""
    if tuple(value.shape) != tuple(shape) or tuple(value.placements) != matrix_placements(state):
        return False
    if value.device_mesh != state.mesh:
        return False
    group = _shard_group(state)
    lo, hi = _row_bounds(shape[0], dist.get_world_size(group), dist.get_rank(group))
    return tuple(value.to_local().shape) == (hi - lo, *shape[1:])


def gather_to_owner(state: MatrixFSDPState, owner_rank: int, value: DTensor) -> torch.Tensor | None:
    """The whole tensor of a DTensor, on the owner (``None`` elsewhere); collective.

    A matrix DTensor's chunks are gathered over the shard group (padded to one size); any other
    layout goes through ``full_tensor()`` (an all-gather over the DTensor's own mesh).
    """
    shape = tuple(value.shape)
    mine = owner_rank == dist.get_rank(_shard_group(state))
    if not _is_matrix_layout(value, state, shape):
        whole = value.full_tensor()
        return whole if mine else None
    return _gather_rows(state, owner_rank, value.to_local().detach(), shape)


def gather_tp_to_owner(state: MatrixFSDPState, mp: MatrixParam,
                       value: DTensor) -> torch.Tensor | None:
    """A TP matrix's shard of this tp rank (an expert stack's local experts) from a DTensor of
    the global tensor, on the owner row (``None`` elsewhere); collective over the shard group,
    or ``full_tensor()``."""
    split = mp.tp or mp.ep
    assert split is not None  # called for TP matrices and expert stacks only
    if mp.ep is not None:
        return gather_experts_to_owner(state, mp, value)
    layout = view_layout(state, mp)
    if (value.device_mesh == layout.mesh and tuple(value.placements) == layout.placements
            and tuple(value.shape) == layout.global_shape):
        rows = value.to_local().detach().transpose(0, layout.dim)
        rows_shape = list(mp.shape)
        rows_shape[0], rows_shape[layout.dim] = rows_shape[layout.dim], rows_shape[0]
        whole = _gather_rows(state, mp.owner_rank, rows, tuple(rows_shape), layout.group)
        return None if whole is None else whole.transpose(0, layout.dim).contiguous()
    full = value.full_tensor()
    return split.slice_of(full, _split_rank(mp)).contiguous() if mp.is_owner else None


def gather_experts_to_owner(state: MatrixFSDPState, mp: MatrixParam,
                            value: DTensor) -> torch.Tensor | None:
    """This ep rank's experts of a DTensor ``(E, ...)`` (a stack or its per-expert state), on
    the stack's owner (``None`` elsewhere); collective over the expert mesh, or
    ``full_tensor()``."""
    assert mp.ep is not None
    local_shape = (mp.ep.local_experts, *value.shape[1:])
    layout = view_layout(state, mp, local_shape)
    if (value.device_mesh == layout.mesh and tuple(value.placements) == layout.placements
            and tuple(value.shape) == layout.global_shape):
        rows = value.to_local().detach().transpose(0, 1)
        rows_shape = (local_shape[1], local_shape[0], *local_shape[2:])
        whole = _gather_rows(state, mp.owner_rank, rows, rows_shape, layout.group)
        return None if whole is None else whole.transpose(0, 1).contiguous()
    full = value.full_tensor()
    return mp.ep.slice_of(full, mp.ep.ep_rank).contiguous() if mp.is_owner else None


def _split_rank(mp: MatrixParam) -> int:
    """This rank's index on the matrix's tp or ep mesh."""
    return mp.tp.tp_rank if mp.tp is not None else mp.ep.ep_rank


def _gather_rows(state: MatrixFSDPState, owner_rank: int, local: torch.Tensor,
                 shape: tuple[int, ...],
                 group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """Row chunks (``torch.chunk`` of ``shape[0]`` over the shard group) gathered on the owner."""
    group = group if group is not None else _shard_group(state)
    parts = dist.get_world_size(group)
    mine = owner_rank == dist.get_rank(group)
    if parts == 1:
        return local
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=local.dtype, device=local.device) if mine else None
    size = -(-shape[0] // parts)
    send = local if local.shape[0] == size else torch.cat(
        [local, local.new_zeros((size - local.shape[0], *shape[1:]))])
    received = (torch.empty((size * parts, *shape[1:]), dtype=local.dtype, device=local.device)
                if mine else None)
    pieces = list(received.split(size)) if received is not None else None
    dist.gather(send.contiguous(), pieces, dst=dist.get_global_rank(group, owner_rank), group=group)
    if received is None:
        return None
    return received if size * parts == shape[0] else received[: shape[0]].clone()


def exchange_json(state: MatrixFSDPState, payload: Any) -> list[Any]:
    """Every shard-group rank's JSON ``payload``, in rank order (two all-gathers of bytes).

    Metadata only (names, shapes, dtypes, small scalars): JSON, never pickle.
    """
    group = _shard_group(state)
    parts = dist.get_world_size(group)
    data = json.dumps(payload, sort_keys=True).encode()
    if parts == 1:
        return [json.loads(data)]
    device = comm_device(state)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(parts)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    everyone = [torch.empty_like(mine) for _ in range(parts)]
    dist.all_gather(everyone, mine, group=group)
    return [json.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(everyone, sizes, strict=True)]


# -- the model's hooks ------------------------------------------------------------------------------
class StateDictView:
    """The hooks that present one wrapped model's matrices as matrix DTensors (see the Note)."""

    def __init__(self, state: MatrixFSDPState) -> None:
        # Weak: the registry maps the state to this view, which must not keep the model alive.
        self._state = weakref.ref(state)
        self.owner_depth = 0  # > 0 inside owner_view()

    @property
    def state(self) -> MatrixFSDPState:
        state = self._state()
        if state is None:  # pragma: no cover - hooks live on the model, which holds the state
            raise RuntimeError("matrixfsdp: the wrapped model of this state-dict view is gone")
        return state

    def install(self, model: nn.Module) -> None:
        by_module: dict[int, tuple[nn.Module, list[MatrixParam]]] = {}
        for mp in self.state.params.values():
            by_module.setdefault(id(mp.module), (mp.module, []))[1].append(mp)
        for module, params in by_module.values():
            module.register_state_dict_post_hook(functools.partial(self._present, params))
            module.register_load_state_dict_pre_hook(functools.partial(self._receive, params))
        model.register_load_state_dict_pre_hook(self._receive_tail)

    # state_dict(): owner's matrix -> matrix DTensor
    def _present(self, params: list[MatrixParam], module: nn.Module, state_dict: dict[str, Any],
                 prefix: str, local_metadata: dict[str, Any]) -> None:
        if self.owner_depth:
            return
        for mp in params:
            key = prefix + mp.name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if mp.is_owner and tuple(value.shape) != tuple(mp.shape):
                raise RuntimeError(
                    f"the owner of matrix {mp.fqn!r} (shape {tuple(mp.shape)}) holds a tensor of "
                    f"shape {tuple(value.shape)}; call state_dict() outside forward/backward"
                )
            layout = view_layout(self.state, mp) if mp.tp or mp.ep else None
            state_dict[key] = scatter_from_owner(self.state, mp.owner_rank,
                                                 value if mp.is_owner else None, mp.shape,
                                                 value.dtype, layout)

    # load_state_dict(): anything -> the owner's whole matrix, or a placeholder
    def _receive(self, params: list[MatrixParam], module: nn.Module, state_dict: dict[str, Any],
                 prefix: str, local_metadata: dict[str, Any], *args: Any) -> None:
        for mp in params:
            key = prefix + mp.name
            if key in state_dict:
                state_dict[key] = self._incoming(mp, state_dict[key])

    def _incoming(self, mp: MatrixParam, value: Any) -> Any:
        if mp.tp is not None or mp.ep is not None:
            return self._incoming_tp(mp, value)
        if isinstance(value, DTensor):
            if tuple(value.shape) != tuple(mp.shape):
                raise ValueError(
                    f"matrix {mp.fqn!r} (shape {tuple(mp.shape)}) got a DTensor of global shape "
                    f"{tuple(value.shape)}; load a state dict of this model"
                )
            whole = gather_to_owner(self.state, mp.owner_rank, value)
            return whole if mp.is_owner else _placeholder(mp, value.dtype)
        if (isinstance(value, torch.Tensor) and not mp.is_owner
                and tuple(value.shape) == tuple(mp.shape)):
            return _placeholder(mp, value.dtype)
        return value  # the owner's whole matrix, a placeholder, or a mismatch torch reports

    def _incoming_tp(self, mp: MatrixParam, value: Any) -> Any:
        """A TP matrix (an expert stack) takes the global tensor (DTensor or plain) or this
        rank's TP shard (local experts)."""
        split = mp.tp or mp.ep
        assert split is not None  # routed here for TP matrices and expert stacks only
        shape = split.global_shape
        if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
            if isinstance(value, DTensor):
                mine = gather_tp_to_owner(self.state, mp, value)
            else:
                mine = split.slice_of(value.detach(), _split_rank(mp)).contiguous()
            return mine if mp.is_owner else _placeholder(mp, value.dtype)
        if isinstance(value, DTensor):
            raise ValueError(
                f"TP matrix {mp.fqn!r} (global shape {shape}) got a DTensor of global shape "
                f"{tuple(value.shape)}; load a state dict of this model"
            )
        return value  # this rank's TP shard, a placeholder, or a mismatch torch reports

    def _receive_tail(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                      *args: Any) -> None:
        """Plain full tensors for FSDP2 (DTensor) parameters: this rank's shard of each."""
        for fqn, param in module.named_parameters():
            key = prefix + fqn
            value = state_dict.get(key)
            if (isinstance(param, DTensor) and isinstance(value, torch.Tensor)
                    and not isinstance(value, DTensor) and value.shape == param.shape):
                state_dict[key] = _local_shard_of(value, param)


def _placeholder(mp: MatrixParam, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(mp.placeholder_shape, dtype=dtype, device=mp.sharded.device)


def _local_shard_of(whole: torch.Tensor, like: DTensor) -> DTensor:
    """``whole`` (every rank holds it) cut to ``like``'s local shard, as a DTensor like it."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - every supported torch has it
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements)
    shape, offset = compute_local_shape_and_global_offset(whole.shape, like.device_mesh,
                                                          like.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    local = whole.detach()[index].to(like.to_local().device)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


# -- entry points -----------------------------------------------------------------------------------
def install_state_dict_view(model: nn.Module, state: MatrixFSDPState) -> StateDictView:
    """Register the view's hooks on a freshly wrapped model (see the Note); once per model."""
    from .optim_state_view import ensure_optimizer_step_hook

    view = StateDictView(state)
    view.install(model)
    _VIEWS[state] = view
    ensure_optimizer_step_hook()
    return view


def live_views() -> list[StateDictView]:
    """The views of every wrapped model alive in this process."""
    return list(_VIEWS.values())


@contextlib.contextmanager
def owner_view(state: MatrixFSDPState) -> Iterator[None]:
    """Inside it, the model's ``state_dict()`` is the owner view (see the Note): local."""
    view = _VIEWS.get(state)
    if view is None:
        yield
        return
    view.owner_depth += 1
    try:
        yield
    finally:
        view.owner_depth -= 1


def owner_state_dict(model: nn.Module, state: MatrixFSDPState) -> dict[str, Any]:
    """``model.state_dict()`` in the owner view: whole matrices on owners, placeholders elsewhere."""
    with owner_view(state):
        return model.state_dict()
