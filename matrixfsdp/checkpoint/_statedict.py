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
On load every rank requests exactly the keys it needs: a new owner (in every replica) asks for
whole matrices and their state, every rank asks for its tail shards (DCP reshards them, also
between 1-D and 2-D meshes), and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from ..runtime import MatrixFSDPState
from ..runtime.state_dict_view import owner_state_dict
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
    "writes_matrix",
]

logger = logging.getLogger(__name__)


def mesh_group(runtime: MatrixFSDPState) -> dist.ProcessGroup | None:
    """A process group over every rank of the model's mesh, replicas included (None: default)."""
    return runtime.dp_mesh.all_ranks_group()


def writes_matrix(runtime: MatrixFSDPState, fqn: str) -> bool:
    """Whether this rank writes matrix ``fqn`` (and its state): its owner, in replica 0."""
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
            entries.append(TensorEntry(fqn=key, shape=tuple(mp.shape), dtype=dtype_name(mp.dtype),
                                       role="matrix", owner_rank=mp.owner_rank))
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
        out[key] = value
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
    """This rank's optimizer state by FQN (owners only for matrices) and the group layout."""
    fqn_of = param_fqns(model)
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
            mp = runtime.params.get(fqn)
            if not entry or (mp is not None and not writes_matrix(runtime, fqn)):
                continue
            state[fqn] = {k: _check_state_value(fqn, k, v) for k, v in entry.items()}
        optimizer_name = group.get("optimizer")
        groups.append(GroupLayout(
            kind=group.get("kind"),
            optimizer=optimizer_name if isinstance(optimizer_name, str) else None,
            params=tuple(fqns), hyperparams=encode_hyperparams(group),
        ))
    cls = type(optimizer)
    return state, OptimizerLayout(cls=f"{cls.__module__}.{cls.__qualname__}", groups=tuple(groups))


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
    """The model tensors this rank fills in place: tail shards, buffers, owned matrices."""
    wanted = set(fqns)
    targets = {}
    for key, value in owner_state_dict(model, runtime).items():
        if key not in wanted:
            continue
        mp = runtime.params.get(key)
        if mp is not None and not mp.is_owner:
            continue
        targets[prefix + key] = value
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
    """Fresh tensors for the saved optimizer state this rank needs.

    Returns the DCP targets and, per parameter (by id), ``state key -> DCP key``.
    """
    fqn_of = param_fqns(model)
    saved = saved_state_keys(metadata)
    targets: dict[str, torch.Tensor] = {}
    routes: dict[int, dict[str, str]] = {}
    for group in optimizer.param_groups:
        on_device_scalars = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            fqn = fqn_of[id(p)]
            mp = runtime.params.get(fqn)
            if mp is not None and not mp.is_owner:
                continue
            route = routes.setdefault(id(p), {})
            for name in saved.get(fqn, []):
                key = f"optim.state.{fqn}.{name}"
                md = _tensor_md(metadata, key)
                if md is None:
                    continue
                targets[key] = _state_target(p, md, on_device_scalars)
                route[name] = key
    return targets, routes


def install_optimizer_state(
    optimizer: torch.optim.Optimizer, targets: dict[str, torch.Tensor],
    routes: dict[int, dict[str, str]],
) -> None:
    """Replace the optimizer's state with the loaded tensors (in place: inner optimizers share it)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            route = routes.get(id(p))
            if route:
                optimizer.state[p] = {name: targets[key] for name, key in route.items()}
            else:
                optimizer.state.pop(p, None)


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
