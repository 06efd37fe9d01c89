"""Errors raised by the checkpoint layer; each message names the path, FQN or shape at fault."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "UnsupportedFormatError",
]


class CheckpointError(ValueError):
    """Base class: the checkpoint (or the request to save or load it) cannot be honoured."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path does not exist, or is not a (complete) matrixfsdp checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is missing or unreadable (``.metadata``, the layout JSON)."""


class UnsupportedFormatError(CheckpointError):
    """The layout JSON was written with a format version this release cannot read."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or optimizer (FQNs, shapes, matrix set, optimizer)."""
