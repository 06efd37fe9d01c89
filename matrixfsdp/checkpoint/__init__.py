"""Checkpoints of owner-sharded models: standard DCP directories plus a JSON layout.

``save``/``load`` are collective and reshard to any world size (each new owner reads whole
matrices and their optimizer state; DCP reshards the FSDP2 tail). Saves are atomic: a checkpoint
directory appears only when every rank has finished, so ``latest`` never returns a partial one.
``export_full`` and ``load_full_state_dict`` move weights to and from plain, unsharded state dicts,
Hugging Face model directories (read lazily, each rank reading what it keeps; see
``sources``) and stock FSDP2 DCP checkpoints. ``load_stages`` loads the checkpoints of several
pipeline stages into one model (see [Note: stage checkpoints] in ``stages``).

On disk, ``<path>/`` holds DCP's ``.metadata`` and ``__<rank>_0.distcp`` files, then
``matrixfsdp_layout.json`` (see ``CheckpointLayout``) and the ``COMPLETE`` marker.
"""

from __future__ import annotations

from .core import AsyncSave, load, open_checkpoint, read_layout, save, wait_pending
from .errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from .interop import LoadResult, export_full, load_full_state_dict
from .layout import FORMAT_VERSION, CheckpointLayout
from .stages import load_stages
from .storage import is_complete, latest, remove_checkpoint, step_dir

__all__ = [
    "FORMAT_VERSION",
    "AsyncSave",
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "LoadResult",
    "UnsupportedFormatError",
    "export_full",
    "is_complete",
    "latest",
    "load",
    "load_full_state_dict",
    "load_stages",
    "open_checkpoint",
    "read_layout",
    "remove_checkpoint",
    "save",
    "step_dir",
    "wait_pending",
]
