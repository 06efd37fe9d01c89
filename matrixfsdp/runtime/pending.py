"""The runtime's one queue of issued, unfinished collectives.

[Note: pending work]
Every collective the runtime issues asynchronously becomes one ``PendingWork`` entry in one FIFO
``WorkQueue`` owned by the model's state, and leaves it in exactly one of two ways:
- *finish*: wait for it and consume its output (a gather writes the peers' segments into the
  group's matrices; a reduction computes each owner's averaged gradient, which lands in
  ``.grad`` when the queue is drained, and frees the send and receive buffers);
- *discard*: wait for it and drop its output (a prefetched gather nobody will use: its storage is
  freed). Work whose output must not be lost (a reduction) discards by finishing.
Bounds: at most ``limits[kind]`` entries of each kind are in flight. Pushing one more first
retires (discards) the oldest of that kind, so memory held by in-flight work is bounded by
construction: one prefetched gather (plus the group being computed), one reduction (FSDP2 keeps
one reduce-scatter in flight the same way), one replicate all-reduce. A group's reduction makes room *before* packing its
gradients, so the previous group's buffers are freed before the next ones are allocated.
Waiting is local, so retiring work early or late cannot break the rule that every rank issues
the same collectives in the same order (the one collective a finish issues, below, follows the
FIFO order of reductions on every rank, whenever they are retired).

Under HSDP (see [Note: HSDP mesh]) a reduction's ``finish`` hands each owner its summed
segment and issues one more collective: the all-reduce of that segment over the replicate group
(``ALL_REDUCE``, at most one in flight, issued async and waited when the next one is pushed or at
the end of backward, as FSDP2 overlaps its HSDP all-reduce). Its ``finish`` hands over the owners'
averaged gradients to land. It holds only the owned segment (a copy), never the group's
full reduction buffer. A new kind of asynchronous work is one more ``WorkKind`` with its own
limit, pushed by whatever issues it, so it is bounded and drained like the rest.
Streams (see [Note: streams]): each entry's collective runs on a side stream, and ``event`` is
the event recorded there after its consume step (``None`` on the host, where the consume step
runs inside ``finish``). A gather's ``finish``/``discard`` makes compute wait that event instead
of blocking the host; a reduction's gradients land after the queue is drained, once compute
waited the events of every finished reduction. The queue's order and limits are the same on
every device.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .group import MatrixGroup

__all__ = ["PendingWork", "WorkKind", "WorkQueue"]


class WorkKind(enum.Enum):
    GATHER = "gather"  # a group's owner-segment all-gather-v issued ahead of use (prefetch)
    REDUCE = "reduce"  # a group's reduce-to-owners of its gradients
    ALL_REDUCE = "all_reduce"  # HSDP: owners' reduced gradients summed over the replicate group


@dataclass(eq=False)
class PendingWork:
    """One issued collective of ``group`` and how to retire it (see [Note: pending work])."""

    kind: WorkKind
    group: MatrixGroup  # the group that issued it
    finish: Callable[[], None]
    discard: Callable[[], None] | None = None  # None: discarding means finishing
    event: Any = None  # recorded on its side stream after the consume step (eager streams only)

    def drop(self) -> None:
        (self.discard or self.finish)()


@dataclass
class WorkQueue:
    """FIFO of in-flight work with a per-kind limit; ``peak`` records the most ever in flight."""

    limits: dict[WorkKind, int]
    _entries: deque[PendingWork] = field(default_factory=deque)
    peak: dict[WorkKind, int] = field(default_factory=dict)

    @classmethod
    def with_limits(cls, limits: Mapping[WorkKind, int]) -> WorkQueue:
        for kind, limit in limits.items():
            if limit < 1:
                raise ValueError(f"the in-flight limit of {kind.value} work must be >= 1, got {limit}")
        return cls(dict(limits))

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, kind: WorkKind) -> int:
        return sum(1 for w in self._entries if w.kind is kind)

    def make_room(self, kind: WorkKind) -> None:
        """Retire the oldest ``kind`` entries until one more fits under its limit."""
        while self.count(kind) >= self.limits[kind]:
            oldest = next(w for w in self._entries if w.kind is kind)
            self._entries.remove(oldest)
            oldest.drop()

    def push(self, work: PendingWork) -> None:
        self.make_room(work.kind)
        self._entries.append(work)
        self.peak[work.kind] = max(self.peak.get(work.kind, 0), self.count(work.kind))

    def take(self, kind: WorkKind, group: MatrixGroup) -> PendingWork | None:
        """Remove and return ``group``'s entry of ``kind`` (the caller finishes or discards it)."""
        for work in self._entries:
            if work.kind is kind and work.group is group:
                self._entries.remove(work)
                return work
        return None

    def drain(self) -> None:
        """Retire everything, oldest first: reductions land, prefetched gathers are dropped."""
        while self._entries:
            self._entries.popleft().drop()
