"""Small collective helpers that keep every rank's view of a failure in step.

A rank that raises while its peers wait in a collective hangs the job until the process-group
timeout. Every step of a save or load that can fail on one rank alone (building the local state
dict, reading and checking the layout against the model, installing the read state, the
coordinator's file operations) is therefore followed by one integer all-reduce before any rank
enters the next collective: if any rank failed, every rank raises.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CheckpointError

__all__ = ["agree", "dcp_errors", "group_rank", "group_size", "on_coordinator"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if _active() else 0


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if _active() else 1


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(error: BaseException | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Collective: raise on every rank if ``error`` is set on any rank.

    The failing rank re-raises its own exception; the others raise a ``CheckpointError`` naming
    the failing ranks (their logs hold the cause).
    """
    if not _active() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    world = dist.get_world_size(group)
    flags = torch.zeros(world, dtype=torch.int32, device=_device(group))
    if error is not None:
        flags[dist.get_rank(group)] = 1
    dist.all_reduce(flags, group=group)
    failed = [r for r in range(world) if flags[r].item()]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on rank(s) {failed}; see their logs for the cause")


def on_coordinator(fn: Callable[[], T], group: dist.ProcessGroup | None, what: str) -> T | None:
    """Collective: run ``fn`` on rank 0 of ``group`` only; every rank raises if it failed."""
    result: T | None = None
    error: BaseException | None = None
    if group_rank(group) == 0:
        try:
            result = fn()
        except Exception as exc:  # forwarded to every rank by agree()
            logger.exception("matrixfsdp.checkpoint: %s failed on rank 0", what)
            error = exc
    agree(error, group, what)
    return result


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a ``BaseException``) into a ``CheckpointError``.

    DCP already forwards a failure on one rank to every rank; this only makes it catchable with
    ``except Exception`` and names the first failing rank's error.
    """
    try:
        yield
    except CheckpointException as exc:
        failures = exc.failures
        ranks = sorted(failures)
        first = failures[ranks[0]][0] if ranks else exc
        raise CheckpointError(
            f"{what} failed on rank(s) {ranks}: {type(first).__name__}: {first}"
        ) from exc
