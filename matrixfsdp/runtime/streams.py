"""The streams the runtime's collectives run on, and the rules for freeing what they touch.

[Note: streams]
Vocabulary. *compute* is the caller's current stream: forward, backward, the optimizer, and
everything the runtime does outside the three side streams below (allocating and freeing
unsharded storage, landing gradients in ``.grad``). Each side stream runs *episodes*: one
collective with its *copy-in* (packing its send buffer) before it and its *consume* step (the
copy-out) after it.
- ``gather``: copy-in (the owner's matrices concatenated into its segment), the owner-segment
  all-gather-v, copy-out (every peer's segment written into this rank's unsharded matrices).
- ``reduce``: copy-in (gradients and presence flags packed by owner, see ``MatrixGroup``), the
  reduce-to-owners, consume (the received copies of the own segment summed; the owners' averaged
  gradients divided out, or under HSDP the owned segment copied out of the group's buffer).
- ``all_reduce`` (HSDP): the all-reduce of the owned segment over the replicas and its consume
  (the averaged gradients). A stream of its own, as FSDP2's ``all_reduce_stream``, so it
  overlaps the next group's reduction.

Waiting. NCCL runs a collective on its internal stream, which at issue waits for the stream that
is current then; ``Work.wait()`` of an ``async_op=True`` collective makes the stream current *at
the wait* wait for it and returns without blocking the host (unless blocking wait is configured).
So on CUDA an episode issues the collective, calls ``wait()`` inside the side stream's context
and issues the consume step right behind it on that stream (*eager* consume): copy-in, transfer
and copy-out all overlap compute, and the host never waits. Gloo's ``wait()`` blocks the host,
so on CPU (``HostOps``, no real streams) the consume step is deferred to the work's ``finish``,
which keeps the gloo transfer overlapped with host compute. NVSHMEM's ``Pending.wait()`` makes
the current stream wait an event of its own stream: the same contract as NCCL. Either way
``PendingWork.event`` is the event recorded on the side stream after the consume step.
What ``wait()`` does not give: it orders only the stream current at the call, and only after
the transfer, not after a copy-out issued behind it; hence compute waits the episode's event,
never the ``Work``. Not needed: waiting the ``Work`` again on compute, or a host ``synchronize``.
Memory NCCL itself reads or writes is kept from reuse by ProcessGroupNCCL until its stream is
done (``record_stream`` on that stream, or the tensors held by the ``Work`` until ``wait()``,
per ``TORCH_NCCL_AVOID_RECORD_STREAMS``), so the rules below cover the runtime's own streams.
- Every episode starts with ``side.wait_stream(compute)``: its inputs (owned values, gradients,
  storage just allocated) were produced in compute order, and memory the side stream reuses
  from its own pool may have been read by compute before it was freed.
- A gather's ``finish`` (its group computes next) and ``discard`` (its storage is freed next)
  make compute wait its event. A reduction's ``finish`` does not: its consume step stays on the
  reduce stream; under HSDP the all-reduce episode waits the reduction's event on its own
  stream. Gradients *land* (become ``.grad``) at the end of backward, or whenever the queue is
  drained, after compute waited every landing work's event; that is also where the host reads
  the presence flags of every group at once: the runtime's only host synchronisation, once per
  backward (none on a rank that owns no trainable matrix).

Freeing. The caching allocator returns a freed block to the pool of the stream it was allocated
on and may hand it to that stream's next allocation at once, whatever other streams still do
with it. Hence:
1. A tensor allocated and used on one side stream (send/receive buffers, allocated inside the
   episode; NCCL's own stream is waited on that stream) is dropped as soon as its last use is
   issued.
2. A tensor used on a stream other than its allocation stream is dropped only after compute
   waited the event of that use, or after ``record_stream`` on the using stream (the allocator
   then holds the block until that stream's work issued before the free has run):
   - unsharded storage: allocated on compute, written by the gather copy-out; freed on compute
     (``reshard``) only after the gather's ``finish``/``discard`` made compute wait its event;
   - gradients read by the reduce copy-in: produced by autograd on compute, ``record_stream``-ed
     on the reduce stream before ``.grad = None`` (FSDP2 packs on compute instead; packing on the
     side stream overlaps the next group's backward);
   - the HSDP owned segment: allocated by the reduce consume, ``record_stream``-ed on the
     all-reduce stream that sums it;
   - averaged gradients: allocated by a consume step, read by compute after landing; the user
     frees them at will, because every later episode of their stream starts after compute.
3. Parameters are mutated only after ``quiesce()`` (``MatrixOptimizer.step``, loads), which
   retires every gather and lands every reduction, so compute has waited every event first.
Compared with FSDP2 (``torch/distributed/fsdp/_fully_shard``): it copies in on
``all_gather_copy_in_stream``, gathers on ``all_gather_stream`` and copies out on compute; packs
gradients on compute, then reduce-scatters, divides and views out on ``reduce_scatter_stream``
(HSDP: all-reduces on ``all_reduce_stream``); compute waits each group's ``post_reduce_event``
at the end of backward, and buffers are held by reference until their events were waited rather
than ``record_stream``-ed. Here the gather's copy-out and the reduction's copy-in also leave
compute, which two ``record_stream`` calls pay for.
On CPU every stream is the host thread and every rule holds trivially; the same control flow
runs with ``HostOps``. Tests run the eager (CUDA) control flow on CPU under a happens-before
checker (tests/stream_check.py) to check these rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from ..collectives import Pending
from ..devices import DeviceOps, device_ops

__all__ = ["InFlight", "RuntimeStreams"]

T = TypeVar("T")


class RuntimeStreams:
    """The side streams of one wrapped model (see [Note: streams]), created on first use.

    ``eager`` is ``ops.overlaps``: consume right after issue on the side stream (CUDA), or at
    ``finish`` (host). ``use_ops`` pins another ``DeviceOps`` (tests run the eager control flow
    on CPU that way).
    """

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._pinned = False
        self.ops: DeviceOps
        self.gather: Any = None
        self.reduce: Any = None
        self.all_reduce: Any = None
        self.eager = False

    def bind(self, device: torch.device) -> RuntimeStreams:
        """Streams on ``device`` (re-created if the matrices moved, e.g. ``to_empty``)."""
        if not self._pinned and device != self._device:
            self._set(device_ops(device), device)
        return self

    def use_ops(self, ops: DeviceOps) -> None:
        self._set(ops, ops.device)
        self._pinned = True

    def _set(self, ops: DeviceOps, device: torch.device) -> None:
        self.ops, self._device = ops, device
        self.gather, self.reduce, self.all_reduce = (ops.new_stream() for _ in range(3))
        self.eager = ops.overlaps

    def issue(self, stream: Any, start: Callable[[], tuple[Pending, Callable[[], T]]], *,
              after: Any = None) -> InFlight[T]:
        """Run ``start`` (copy-in, then issue the collective) as one episode on ``stream``.

        ``start`` returns the collective's ``Pending`` and its consume step. ``after``: an event
        the episode also waits for (the reduction an HSDP all-reduce sums).
        """
        ops = self.ops
        ops.stream_waits_current(stream)
        ops.stream_waits_event(stream, after)
        with ops.on_stream(stream):
            pending, consume = start()
        work = InFlight(self, stream, pending, consume)
        if self.eager:
            work.complete()
        return work


class InFlight(Generic[T]):
    """One episode's collective and consume step; ``complete`` runs the consume at most once."""

    def __init__(self, streams: RuntimeStreams, stream: Any, pending: Pending,
                 consume: Callable[[], T]) -> None:
        self._streams, self._stream = streams, stream
        self._pending: Pending | None = pending
        self._consume: Callable[[], T] | None = consume
        self.result: T | None = None
        self.event: Any = None
        self.done = False

    def complete(self) -> T | None:
        """Order ``stream`` after the collective, consume there, record the event (no compute wait)."""
        if not self.done:
            self._run(consume=True)
        return self.result

    def finish(self) -> T | None:
        """``complete``, then make compute wait for it."""
        result = self.complete()
        self._streams.ops.current_waits(self.event)
        return result

    def discard(self) -> None:
        """Wait for the collective, drop its output, make compute wait (its storage is freed next)."""
        if not self.done:
            self._run(consume=False)
        self._streams.ops.current_waits(self.event)

    def _run(self, *, consume: bool) -> None:
        ops = self._streams.ops
        assert self._pending is not None and self._consume is not None  # not done yet
        with ops.on_stream(self._stream):
            self._pending.wait()
            if consume:
                self.result = self._consume()
            self.event = ops.record_event(self._stream)
        # Drop the buffers now: their last uses are issued on this stream ([Note: streams] 1).
        self._pending = self._consume = None
        self.done = True
