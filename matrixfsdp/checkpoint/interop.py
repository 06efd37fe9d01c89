"""Full (unsharded) state dicts in and out: export a checkpoint, import plain or stock-FSDP2 weights.

- ``export_full`` (one process, no process group): every model tensor of a checkpoint, whole,
  under its plain FQN, to a ``.safetensors`` file or a ``torch.save`` file. The result loads into
  the unwrapped model with ``load_state_dict(strict=True)``.
- ``load_full_state_dict`` (collective): weights from a plain full state dict (a mapping, a
  ``torch.save`` file read with ``weights_only=True``, a ``.safetensors`` file) or from any DCP
  directory (a stock FSDP2 checkpoint or a matrixfsdp one) into a wrapped model. Owners copy
  their matrices, every rank its tail shards; nothing is communicated for in-memory sources.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from ..api import get_state
from ..runtime import MatrixFSDPState
from ._compat import names
from ._dist import dcp_errors
from ._statedict import mesh_group, model_targets
from .core import open_checkpoint
from .errors import CheckpointMismatchError, CheckpointNotFoundError, CorruptCheckpointError
from .storage import METADATA_FILE, SafeFileSystemReader, check_data_files, read_metadata

__all__ = ["LoadResult", "export_full", "load_full_state_dict"]

logger = logging.getLogger(__name__)

DCP_PREFIXES = ("model.", "", "app.model.", "module.")


class LoadResult(NamedTuple):
    """Entries skipped by a non-strict ``load_full_state_dict``."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _dtype(name: str, path: Path) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{path}: unknown dtype {name!r} in the layout")
    return dtype


# -- export ----------------------------------------------------------------------------------------
def export_full(
    path: str | os.PathLike[str], out_file: str | os.PathLike[str]
) -> Path:
    """Write the checkpoint's model as one full state dict; returns the written file.

    ``out_file`` ending in ``.safetensors`` is written with safetensors (package needed), any
    other name with ``torch.save`` (a dict of tensors, loadable with ``weights_only=True``).
    Single process: needs no process group and reads only the model tensors.
    """
    path, out = Path(path), Path(out_file)
    layout, _ = open_checkpoint(path)
    targets = {"model." + e.fqn: torch.empty(e.shape, dtype=_dtype(e.dtype, path))
               for e in layout.model}
    with warnings.catch_warnings(), dcp_errors(f"reading {path}"):
        warnings.simplefilter("ignore")  # DCP warns that no_dist means a single process
        dcp.load(targets, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    full = {e.fqn: targets["model." + e.fqn] for e in layout.model}
    tmp = out.parent / f".{out.name}.tmp"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise ImportError("export to .safetensors needs `pip install safetensors`") from exc
        save_file(full, str(tmp), metadata={"format": "pt", "step": str(layout.step)})
    else:
        torch.save(full, tmp)
    os.replace(tmp, out)
    logger.info("matrixfsdp.checkpoint: exported %d tensors of %s to %s", len(full), path, out)
    return out


# -- import ----------------------------------------------------------------------------------------
def _read_file(path: Path) -> Mapping[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{path}: not a readable torch.save file of tensors ({type(exc).__name__}: {exc})"
        ) from exc
    for key in ("model", "state_dict"):  # {"model": state_dict} wrappers
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
    if not isinstance(loaded, dict):
        raise CorruptCheckpointError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    return loaded


def _match_keys(
    wanted: dict[str, tuple[int, ...]], available: dict[str, tuple[int, ...]], source: str,
    strict: bool,
) -> LoadResult:
    missing = sorted(set(wanted) - set(available))
    unexpected = sorted(set(available) - set(wanted))
    problems = [f"{k!r}: source shape {list(available[k])}, model shape {list(wanted[k])}"
                for k in wanted if k in available and tuple(available[k]) != tuple(wanted[k])]
    text = []
    if problems:
        text.append("shape mismatch: " + "; ".join(problems))
    if strict and missing:
        text.append(f"the source lacks {len(missing)} entries of the model: {names(missing)}")
    if strict and unexpected:
        text.append(f"the source holds {len(unexpected)} entries the model lacks: "
                    f"{names(unexpected)}")
    if text:
        raise CheckpointMismatchError(f"cannot load {source} into this model:\n - "
                                      + "\n - ".join(text))
    return LoadResult(missing, unexpected)


def _model_shapes(model: nn.Module, runtime: MatrixFSDPState) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, value in model.state_dict().items():
        mp = runtime.params.get(key)
        out[key] = tuple(mp.shape) if mp is not None else tuple(value.shape)
    return out


@torch.no_grad()
def _copy_from_full(model: nn.Module, runtime: MatrixFSDPState,
                    full: Mapping[str, torch.Tensor], keys: set[str]) -> None:
    for key, target in model.state_dict().items():
        if key not in keys:
            continue
        mp = runtime.params.get(key)
        if mp is not None and not mp.is_owner:
            continue
        value = full[key].to(device=target.device, dtype=target.dtype)
        if isinstance(target, DTensor):
            shard = distribute_tensor(value, target.device_mesh, target.placements,
                                      src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(value)


def _detect_prefix(metadata: Metadata, wanted: dict[str, tuple[int, ...]], path: Path) -> str:
    saved = {k for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    hits = {p: sum(p + k in saved for k in wanted) for p in DCP_PREFIXES}
    prefix = max(DCP_PREFIXES, key=lambda p: hits[p])  # first prefix wins a tie
    if hits[prefix] == 0:
        raise CheckpointMismatchError(
            f"{path}: no tensor of the model found under any of the key prefixes "
            f"{list(DCP_PREFIXES)}; saved tensors include {names(saved, 6)}"
        )
    return prefix


def _load_dcp_dir(model: nn.Module, runtime: MatrixFSDPState, path: Path,
                  strict: bool) -> LoadResult:
    metadata = read_metadata(path)
    check_data_files(path, metadata)
    wanted = _model_shapes(model, runtime)
    prefix = _detect_prefix(metadata, wanted, path)
    available = {k[len(prefix):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                 if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)
                 and k[len(prefix):] in wanted}
    result = _match_keys(wanted, available, str(path), strict)
    targets = model_targets(model, runtime, available, prefix=prefix)
    with torch.no_grad(), dcp_errors(f"reading {path}"):
        dcp.load(targets, storage_reader=SafeFileSystemReader(str(path)),
                 process_group=mesh_group(runtime))
    return result


def load_full_state_dict(
    model: nn.Module,
    source: Mapping[str, torch.Tensor] | str | os.PathLike[str],
    *,
    strict: bool = True,
) -> LoadResult:
    """Load unsharded weights into a wrapped model (collective for DCP directories).

    ``source`` is a full state dict of the *unwrapped* model (every rank passes the whole dict,
    e.g. loaded with ``mmap=True``), a ``torch.save``/``.safetensors`` file of one, or a DCP
    directory: a stock FSDP2 checkpoint saved as ``{"model": model.state_dict()}`` (keys prefixed
    ``model.``, ``app.model.``, ``module.`` or none) or a matrixfsdp checkpoint. Only weights are
    loaded. Raises ``CheckpointMismatchError`` for shape mismatches and, with ``strict``, for
    missing or unexpected entries (all checked before anything is written).
    """
    runtime = get_state(model)
    if not isinstance(source, Mapping):
        path = Path(source)
        if not path.exists():
            raise CheckpointNotFoundError(f"{path} does not exist")
        if path.is_dir():
            if not (path / METADATA_FILE).is_file():
                raise CheckpointNotFoundError(
                    f"{path} is a directory without DCP '{METADATA_FILE}': not a checkpoint"
                )
            return _load_dcp_dir(model, runtime, path, strict)
        source_name = str(path)
        full: Mapping[str, Any] = _read_file(path)
    else:
        source_name, full = "the given state dict", source
    wanted = _model_shapes(model, runtime)
    bad = [k for k, v in full.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointMismatchError(f"{source_name}: non-tensor entries {names(bad)}")
    result = _match_keys(wanted, {k: tuple(v.shape) for k, v in full.items()}, source_name, strict)
    _copy_from_full(model, runtime, full, set(wanted) & set(full))
    return result
