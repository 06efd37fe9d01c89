"""Counting collectives (torch.profiler backend events), timing them, and reading process RSS.

[Note: what a collective "costs" in the tables]
Every backend collective is counted from the profiler's ``gloo:*`` / ``nccl:*`` events (FSDP2's,
DTensor's and the library's alike), with the input shape and dtype the backend recorded. Bytes are
*received from peers by one rank*, under each operation's semantics with direct exchange
(N = group size, s = this rank's input bytes, n = the whole buffer):

- all_gather: (N-1)·s          - all_reduce: 2(N-1)/N·n (ring; gloo runs FSDP2's
- reduce_scatter: (N-1)/N·n      reduce-scatter as an all-reduce of the whole buffer)
- all_to_all: this rank's output bytes (the output size comes from the matching
  ``c10d::alltoall_base_`` event; the DistMuon baseline also carries each rank's own rows to
  itself, a local copy the output size includes). matrixfsdp's *exchange* (one
  ``batch_isend_irecv`` of sends and receives, see ``TorchOwnerComm``) counts as one all_to_all:
  its ``send``/``recv`` events' bytes (recorded by a wrapper while counting), nothing to itself
- broadcast: n on non-roots, 0 on the root;  reduce: (N-1)·n on the root, 0 elsewhere (the root
  is recorded by a wrapper around ``torch.distributed.broadcast``/``reduce`` while counting)
Tables show the busiest rank. ``size`` is the op's logical size (all_gather: the output; all_to_all:
max(in, out); the rest: n), the x of the α–β fit in ``costmodel``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from matrixfsdp.memory import (
    peak_rss_bytes,
    pin_malloc_mmap_threshold,
    reset_peak_rss,
    rss_bytes,
)

__all__ = [
    "Collective",
    "count_by_dim",
    "count_collectives",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
    "summarize",
    "time_collectives",
    "track_live_memory",
]

_ITEMSIZE = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long": 8, "int": 4,
    "short": 2, "unsigned char": 1, "signed char": 1, "bool": 1,
}
_BACKENDS = ("gloo:", "nccl:")


@dataclass(frozen=True)
class Collective:
    """One backend collective as one rank saw it."""

    phase: str
    op: str
    size: int
    recv: int
    sent: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nbytes(shapes: list[Any], dtypes: list[str]) -> int:
    total = 0
    for shape, dtype in zip(shapes, dtypes, strict=False):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
            numel = 1
            for d in shape:
                numel *= d
            total += numel * _ITEMSIZE.get(dtype, 4)
    return total


@contextlib.contextmanager
def _batch_log() -> Iterator[list[Collective]]:
    """Record every ``dist.batch_isend_irecv`` call as one all_to_all (phase left empty)."""
    log: list[Collective] = []
    original = dist.batch_isend_irecv

    def wrapper(ops: list[Any]) -> Any:
        _log_exchange(log, _exchange_record("", ops), ops)
        return original(ops)

    dist.batch_isend_irecv = wrapper
    try:
        yield log
    finally:
        dist.batch_isend_irecv = original


def _log_exchange(log: list[Any], record: Any, ops: list[Any]) -> None:
    """Append ``record`` (a ``Collective`` or count_by_dim's ``(dim, Collective)``), except that a
    batch of receives only (a later round of a reduction in rounds, ``TorchOwnerComm``) adds its
    bytes to the last exchange logged: one reduction, one call, as in the schedule."""
    if all(o.op is dist.irecv for o in ops):
        for i in range(len(log) - 1, -1, -1):
            entry = log[i]
            last = entry[1] if isinstance(entry, tuple) else entry
            if last.op == "all_to_all":
                rec = record[1] if isinstance(record, tuple) else record
                merged = dataclasses.replace(last, recv=last.recv + rec.recv,
                                             size=max(last.size, last.recv + rec.recv))
                log[i] = (entry[0], merged) if isinstance(entry, tuple) else merged
                return
    log.append(record)


def _exchange_record(phase: str, ops: list[Any]) -> Collective:
    sent = sum(o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.isend)
    recv = sum(o.tensor.numel() * o.tensor.element_size() for o in ops if o.op is dist.irecv)
    return Collective(phase, "all_to_all", max(sent, recv), recv, sent)


@contextlib.contextmanager
def _rooted_log() -> Iterator[list[tuple[str, int, bool]]]:
    """Record (op, bytes, am_root) of every ``dist.broadcast``/``dist.reduce`` call, in call
    order (see ``_take_root`` for how they are matched with the profiler's events)."""
    log: list[tuple[str, int, bool]] = []
    originals = {"broadcast": dist.broadcast, "reduce": dist.reduce}

    def wrap(op: str, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            root = kwargs.get(key, args[0] if args else None)
            log.append((op, tensor.numel() * tensor.element_size(), root == dist.get_rank()))
            return fn(tensor, *args, **kwargs)

        return wrapper

    dist.broadcast = wrap("broadcast", originals["broadcast"], "src")
    dist.reduce = wrap("reduce", originals["reduce"], "dst")
    try:
        yield log
    finally:
        dist.broadcast, dist.reduce = originals["broadcast"], originals["reduce"]


def count_collectives(phase: str, fn: Callable[[], Any], world: int) -> tuple[Any, list[Collective]]:
    """Run ``fn()`` under the profiler; return its result and every backend collective it issued."""
    with _rooted_log() as roots, _batch_log() as batches, profile(
            activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    a2a_out = [_nbytes(e.shapes()[:1], e.dtypes()[:1]) for e in events
               if e.name() == "c10d::alltoall_base_"]
    backend = [e for e in events if e.name().startswith(_BACKENDS)]
    pending_roots = list(roots)
    out = [Collective(phase, b.op, b.size, b.recv, b.sent) for b in batches]
    for e in backend:
        op = e.name().split(":", 1)[1]
        s = _nbytes(e.shapes(), e.dtypes())
        if op in ("send", "recv"):  # parts of a logged exchange
            continue
        if op == "all_to_all":
            o = a2a_out.pop(0) if a2a_out else s
            out.append(Collective(phase, op, max(s, o), o, s))
        elif op in ("broadcast", "reduce"):
            am_root = _take_root(pending_roots, op, s)
            many = (world - 1) * s
            recv = (many if am_root else 0) if op == "reduce" else (0 if am_root else s)
            sent = (s if not am_root else 0) if op == "reduce" else (many if am_root else 0)
            out.append(Collective(phase, op, s, recv, sent))
        else:
            out.append(_symmetric(phase, op, s, world))
    return result, out


def _take_root(pending: list[tuple[str, int, bool]], op: str, nbytes: int) -> bool:
    """Whether this rank was the root of the profiler event ``op`` of ``nbytes``: the first
    logged call of that op and size. Events are ordered by start time, which for asynchronous
    calls on gloo's worker threads need not be call order; calls of one size are
    interchangeable for the byte counts (one root, one receiver either way)."""
    for i, (o, size, am_root) in enumerate(pending):
        if o == op and size == nbytes:
            del pending[i]
            return am_root
    for i, (o, _, am_root) in enumerate(pending):
        if o == op:
            del pending[i]
            return am_root
    return False


_DIM_OPS = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
            "reduce_scatter_tensor", "all_reduce", "all_to_all_single", "broadcast", "reduce")


def _dist_record(phase: str, op: str, bound: inspect.BoundArguments, n: int,
                 group: Any) -> Collective:
    """One ``torch.distributed`` call as a ``Collective`` (the profiler-count conventions of the
    Note, with the call's own group size ``n``)."""
    values = list(bound.arguments.values())
    first = values[0]  # the output (or the in-place tensor) of every op counted here
    nbytes = first.numel() * first.element_size()
    if op in ("all_gather_single", "all_gather_into_tensor"):
        return _symmetric(phase, "all_gather", nbytes // n, n)
    if op in ("reduce_scatter_single", "reduce_scatter_tensor"):
        inp = values[1].numel() * values[1].element_size()
        gloo = "gloo" in str(dist.get_backend(group))  # gloo reduce-scatters by an all-reduce
        return _symmetric(phase, "all_reduce" if gloo else "reduce_scatter", inp, n)
    if op == "all_reduce":
        return _symmetric(phase, "all_reduce", nbytes, n)
    if op == "all_to_all_single":
        sent = values[1].numel() * values[1].element_size()
        return Collective(phase, "all_to_all", max(sent, nbytes), nbytes, sent)
    a = bound.arguments
    key = "src" if op == "broadcast" else "dst"
    root = a.get(key)
    if root is None and a.get(f"group_{key}") is not None:
        root = dist.get_global_rank(group or dist.group.WORLD, a[f"group_{key}"])
    am_root = root == dist.get_rank()
    many = (n - 1) * nbytes
    if op == "broadcast":
        return Collective(phase, op, nbytes, 0 if am_root else nbytes, many if am_root else 0)
    return Collective(phase, op, nbytes, many if am_root else 0, 0 if am_root else nbytes)


@contextlib.contextmanager
def count_by_dim(dims: dict[tuple[int, ...], str],
                 phase: str) -> Iterator[list[tuple[str, Collective]]]:
    """Every ``torch.distributed`` collective call made in the block, with the mesh dim of its
    group: ``dims`` maps a group's global ranks to its dim name (other groups: "other").

    Unlike the profiler's events these know their group's size, so HSDP strategies (groups
    smaller than the world) are counted exactly. Functional collectives (DTensor
    redistribution) do not pass through here.
    """
    out: list[tuple[str, Collective]] = []
    originals = {op: getattr(dist, op) for op in _DIM_OPS if hasattr(dist, op)}
    signatures = {op: inspect.signature(fn) for op, fn in originals.items()}

    def wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signatures[op].bind(*args, **kwargs)
            group = bound.arguments.get("group")
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            out.append((dims.get(ranks, "other"),
                        _dist_record(phase, op, bound, len(ranks), group)))
            return fn(*args, **kwargs)

        return wrapper

    def wrap_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(ops: list[Any]) -> Any:
            ranks = tuple(dist.get_process_group_ranks(ops[0].group or dist.group.WORLD))
            _log_exchange(out, (dims.get(ranks, "other"), _exchange_record(phase, ops)), ops)
            return fn(ops)

        return wrapper

    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    for op, fn in originals.items():
        setattr(dist, op, wrap_batch(fn) if op == "batch_isend_irecv" else wrap(op, fn))
    try:
        yield out
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)


def _symmetric(phase: str, op: str, s: int, world: int) -> Collective:
    if op == "all_gather":
        return Collective(phase, op, world * s, (world - 1) * s, (world - 1) * s)
    if op == "all_reduce":
        v = 2 * (world - 1) * s // world
        return Collective(phase, op, s, v, v)
    if op == "reduce_scatter":
        v = (world - 1) * s // world
        return Collective(phase, op, s, v, v)
    return Collective(phase, op, s, s, s)


def summarize(records: list[Collective]) -> dict[str, dict[str, int]]:
    """Calls and bytes per phase: ``{phase: {"calls", "recv", "sent"}}``."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        slot = out.setdefault(r.phase, {"calls": 0, "recv": 0, "sent": 0})
        slot["calls"] += 1
        slot["recv"] += r.recv
        slot["sent"] += r.sent
    return out


def time_collectives(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """Wall time of each collective kind at each size (bytes of fp32 data), on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    samples = []
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)
        cases: dict[str, tuple[Callable[[], Any], int]] = {
            "all_gather": (_ag(n, world), n * 4),
            "all_reduce": (lambda n=n: dist.all_reduce(torch.ones(n)), n * 4),
            "all_to_all": (_a2a(n, world, rank), n * 4 * (world - 1) // world),
            "broadcast": (lambda n=n: dist.broadcast(torch.ones(n), src=0), n * 4),
            "reduce": (lambda n=n: dist.reduce(torch.ones(n), dst=0), n * 4),
        }
        for op, (fn, size) in cases.items():
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            samples.append({"op": op, "size": size, "seconds": statistics.median(times[1:])})
    return samples


def _ag(n: int, world: int) -> Callable[[], Any]:
    def run() -> None:
        out = torch.empty(n)
        dist.all_gather_into_tensor(out, torch.ones(n // world))

    return run


def _a2a(n: int, world: int, rank: int) -> Callable[[], Any]:
    """Even all-to-all that, like the strategies', sends nothing to the rank itself."""
    part = n // world
    splits = [0 if r == rank else part for r in range(world)]

    def run() -> None:
        out = torch.empty(part * (world - 1))
        dist.all_to_all_single(out, torch.ones(part * (world - 1)), splits, splits)

    return run


# -- process memory ---------------------------------------------------------------------------------
# The library's own helpers (matrixfsdp.memory), under the names this package has always used.
track_live_memory = pin_malloc_mmap_threshold
