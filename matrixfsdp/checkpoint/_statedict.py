"""What each rank hands DCP on save, and the tensors it asks DCP to fill on load.

[Note: checkpoint keys]
- ``model.<fqn>``: a tail parameter or buffer as the FSDP2 ``state_dict()`` gives it (DTensor
  shards; under HSDP DCP writes each replicated shard once), or a matrix, whole, written by its
  owner alone. Non-owners omit the key: an empty placeholder would break DCP's planning, and a
  plain tensor under one key with different values on different ranks would be silently
  deduplicated. Under HSDP only replica 0's owners write matrices (the other replicas hold the
  same values and take part in the collective without matrix keys): written once. Matrices
  are read in the owner view of ``model.state_dict()`` (see [Note: state-dict view]), not as
  the matrix DTensors torch's state-dict API gets.
- ``optim.state.<fqn>.<key>``: optimizer state. A matrix's state is written by its owner (plain
  tensors); the tail's by every rank (DTensor shards plus replicated scalars such as ``step``).
  State keys must not contain ``.`` so ``<fqn>`` and ``<key>`` split unambiguously.
- ``rng.cpu.<rank>`` / ``rng.cuda.<rank>``: each rank's generator states under its own key.
- TP matrices are stored as global matrices in tp chunks, and their ``MatrixOptimizer`` state
  whole by the step owner: [Note: TP matrices in checkpoints] in ``_tp.py``. Expert stacks and
  their state are stored as global stacks in ep chunks: [Note: experts in checkpoints] in
  ``_experts.py``.
On load every rank requests exactly the keys it needs: a new owner (in every replica) asks for
whole matrices and their state, every rank asks for its tail shards (DCP reshards them, also
between 1-D and 2-D meshes), and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from ..runtime import MatrixFSDPState
from ..runtime.matrix_param import MatrixParam
from ..runtime.state_dict_view import owner_state_dict
from . import _experts, _tp
from .layout import (
    GroupLayout,
    OptimizerLayout,
    TensorEntry,
    decode_hyperparams,
    dtype_name,
    encode_hyperparams,
)

__all__ = [
    "install_optimizer_state",
    "mesh_group",
    "model_entries",
    "model_state",
    "model_targets",
    "optimizer_state",
    "optimizer_targets",
    "param_fqns",
    "restore_hyperparams",
    "restore_rng",
    "rng_state",
    "rng_targets",
    "saved_state_keys",
    "state_holder",
    "writes_matrix",
]

logger = logging.getLogger(__name__)


def mesh_group(runtime: MatrixFSDPState) -> dist.ProcessGroup | None:
    """A process group over every rank of the model's mesh, replicas and tp included (None:
    default)."""
    if runtime.tp_mesh is not None:
        return _tp.dp_tp_group(runtime)
    return runtime.dp_mesh.all_ranks_group()


def writes_matrix(runtime: MatrixFSDPState, fqn: str) -> bool:
    """Whether this rank writes matrix ``fqn``: its owner (each tp rank of a TP matrix's owner
    row, its chunk), in replica 0. Its state: ``state_holder``."""
    mp = runtime.params.get(fqn)
    return mp is not None and mp.is_owner and runtime.replica_rank == 0


def param_fqns(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> FQN`` for every parameter (first name of a shared one)."""
    return {id(p): fqn for fqn, p in model.named_parameters()}


# -- save ------------------------------------------------------------------------------------------
def model_entries(model: nn.Module, runtime: MatrixFSDPState) -> list[TensorEntry]:
    """Every state-dict entry of the wrapped model with its global shape and role."""
    buffers = {name for name, _ in model.named_buffers()}
    stacks = {p.fqn for p in runtime.plan.sharded_stacks}
    entries = []
    for key, value in owner_state_dict(model, runtime).items():
        mp = runtime.params.get(key)
        if mp is not None:
            tp = None if mp.tp is None else _tp.tp_entry(mp.tp)
            entries.append(TensorEntry(fqn=key, shape=mp.global_shape, dtype=dtype_name(mp.dtype),
                                       role="matrix", owner_rank=mp.owner_rank, tp=tp))
            continue
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(
                f"state_dict entry {key!r} is a {type(value).__name__}; matrixfsdp checkpoints "
                "hold tensors only (move extra state into save(..., extra=...))"
            )
        role = "buffer" if key in buffers else "sharded_stack" if key in stacks else "tail"
        entries.append(TensorEntry(fqn=key, shape=tuple(value.shape), dtype=dtype_name(value.dtype),
                                   role=role))
    return entries


def model_state(model: nn.Module, runtime: MatrixFSDPState) -> dict[str, torch.Tensor]:
    """This rank's model tensors for DCP: tail shards, buffers, and the matrices it owns."""
    out: dict[str, torch.Tensor] = {}
    for key, value in owner_state_dict(model, runtime).items():
        mp = runtime.params.get(key)
        if mp is not None and not writes_matrix(runtime, key):
            continue  # its owner in replica 0 writes it
        if mp is not None and tuple(value.shape) != tuple(mp.shape):
            raise RuntimeError(
                f"owner of matrix {key!r} holds shape {tuple(value.shape)}, expected "
                f"{tuple(mp.shape)}; save outside forward/backward"
            )
        out[key] = value if mp is None else _experts.chunk(mp, value)
    return out


def _check_state_value(fqn: str, key: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise NotImplementedError(
            f"optimizer state of {fqn!r} has {key!r} = {type(value).__name__}; matrixfsdp "
            "checkpoints store optimizer state tensors only"
        )
    if "." in key:
        raise NotImplementedError(
            f"optimizer state key {key!r} of {fqn!r} contains '.', which the checkpoint key "
            "scheme optim.state.<fqn>.<key> cannot split"
        )
    return value


def optimizer_state(
    model: nn.Module, runtime: MatrixFSDPState, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, dict[str, torch.Tensor]], OptimizerLayout]:
    """This rank's optimizer state by FQN (owners only for matrices; for TP matrices see
    [Note: TP matrices in checkpoints]) and the group layout."""
    fqn_of = param_fqns(model)
    holds = state_holder(runtime, optimizer)
    whole = _tp.state_mode(optimizer) == "whole"
    state: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            fqn = fqn_of.get(id(p))
            if fqn is None:
                raise ValueError(
                    f"optimizer param group {index} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model"
                )
            fqns.append(fqn)
            entry = optimizer.state.get(p)
            if entry and holds(fqn) and (fqn not in runtime.params or runtime.replica_rank == 0):
                state[fqn] = _state_entry(runtime.params.get(fqn), fqn, entry, whole)
        optimizer_name = group.get("optimizer")
        groups.append(GroupLayout(
            kind=group.get("kind"),
            optimizer=optimizer_name if isinstance(optimizer_name, str) else None,
            params=tuple(fqns), hyperparams=encode_hyperparams(group),
        ))
    cls = type(optimizer)
    return state, OptimizerLayout(cls=f"{cls.__module__}.{cls.__qualname__}", groups=tuple(groups))


def state_holder(runtime: MatrixFSDPState, optimizer: torch.optim.Optimizer
                 ) -> Callable[[str], bool]:
    """Whether this rank keeps the optimizer state of a parameter (by FQN), so reads it on load:
    the tail's every rank; a matrix's its owner; a TP matrix's under ``MatrixOptimizer`` its
    step owner (see [Note: TP matrices in checkpoints]). In replica 0 they also write it."""
    whole = _tp.state_mode(optimizer) == "whole"
    stepped = _tp.step_owned(runtime, optimizer) if whole else set()

    def holds(fqn: str) -> bool:
        mp = runtime.params.get(fqn)
        if mp is None:
            return True
        return mp.is_owner and (mp.tp is None or not whole or fqn in stepped)

    return holds


def _state_entry(mp: MatrixParam | None, fqn: str, entry: dict[str, Any], whole: bool
                 ) -> dict[str, torch.Tensor]:
    """One parameter's state as DCP stores it: a torch optimizer's TP shards as chunks."""
    values = {k: _check_state_value(fqn, k, v) for k, v in entry.items()}
    if mp is not None and mp.ep is not None:
        return {k: _experts.state_chunk(mp, k, v) for k, v in values.items()}
    if mp is None or mp.tp is None or whole:
        return values
    return {k: _tp.shard_state_value(mp, k, v) for k, v in values.items()}


def rng_state(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's generator states: CPU always, CUDA (current device) when CUDA is in use."""
    out = {"cpu": {str(rank): torch.get_rng_state()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = {str(rank): torch.cuda.get_rng_state()}
    return out


# -- load ------------------------------------------------------------------------------------------
def _tensor_md(metadata: Metadata, key: str) -> TensorStorageMetadata | None:
    md = metadata.state_dict_metadata.get(key)
    return md if isinstance(md, TensorStorageMetadata) else None


def model_targets(
    model: nn.Module, runtime: MatrixFSDPState, fqns: Iterable[str], prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """The model tensors this rank fills in place: tail shards, buffers, owned matrices (a TP
    matrix's owner row: each tp rank its TP shard, as its chunk of the global matrix)."""
    wanted = set(fqns)
    targets = {}
    for key, value in owner_state_dict(model, runtime).items():
        if key not in wanted:
            continue
        mp = runtime.params.get(key)
        if mp is not None and not mp.is_owner:
            continue
        targets[prefix + key] = value if mp is None else _experts.chunk(mp, value)
    return targets


def saved_state_keys(metadata: Metadata) -> dict[str, list[str]]:
    """``fqn -> [state keys]`` found under ``optim.state.`` in the checkpoint."""
    out: dict[str, list[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith("optim.state."):
            fqn, _, name = key[len("optim.state."):].rpartition(".")
            out.setdefault(fqn, []).append(name)
    return out


def _state_target(p: torch.Tensor, md: TensorStorageMetadata, on_device_scalars: bool
                  ) -> torch.Tensor:
    """A tensor to load one state entry into: a DTensor like ``p`` when the shapes agree.

    Scalars (``step``) stay on the CPU, as torch's optimizers keep them, unless the group is
    ``fused``/``capturable`` (then they live on the parameter's device).
    """
    dtype = md.properties.dtype
    if isinstance(p, DTensor) and tuple(md.size) == tuple(p.shape):
        local = torch.empty_like(p.to_local(), dtype=dtype)
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride())
    if _sharded_like_stack(p, md):
        # Per-expert state of a sharded stack ((E, ...) with any trailing shape): shard dim 0
        # exactly as the parameter's experts are sharded.
        size = tuple(md.size)
        local = torch.empty((p.to_local().shape[0], *size[1:]), dtype=dtype, device=p.device)
        stride = [1] * len(size)
        for i in range(len(size) - 2, -1, -1):
            stride[i] = stride[i + 1] * size[i + 1]
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=torch.Size(size),
                                  stride=tuple(stride))
    device = p.device if len(md.size) or on_device_scalars else torch.device("cpu")
    return torch.empty(tuple(md.size), dtype=dtype, device=device)


def _sharded_like_stack(p: torch.Tensor, md: TensorStorageMetadata) -> bool:
    """A sharded stack: ``Shard(0)`` on the shard dim, replicated on an HSDP replicate dim."""
    if not (isinstance(p, DTensor) and p.ndim == 3 and len(md.size) >= 1
            and md.size[0] == p.shape[0]):
        return False
    *replicated, last = p.placements
    return last == Shard(0) and all(pl.is_replicate() for pl in replicated)


def optimizer_targets(
    model: nn.Module, runtime: MatrixFSDPState, optimizer: torch.optim.Optimizer,
    metadata: Metadata,
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, str]]]:
    """Fresh tensors for the saved optimizer state this rank needs (a matrix's on its owner; a
    TP matrix's: see [Note: TP matrices in checkpoints]).

    Returns the DCP targets and, per parameter (by id), ``state key -> DCP key``.
    """
    fqn_of = param_fqns(model)
    saved = saved_state_keys(metadata)
    holds = state_holder(runtime, optimizer)
    whole = _tp.state_mode(optimizer) == "whole"
    targets: dict[str, torch.Tensor] = {}
    routes: dict[int, dict[str, str]] = {}
    for group in optimizer.param_groups:
        on_device_scalars = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            fqn = fqn_of[id(p)]
            mp = runtime.params.get(fqn)
            if not holds(fqn):
                continue
            route = routes.setdefault(id(p), {})
            for name in saved.get(fqn, []):
                key = f"optim.state.{fqn}.{name}"
                md = _tensor_md(metadata, key)
                if md is None:
                    continue
                if mp is not None and mp.ep is not None and len(md.size):
                    targets[key] = _experts.state_target(mp, name, md)
                elif mp is not None and mp.tp is not None and not whole and len(md.size):
                    targets[key] = _tp.shard_state_target(mp, name, md)
                else:
                    targets[key] = _state_target(p, md, on_device_scalars)
                route[name] = key
    return targets, routes


def install_optimizer_state(
    optimizer: torch.optim.Optimizer, targets: dict[str, torch.Tensor],
    routes: dict[int, dict[str, str]],
) -> None:
    """Replace the optimizer's state with the loaded tensors (in place: inner optimizers share
    it). A DTensor read for a plain parameter (a TP shard's chunk) is kept as its local tensor."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            route = routes.get(id(p))
            if route:
                optimizer.state[p] = {name: _local_for(p, targets[key])
                                      for name, key in route.items()}
            else:
                optimizer.state.pop(p, None)


def _local_for(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor) and not isinstance(p, DTensor):
        return value.to_local()
    return value


def restore_hyperparams(optimizer: torch.optim.Optimizer, saved: OptimizerLayout) -> None:
    for group, layout in zip(optimizer.param_groups, saved.groups, strict=True):
        decode_hyperparams(layout.hyperparams, group)


def rng_targets(metadata: Metadata, rank: int) -> dict[str, torch.Tensor]:
    targets = {}
    for kind in ("cpu", "cuda"):
        key = f"rng.{kind}.{rank}"
        md = _tensor_md(metadata, key)
        if md is not None and (kind == "cpu" or torch.cuda.is_available()):
            targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return targets


def restore_rng(targets: dict[str, torch.Tensor], rank: int) -> None:
    cpu = targets.get(f"rng.cpu.{rank}")
    if cpu is None:
        logger.info("matrixfsdp.checkpoint: no saved RNG state for rank %d; RNG left as is", rank)
        return
    torch.set_rng_state(cpu)
    cuda = targets.get(f"rng.cuda.{rank}")
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
