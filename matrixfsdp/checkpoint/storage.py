"""Checkpoint directories on disk: safe metadata reads, atomic publication, discovery.

[Note: atomic checkpoints]
- Every rank writes into a hidden temporary sibling ``<parent>/.<name>.tmp``; the coordinator
  then writes the layout JSON and, last, the ``COMPLETE`` marker, and renames the directory to
  ``<name>`` (one ``rename`` on the same filesystem). A save that dies at any point leaves at most a
  hidden ``.tmp`` directory, which the next save to that path removes; ``latest()`` only looks at
  visible directories holding ``COMPLETE``, ``.metadata`` and the layout.
- Replacing an existing checkpoint renames it to ``.<name>.old`` first and deletes it after the
  new one is in place. A save killed between those two renames leaves ``<name>`` missing and the
  previous checkpoint, complete, under ``.<name>.old``: ``latest()`` counts it in that case (and
  only then), and the next save to ``<name>`` renames it back first. No moment of a replacement
  leaves ``latest()`` without the newest checkpoint that was complete before it began.
- ``remove_checkpoint`` renames a checkpoint to a hidden ``.<name>.deleting`` before deleting
  it, so a deletion killed half-way never leaves a visible, partly deleted checkpoint.

[Note: reading DCP metadata without arbitrary unpickling]
DCP stores ``.metadata`` as a pickle. ``read_metadata`` unpickles it with an allow-list of the
classes DCP's metadata is made of (its dataclasses, ``torch.Size``, dtypes, the layout helper and
``pathlib`` paths); any other global raises ``CorruptCheckpointError``. ``SafeFileSystemReader``
is DCP's ``FileSystemReader`` with that reader plugged in; the tensor data itself is read by DCP
with ``torch.load(weights_only=True)``. Byte (pickled object) entries are never requested.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .layout import COMPLETE_FILE, LAYOUT_FILE, CheckpointLayout, CompleteMarker, parse_marker

__all__ = [
    "METADATA_FILE",
    "SafeFileSystemReader",
    "check_data_files",
    "is_complete",
    "latest",
    "old_sibling",
    "prepare_target",
    "publish",
    "read_marker",
    "read_metadata",
    "remove_checkpoint",
    "require_checkpoint",
    "step_dir",
    "tmp_sibling",
]

logger = logging.getLogger(__name__)

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint directory ``path``, read with the allow-list."""
    file = Path(path) / METADATA_FILE
    if not file.is_file():
        raise CorruptCheckpointError(
            f"{path}: the DCP metadata file '{METADATA_FILE}' is missing; the checkpoint is "
            "incomplete or damaged"
        )
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{file}: unreadable DCP metadata ({type(exc).__name__}: {exc}); the checkpoint is "
            "damaged or was not written by torch.distributed.checkpoint"
        ) from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(
            f"{file}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


def check_data_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata points to exists and is long enough (checked before reading).

    A missing or truncated ``.distcp`` file would otherwise fail half-way through a load, after
    some tensors were already overwritten.
    """
    needed: dict[str, int] = {}
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        relative = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[relative] = max(needed.get(relative, 0), end)
    root = Path(path).resolve()
    for relative, end in sorted(needed.items()):
        file = (root / relative).resolve()
        if root not in file.parents:
            raise CorruptCheckpointError(f"{path}: the DCP metadata points outside the checkpoint "
                                         f"({relative!r})")
        size = file.stat().st_size if file.is_file() else -1
        if size < end:
            state = "is missing" if size < 0 else f"has {size} bytes, {end} expected"
            raise CorruptCheckpointError(f"{path}: data file {relative!r} {state}")


class SafeFileSystemReader(FileSystemReader):
    """DCP ``FileSystemReader`` whose ``.metadata`` goes through the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(str(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


# -- names -----------------------------------------------------------------------------------------
def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The conventional directory of the checkpoint at ``step``: ``root/step_00000100``."""
    if int(step) < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return Path(root) / f"step_{int(step):08d}"


def tmp_sibling(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp"


def old_sibling(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


# -- discovery -------------------------------------------------------------------------------------
def read_marker(path: Path) -> CompleteMarker | None:
    """The ``COMPLETE`` marker of ``path`` if it is a complete checkpoint, else None."""
    path = Path(path)
    marker = path / COMPLETE_FILE
    if not (marker.is_file() and (path / METADATA_FILE).is_file() and (path / LAYOUT_FILE).is_file()):
        return None
    try:
        return parse_marker(marker.read_bytes())
    except OSError:
        return None


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a published, complete matrixfsdp checkpoint."""
    return read_marker(Path(path)) is not None


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint under ``root`` with the highest step (None if there is none).

    Hidden directories (in-flight or crashed saves) and directories without the ``COMPLETE``
    marker never count, except ``.<name>.old`` while ``<name>`` is missing (a replacement killed
    half-way, see [Note: atomic checkpoints]); ties on the step go to the lexically last name.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, str] | None = None
    best_path: Path | None = None
    for child in root.iterdir():
        if not child.is_dir() or (child.name.startswith(".") and _replaced_name(child) is None):
            continue
        marker = read_marker(child)
        if marker is None:
            continue
        key = (marker.step, child.name)
        if best is None or key > best:
            best, best_path = key, child
    return best_path


def _replaced_name(hidden: Path) -> Path | None:
    """``<name>`` for a ``.<name>.old`` whose ``<name>`` is missing (an interrupted replace)."""
    name = hidden.name
    if not (name.startswith(".") and name.endswith(".old")) or len(name) <= len("..old"):
        return None
    visible = hidden.parent / name[1 : -len(".old")]
    return None if visible.exists() else visible


# -- writing ---------------------------------------------------------------------------------------
def prepare_target(path: Path) -> Path:
    """Coordinator: check ``path`` may be (over)written, make a fresh temporary sibling."""
    old = old_sibling(path)
    if not path.exists() and is_complete(old):
        logger.warning("matrixfsdp.checkpoint: restoring %s from %s (an interrupted replace)",
                       path, old)
        os.rename(old, path)
    if path.exists() and not (path.is_dir() and (is_complete(path) or not any(path.iterdir()))):
        raise CheckpointError(
            f"refusing to save to {path}: it exists and is not a matrixfsdp checkpoint (nor an "
            "empty directory); choose another path"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(path)
    if tmp.exists():
        logger.warning("matrixfsdp.checkpoint: removing %s left by an interrupted save", tmp)
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _write_synced(file: Path, data: str) -> None:
    with open(file, "w", encoding="utf-8") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(tmp: Path, path: Path, layout: CheckpointLayout) -> None:
    """Coordinator, after every rank finished writing: layout, marker, then the rename."""
    _write_synced(tmp / LAYOUT_FILE, layout.model_dump_json())
    marker = CompleteMarker(step=layout.step)
    _write_synced(tmp / COMPLETE_FILE, marker.model_dump_json())
    _fsync_dir(tmp)
    old = old_sibling(path)
    if old.exists():
        shutil.rmtree(old)
    replaced = path.exists()
    if replaced:
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if replaced:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("matrixfsdp.checkpoint: saved step %d to %s", layout.step, path)


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint directory; it turns hidden first, so no half-deleted one stays visible."""
    path = Path(path)
    trash = path.parent / f".{path.name}.deleting"
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def require_checkpoint(path: Path) -> None:
    """Raise ``CheckpointNotFoundError`` unless ``path`` looks like a published checkpoint."""
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint directory; for a full state dict file use "
            "matrixfsdp.checkpoint.load_full_state_dict"
        )
    if not (path / LAYOUT_FILE).is_file():
        hint = (
            "it is a DCP checkpoint without a matrixfsdp layout: load its weights with "
            "matrixfsdp.checkpoint.load_full_state_dict"
            if (path / METADATA_FILE).is_file()
            else "no layout, no DCP metadata"
        )
        raise CheckpointNotFoundError(f"{path} is not a matrixfsdp checkpoint ({hint})")
    if not (path / COMPLETE_FILE).is_file():
        raise CorruptCheckpointError(
            f"{path}: the '{COMPLETE_FILE}' marker is missing; the checkpoint was not published "
            "by a finished save"
        )
