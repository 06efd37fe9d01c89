"""``save`` and ``load``: collective, atomic, resharding DCP checkpoints of a wrapped model.

See [Note: checkpoint keys], [Note: checkpoint layout] and [Note: atomic checkpoints].
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..api import get_state
from ..runtime import MatrixFSDPState
from . import _statedict as sd
from ._compat import check_model, check_optimizer
from ._dist import agree, dcp_errors, group_rank, group_size, on_coordinator
from .errors import CorruptCheckpointError
from .layout import (
    EP_FORMAT_VERSION,
    FORMAT_VERSION,
    LAYOUT_FILE,
    TP_FORMAT_VERSION,
    CheckpointLayout,
    parse_layout,
)
from .storage import (
    SafeFileSystemReader,
    check_data_files,
    prepare_target,
    publish,
    read_metadata,
    require_checkpoint,
    tmp_sibling,
)

__all__ = ["AsyncSave", "load", "open_checkpoint", "read_layout", "save", "wait_pending"]

logger = logging.getLogger(__name__)

_PENDING: list[AsyncSave] = []
_ASYNC_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


# -- reading ---------------------------------------------------------------------------------------
def read_layout(path: str | os.PathLike[str]) -> CheckpointLayout:
    """The validated layout of a complete checkpoint (no process group needed)."""
    path = Path(path)
    require_checkpoint(path)
    try:
        text = (path / LAYOUT_FILE).read_bytes()
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot read {LAYOUT_FILE} ({exc})") from exc
    return parse_layout(text, path / LAYOUT_FILE)


def open_checkpoint(path: str | os.PathLike[str]) -> tuple[CheckpointLayout, Metadata]:
    """Layout and DCP metadata of a checkpoint, cross-checked: every listed tensor is present."""
    path = Path(path)
    layout = read_layout(path)
    metadata = read_metadata(path)
    check_data_files(path, metadata)
    for entry in layout.model:
        md = metadata.state_dict_metadata.get("model." + entry.fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(
                f"{path}: the layout lists {entry.fqn!r} but the DCP metadata has no tensor "
                f"'model.{entry.fqn}'"
            )
        if tuple(md.size) != entry.shape:
            raise CorruptCheckpointError(
                f"{path}: {entry.fqn!r} has shape {list(md.size)} in the DCP metadata but "
                f"{list(entry.shape)} in the layout"
            )
    return layout, metadata


# -- save ------------------------------------------------------------------------------------------
def _check_args(step: int, extra: Any) -> int:
    if isinstance(step, bool) or int(step) != step or int(step) < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra must be JSON-serializable (dicts, lists, numbers, strings): {exc}") from exc
    return int(step)


def _build(
    model: nn.Module, runtime: MatrixFSDPState, optimizer: torch.optim.Optimizer | None,
    step: int, extra: Any, rank: int,
) -> tuple[dict[str, Any], CheckpointLayout]:
    from .. import __version__

    state: dict[str, Any] = {"model": sd.model_state(model, runtime), "rng": sd.rng_state(rank)}
    optimizer_layout = None
    if optimizer is not None:
        optim_state, optimizer_layout = sd.optimizer_state(model, runtime, optimizer)
        state["optim"] = {"state": optim_state}
    plan = runtime.plan
    tp_size = runtime.tp_mesh.size() if runtime.tp_mesh is not None else None
    ep_size = next((mp.ep.ep_size for mp in runtime.params.values() if mp.ep is not None), None)
    version = (EP_FORMAT_VERSION if ep_size is not None else
               TP_FORMAT_VERSION if tp_size is not None else FORMAT_VERSION)
    layout = CheckpointLayout(
        format_version=version,
        matrixfsdp_version=__version__, torch_version=torch.__version__, step=step,
        extra=extra, world_size=plan.world_size, mesh_shape=runtime.mesh_shape, plan=plan,
        plan_hash=plan.plan_hash(),
        model=tuple(sd.model_entries(model, runtime)), optimizer=optimizer_layout,
        tp_size=tp_size, ep_size=ep_size,
    )
    return state, layout


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: Any = None,
    async_save: bool = False,
) -> AsyncSave | None:
    """Save a checkpoint of a wrapped model (and optimizer) to the directory ``path``.

    Collective over every rank of the model's mesh (the dp x tp mesh of a TP model). Every
    matrix is written once, whole, by its owner (under HSDP, its owner in replica 0; a TP matrix
    as the global matrix in tp chunks by the owner row, its ``MatrixOptimizer`` state whole by
    its step owner: [Note: TP matrices in checkpoints]); the tail as FSDP2 DTensor shards;
    optimizer state by FQN; per-rank RNG states; ``step``, the JSON ``extra`` and the owner and
    TP layout go into the layout. The directory appears (atomically renamed from a hidden
    sibling) only after every rank finished; an existing checkpoint at ``path`` is replaced.

    With ``async_save=True`` the state is copied to CPU memory, written by a background thread
    (``torch.distributed.checkpoint.async_save`` over a dedicated gloo group), and an
    ``AsyncSave`` handle is returned: call its ``wait()`` on every rank to publish the checkpoint
    (the next ``save``/``load`` does so first).
    """
    wait_pending()
    step = _check_args(step, extra)
    path = Path(path)
    runtime = get_state(model)
    group = sd.mesh_group(runtime)
    state: dict[str, Any] = {}
    layout: CheckpointLayout | None = None
    error = None
    try:
        state, layout = _build(model, runtime, optimizer, step, extra, group_rank(group))
    except Exception as exc:  # forwarded so that no rank waits alone in a collective
        error = exc
    agree(error, group, "building the checkpoint state dict")
    assert layout is not None  # agree() raised otherwise
    on_coordinator(lambda: prepare_target(path), group, f"preparing {path}")
    tmp = tmp_sibling(path)
    writer = FileSystemWriter(str(tmp))
    if async_save:
        return _start_async(state, writer, tmp, path, layout, group)
    with dcp_errors(f"writing {path}"):
        dcp.save(state, storage_writer=writer, process_group=group)
    on_coordinator(lambda: publish(tmp, path, layout), group, f"publishing {path}")
    return None


# -- async -----------------------------------------------------------------------------------------
class AsyncSave:
    """A checkpoint being written in the background; ``wait()`` (collective) publishes it."""

    def __init__(self, future: Future, tmp: Path, path: Path, layout: CheckpointLayout,
                 group: dist.ProcessGroup | None) -> None:
        self.path = path
        self._future = future
        self._tmp = tmp
        self._layout = layout
        self._group = group
        self._finished = False

    def done(self) -> bool:
        """True when this rank's background write finished (publishing still needs wait())."""
        return self._future.done()

    def wait(self) -> Path:
        """Collective: wait for every rank's write, then publish the checkpoint; returns its path."""
        if self._finished:
            return self.path
        self._finished = True
        if self in _PENDING:
            _PENDING.remove(self)
        error = None
        try:
            with dcp_errors(f"writing {self.path}"):
                self._future.result()
        except Exception as exc:
            error = exc
        agree(error, self._group, f"async save to {self.path}")
        on_coordinator(lambda: publish(self._tmp, self.path, self._layout), self._group,
                       f"publishing {self.path}")
        return self.path


def _async_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group over the same ranks, so the background thread never shares the training PG."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if ranks not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo",
                                              use_local_synchronization=True)
    return _ASYNC_GROUPS[ranks]


def _start_async(state: dict[str, Any], writer: FileSystemWriter, tmp: Path, path: Path,
                 layout: CheckpointLayout, group: dist.ProcessGroup | None) -> AsyncSave:
    async_fn = getattr(dcp, "async_save", None)
    if async_fn is None:
        raise NotImplementedError(
            f"torch {torch.__version__} has no torch.distributed.checkpoint.async_save; "
            "save with async_save=False"
        )
    response = async_fn(state, storage_writer=writer, process_group=_async_group(group))
    future = getattr(response, "upload_completion", response)
    handle = AsyncSave(future, tmp, path, layout, group)
    _PENDING.append(handle)
    return handle


def wait_pending() -> None:
    """Collective: publish every async save still in flight (in the order they started)."""
    while _PENDING:
        _PENDING[0].wait()


# -- load ------------------------------------------------------------------------------------------
@dataclass
class _LoadRequest:
    """What one rank reads in a load, decided (and checked) before any collective."""

    layout: CheckpointLayout
    targets: dict[str, torch.Tensor]
    routes: dict[int, dict[str, str]]  # per optimizer parameter (by id): state key -> DCP key
    rng: dict[str, torch.Tensor] | None  # None: the RNG state is not restored
    use_optimizer: bool


def _prepare_load(
    path: Path, model: nn.Module, runtime: MatrixFSDPState,
    optimizer: torch.optim.Optimizer | None, *, weights_only: bool, strict: bool,
    restore_rng: bool, rank: int,
) -> _LoadRequest:
    """Local: read and check the layout, build this rank's DCP targets. Issues no collective."""
    layout, metadata = open_checkpoint(path)
    runtime.quiesce()  # nothing in flight may read a parameter this load writes
    current = sd.model_entries(model, runtime)
    fqns = check_model(path, layout, current, weights_only=weights_only, strict=strict)
    use_optimizer = optimizer is not None and not weights_only
    if use_optimizer:
        check_optimizer(path, layout, optimizer, model, plan=runtime.plan)
    targets = sd.model_targets(model, runtime, fqns)
    routes: dict[int, dict[str, str]] = {}
    if use_optimizer:
        optim_targets, routes = sd.optimizer_targets(model, runtime, optimizer, metadata)
        targets.update(optim_targets)
    rng = sd.rng_targets(metadata, rank) if restore_rng and not weights_only else None
    targets.update(rng or {})
    return _LoadRequest(layout, targets, routes, rng, use_optimizer)


def _install(request: _LoadRequest, optimizer: torch.optim.Optimizer | None, rank: int) -> None:
    """Local: hand the read optimizer state, hyperparameters and RNG state to their owners."""
    if request.use_optimizer:
        assert optimizer is not None and request.layout.optimizer is not None  # checked before
        sd.install_optimizer_state(optimizer, request.targets, request.routes)
        sd.restore_hyperparams(optimizer, request.layout.optimizer)
    if request.rng is not None:
        sd.restore_rng(request.rng, rank)


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    weights_only: bool = False,
    strict: bool = True,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into a wrapped model (and optimizer), at any world size.

    Collective. Each owner of the current plan (in every replica under HSDP) reads its matrices
    (and their optimizer state) whole; the tail is resharded by DCP, so a checkpoint loads at any
    mesh shape: flat or HSDP, either way, with or without TP and at any tp size (a TP matrix's
    owner row reads its TP shards of the stored whole matrix, its step owner the whole state;
    [Note: TP matrices in checkpoints]). Everything is checked before any tensor is written: a
    different matrix set or optimizer raises ``CheckpointMismatchError`` naming the FQNs, unless
    ``weights_only=True``, which loads model weights alone (no optimizer state, hyperparameters or
    RNG). ``strict=False`` skips entries missing on either side (shape mismatches always raise).
    ``restore_rng`` restores each rank's saved CPU (and CUDA) generator state where the saving
    world had that rank. Returns ``{"step": ..., "extra": ...}``.

    A failure on some ranks only (a file one rank reads differently, a model that differs on one
    rank) raises on every rank, never leaving the others waiting in a collective: the failing
    ranks raise their own error, the others a ``CheckpointError`` naming the failing ranks.
    Checks fail before anything is written; a failure while installing the read state (after
    the read) leaves the model holding the checkpoint's weights.
    """
    wait_pending()
    path = Path(path)
    runtime = get_state(model)
    group = sd.mesh_group(runtime)
    rank = group_rank(group)
    request: _LoadRequest | None = None
    error = None
    try:
        request = _prepare_load(path, model, runtime, optimizer, weights_only=weights_only,
                                strict=strict, restore_rng=restore_rng, rank=rank)
    except Exception as exc:  # forwarded so that no rank waits alone in dcp.load
        error = exc
    agree(error, group, f"checking {path} against the model")
    assert request is not None  # agree() raised otherwise
    with torch.no_grad(), dcp_errors(f"reading {path}"):
        dcp.load(request.targets, storage_reader=SafeFileSystemReader(str(path)),
                 process_group=group)
    try:
        _install(request, optimizer, rank)
    except Exception as exc:  # forwarded so that no rank trains on while another failed
        error = exc
    agree(error, group, f"installing the state read from {path}")
    layout = request.layout
    logger.info("matrixfsdp.checkpoint: loaded step %d from %s (saved on mesh (replicate, "
                "shard) = %s x tp %d, now %s x tp %d over %d ranks)", layout.step, path,
                layout.saved_mesh_shape, layout.saved_tp_size, runtime.mesh_shape,
                runtime.tp_mesh.size() if runtime.tp_mesh is not None else 1, group_size(group))
    return {"step": layout.step, "extra": layout.extra}
