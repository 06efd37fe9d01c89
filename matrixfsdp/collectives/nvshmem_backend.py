"""``OwnerComm`` on NVSHMEM (nvshmem4py): one-sided put-with-signal owner collectives.

The schedule (which bytes go where, which signal counts to wait for) comes from
``nvshmem_schedule`` (see [Note: one-sided owner schedule]); this module only runs it. A program's
steps go to a ``SymmetricTransport``: ``Nvshmem4pyTransport`` issues them on a CUDA side stream
through nvshmem4py, ``nvshmem_sim.ThreadedWorld`` executes them on CPU tensors (tests). Consuming
the received slots (copy out for a gather, a fixed-order sum for a reduction) is plain torch and
runs on the same stream right after the waits, so the heap is free again as soon as the program
ends; ``Pending.wait()`` only orders the caller's stream after it (no host synchronisation).

Scalars (``all_reduce_scalar``) and any collective whose segment does not fit the heap's slots
(a call the plan did not announce) go through the torch/NCCL communicator given as ``fallback``;
both choices depend only on the plan, so every rank makes the same one.

nvshmem4py API used (checked against nvshmem4py-cu13 0.4.1, ``nvshmem/core/init_fini.py``,
``interop/torch.py`` and ``bindings/nvshmem.pxd``; the same names exist in the 0.1 line of
NVIDIA/nvshmem's ``nvshmem4py`` tree): ``nvshmem.core.get_unique_id(empty=...)`` (its ``_data`` is
a 128-byte numpy record, broadcast in place over the torch group), ``nvshmem.core.init(device=
cuda.core.Device(i), uid=..., rank=..., nranks=..., initializer_method="uid")``,
``nvshmem.core.tensor(shape, dtype)`` / ``free_tensor`` / ``finalize``, and the stream bindings
``nvshmem.bindings.putmem_signal_on_stream``, ``signal_op_on_stream``,
``signal_wait_until_on_stream``, ``barrier_all_on_stream`` with ``nvshmem.core.SignalOp`` and
``ComparisonType``. The bindings are called with raw addresses because ``nvshmem.core.put_signal``
sizes a transfer as the smaller of the two *whole* buffers and finds a tensor's buffer by its
base pointer, so it cannot address a slot inside the heap.

At interpreter exit every communicator still open is closed (drain, barrier, free, finalize).
Those steps are collective, so a peer that died or hangs would block the exit for ever; the exit
path therefore runs them on a daemon thread and waits at most ``MATRIXFSDP_NVSHMEM_EXIT_TIMEOUT_S``
seconds (default 5; a positive number). When that expires it logs a warning and leaves the rest
undone: no further heap is freed and NVSHMEM is not finalised, even if the stuck barrier returns
later. An explicit ``close()`` is not bounded (every rank calls it while all are alive).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..devices import DeviceOps, device_ops
from .base import CommCounter, OwnerComm, Pending
from .nvshmem_probe import ProbeReason, probe
from .nvshmem_schedule import (
    Ack,
    Consume,
    HeapLayout,
    Ledger,
    Program,
    Put,
    SegmentShape,
    Wait,
    gather_program,
    plan_heap,
    reduce_program,
)

__all__ = [
    "Nvshmem4pyTransport",
    "NvshmemOwnerComm",
    "SymmetricTransport",
    "close_all",
    "consume_gather",
    "consume_reduce",
    "exit_timeout_s",
    "make_nvshmem_comm",
    "run_program",
    "segment_shapes",
]

logger = logging.getLogger(__name__)


class SymmetricTransport(Protocol):
    """One PE's view of the symmetric heap and its one-sided operations (issued on ``stream``)."""

    rank: int
    world_size: int
    heap: torch.Tensor  # this PE's data bytes (uint8, ``layout.data_bytes`` long)

    def put_signal(self, dst_offset: int, src: torch.Tensor, pe: int, signal_word: int,
                   stream: Any) -> None: ...

    def signal_add(self, pe: int, word: int, value: int, stream: Any) -> None: ...

    def wait_until(self, word: int, at_least: int, stream: Any) -> None: ...

    def close(self) -> None: ...


# -- consuming received slots (plain torch, any device) ---------------------------------------------
def consume_gather(heap: torch.Tensor, slots: Sequence[tuple[int, int, int]],
                   outputs: Sequence[torch.Tensor]) -> None:
    """Copy each received slot (bit for bit) into the output segment of its source rank."""
    for source, offset, nbytes in slots:
        outputs[source].view(torch.uint8).copy_(heap[offset : offset + nbytes])


def consume_reduce(heap: torch.Tensor, slots: Sequence[tuple[int, int, int]],
                   own: torch.Tensor, rank: int) -> None:
    """``own`` ← sum over ranks 0..N-1, in that order, of each rank's contribution.

    Contributions of other ranks come from their slots, this rank's from ``own`` itself; 16-bit
    dtypes accumulate in float32. A fixed order makes the result identical run after run.
    """
    parts = {source: heap[offset : offset + nbytes].view(own.dtype)
             for source, offset, nbytes in slots}
    parts[rank] = own
    acc_dtype = torch.float32 if own.element_size() < 4 and own.is_floating_point() else own.dtype
    acc: torch.Tensor | None = None
    for source in sorted(parts):
        if acc is None:
            acc = parts[source].to(acc_dtype, copy=True)
        else:
            acc.add_(parts[source])
    if acc is not None:
        own.copy_(acc)


def run_program(transport: SymmetricTransport, program: Program, send: torch.Tensor,
                consume: Callable[[tuple[tuple[int, int, int], ...]], None], stream: Any) -> None:
    """Issue one PE's program: ``send`` is the byte view the puts read from."""
    for action in program.actions:
        if isinstance(action, Wait):
            transport.wait_until(action.word, action.at_least, stream)
        elif isinstance(action, Put):
            src = send[action.src_offset : action.src_offset + action.nbytes]
            transport.put_signal(action.dst_offset, src, action.pe, action.signal_word, stream)
        elif isinstance(action, Consume):
            consume(action.slots)
        elif isinstance(action, Ack):
            transport.signal_add(action.pe, action.word, 1, stream)
        else:  # pragma: no cover - the schedule builds only the four kinds
            raise TypeError(f"unknown action {action!r}")


class _StreamPending(Pending):
    """Done when the comm stream's event is; ``wait()`` orders the caller's stream after it."""

    def __init__(self, ops: DeviceOps, event: Any, keepalive: Sequence[object]) -> None:
        super().__init__((), keepalive)
        self._ops, self._event = ops, event

    def wait(self) -> None:
        if self._event is not None:
            self._ops.current_waits(self._event)
            self._event = None
        super().wait()


class NvshmemOwnerComm(OwnerComm):
    """Owner-segment collectives over a symmetric heap (see [Note: owner segments]).

    ``transport`` does the one-sided work, ``layout`` is the heap it was sized with (a pure
    function of the plan), ``fallback`` the torch communicator of the same group (scalars, and
    collectives that do not fit the heap). ``ops`` orders the side stream against the caller's.
    """

    def __init__(self, transport: SymmetricTransport, layout: HeapLayout, *,
                 fallback: OwnerComm, ops: DeviceOps | None = None,
                 counter: CommCounter | None = None) -> None:
        if layout.world_size != transport.world_size or fallback.world_size != transport.world_size:
            raise ValueError(
                f"world sizes disagree: layout {layout.world_size}, transport "
                f"{transport.world_size}, fallback {fallback.world_size}"
            )
        self.transport, self.layout, self.fallback = transport, layout, fallback
        self.rank, self.world_size = transport.rank, transport.world_size
        self.group = getattr(fallback, "group", None)
        self.counter = counter if counter is not None else fallback.counter
        self._ops = ops if ops is not None else device_ops(transport.heap.device)
        self._stream = self._ops.new_stream()
        self._ledger = Ledger(layout, self.rank)
        self._closed = False
        self._created = next(_CREATION_ORDER)
        _LIVE.add(self)

    # -- all-gather-v -----------------------------------------------------------------------------
    def all_gather_v(self, own: torch.Tensor, numels: Sequence[int], *,
                     async_op: bool = False) -> tuple[list[torch.Tensor], Pending]:
        if own.numel() != numels[self.rank]:
            raise ValueError(f"own segment has {own.numel()} elements, plan says {numels[self.rank]}")
        if self.world_size == 1:
            return [own], Pending()
        shape = SegmentShape(tuple(int(n) for n in numels), own.element_size())
        if not self.layout.fits(shape):
            return self.fallback.all_gather_v(own, numels, async_op=async_op)
        self._check_open()
        send = own.contiguous()
        segments = [own if r == self.rank else own.new_empty(n) for r, n in enumerate(numels)]
        program = gather_program(self.layout, self._ledger, shape)
        with record_function("matrixfsdp::all_gather_v"):
            pending = self._issue(program, send, segments,
                                  lambda slots: consume_gather(self.transport.heap, slots, segments))
        others = sum(numels) - numels[self.rank]
        self.counter.record("all_gather_v", numels[self.rank] * shape.itemsize *
                            (self.world_size - 1), others * shape.itemsize)
        if not async_op:
            pending.wait()
        return segments, pending

    # -- reduce-to-owners -------------------------------------------------------------------------
    def reduce_to_owners(self, flat: torch.Tensor, numels: Sequence[int], *,
                         async_op: bool = False) -> tuple[torch.Tensor, Pending]:
        if flat.numel() != sum(numels):
            raise ValueError(f"buffer has {flat.numel()} elements, segments sum to {sum(numels)}")
        offset = sum(numels[: self.rank])
        own = flat[offset : offset + numels[self.rank]]
        if self.world_size == 1:
            return own, Pending()
        shape = SegmentShape(tuple(int(n) for n in numels), flat.element_size())
        if not self.layout.fits(shape) or not flat.is_contiguous():
            return self.fallback.reduce_to_owners(flat, numels, async_op=async_op)
        self._check_open()
        program = reduce_program(self.layout, self._ledger, shape)
        with record_function("matrixfsdp::reduce_to_owners"):
            pending = self._issue(program, flat, [flat],
                                  lambda slots: consume_reduce(self.transport.heap, slots, own,
                                                               self.rank))
        nbytes = shape.itemsize
        self.counter.record("reduce_to_owners", (sum(numels) - numels[self.rank]) * nbytes,
                            numels[self.rank] * nbytes * (self.world_size - 1))
        if not async_op:
            pending.wait()
        return own, pending

    def _issue(self, program: Program, send: torch.Tensor, keep: Sequence[torch.Tensor],
               consume: Callable[[tuple[tuple[int, int, int], ...]], None]) -> Pending:
        ops, stream = self._ops, self._stream
        ops.stream_waits_current(stream)  # inputs were produced on the caller's stream
        with ops.on_stream(stream):
            run_program(self.transport, program, send.view(-1).view(torch.uint8), consume, stream)
        event = ops.record_event(stream)
        return _StreamPending(ops, event, keepalive=(send, *keep))

    # -- scalars ----------------------------------------------------------------------------------
    def all_reduce_scalar(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.fallback.all_reduce_scalar(value, op)

    # -- teardown ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this NvshmemOwnerComm was closed; wrap the model again")

    def close(self) -> None:
        """Free the symmetric heap (collective: call on every rank); idempotent."""
        if not self._closed:
            self._closed = True
            _LIVE.discard(self)
            self.transport.close()


_LIVE: weakref.WeakSet[NvshmemOwnerComm] = weakref.WeakSet()
# Closing is collective: every rank closes its communicators in creation order (a WeakSet's own
# iteration order differs between processes, and mismatched barriers would hang the exit).
_CREATION_ORDER = itertools.count()


# -- the bounded exit path ------------------------------------------------------------------------
EXIT_TIMEOUT_ENV = "MATRIXFSDP_NVSHMEM_EXIT_TIMEOUT_S"
DEFAULT_EXIT_TIMEOUT_S = 5.0
# Set when the exit path gave up: nothing may free or finalise after that, even if a barrier that
# was stuck returns late (the interpreter is shutting down around it).
_EXIT_EXPIRED = threading.Event()


def exit_timeout_s() -> float:
    """Seconds the exit path waits for the collective close (``MATRIXFSDP_NVSHMEM_EXIT_TIMEOUT_S``)."""
    raw = os.environ.get(EXIT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_EXIT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{EXIT_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds "
                         f"(default {DEFAULT_EXIT_TIMEOUT_S:g})")
    return value


def _close_in_order(comms: Sequence[NvshmemOwnerComm]) -> None:
    for comm in comms:
        if _EXIT_EXPIRED.is_set():
            return  # given up: the next close would free (and maybe finalise) after the deadline
        try:
            comm.close()
        except Exception:  # the peers may be gone already; nothing left to protect
            logger.debug("matrixfsdp: closing an NVSHMEM communicator at exit failed",
                         exc_info=True)


def close_all(timeout_s: float | None = None) -> bool:
    """Close every open ``NvshmemOwnerComm``, waiting at most ``timeout_s`` seconds.

    The interpreter-exit path (see the module docstring); ``None`` reads
    ``MATRIXFSDP_NVSHMEM_EXIT_TIMEOUT_S``. Returns True when every close finished in time; else
    logs a warning, leaves the remaining heaps and NVSHMEM itself as they are (no finalize) and
    returns False, with the stuck close left on a daemon thread that cannot delay the exit.
    """
    comms = sorted(_LIVE, key=lambda comm: comm._created)
    if not comms:
        return True
    if timeout_s is None:
        try:
            timeout_s = exit_timeout_s()
        except ValueError as exc:
            logger.warning("matrixfsdp: %s; using %g s", exc, DEFAULT_EXIT_TIMEOUT_S)
            timeout_s = DEFAULT_EXIT_TIMEOUT_S
    closer = threading.Thread(target=_close_in_order, args=(comms,), daemon=True,
                              name="matrixfsdp-nvshmem-exit")
    closer.start()
    closer.join(timeout_s)
    if not closer.is_alive():
        return True
    _EXIT_EXPIRED.set()
    logger.warning(
        "matrixfsdp: closing %d NVSHMEM communicator(s) at exit did not finish within %g s (a "
        "peer died or has not reached its exit; %s sets the bound); exiting without freeing the "
        "symmetric heap or finalising NVSHMEM", len(comms), timeout_s, EXIT_TIMEOUT_ENV)
    return False


def segment_shapes(groups: Sequence[Any]) -> list[SegmentShape]:
    """Every collective a model's matrix groups will issue, as segment shapes for ``plan_heap``."""
    shapes = []
    for g in groups:
        first = g.params[0]
        shapes.append(SegmentShape(tuple(g.gather_numels), first.compute_dtype.itemsize))
        reduce_dtype = g.reduce_dtype or first.dtype
        shapes.append(SegmentShape(tuple(g.reduce_numels), reduce_dtype.itemsize))
    return shapes


def make_nvshmem_comm(fallback: OwnerComm, groups: Sequence[Any], device: torch.device, *,
                      buffers: int = 2) -> OwnerComm:
    """An ``NvshmemOwnerComm`` when every rank can run one, else ``fallback`` and one warning.

    Collective over ``fallback.group``: a probe (two small all-gathers), then NVSHMEM's
    initialisation and the collective symmetric allocations.
    """
    exit_timeout_s()  # a bad MATRIXFSDP_NVSHMEM_EXIT_TIMEOUT_S fails here, not at exit
    layout = plan_heap(segment_shapes(groups), fallback.world_size, buffers)
    group = getattr(fallback, "group", None)
    reason, detail = probe(group, device.type, layout.total_bytes)
    if reason is not ProbeReason.OK:
        logger.warning("matrixfsdp: collectives='nvshmem' unavailable: %s (%s); using the "
                       "torch.distributed path", reason.describe(), detail)
        return fallback
    transport = Nvshmem4pyTransport(group, device, layout)  # pragma: no cover - needs CUDA
    return NvshmemOwnerComm(transport, layout, fallback=fallback)  # pragma: no cover


# -- nvshmem4py (CUDA only) -------------------------------------------------------------------------
class _Runtime:  # pragma: no cover - needs CUDA and nvshmem4py
    """NVSHMEM is initialised once per process and finalised after the last heap is freed."""

    users = 0
    ranks: tuple[int, ...] = ()

    @classmethod
    def acquire(cls, group: dist.ProcessGroup | None, device: torch.device) -> None:
        import numpy as np
        import nvshmem.core as core

        try:
            from cuda.core import Device  # cuda.core >= 0.5 (nvshmem4py 0.4)
        except ImportError:
            from cuda.core.experimental import Device  # older cuda.core (nvshmem4py 0.1)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = tuple(dist.get_global_rank(group, r) if group is not None else r
                      for r in range(world))
        if cls.users:
            if ranks != cls.ranks:
                raise NotImplementedError(
                    f"NVSHMEM is already initialised over global ranks {cls.ranks}; one process "
                    f"cannot also use it over {ranks} (wrap with collectives='auto' instead)"
                )
            cls.users += 1
            return
        uid = core.get_unique_id(empty=rank != 0)
        raw = uid._data.view(np.uint8).reshape(-1)
        payload = torch.from_numpy(raw.copy()).to(device)
        dist.broadcast(payload, src=ranks[0], group=group)
        raw[:] = payload.cpu().numpy()
        dev = Device(device.index)
        dev.set_current()
        core.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
        cls.users, cls.ranks = 1, ranks

    @classmethod
    def release(cls) -> None:
        import nvshmem.core as core

        cls.users -= 1
        if cls.users == 0:
            core.finalize()
            cls.ranks = ()


class Nvshmem4pyTransport:  # pragma: no cover - needs CUDA and nvshmem4py
    """Symmetric heap + signal words allocated with nvshmem4py; one-sided ops on CUDA streams."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 layout: HeapLayout) -> None:
        import nvshmem.bindings as bindings
        import nvshmem.core as core

        _Runtime.acquire(group, device)
        self._core, self._bindings = core, bindings
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = device
        self._signal_add = int(core.SignalOp.SIGNAL_ADD)
        self._cmp_ge = int(core.ComparisonType.CMP_GE)
        # Collective, equal-sized allocations on every PE (the layout is a function of the plan).
        self.heap = core.tensor((layout.data_bytes,), dtype=torch.uint8)
        self._signals = core.tensor((layout.signal_words,), dtype=torch.int64)
        self._signals.zero_()
        self._barrier()

    def _barrier(self) -> None:
        stream = torch.cuda.current_stream(self.device)
        self._bindings.barrier_all_on_stream(int(stream.cuda_stream))
        stream.synchronize()

    def _word(self, word: int) -> int:
        return self._signals.data_ptr() + 8 * word

    def put_signal(self, dst_offset: int, src: torch.Tensor, pe: int, signal_word: int,
                   stream: torch.cuda.Stream) -> None:
        self._bindings.putmem_signal_on_stream(
            self.heap.data_ptr() + dst_offset, src.data_ptr(), src.numel(),
            self._word(signal_word), 1, self._signal_add, pe, int(stream.cuda_stream))

    def signal_add(self, pe: int, word: int, value: int, stream: torch.cuda.Stream) -> None:
        self._bindings.signal_op_on_stream(self._word(word), value, self._signal_add, pe,
                                           int(stream.cuda_stream))

    def wait_until(self, word: int, at_least: int, stream: torch.cuda.Stream) -> None:
        self._bindings.signal_wait_until_on_stream(self._word(word), self._cmp_ge, at_least,
                                                   int(stream.cuda_stream))

    def close(self) -> None:
        """Collective: drain, barrier, free the symmetric tensors, then maybe finalize.

        Runs on the caller's thread or on the exit path's closer thread (hence the device guard).
        """
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            self._barrier()
            if _EXIT_EXPIRED.is_set():
                return  # the exit path gave up waiting: free and finalize would race the shutdown
            self._core.free_tensor(self._signals)
            self._core.free_tensor(self.heap)
            _Runtime.release()


@atexit.register
def _close_all_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    close_all()
