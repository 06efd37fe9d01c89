"""CPU stand-ins for NVSHMEM: run the one-sided owner schedule for N fake PEs with plain tensors.

- ``simulate`` runs every PE's programs (see [Note: one-sided owner schedule]) one step at a time
  in a seeded random interleaving, as if each PE's stream ran at its own speed. It fails loudly on
  a put into a slot whose previous data was not yet consumed, a consume of a slot that holds
  anything but the expected collective's data from the expected writer, a put outside the
  writer's own slot, or a deadlock.
- ``ThreadedWorld`` gives each PE a ``SymmetricTransport`` whose waits block (one thread per PE),
  so ``NvshmemOwnerComm`` itself runs unchanged on CPU.
Both consume received slots with the backend's own ``consume_gather`` / ``consume_reduce``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .nvshmem_backend import consume_gather, consume_reduce
from .nvshmem_schedule import (
    Ack,
    Consume,
    HeapLayout,
    Ledger,
    Put,
    SegmentShape,
    Wait,
    gather_program,
    reduce_program,
    slot_of,
)

__all__ = ["Call", "ScheduleViolationError", "SimTransport", "ThreadedWorld", "simulate"]


class ScheduleViolationError(AssertionError):
    """The schedule let two writes collide, read stale data, or deadlocked."""


@dataclass(frozen=True)
class Call:
    """One collective: a gather (``inputs[r]`` = rank r's own segment) or a reduction
    (``inputs[r]`` = rank r's full flat buffer, laid out by ``numels``)."""

    kind: str
    inputs: Sequence[torch.Tensor]
    numels: tuple[int, ...]

    @classmethod
    def gather(cls, inputs: Sequence[torch.Tensor]) -> Call:
        return cls("gather", list(inputs), tuple(t.numel() for t in inputs))

    @classmethod
    def reduce(cls, flats: Sequence[torch.Tensor], numels: Sequence[int]) -> Call:
        return cls("reduce", list(flats), tuple(numels))

    def shape(self) -> SegmentShape:
        return SegmentShape(self.numels, self.inputs[0].element_size())


class _Pe:
    def __init__(self, layout: HeapLayout, rank: int) -> None:
        self.heap = torch.zeros(layout.data_bytes, dtype=torch.uint8)
        self.signals = [0] * layout.signal_words
        self.steps: list[tuple[int, Any, Any, Any]] = []  # (call, action, send bytes, consume)
        self.next = 0


def simulate(layout: HeapLayout, calls: Sequence[Call], seed: int = 0) -> list[list[Any]]:
    """Run ``calls`` on ``layout.world_size`` PEs; per call, per rank: its result.

    A gather's result is the list of segments, a reduction's the rank's own summed segment.
    """
    world = layout.world_size
    pes = [_Pe(layout, r) for r in range(world)]
    results: list[list[Any]] = [[None] * world for _ in calls]
    for r, pe in enumerate(pes):
        ledger = Ledger(layout, r)
        for index, call in enumerate(calls):
            _queue(pe, ledger, index, call, results, layout)
    filled: dict[tuple[int, int], tuple[int, int]] = {}  # (pe, global slot) -> (call, writer)
    rng = random.Random(seed)
    while True:
        runnable = [r for r, pe in enumerate(pes) if pe.next < len(pe.steps) and _ready(pe)]
        if not runnable:
            stuck = [r for r, pe in enumerate(pes) if pe.next < len(pe.steps)]
            if stuck:
                raise ScheduleViolationError(f"deadlock: PEs {stuck} wait forever")
            return results
        r = rng.choice(runnable)
        _step(pes, r, filled, layout)


def _queue(pe: _Pe, ledger: Ledger, index: int, call: Call, results: list[list[Any]],
           layout: HeapLayout) -> None:
    r, shape = ledger.rank, call.shape()
    if call.kind == "gather":
        program = gather_program(layout, ledger, shape)
        own = call.inputs[r]
        segments = [own if s == r else own.new_empty(n) for s, n in enumerate(shape.numels)]
        results[index][r] = segments
        send = own.contiguous().view(torch.uint8)

        def consume(slots: Any, heap: torch.Tensor = pe.heap) -> None:
            consume_gather(heap, slots, segments)
    else:
        program = reduce_program(layout, ledger, shape)
        flat = call.inputs[r].clone()
        start = sum(shape.numels[:r])
        own = flat[start : start + shape.numels[r]]
        results[index][r] = own
        send = flat.view(torch.uint8)

        def consume(slots: Any, heap: torch.Tensor = pe.heap) -> None:
            consume_reduce(heap, slots, own, r)
    pe.steps += [(index, action, send, consume) for action in program.actions]


def _ready(pe: _Pe) -> bool:
    action = pe.steps[pe.next][1]
    return not isinstance(action, Wait) or pe.signals[action.word] >= action.at_least


def _step(pes: list[_Pe], r: int, filled: dict[tuple[int, int], tuple[int, int]],
          layout: HeapLayout) -> None:
    pe = pes[r]
    index, action, send, consume = pe.steps[pe.next]
    pe.next += 1
    if isinstance(action, Put):
        slot, within = divmod(action.dst_offset, layout.slot_bytes)
        if within or action.nbytes > layout.slot_bytes:
            raise ScheduleViolationError(f"PE {r} puts {action} outside a slot")
        if slot % layout.slots != slot_of(r, action.pe):
            raise ScheduleViolationError(f"PE {r} writes slot {slot} of PE {action.pe}, not its own")
        key = (action.pe, slot)
        if key in filled:
            raise ScheduleViolationError(
                f"call {index}: PE {r} overwrites slot {slot} of PE {action.pe} holding "
                f"unconsumed data {filled[key]}"
            )
        filled[key] = (index, r)
        target = pes[action.pe]
        target.heap[action.dst_offset : action.dst_offset + action.nbytes].copy_(
            send[action.src_offset : action.src_offset + action.nbytes])
        target.signals[action.signal_word] += 1
    elif isinstance(action, Consume):
        for source, offset, _ in action.slots:
            key = (r, offset // layout.slot_bytes)
            if filled.pop(key, None) != (index, source):
                raise ScheduleViolationError(f"call {index}: PE {r} reads slot {key[1]} before "
                                        f"PE {source}'s data for this call arrived")
        consume(action.slots)
    elif isinstance(action, Ack):
        pes[action.pe].signals[action.word] += 1


class ThreadedWorld:
    """Shared heaps and signal words for ``world`` PEs, one thread each; waits block."""

    def __init__(self, layout: HeapLayout, timeout: float = 30.0) -> None:
        self.layout, self.timeout = layout, timeout
        self.heaps = [torch.zeros(layout.data_bytes, dtype=torch.uint8)
                      for _ in range(layout.world_size)]
        self.signals = [[0] * layout.signal_words for _ in range(layout.world_size)]
        self.cond = threading.Condition()

    def transport(self, rank: int) -> SimTransport:
        return SimTransport(self, rank)


class SimTransport:
    """``SymmetricTransport`` of one PE of a ``ThreadedWorld`` (operations complete at once)."""

    def __init__(self, world: ThreadedWorld, rank: int) -> None:
        self.world, self.rank = world, rank
        self.world_size = world.layout.world_size
        self.heap = world.heaps[rank]
        self.closed = False

    def put_signal(self, dst_offset: int, src: torch.Tensor, pe: int, signal_word: int,
                   stream: Any) -> None:
        with self.world.cond:
            self.world.heaps[pe][dst_offset : dst_offset + src.numel()].copy_(src)
            self.world.signals[pe][signal_word] += 1
            self.world.cond.notify_all()

    def signal_add(self, pe: int, word: int, value: int, stream: Any) -> None:
        with self.world.cond:
            self.world.signals[pe][word] += value
            self.world.cond.notify_all()

    def wait_until(self, word: int, at_least: int, stream: Any) -> None:
        signals = self.world.signals[self.rank]
        with self.world.cond:
            if not self.world.cond.wait_for(lambda: signals[word] >= at_least, self.world.timeout):
                raise TimeoutError(f"PE {self.rank}: signal word {word} stuck at {signals[word]} "
                                   f"< {at_least}")

    def close(self) -> None:
        self.closed = True
