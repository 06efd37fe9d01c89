"""Offsets, slots and signals of the one-sided owner collectives: pure Python, no torch, no CUDA.

[Note: one-sided owner schedule]
Vocabulary (segments as in [Note: owner segments]; PE = processing element = the rank in the
data-parallel group):
- The *symmetric heap* has the same size and layout on every PE: ``buffers`` buffers, each of
  ``world - 1`` *slots* of ``slot_bytes`` (the largest segment any collective of the plan moves,
  rounded up to ``ALIGN``). In reader ``r``'s buffer, slot ``slot_of(w, r)`` belongs to writer
  ``w`` alone, so no two writers ever write the same bytes, in one collective or across them.
- *Signal words* (uint64) beside the data: per buffer, one ``ready`` word per slot (bumped by the
  writer's put-with-signal, read by the slot's reader) and one ``credit`` word (bumped by every
  reader that has consumed one of this PE's puts into that buffer).
- Collective number ``k`` (counted per communicator; every PE issues the same collectives in the
  same order, as the runtime guarantees) uses buffer ``k % buffers``. Signal words count up
  forever (uint64 never wraps in practice), so no word is ever reset and a wait is ``>=`` a
  cumulative target that each PE's ``Ledger`` knows without asking anyone.
A collective on one PE is a *program*, run in this order:
1. ``Wait(credit[b], sent[b])``: every earlier put of this PE into buffer ``b`` (at any reader)
   has been consumed, so this PE's slots there may be overwritten (write-after-read safety).
2. ``Put`` per destination (ring order from ``rank + 1``): data into the writer's slot in the
   reader's buffer ``b`` and ``+1`` on that slot's ``ready`` word, delivered after the data.
3. ``Wait(ready[b][slot], received)`` per expected writer: its data has landed.
4. ``Consume``: gather copies each slot out to its segment; reduce sums the owner's per-source
   slots and its own contribution in rank order 0..N-1 (deterministic).
5. ``Ack`` per writer consumed: ``+1`` on the writer's ``credit[b]``.
Every PE's steps run in program order (on one CUDA stream), puts come before waits within a
collective, and a credit wait only depends on collectives ``buffers`` or more earlier, so the
protocol cannot deadlock; ``matrixfsdp.collectives.nvshmem_sim`` checks that, the slot
ownership and the results under random interleavings of all PEs' steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "ALIGN",
    "Ack",
    "Consume",
    "HeapLayout",
    "Ledger",
    "Program",
    "Put",
    "SegmentShape",
    "Wait",
    "gather_program",
    "plan_heap",
    "reduce_program",
    "segment_offsets",
    "slot_of",
]

ALIGN = 128  # bytes: every slot starts on a 128-byte boundary (full-width transactions)


class SegmentShape(NamedTuple):
    """One collective's segment sizes (elements per rank) and element size in bytes."""

    numels: tuple[int, ...]
    itemsize: int


class Wait(NamedTuple):
    word: int
    at_least: int


class Put(NamedTuple):
    """Put ``nbytes`` from byte ``src_offset`` of the send buffer into ``pe``'s heap."""

    src_offset: int
    nbytes: int
    pe: int
    dst_offset: int
    signal_word: int


class Consume(NamedTuple):
    """Read slots of this PE's heap: ``(source rank, heap offset, nbytes)`` in rank order."""

    slots: tuple[tuple[int, int, int], ...]


class Ack(NamedTuple):
    pe: int
    word: int


Action = Wait | Put | Consume | Ack


class Program(NamedTuple):
    kind: str  # "gather" or "reduce"
    buffer: int
    actions: tuple[Action, ...]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def slot_of(source: int, reader: int) -> int:
    """Index of writer ``source``'s slot in reader ``reader``'s buffer (readers have no self slot)."""
    if source == reader:
        raise ValueError(f"PE {reader} has no slot for itself")
    return source - (source > reader)


@dataclass(frozen=True)
class HeapLayout:
    """The symmetric heap: identical on every PE (a pure function of the plan)."""

    world_size: int
    slot_bytes: int
    buffers: int = 2

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"HeapLayout.world_size must be >= 1, got {self.world_size}")
        if self.slot_bytes < ALIGN or self.slot_bytes % ALIGN:
            raise ValueError(
                f"HeapLayout.slot_bytes must be a positive multiple of {ALIGN}, got {self.slot_bytes}"
            )
        if self.buffers < 1:
            raise ValueError(f"HeapLayout.buffers must be >= 1, got {self.buffers}")

    @property
    def slots(self) -> int:
        return max(self.world_size - 1, 1)

    @property
    def data_bytes(self) -> int:
        return self.buffers * self.slots * self.slot_bytes

    @property
    def words_per_buffer(self) -> int:
        return self.slots + 1

    @property
    def signal_words(self) -> int:
        return self.buffers * self.words_per_buffer

    @property
    def total_bytes(self) -> int:
        """Data plus signal words: what the symmetric heap must hold for this communicator."""
        return self.data_bytes + 8 * self.signal_words

    def slot_offset(self, buffer: int, slot: int) -> int:
        return (buffer * self.slots + slot) * self.slot_bytes

    def ready_word(self, buffer: int, slot: int) -> int:
        return buffer * self.words_per_buffer + slot

    def credit_word(self, buffer: int) -> int:
        return buffer * self.words_per_buffer + self.slots

    def fits(self, shape: SegmentShape) -> bool:
        return max(shape.numels, default=0) * shape.itemsize <= self.slot_bytes


def plan_heap(shapes: Iterable[SegmentShape], world_size: int, buffers: int = 2) -> HeapLayout:
    """The smallest layout that carries every collective in ``shapes`` (same on every PE)."""
    largest = 0
    for shape in shapes:
        if len(shape.numels) != world_size:
            raise ValueError(
                f"segment sizes {shape.numels} have {len(shape.numels)} entries, world size is "
                f"{world_size}"
            )
        largest = max(largest, max(shape.numels, default=0) * shape.itemsize)
    return HeapLayout(world_size, _round_up(max(largest, 1), ALIGN), buffers)


def segment_offsets(numels: Sequence[int]) -> list[int]:
    """Start element of each segment in a buffer laid out segment by segment."""
    out, total = [], 0
    for n in numels:
        out.append(total)
        total += n
    return out


@dataclass
class Ledger:
    """One PE's cumulative signal targets, advanced by every program built for it."""

    layout: HeapLayout
    rank: int
    issued: int = 0
    sent: list[int] = field(default_factory=list)  # per buffer: puts by this PE
    received: list[list[int]] = field(default_factory=list)  # per buffer, per slot

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.layout.world_size:
            raise ValueError(f"Ledger.rank {self.rank} outside world of {self.layout.world_size}")
        self.sent = [0] * self.layout.buffers
        self.received = [[0] * self.layout.slots for _ in range(self.layout.buffers)]

    def next_buffer(self) -> int:
        buffer = self.issued % self.layout.buffers
        self.issued += 1
        return buffer


def _ring(rank: int, world: int) -> list[int]:
    return [(rank + i) % world for i in range(1, world)]


def _check(layout: HeapLayout, shape: SegmentShape) -> None:
    if len(shape.numels) != layout.world_size:
        raise ValueError(
            f"segment sizes {tuple(shape.numels)} do not match world size {layout.world_size}"
        )
    if any(n < 0 for n in shape.numels):
        raise ValueError(f"segment sizes must be >= 0, got {tuple(shape.numels)}")
    if not layout.fits(shape):
        raise ValueError(
            f"a segment of {max(shape.numels) * shape.itemsize} bytes exceeds the heap's slot of "
            f"{layout.slot_bytes} bytes"
        )


def _puts(layout: HeapLayout, ledger: Ledger, buffer: int,
          sends: list[tuple[int, int, int]]) -> list[Action]:
    """Credit wait + one put-with-signal per ``(reader, src_offset, nbytes)``."""
    if not sends:
        return []
    actions: list[Action] = []
    if ledger.sent[buffer]:  # nothing to wait for before this PE's first put into the buffer
        actions.append(Wait(layout.credit_word(buffer), ledger.sent[buffer]))
    for reader, src_offset, nbytes in sends:
        slot = slot_of(ledger.rank, reader)
        actions.append(Put(src_offset, nbytes, reader, layout.slot_offset(buffer, slot),
                           layout.ready_word(buffer, slot)))
    ledger.sent[buffer] += len(sends)
    return actions


def _receive(layout: HeapLayout, ledger: Ledger, buffer: int,
             sources: list[tuple[int, int]]) -> list[Action]:
    """Ready waits, one consume, then acks, for ``(writer, nbytes)`` in rank order."""
    if not sources:
        return []
    actions: list[Action] = []
    slots = []
    for writer, nbytes in sources:
        slot = slot_of(writer, ledger.rank)
        ledger.received[buffer][slot] += 1
        actions.append(Wait(layout.ready_word(buffer, slot), ledger.received[buffer][slot]))
        slots.append((writer, layout.slot_offset(buffer, slot), nbytes))
    actions.append(Consume(tuple(slots)))
    actions += [Ack(writer, layout.credit_word(buffer)) for writer, _ in sources]
    return actions


def gather_program(layout: HeapLayout, ledger: Ledger, shape: SegmentShape) -> Program:
    """All-gather-v on PE ``ledger.rank``: send the own segment (send-buffer byte 0) to all."""
    _check(layout, shape)
    me, world, size = ledger.rank, layout.world_size, shape.itemsize
    buffer = ledger.next_buffer()
    own = shape.numels[me] * size
    sends = [(r, 0, own) for r in _ring(me, world)] if own else []
    sources = [(w, shape.numels[w] * size) for w in range(world) if w != me and shape.numels[w]]
    actions = _puts(layout, ledger, buffer, sends) + _receive(layout, ledger, buffer, sources)
    return Program("gather", buffer, tuple(actions))


def reduce_program(layout: HeapLayout, ledger: Ledger, shape: SegmentShape) -> Program:
    """Reduce-to-owners on PE ``ledger.rank``: segment ``r`` of the send buffer goes to ``r``."""
    _check(layout, shape)
    me, world, size = ledger.rank, layout.world_size, shape.itemsize
    buffer = ledger.next_buffer()
    starts = segment_offsets(shape.numels)
    sends = [(r, starts[r] * size, shape.numels[r] * size) for r in _ring(me, world)
             if shape.numels[r]]
    own = shape.numels[me] * size
    sources = [(w, own) for w in range(world) if w != me] if own else []
    actions = _puts(layout, ledger, buffer, sends) + _receive(layout, ledger, buffer, sources)
    return Program("reduce", buffer, tuple(actions))
