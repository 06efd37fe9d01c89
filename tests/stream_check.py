"""Run the runtime's CUDA stream control flow on CPU under a happens-before checker.

``CheckedOps`` is a ``DeviceOps`` that claims real streams (``overlaps=True``), so the runtime
takes its eager CUDA path (consume on the side stream, compute waits events; see
[Note: streams]), while every tensor stays on the CPU and every operation still runs in host
order. ``StreamRaceMode`` (a ``TorchDispatchMode``) attributes each aten operation to the stream
that is current in ``CheckedOps`` and checks it against a vector clock per stream, as CUDA's
sanitizer does on a GPU:
- a read or write of a storage last written on another stream must happen after that write
  (reached through ``wait_stream`` / ``wait_event`` chains); a write must also happen after the
  other streams' reads since then;
- a storage freed (``resize_(0)``, or its last reference dropped) must not be in use by a stream
  other than the one it was allocated on, unless that use happens before its allocation stream's
  present point, or before a stream it was ``record_stream``-ed on (the caching allocator's rule).
Collectives (gloo, invisible to the dispatcher) are modelled by ``checked_comms`` as NCCL runs
them: on a stream of their own that waits the issuing stream, reading their input and writing
their output, joined by whatever stream calls ``Pending.wait()``.

``count_host_syncs`` counts host synchronisations (``item``, ``tolist``, ``bool`` ... of a tensor)
by patching ``torch.Tensor`` itself, so calls inside autograd's backward count too.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from matrixfsdp.collectives import OwnerComm, Pending, ReplicateComm
from matrixfsdp.devices import HostOps
from matrixfsdp.runtime import matrix_param

__all__ = ["CheckedOps", "StreamRaceMode", "checked_comms", "count_host_syncs"]

COMPUTE = "compute"


@dataclass
class _Block:
    """One allocation: the stream it came from and the accesses made to it since."""

    alloc: str
    ref: StorageWeakRef
    key: tuple[int, int]
    desc: str = ""
    last_write: tuple[str, int] | None = None
    reads: dict[str, int] = field(default_factory=dict)  # since the last write
    used: dict[str, int] = field(default_factory=dict)  # latest access per stream
    protected: set[str] = field(default_factory=set)  # record_stream-ed on


class CheckedOps(HostOps):
    """Named streams with vector clocks; every ordering call updates them, nothing blocks."""

    overlaps = True

    def __init__(self) -> None:
        super().__init__("cpu")
        self._names = itertools.count()
        self.clock: dict[str, dict[str, int]] = {COMPUTE: {COMPUTE: 0}}
        self._stack = [COMPUTE]
        self.blocks: dict[tuple[int, int], _Block] = {}
        self._watch: dict[tuple[int, int], _Block] = {}  # blocks used off their alloc stream
        self._reusable: dict[str, list[tuple[str, list[tuple[str, int]]]]] = {}
        self.violations: list[str] = []
        self.accesses: dict[str, int] = {}
        self.waits = 0

    # -- DeviceOps ---------------------------------------------------------------------------------
    def new_stream(self) -> str:
        name = f"side{next(self._names)}"
        self.clock[name] = {name: 0}
        return name

    def comm_stream(self) -> str:
        name = f"comm{next(self._names)}"
        self.clock[name] = dict(self.clock[self.current])  # NCCL waits the issuing stream
        self.clock[name][name] = 0
        return name

    @property
    def current(self) -> str:
        return self._stack[-1]

    @contextlib.contextmanager
    def on_stream(self, stream: str) -> Iterator[None]:
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def record_event(self, stream: str) -> dict[str, int]:
        return dict(self.clock[stream])

    def stream_waits_event(self, stream: str, event: dict[str, int] | None) -> None:
        if event is not None:
            self.waits += 1
            mine = self.clock[stream]
            for name, t in event.items():
                mine[name] = max(mine.get(name, 0), t)

    def stream_waits_current(self, stream: str) -> None:
        self.stream_waits_event(stream, self.record_event(self.current))

    def current_waits(self, event: dict[str, int] | None) -> None:
        self.stream_waits_event(self.current, event)

    def synchronize(self, stream: str) -> None:
        for name in self.clock:
            self.stream_waits_event(name, self.clock[stream])

    def keep_until_done(self, tensor: torch.Tensor, stream: str) -> None:
        block = self._block(tensor, fresh=False)
        if block is not None:
            block.protected.add(stream)

    # -- the checker -------------------------------------------------------------------------------
    def _knows(self, stream: str, access: tuple[str, int]) -> bool:
        name, t = access
        return name == stream or self.clock[stream].get(name, 0) >= t

    def _block(self, tensor: torch.Tensor, *, fresh: bool) -> _Block | None:
        if (not isinstance(tensor, torch.Tensor) or is_traceable_wrapper_subclass(tensor)
                or tensor.device.type != "cpu" or tensor.numel() == 0):
            return None
        storage = tensor.untyped_storage()
        if storage.data_ptr() == 0:
            return None
        ref = StorageWeakRef(storage)
        key = (ref.cdata, storage.data_ptr())
        block = self.blocks.get(key)
        if block is None and not fresh and tensor.dim() == 0:
            return None  # a Python number wrapped for one op (a host value on any device)
        if block is None or fresh or block.ref.expired():
            block = _Block(self.current if fresh else COMPUTE, ref, key,
                           f"{tuple(tensor.shape)} {tensor.dtype}")
            self.blocks[key] = block
        return block

    def access(self, tensor: torch.Tensor, *, write: bool, fresh: bool = False) -> None:
        block = self._block(tensor, fresh=fresh)
        if block is None:
            return
        s = self.current
        if fresh:
            self._reuse(s)
        self.clock[s][s] += 1
        now = (s, self.clock[s][s])
        self.accesses[s] = self.accesses.get(s, 0) + 1
        what = f"{'write' if write else 'read'} on {s} of a {tuple(tensor.shape)} tensor"
        if block.last_write is not None and not self._knows(s, block.last_write):
            self._flag(f"{what} races the write on {block.last_write[0]}")
        if write:
            for access in block.reads.items():
                if not self._knows(s, access):
                    self._flag(f"{what} races a read on {access[0]}")
            block.last_write, block.reads = now, {}
        else:
            block.reads[s] = now[1]
        block.used[s] = now[1]
        if s != block.alloc:
            self._watch[block.key] = block

    def freed(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is about to be released (``resize_(0)``)."""
        storage = tensor.untyped_storage()
        key = (StorageWeakRef(storage).cdata, storage.data_ptr())
        block = self.blocks.pop(key, None)
        self._watch.pop(key, None)
        if block is not None:
            self._check_free(block)

    def poll_frees(self) -> None:
        for key, block in list(self._watch.items()):
            if block.ref.expired():
                del self._watch[key]
                self.blocks.pop(key, None)
                self._check_free(block)

    def _check_free(self, block: _Block) -> None:
        """The caching allocator may hand the block to the next allocation on its stream: every
        other stream's use must be ordered before that allocation, or covered by a stream it was
        ``record_stream``-ed on (checked against that stream's work issued up to the free)."""
        unresolved = [
            access for access in block.used.items()
            if access[0] != block.alloc and not any(self._knows(p, access) for p in block.protected)
        ]
        if unresolved:
            self._reusable.setdefault(block.alloc, []).append((block.desc, unresolved))

    def _reuse(self, stream: str) -> None:
        """An allocation on ``stream``: it may reuse any block freed there so far."""
        for desc, unresolved in self._reusable.pop(stream, []):
            for access in unresolved:
                if not self._knows(stream, access):
                    self._flag(f"a {desc} block allocated on {stream} was freed while {access[0]} "
                               "may still use it (no event waited, no record_stream) and then "
                               f"reused by {stream}")

    def _flag(self, message: str) -> None:
        if len(self.violations) < 20:
            self.violations.append(message)


def _arguments(schema: Any, args: tuple, kwargs: dict) -> Iterator[tuple[Any, Any]]:
    for i, arg in enumerate(schema.arguments):
        if arg.kwarg_only or i >= len(args):
            if arg.name in kwargs:
                yield arg, kwargs[arg.name]
        else:
            yield arg, args[i]


def _storage_id(t: torch.Tensor) -> object:
    if is_traceable_wrapper_subclass(t) or t.device.type == "meta":
        return id(t)
    return t.untyped_storage().data_ptr() or id(t)


class StreamRaceMode(TorchDispatchMode):
    """Attribute each aten op to ``ops.current`` and check it (see the module docstring)."""

    def __init__(self, ops: CheckedOps) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ops = self.ops
        ops.poll_frees()
        out = func(*args, **kwargs)
        schema = func._schema
        writes, inputs = [], set()
        for arg, value in _arguments(schema, args, kwargs):
            alias = arg.alias_info
            for t in tree_flatten(value)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                inputs.add(_storage_id(t))
                if alias is not None and alias.is_write:
                    writes.append(t)
                elif alias is None:  # views only read metadata
                    ops.access(t, write=False)
        for t in writes:
            ops.access(t, write=True)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, value in zip(schema.returns, outs, strict=False):
            if ret.alias_info is None:  # a new tensor, allocated on the current stream
                for t in tree_flatten(value)[0]:  # (c10d ops return their inputs unannotated)
                    if isinstance(t, torch.Tensor):
                        fresh = _storage_id(t) not in inputs
                        ops.access(t, write=True, fresh=fresh)
        return out


@contextlib.contextmanager
def checking(ops: CheckedOps) -> Iterator[None]:
    """The race mode, plus explicit frees of unsharded storage reported to ``ops``."""
    original = matrix_param._free

    def free(t: torch.Tensor) -> None:
        ops.freed(t)
        original(t)

    matrix_param._free = free
    try:
        with StreamRaceMode(ops):
            yield
    finally:
        matrix_param._free = original
        ops.poll_frees()


# -- collectives as NCCL runs them ------------------------------------------------------------------
class _CommPending(Pending):
    def __init__(self, ops: CheckedOps, stream: str, inner: Pending) -> None:
        super().__init__()
        self._ops, self._stream, self._inner = ops, stream, inner

    def wait(self) -> None:
        self._ops.current_waits(self._ops.record_event(self._stream))
        self._inner.wait()  # a gloo wait (and a local sum on wait) runs after the join


class _CheckedOwnerComm(OwnerComm):
    def __init__(self, inner: OwnerComm, ops: CheckedOps) -> None:
        self.inner, self.ops = inner, ops
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter
        self.group = getattr(inner, "group", None)

    def _on_comm(self, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> str:
        stream = self.ops.comm_stream()
        with self.ops.on_stream(stream):
            for t in reads:
                self.ops.access(t, write=False)
            for t in writes:
                self.ops.access(t, write=True)
        return stream

    def all_gather_v(self, own, numels, *, async_op=False):
        segments, pending = self.inner.all_gather_v(own, numels, async_op=async_op)
        others = [s for r, s in enumerate(segments) if r != self.rank]
        stream = self._on_comm([own], others)
        return segments, _CommPending(self.ops, stream, pending)

    def all_gather_into(self, parts, *, async_op=False):
        pending = self.inner.all_gather_into(parts, async_op=async_op)
        others = [t for r, part in enumerate(parts) if r != self.rank for t in part]
        stream = self._on_comm(list(parts[self.rank]), others)
        return _CommPending(self.ops, stream, pending)

    def reduce_to_owners(self, flat, numels, *, async_op=False):
        owned, pending = self.inner.reduce_to_owners(flat, numels, async_op=async_op)
        stream = self._on_comm([flat], [flat])  # reduced in place (owned is a view of it)
        return owned, _CommPending(self.ops, stream, pending)

    def all_reduce_scalar(self, value, op="sum"):
        return self.inner.all_reduce_scalar(value, op)


class _CheckedReplicateComm(ReplicateComm):
    def __init__(self, inner: ReplicateComm, ops: CheckedOps) -> None:
        self.inner, self.ops = inner, ops
        self.rank, self.world_size, self.counter = inner.rank, inner.world_size, inner.counter

    def all_reduce(self, tensor, *, async_op=False):
        pending = self.inner.all_reduce(tensor, async_op=async_op)
        stream = self.ops.comm_stream()
        with self.ops.on_stream(stream):
            self.ops.access(tensor, write=False)
            self.ops.access(tensor, write=True)
        return _CommPending(self.ops, stream, pending)


def checked_comms(state: Any, ops: CheckedOps) -> None:
    """Route a wrapped model's matrix collectives through the NCCL model above; pin ``ops``."""
    state.streams.use_ops(ops)
    comm = _CheckedOwnerComm(state.comm, ops)
    replicate = None
    for group in state.groups:
        group.comm = comm
        if group.replicate is not None:
            replicate = replicate or _CheckedReplicateComm(group.replicate, ops)
            group.replicate = replicate


# -- host synchronisations -------------------------------------------------------------------------
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def count_host_syncs(host_resident: Callable[[torch.Tensor], bool] = lambda t: False,
                     ) -> Iterator[list[str]]:
    """Record each call of a host-synchronising ``torch.Tensor`` method (any thread).

    ``host_resident(t)``: ``t`` lives in host memory on every device (optimizer ``step``
    counters, as torch.optim keeps them), so reading it does not synchronise with a device.
    """
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counting(name: str, method: Any) -> Any:
        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not host_resident(self):
                calls.append(f"{name} of a {tuple(self.shape)} {self.dtype} tensor")
            return method(self, *args, **kwargs)
        return call

    for name, method in originals.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield calls
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
