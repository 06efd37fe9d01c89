"""The owner-segment communication interface and its call/byte counter.

[Note: owner segments]
Within one group, the matrices owned by rank ``r`` packed back to back (in plan order) form
``r``'s *segment*; ``numels[r]`` is its length in elements (0 when ``r`` owns nothing there).
- *all-gather-v*: every rank contributes its own segment and receives every other rank's, with
  no padding to the largest segment (the uneven all-gather FSDP2 cannot express). Given as
  *parts* (``all_gather_into``: each segment as its matrices, the owner's read in place, every
  other rank's written into the storage the caller names), a backend may move them with no
  buffer at all; ``all_gather_v`` takes and returns packed segments.
- *reduce-to-owners*: every rank holds a full-length gradient buffer laid out segment by segment;
  rank ``r`` ends up with the sum over ranks of segment ``r`` only. No other rank keeps a copy.
Both are issued in the same order on every rank (the runtime guarantees it), may be async, and
are counted by phase and mesh dim so tests and benchmarks can assert exact call and byte totals.
Under HSDP they run inside one shard group; the owners' all-reduce over the replicate group is a
``ReplicateComm`` (see [Note: HSDP mesh]).
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = [
    "CommCounter",
    "CommStats",
    "OwnerComm",
    "Pending",
    "Phase",
    "ReplicateComm",
    "comm_phase",
    "current_phase",
]


class Phase(enum.Enum):
    """Training phase a collective is attributed to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"


_phase_local = threading.local()


def current_phase() -> Phase:
    return getattr(_phase_local, "phase", Phase.OTHER)


@contextmanager
def comm_phase(phase: Phase) -> Iterator[None]:
    """Attribute collectives issued inside the block to ``phase``."""
    previous = current_phase()
    _phase_local.phase = phase
    try:
        yield
    finally:
        _phase_local.phase = previous


@dataclass
class CommStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }


def _phases() -> dict[Phase, CommStats]:
    return {phase: CommStats() for phase in Phase}


@dataclass
class CommCounter:
    """Counts collective calls and payload bytes per phase, per operation and per mesh dim.

    ``dim`` names the mesh dim whose process group carried the collective (see [Note: HSDP
    mesh]): ``"shard"`` for owner gathers, reductions and scalar all-reduces (on a flat mesh
    too), ``"replicate"`` for the HSDP all-reduce of owned gradients. An all-reduce records its
    buffer's bytes as sent and received (the payload; a ring moves 2(R-1)/R of it each way).
    """

    by_phase: dict[Phase, CommStats] = field(default_factory=_phases)
    by_op: dict[str, CommStats] = field(default_factory=dict)
    by_dim: dict[str, dict[Phase, CommStats]] = field(default_factory=dict)

    def record(self, op: str, bytes_sent: int, bytes_received: int, *, dim: str = "shard") -> None:
        phase = current_phase()
        per_dim = self.by_dim.setdefault(dim, _phases())[phase]
        for stats in (self.by_phase[phase], self.by_op.setdefault(op, CommStats()), per_dim):
            stats.calls += 1
            stats.bytes_sent += bytes_sent
            stats.bytes_received += bytes_received

    def reset(self) -> None:
        self.by_phase = _phases()
        self.by_op = {}
        self.by_dim = {}

    def snapshot(self, dim: str | None = None) -> dict[str, dict[str, int]]:
        """Per phase: calls and bytes, over every mesh dim or over ``dim`` only."""
        phases = self.by_phase if dim is None else self.by_dim.get(dim, _phases())
        return {phase.value: stats.as_dict() for phase, stats in phases.items()}


class Pending:
    """An issued collective: ``wait()`` blocks until its output buffer is ready.

    ``keepalive`` holds the send/receive buffers until the collective is done.
    """

    def __init__(self, works: Sequence[object] = (), keepalive: Sequence[object] = ()) -> None:
        self._works = list(works)
        self._keepalive = list(keepalive)

    def wait(self) -> None:
        for work in self._works:
            work.wait()  # type: ignore[attr-defined]
        self._works.clear()
        self._keepalive.clear()


class _UnpackOnWait(Pending):
    """A packed all-gather-v whose received segments are copied into their parts on ``wait()``."""

    def __init__(self, pending: Pending, segments: Sequence[torch.Tensor],
                 parts: Sequence[Sequence[torch.Tensor]], rank: int) -> None:
        super().__init__()
        self._pending, self._segments, self._parts, self._rank = pending, segments, parts, rank

    def wait(self) -> None:
        if self._pending is None:
            return
        self._pending.wait()
        for r, (segment, part) in enumerate(zip(self._segments, self._parts, strict=True)):
            if r == self._rank or not part:
                continue
            for t, piece in zip(part, torch.split(segment, [t.numel() for t in part]), strict=True):
                t.copy_(piece)
        self._pending, self._segments, self._parts = None, [], []


class OwnerComm(ABC):
    """Owner-segment collectives over one data-parallel process group."""

    rank: int
    world_size: int
    counter: CommCounter

    @abstractmethod
    def all_gather_v(
        self, own: torch.Tensor, numels: Sequence[int], *, async_op: bool = False
    ) -> tuple[list[torch.Tensor], Pending]:
        """Send ``own`` (this rank's segment) to all; return every rank's segment (own included).

        The returned list holds one 1-D tensor per rank, valid after ``Pending.wait()``.
        """

    def all_gather_into(
        self, parts: Sequence[Sequence[torch.Tensor]], *, async_op: bool = False
    ) -> Pending:
        """All-gather-v by parts: ``parts[r]`` is rank ``r``'s segment as 1-D tensors in plan order;
        this rank's are sent, every other rank's are written (valid after ``Pending.wait()``).

        This default packs this rank's parts, calls ``all_gather_v`` and unpacks on ``wait()``;
        a backend that can address the parts directly overrides it and holds no buffer.
        """
        mine = list(parts[self.rank])
        numels = [sum(t.numel() for t in part) for part in parts]
        if len(mine) == 1:
            own = mine[0]
        elif mine:
            own = torch.cat(mine)
        else:
            like = next(t for part in parts for t in part)
            own = like.new_empty(0)
        segments, pending = self.all_gather_v(own, numels, async_op=async_op)
        unpack = _UnpackOnWait(pending, segments, parts, self.rank)
        if not async_op:
            unpack.wait()
        return unpack

    @abstractmethod
    def reduce_to_owners(
        self, flat: torch.Tensor, numels: Sequence[int], *, async_op: bool = False
    ) -> tuple[torch.Tensor, Pending]:
        """Sum segment ``rank`` of ``flat`` over all ranks; return it (valid after wait())."""

    @abstractmethod
    def all_reduce_scalar(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce a 0-d/1-element tensor in place (``op`` is ``"sum"`` or ``"max"``)."""


class ReplicateComm(ABC):
    """The all-reduce of owned gradients over one HSDP replicate group (see [Note: HSDP mesh])."""

    rank: int
    world_size: int
    counter: CommCounter

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Sum ``tensor`` in place over the replicate group (valid after ``Pending.wait()``)."""
