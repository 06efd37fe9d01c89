"""Memory measured, not assumed: live tensor bytes per phase, peak RSS, and the plan's bound.

[Note: live bytes]
``LiveBytesTracker`` is a ``TorchDispatchMode`` that follows every tensor storage while it is
active. *Live bytes* = bytes of the tensors handed to ``track()`` (what existed before, e.g. the
parameters and optimizer state) + bytes allocated since the tracker started − bytes freed since.
- An allocation is a fresh output of an aten op (an output that aliases an input, i.e. a view or
  an in-place/``out=`` result, allocates nothing). Its storage gets a ``weakref.finalize``: when
  the last tensor using the storage dies, its bytes leave the count.
- ``UntypedStorage.resize_`` is not an aten op, yet it is how matrixfsdp and FSDP2 free and
  revive unsharded parameters: while tracking, it is wrapped so that every resize counts its
  difference in bytes (a storage first seen being resized starts being followed then).
- Storages that existed before the tracker started and were not handed to ``track()`` are
  invisible until they are resized; free them before tracking (e.g. ``zero_grad()``) or track
  them, else their death goes unseen and live bytes read high.
Bytes count on every device except ``meta``; ``peak`` is the highest live count, per phase too
(``with tracker.phase("backward"): ...``). It is exact for what it sees, deterministic, and needs
no allocator statistics, so it works on CPU, where the RSS lags behind frees (see
``pin_malloc_mmap_threshold``), and on GPUs alike.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .collectives import torch_backend
from .planner import Plan, dtype_itemsize

__all__ = [
    "GroupBytes",
    "LiveBytesTracker",
    "MatrixMemory",
    "PhasePeak",
    "matrix_memory",
    "peak_rss_bytes",
    "pin_malloc_mmap_threshold",
    "reset_peak_rss",
    "rss_bytes",
]

logger = logging.getLogger(__name__)


class PhasePeak(NamedTuple):
    """Live bytes when a phase started and the highest live bytes during it."""

    start: int
    peak: int


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage holding ``t``'s bytes (a DTensor's local shard); None for storage-less ones."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... tensors
        return None


class LiveBytesTracker(TorchDispatchMode):
    """Live tensor bytes of this process, op by op (see [Note: live bytes]).

    Example::

        tracker = LiveBytesTracker()
        tracker.track(model.parameters(), (v for s in opt.state.values() for v in s.values()))
        with tracker:
            with tracker.phase("forward"):
                loss = model(batch)
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                opt.step()
        tracker.peak, tracker.phases["backward"].peak
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.phases: dict[str, PhasePeak] = {}
        self._active: list[str] = []  # the phases entered and not left, outermost first
        self._counted: dict[int, int] = {}  # storage key -> bytes currently counted for it
        self._finalizers: list[weakref.finalize] = []
        self._lock = threading.Lock()
        self._orig_resize: Any = None

    # -- registering storages ---------------------------------------------------------------------
    def track(self, *tensors: Iterable[Any] | torch.Tensor | None) -> LiveBytesTracker:
        """Count storages that already exist (parameters, gradients, optimizer state)."""
        for item in tensors:
            items = [item] if isinstance(item, torch.Tensor) else (item or [])
            for t in items:
                if isinstance(t, torch.Tensor):
                    self._follow(_storage(t), fresh=True)
        return self

    def _follow(self, storage: torch.UntypedStorage | None, *, fresh: bool, delta: int = 0) -> None:
        """Start following ``storage`` (``fresh``: all its bytes are new) or add ``delta``."""
        if storage is None or storage.device.type == "meta":
            return
        key = storage._cdata
        with self._lock:
            if key in self._counted:
                self._counted[key] += delta
                self._add(delta)
                return
            nbytes = storage.nbytes()
            self._counted[key] = nbytes
            self._add(nbytes if fresh else delta)
        self._finalizers.append(weakref.finalize(storage, self._forget, key))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._add(-self._counted.pop(key, 0))

    def _add(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
        for name in self._active:
            start, peak = self.phases[name]
            if self.current > peak:
                self.phases[name] = PhasePeak(start, self.current)

    # -- phases -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the peak of the block to ``name`` (a repeated name keeps the higher peak).

        Phases nest: an enclosing phase keeps counting while an inner one is open, so
        ``phases[inner].peak - phases[inner].start`` is what the inner block added on top."""
        old = self.phases.get(name)
        self.phases[name] = PhasePeak(self.current, max(self.current, old.peak if old else 0))
        self._active.append(name)
        try:
            yield
        finally:
            self._active.pop()

    # -- dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = getattr(getattr(func, "_schema", None), "returns", ())
        aliases = any(r.alias_info is not None for r in returns)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not aliases:
                self._follow(_storage(t), fresh=True)
            elif isinstance(t, torch.Tensor):
                self._recount(_storage(t))  # in place: aten.resize_, set_, ...
        return out

    def _recount(self, storage: torch.UntypedStorage | None) -> None:
        if storage is None:
            return
        key = storage._cdata
        with self._lock:
            counted = self._counted.get(key)
            if counted is None or counted == storage.nbytes():
                return
            self._counted[key] = storage.nbytes()
            self._add(storage.nbytes() - counted)

    def __enter__(self) -> LiveBytesTracker:
        self._orig_resize = torch.UntypedStorage.resize_
        tracker, original = self, self._orig_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            result = original(storage, size)
            if storage.nbytes() != before:
                tracker._follow(storage, fresh=False, delta=storage.nbytes() - before)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        for finalizer in self._finalizers:  # stop following: the figures stay as they were
            finalizer.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)


# -- process RSS (Linux) --------------------------------------------------------------------------
def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Current resident set size (``VmRSS``; 0 where /proc is unavailable)."""
    return _status_bytes("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """RSS high-water mark since the last reset (``VmHWM``; else ``getrusage`` ``ru_maxrss``)."""
    hwm = _status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pin_malloc_mmap_threshold(threshold: int = 65536) -> bool:
    """Make the RSS follow live memory (glibc): allocations >= ``threshold`` bytes are served by
    ``mmap`` and returned to the OS when freed, and freed heap is trimmed at once (``mallopt``
    ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``, what ``MALLOC_MMAP_THRESHOLD_=65536`` in the
    environment of a fresh process does). Without it glibc raises its threshold dynamically and
    keeps freed tensors in the heap, so a peak RSS measures the allocator, not the program.
    Returns False where it is unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, threshold)) and bool(libc.mallopt(-1, 0))
    except (OSError, AttributeError):
        return False


# -- the plan's matrix bytes ----------------------------------------------------------------------
class GroupBytes(NamedTuple):
    """One group's matrix bytes on one rank while it moves (see ``MatrixMemory``)."""

    gathered: int
    gather_buffers: int
    grads: int
    reduce_buffers: int
    all_reduce_buffer: int = 0  # HSDP: the owned segment's copy all-reduced over the replicas
    accumulated: int = 0  # gradient sync off: the full-size gradients held between backwards


@dataclass(frozen=True)
class MatrixMemory:
    """Matrix bytes on one rank by the runtime's schedule (see [Note: one step of the matrix
    runtime] and [Note: pending work]), from the plan alone, per group:

    - ``gathered``: the group's matrices whole, in the compute dtype, that this rank holds while
      the group is unsharded: the ones it does not own (and its own too when the compute dtype
      differs from the master's: a cast copy).
    - ``gather_buffers``: what a gather holds besides those matrices: nothing in the
      buffer-free forms (``TorchOwnerComm`` sends from the owner's storage and receives into the
      peers'); the padded one-call form ``"auto"`` picks on gloo for small groups holds a send
      buffer of the longest segment and a receive buffer of N of them (see [Note: one call per
      group] in ``collectives/torch_backend.py``).
    - ``grads``: the group's full-size gradients (compute dtype), which every rank computes.
    - ``reduce_buffers``: a reduction's packed buffer (every trainable matrix + a presence flag,
      reduce dtype) and the owner's receive buffers: exchange form (``collectives="alltoall"``)
      N − 1 copies of its segment; ``"auto"`` on gloo (the rounds) one copy, for small groups
      none (one in-place all-reduce); ``"auto"`` on NCCL and ``"p2p"`` reduce in place.
    - ``all_reduce_buffer``: under HSDP (``plan.mesh_shape`` with replicas), the copy of this
      rank's summed segment (values and flags; with ``replicate_presence_flags=False`` only
      the values cross replicas, from the same buffer) being all-reduced over its replicate
      group.
    - ``accumulated``: with gradient sync off (``set_requires_gradient_sync(False)``, gradient
      accumulation), the group's full-size gradients every rank holds from one backward to the
      next until a synced backward reduces them, in the reduction dtype: fp32 accumulators under
      ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, else the leaves' own
      gradients ([Note: accumulation in reduce_dtype] in ``runtime/group.py``; FSDP2 holds its
      tail's the same way). Counted by ``transient(accumulating=True)`` for every group at once.
    ``owned`` is the bytes of the matrices this rank owns (each also gets a gradient of the same
    size and the optimizer's state).
    """

    owned: int
    groups: dict[str, GroupBytes]

    def largest(self, field: str) -> int:
        return max((getattr(g, field) for g in self.groups.values()), default=0)

    def accumulated(self) -> int:
        """Bytes every group's held gradients take while gradient sync is off."""
        return sum(g.accumulated for g in self.groups.values())

    def transient(self, *, gathered: int = 2, reducing: int = 1,
                  accumulating: bool = False) -> int:
        """Matrix bytes beyond the owned ones at any moment of a step, bounded by the runtime's
        limits: ``gathered`` groups unsharded (one with its gather in flight), one group's
        gradients being computed, ``reducing`` groups' reduction buffers and (HSDP) one
        all-reduce over the replicas; with ``accumulating``, also every group's gradients held
        between no-sync backwards (``accumulated``)."""
        return (gathered * self.largest("gathered") + self.largest("gather_buffers")
                + self.largest("grads") + reducing * self.largest("reduce_buffers")
                + self.largest("all_reduce_buffer")
                + (self.accumulated() if accumulating else 0))


def matrix_memory(plan: Plan, rank: int, *, collectives: str = "auto", gloo: bool = False,
                  reduce_itemsize: int | None = None,
                  compute_itemsize: int | None = None) -> MatrixMemory:
    """Per-rank matrix bytes of ``plan`` (pure arithmetic; all matrices assumed trainable).

    ``collectives`` is ``fully_shard_matrix``'s argument (``"auto"`` decides per group as the
    runtime does, on gloo when ``gloo`` is true, else on NCCL); the item sizes default to the
    matrices' own dtype. ``rank`` is the rank in the plan's world: under HSDP, the shard
    coordinate.
    """
    world = plan.world_size
    members: dict[str, list[Any]] = {}
    for m in plan.matrices:
        members.setdefault(m.group, []).append(m)
    groups = {}
    for name, group in members.items():
        master = dtype_itemsize(group[0].dtype)
        size, red = compute_itemsize or master, reduce_itemsize or master
        numels = [sum(m.numel for m in group if m.owner_rank == r) for r in range(world)]
        counts = [sum(1 for m in group if m.owner_rank == r) for r in range(world)]
        own, total = numels[rank], sum(numels)
        gathered = (total - own if size == master else total) * size
        # The one-call forms on gloo (see [Note: one call per group]): the gather's send buffer of
        # the longest segment and receive buffer of N of them; the reduction is in place.
        width, red_width = max(numels), max(n + c for n, c in zip(numels, counts, strict=True))
        cap = torch_backend.PADDED_MAX_BYTES  # read at call time (tests lower it)
        padded_gather = collectives == "auto" and gloo and world > 1 and width * world * size <= cap
        padded_reduce = collectives == "auto" and gloo and world > 1 and \
            red_width * world * red <= cap
        gather_buffers = (world + 1) * width * size if padded_gather else 0
        copies = 0  # received copies of the owned segment held at once (TorchOwnerComm)
        if world > 1 and own and not padded_reduce:
            copies = {"alltoall": world - 1, "auto": 1 if gloo else 0}.get(collectives, 0)
        recv = copies * (own + counts[rank]) * red  # the padded reduction is in place
        flat = (total + sum(counts)) * red
        all_reduce = (own + counts[rank]) * red if plan.replicate_size > 1 else 0
        groups[name] = GroupBytes(gathered, gather_buffers, total * size, flat + recv, all_reduce,
                                  total * red)
    owned = sum(m.nbytes for m in plan.owned_by(rank) if m.role == "matrix")
    return MatrixMemory(owned, groups)
