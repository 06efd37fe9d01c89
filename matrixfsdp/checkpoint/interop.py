"""Full (unsharded) state dicts in and out: export a checkpoint, import plain, HF or FSDP2 weights.

- ``export_full`` (one process, no process group): every model tensor of a checkpoint, whole,
  under its plain FQN, to a ``.safetensors`` file or a ``torch.save`` file. The result loads into
  the unwrapped model with ``load_state_dict(strict=True)``.
- ``load_full_state_dict``: weights from a plain full state dict (a mapping, a ``torch.save``
  file, a ``.safetensors`` file), a Hugging Face model directory, or any DCP directory (a stock
  FSDP2 checkpoint or a matrixfsdp one) into a wrapped model. Files are read lazily (see
  ``[Note: lazy tensor sources]``): owners read their matrices, every rank the rows of its tail
  shards, and nothing is communicated except for DCP directories.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..api import get_state
from ..runtime import MatrixFSDPState
from ..runtime.state_dict_view import owner_state_dict
from ._compat import names
from ._dist import agree, dcp_errors
from ._statedict import mesh_group, model_targets
from ._streaming import alias_groups, copy_reads, plan_reads
from .core import open_checkpoint
from .errors import CheckpointMismatchError, CheckpointNotFoundError, CorruptCheckpointError
from .sources import HF_FILES, MappingSource, TensorInfo, TensorSource, open_file, open_hf_dir
from .storage import METADATA_FILE, SafeFileSystemReader, check_data_files, read_metadata

__all__ = ["DCP_PREFIXES", "FILE_PREFIXES", "KeyMap", "LoadResult", "export_full",
           "load_full_state_dict"]

logger = logging.getLogger(__name__)

DCP_PREFIXES = ("model.", "", "app.model.", "module.")
"""Key prefixes of a DCP directory's model entries (the one matching most model keys is used)."""
FILE_PREFIXES = ("", "model.", "transformer.", "module.", "_orig_mod.")
"""Prefixes a file or mapping source's keys may carry beyond the model's (see
``load_full_state_dict``)."""

KeyMap = Callable[[str], "str | None"]


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


# -- import: matching a source to the model --------------------------------------------------------
class _Wanted(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _model_entries(model: nn.Module, runtime: MatrixFSDPState) -> dict[str, _Wanted]:
    """Every state-dict key of the wrapped model with its global shape and dtype."""
    out = {}
    for key, value in owner_state_dict(model, runtime).items():
        mp = runtime.params.get(key)
        if mp is not None:
            out[key] = _Wanted(mp.global_shape, mp.dtype)
        else:
            out[key] = _Wanted(tuple(value.shape), value.dtype)
    return out


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def _rename(available: list[str], wanted: dict[str, _Wanted], key_map: KeyMap | None,
            source: str) -> dict[str, str]:
    """``model key -> source key`` (see ``load_full_state_dict`` for the rules)."""
    if key_map is not None:
        renamed = [(key_map(k), k) for k in available]
    else:
        hits = {p: sum(_strip(k, p) in wanted for k in available) for p in FILE_PREFIXES}
        prefix = max(FILE_PREFIXES, key=lambda p: hits[p])  # the first prefix wins a tie
        if wanted and available and hits[prefix] == 0:
            raise CheckpointMismatchError(
                f"{source}: no tensor of the model found, with or without the key prefixes "
                f"{list(FILE_PREFIXES[1:])}; the source holds {names(available, 6)}, the model "
                f"wants {names(wanted, 6)} (pass key_map= to rename)"
            )
        renamed = [(_strip(k, prefix), k) for k in available]
    out: dict[str, str] = {}
    for new, old in renamed:
        if new is None:
            continue
        if new in out:
            raise CheckpointMismatchError(
                f"{source}: both {out[new]!r} and {old!r} map to the model key {new!r}"
            )
        out[new] = old
    return out


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating-point"
    return "bool" if dtype == torch.bool else "integer"


def _check_source(wanted: dict[str, _Wanted], infos: dict[str, TensorInfo],
                  renamed: dict[str, str], source: str, strict: bool,
                  aliases: dict[str, list[str]]) -> LoadResult:
    """Raise ``CheckpointMismatchError`` listing every problem; returns what is skipped.

    A key absent from the source is not missing when a tied name of the same parameter is there.
    """
    missing = sorted(k for k in wanted if not any(a in renamed for a in aliases.get(k, [k])))
    unexpected = sorted(source_key for key, source_key in renamed.items() if key not in wanted)
    problems, casts = [], []
    for key in wanted:
        if key not in renamed:
            continue
        info, want = infos[renamed[key]], wanted[key]
        where = f"{key!r} ({info.file}" + (")" if renamed[key] == key else f" as {renamed[key]!r})")
        if info.shape != want.shape:
            problems.append(f"{where}: source shape {list(info.shape)}, model shape "
                            f"{list(want.shape)}")
        elif _kind(info.dtype) != _kind(want.dtype):
            problems.append(f"{where}: source dtype {info.dtype}, model dtype {want.dtype} "
                            f"({_kind(info.dtype)} into {_kind(want.dtype)})")
        elif info.dtype != want.dtype:
            casts.append(f"{key} ({info.dtype} -> {want.dtype})")
    text = ["mismatch: " + "; ".join(problems)] if problems else []
    if strict and missing:
        text.append(f"the source lacks {len(missing)} entries of the model: {names(missing)}")
    if strict and unexpected:
        text.append(f"the source holds {len(unexpected)} entries the model lacks: "
                    + _with_files(unexpected, infos))
    if text:
        raise CheckpointMismatchError(
            f"cannot load {source} into this model:\n - " + "\n - ".join(text)
            + ("\n(strict=False skips missing and unexpected entries)" if missing or unexpected
               else "")
        )
    if casts:
        logger.warning("matrixfsdp.checkpoint: %d tensors of %s are cast on load: %s",
                       len(casts), source, names(casts, 4))
    return LoadResult(missing, unexpected)


def _with_files(keys: list[str], infos: dict[str, TensorInfo], limit: int = 12) -> str:
    shown = ", ".join(f"{k!r} ({infos[k].file})" for k in keys[:limit])
    more = len(keys) - limit
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def _read_keys(wanted: dict[str, _Wanted], renamed: dict[str, str],
               aliases: dict[str, list[str]]) -> dict[str, str]:
    """``model key -> source key`` to read: each (tied) parameter once, under its first name."""
    reads, seen = {}, set()
    for key, source_key in renamed.items():
        group = tuple(aliases.get(key, [key]))
        if key in wanted and group not in seen:
            seen.add(group)
            reads[key] = source_key
    return reads


# -- import: loading -------------------------------------------------------------------------------
def _detect_prefix(metadata: Metadata, wanted: dict[str, _Wanted], path: Path) -> str:
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


class _Prepared(NamedTuple):
    """A checked load: what it returns and how it reads (``read()`` writes the model)."""

    result: LoadResult
    read: Callable[[], None]
    name: str


def _prepare_dcp_dir(model: nn.Module, runtime: MatrixFSDPState, path: Path,
                     strict: bool) -> _Prepared:
    metadata = read_metadata(path)
    check_data_files(path, metadata)
    wanted = _model_entries(model, runtime)
    prefix = _detect_prefix(metadata, wanted, path)
    infos = {k[len(prefix):]: TensorInfo(tuple(v.size), v.properties.dtype, str(path))
             for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)
             and k[len(prefix):] in wanted}
    result = _check_source(wanted, infos, {k: k for k in infos}, str(path), strict, {})
    targets = model_targets(model, runtime, infos, prefix=prefix)

    def read() -> None:  # collective: DCP plans the reads (and forwards its own failures)
        with torch.no_grad(), dcp_errors(f"reading {path}"):
            dcp.load(targets, storage_reader=SafeFileSystemReader(str(path)),
                     process_group=mesh_group(runtime))
    return _Prepared(result, read, str(path))


def _open_source(path: Path) -> TensorSource | None:
    """A lazy source for a file or a Hugging Face directory; None for a DCP directory."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        return open_file(path)
    if (path / METADATA_FILE).is_file():
        return None
    source = open_hf_dir(path)
    if source is None:
        raise CheckpointNotFoundError(
            f"{path} is a directory without DCP '{METADATA_FILE}' nor any of the Hugging Face "
            f"weight files {list(HF_FILES)}: not a checkpoint"
        )
    return source


def _prepare_source(model: nn.Module, runtime: MatrixFSDPState, source: TensorSource,
                    strict: bool, key_map: KeyMap | None) -> _Prepared:
    infos = source.infos()  # metadata only: headers, index, mmap'd pickles
    wanted = _model_entries(model, runtime)
    renamed = _rename(list(infos), wanted, key_map, source.name)
    aliases = alias_groups(model)
    result = _check_source(wanted, infos, renamed, source.name, strict, aliases)
    reads = plan_reads(model, runtime, _read_keys(wanted, renamed, aliases))

    def read() -> None:
        copy_reads(source, reads)
        logger.info("matrixfsdp.checkpoint: loaded %d tensors from %s (%d read on this rank, "
                    "%.1f MiB)", len(wanted) - len(result.missing_keys), source.name, len(reads),
                    sum(r.target.numel() * r.target.element_size() for r in reads) / 2**20)
    return _Prepared(result, read, source.name)


def _prepare(model: nn.Module, runtime: MatrixFSDPState,
             source: Mapping[str, torch.Tensor] | str | os.PathLike[str], strict: bool,
             key_map: KeyMap | None, opened: list[TensorSource]) -> _Prepared:
    """Open and check ``source`` (nothing written); lazy sources opened go in ``opened``."""
    if isinstance(source, Mapping):
        opened.append(MappingSource(source))
    else:
        path = Path(source)
        lazy = _open_source(path)
        if lazy is None:
            if key_map is not None:
                raise NotImplementedError(
                    f"{path}: key_map applies to files, mappings and Hugging Face directories, "
                    "not to DCP checkpoints"
                )
            return _prepare_dcp_dir(model, runtime, path, strict)
        opened.append(lazy)
    return _prepare_source(model, runtime, opened[0], strict, key_map)


def load_full_state_dict(
    model: nn.Module,
    source: Mapping[str, torch.Tensor] | str | os.PathLike[str],
    *,
    strict: bool = True,
    key_map: KeyMap | None = None,
) -> LoadResult:
    """Load unsharded weights into a wrapped model; each rank reads only what it keeps.

    ``source`` is one of:

    - a full state dict of the *unwrapped* model (every rank passes the whole mapping, e.g.
      loaded with ``mmap=True``);
    - a ``.safetensors`` file or a ``torch.save`` file of one (read lazily: ``safe_open``,
      ``torch.load(mmap=True, weights_only=True)``);
    - a Hugging Face model directory: ``model.safetensors``, or
      ``model.safetensors.index.json`` plus its shards (``pytorch_model.bin[.index.json]`` too);
    - a DCP directory: a stock FSDP2 checkpoint saved as ``{"model": model.state_dict()}``
      (keys prefixed ``model.``, ``app.model.``, ``module.`` or none) or a matrixfsdp one
      (collective: DCP plans the reads).

    Collective. For mappings, files and Hugging Face directories no tensor is communicated: two
    4-byte-per-rank all-reduces make a failure on one rank (a corrupt or missing file there, a
    model that differs) an error on every rank: after the checks, before anything is written,
    and after the reads (the failing rank raises its own error, the others a
    ``CheckpointError`` naming it). An owner reads its matrices whole, every rank the rows of its FSDP2 shards and the buffers, one tensor at a
    time, so the extra memory is about one tensor (see ``[Note: what each rank reads in a
    full-weight load]``).

    Key names: a source key matches the model key of the same name. Without ``key_map``, one
    prefix among ``FILE_PREFIXES`` (``model.``, ``transformer.``, ``module.``, ``_orig_mod.``) may
    be stripped from the source keys that carry it, the one matching the most model keys (none
    wins a tie); keys without it are kept as they are (Hugging Face's ``lm_head.weight`` beside
    ``model.layers...``). ``key_map(source_key) -> model key or None`` (None: skip) replaces that
    rule. A tied parameter is read once, and is not missing when any of its names is present.

    Before any parameter is written, everything is checked against the source's metadata alone
    (safetensors headers, the index): a missing file or an index naming a tensor its shard lacks
    (``CheckpointNotFoundError``/``CheckpointMismatchError``), shape or dtype-kind mismatches and,
    with ``strict``, missing or unexpected entries (``CheckpointMismatchError``), each naming the
    file and the key. Floating-point tensors of another precision are cast (logged), like
    ``nn.Module.load_state_dict`` does. Returns the skipped keys: ``missing_keys`` in the
    model's names, ``unexpected_keys`` in the source's.
    """
    runtime = get_state(model)
    group = mesh_group(runtime)
    opened: list[TensorSource] = []
    prepared: _Prepared | None = None
    error: BaseException | None = None
    try:
        prepared = _prepare(model, runtime, source, strict, key_map, opened)
    except Exception as exc:  # forwarded: no rank writes a parameter while another failed
        error = exc
    what = source if isinstance(source, (str, os.PathLike)) else "the state dict"
    try:
        agree(error, group, f"checking {what} against the model")
        assert prepared is not None  # agree() raised otherwise
        runtime.quiesce()  # nothing in flight may read a parameter this load writes
        try:
            prepared.read()
        except Exception as exc:  # forwarded: no rank trains on while another failed
            error = exc
        agree(error, group, f"reading {prepared.name}")
    finally:
        for lazy in opened:
            lazy.close()
    return prepared.result
