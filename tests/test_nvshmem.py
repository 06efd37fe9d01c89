"""The NVSHMEM owner collectives on CPU: the pure schedule, a simulator of N PEs, the probe."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from matrixfsdp.collectives import nvshmem_backend
from matrixfsdp.collectives import nvshmem_schedule as sched
from matrixfsdp.collectives.base import CommCounter, OwnerComm, Pending
from matrixfsdp.collectives.nvshmem_backend import NvshmemOwnerComm, close_all, exit_timeout_s
from matrixfsdp.collectives.nvshmem_probe import (
    LocalFacts,
    ProbeReason,
    agree,
    local_reason,
    parse_size,
)
from matrixfsdp.collectives.nvshmem_schedule import (
    ALIGN,
    Ack,
    Consume,
    Ledger,
    Put,
    SegmentShape,
    Wait,
    gather_program,
    plan_heap,
    reduce_program,
    slot_of,
)
from matrixfsdp.collectives.nvshmem_sim import (
    Call,
    ScheduleViolationError,
    SimTransport,
    ThreadedWorld,
    simulate,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _random_numels(rng: random.Random, world: int) -> tuple[int, ...]:
    """Uneven segments, often empty (a rank owning nothing in a group), sometimes all empty."""
    return tuple(0 if rng.random() < 0.35 else rng.randint(1, 37) for _ in range(world))


def _random_calls(rng: random.Random, world: int, count: int) -> list[tuple[str, SegmentShape]]:
    return [(rng.choice(("gather", "reduce")),
             SegmentShape(_random_numels(rng, world), rng.choice((2, 4, 8))))
            for _ in range(count)]


# -- the pure schedule ------------------------------------------------------------------------------
def _programs(layout: sched.HeapLayout, calls: Sequence[tuple[str, SegmentShape]]
              ) -> list[list[sched.Program]]:
    """programs[call][pe], each PE building its own with its own ledger (as on the devices)."""
    ledgers = [Ledger(layout, r) for r in range(layout.world_size)]
    build = {"gather": gather_program, "reduce": reduce_program}
    return [[build[kind](layout, ledgers[r], shape) for r in range(layout.world_size)]
            for kind, shape in calls]


def _check_static(layout: sched.HeapLayout, calls: Sequence[tuple[str, SegmentShape]],
                  programs: list[list[sched.Program]]) -> None:
    world = layout.world_size
    received = [[0] * layout.signal_words for _ in range(world)]  # signal bumps per PE and word
    for (kind, shape), per_pe in zip(calls, programs, strict=True):
        written: dict[int, list[tuple[int, int]]] = {}
        expected_puts = 0
        for r in range(world):
            n_r = shape.numels[r]
            if kind == "gather":
                expected_puts += (world - 1) if n_r else 0
            else:
                expected_puts += sum(1 for q in range(world) if q != r and shape.numels[q])
        puts = [(r, a) for r, p in enumerate(per_pe) for a in p.actions if isinstance(a, Put)]
        assert len(puts) == expected_puts
        for r, put in puts:
            assert put.dst_offset % ALIGN == 0 and put.nbytes <= layout.slot_bytes
            assert put.dst_offset + put.nbytes <= layout.data_bytes
            slot = put.dst_offset // layout.slot_bytes
            assert slot % layout.slots == slot_of(r, put.pe), "a writer left its own slot"
            assert put.signal_word == layout.ready_word(per_pe[r].buffer, slot % layout.slots)
            # the source bytes are this PE's own segment (gather) / the destination's (reduce)
            seg = shape.numels[r] if kind == "gather" else shape.numels[put.pe]
            assert put.nbytes == seg * shape.itemsize
            if kind == "reduce":
                assert put.src_offset == sum(shape.numels[: put.pe]) * shape.itemsize
            for lo, hi in written.get(put.pe, []):
                assert put.dst_offset + put.nbytes <= lo or hi <= put.dst_offset, "writes overlap"
            written.setdefault(put.pe, []).append((put.dst_offset, put.dst_offset + put.nbytes))
            received[put.pe][put.signal_word] += 1
        for program in per_pe:
            for action in program.actions:
                if isinstance(action, Ack):
                    received[action.pe][action.word] += 1
        for r, program in enumerate(per_pe):
            for action in program.actions:
                if isinstance(action, Wait) and action.word % layout.words_per_buffer < layout.slots:
                    # a ready wait targets exactly the puts that reached the word so far
                    assert action.at_least == received[r][action.word]
            consumed = [a for a in program.actions if isinstance(a, Consume)]
            n_sources = sum(len(c.slots) for c in consumed)
            assert n_sources == sum(1 for a in program.actions if isinstance(a, Ack))
            if kind == "reduce" and shape.numels[r]:
                assert n_sources == world - 1  # every other rank contributes, zeros included
    # every credit wait asks for no more acks than the PE's puts into that buffer earned
    for r in range(world):
        puts_by_buffer = [0] * layout.buffers
        for per_pe in programs:
            program = per_pe[r]
            for action in program.actions:
                if isinstance(action, Wait) and action.word == layout.credit_word(program.buffer):
                    assert action.at_least == puts_by_buffer[program.buffer]
                if isinstance(action, Put):
                    puts_by_buffer[program.buffer] += 1


def test_schedule_static_properties_on_random_plans() -> None:
    rng = random.Random(0)
    for trial in range(300):
        world = rng.randint(1, 8)
        calls = _random_calls(rng, world, rng.randint(1, 7))
        layout = plan_heap([s for _, s in calls], world, buffers=rng.choice((1, 2, 3)))
        assert layout.slot_bytes % ALIGN == 0 and layout.total_bytes > 0, trial
        assert layout.slot_bytes >= max(max(s.numels) * s.itemsize for _, s in calls)
        _check_static(layout, calls, _programs(layout, calls))


def test_layout_is_rank_independent_and_validated() -> None:
    shapes = [SegmentShape((3, 0, 9), 4), SegmentShape((4, 4, 0), 2)]
    layout = plan_heap(shapes, 3)
    assert layout == plan_heap(list(reversed(shapes)), 3)  # same heap on every PE
    assert layout.slot_bytes == ALIGN and layout.data_bytes == 2 * 2 * ALIGN
    assert layout.signal_words == 2 * 3
    with pytest.raises(ValueError, match="world size"):
        plan_heap([SegmentShape((1, 2), 4)], 3)
    with pytest.raises(ValueError, match="exceeds the heap's slot"):
        gather_program(layout, Ledger(layout, 0), SegmentShape((100, 0, 0), 4))
    with pytest.raises(ValueError, match="slot_bytes"):
        sched.HeapLayout(2, 100)


# -- the simulator ----------------------------------------------------------------------------------
def _make_inputs(rng: torch.Generator, kind: str, shape: SegmentShape, dtype: torch.dtype,
                 world: int) -> Call:
    if kind == "gather":
        return Call.gather([torch.randn(n, generator=rng).to(dtype) for n in shape.numels])
    flats = [torch.randn(sum(shape.numels), generator=rng).to(dtype) for _ in range(world)]
    return Call.reduce(flats, shape.numels)


def _check_results(call: Call, results: list, world: int) -> None:
    starts = sched.segment_offsets(call.numels)
    for r in range(world):
        if call.kind == "gather":
            for s in range(world):
                assert torch.equal(results[r][s], call.inputs[s]), (r, s)  # bit for bit
            continue
        lo, hi = starts[r], starts[r] + call.numels[r]
        want = sum(f[lo:hi].double() for f in call.inputs)
        got = results[r]
        tol = 1e-2 if got.element_size() == 2 else 1e-5
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        # the fixed rank order: sum(ranks 0..N-1) exactly as consume_reduce defines it
        acc = call.inputs[0][lo:hi].to(torch.float32 if got.element_size() < 4 else got.dtype)
        for f in call.inputs[1:]:
            acc = acc + f[lo:hi]
        assert torch.equal(got, acc.to(got.dtype))


def test_simulator_matches_collective_semantics_under_random_interleavings() -> None:
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    for trial in range(60):
        world = rng.randint(2, 6)
        shapes = _random_calls(rng, world, rng.randint(2, 6))
        calls, kinds = [], []
        for kind, shape in shapes:
            dtype = {2: rng.choice((torch.bfloat16, torch.float16)), 4: torch.float32,
                     8: torch.float64}[shape.itemsize]
            calls.append(_make_inputs(gen, kind, shape, dtype, world))
            kinds.append(kind)
        layout = plan_heap([c.shape() for c in calls], world, buffers=rng.choice((1, 2)))
        first = simulate(layout, calls, seed=trial)
        for call, per_rank in zip(calls, first, strict=True):
            _check_results(call, per_rank, world)
        again = simulate(layout, calls, seed=trial + 1000)  # another interleaving
        for call, a, b in zip(calls, first, again, strict=True):
            for r in range(world):
                if call.kind == "reduce":
                    assert torch.equal(a[r], b[r]), "reduction not deterministic across runs"


def test_simulator_catches_a_schedule_without_credits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop the write-after-read credit waits: some interleaving overwrites unconsumed data."""
    real = sched._puts

    def no_credit(*args: object) -> list:
        return [a for a in real(*args) if not isinstance(a, Wait)]

    monkeypatch.setattr(sched, "_puts", no_credit)
    gen = torch.Generator().manual_seed(0)
    calls = [Call.gather([torch.randn(5, generator=gen), torch.randn(3, generator=gen)])
             for _ in range(4)]
    layout = plan_heap([c.shape() for c in calls], 2, buffers=1)
    failures = 0
    for seed in range(40):
        try:
            simulate(layout, calls, seed=seed)
        except ScheduleViolationError:
            failures += 1
    assert failures > 0


# -- the backend class over threads (one per PE) ----------------------------------------------------
class _CountingFallback(OwnerComm):
    """A stand-in torch communicator: records which calls the NVSHMEM comm handed over."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size, self.counter = rank, world, CommCounter()
        self.calls: list[str] = []

    def all_gather_v(self, own, numels, *, async_op=False):  # type: ignore[override]
        self.calls.append("all_gather_v")
        return [own if r == self.rank else own.new_zeros(n) for r, n in enumerate(numels)], Pending()

    def reduce_to_owners(self, flat, numels, *, async_op=False):  # type: ignore[override]
        self.calls.append("reduce_to_owners")
        start = sum(numels[: self.rank])
        return flat[start : start + numels[self.rank]], Pending()

    def all_reduce_scalar(self, value, op="sum"):  # type: ignore[override]
        self.calls.append("all_reduce_scalar")
        return value


def _run_threads(world: int, fn: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:  # surface every rank's failure
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def test_owner_comm_runs_unchanged_on_threaded_pes() -> None:
    world = 3
    numel_sets = [(4, 0, 7), (0, 0, 5), (6, 6, 6), (0, 0, 0)]
    layout = plan_heap([SegmentShape(n, 4) for n in numel_sets], world)
    shared = ThreadedWorld(layout)
    data = {(r, i): torch.randn(sum(n)) for r in range(world) for i, n in enumerate(numel_sets)}
    fallbacks = [_CountingFallback(r, world) for r in range(world)]
    outputs: dict[tuple[int, int], list[torch.Tensor]] = {}

    def rank_fn(rank: int) -> None:
        comm = NvshmemOwnerComm(shared.transport(rank), layout, fallback=fallbacks[rank])
        pending = []
        for i, numels in enumerate(numel_sets):  # async gathers then async reductions, in order
            start = sum(numels[:rank])
            own = data[(rank, i)][start : start + numels[rank]]
            pending.append(comm.all_gather_v(own, numels, async_op=True))
        reduced = [comm.reduce_to_owners(data[(rank, i)].clone(), numels, async_op=True)
                   for i, numels in enumerate(numel_sets)]
        for i, (segments, p) in enumerate(pending):
            p.wait()
            outputs[(rank, i)] = segments
        for i, (own, p) in enumerate(reduced):
            p.wait()
            outputs[(rank, 100 + i)] = [own]
        big = comm.all_gather_v(torch.ones(64), (64, 64, 64))[0]  # beyond the heap: fallback
        assert len(big) == world
        comm.all_reduce_scalar(torch.ones(()))
        comm.close()
        assert shared.transport(rank).heap is shared.heaps[rank]

    _run_threads(world, rank_fn)
    for i, numels in enumerate(numel_sets):
        starts = sched.segment_offsets(numels)
        for rank in range(world):
            for src in range(world):
                want = data[(src, i)][starts[src] : starts[src] + numels[src]]
                assert torch.equal(outputs[(rank, i)][src], want)
            lo, hi = starts[rank], starts[rank] + numels[rank]
            total = sum(data[(r, i)][lo:hi].double() for r in range(world))
            torch.testing.assert_close(outputs[(rank, 100 + i)][0].double(), total)
    assert all(f.calls == ["all_gather_v", "all_reduce_scalar"] for f in fallbacks)
    assert fallbacks[0].counter.by_op["all_gather_v"].calls == len(numel_sets)


def test_gather_into_parts_on_threaded_pes() -> None:
    """``OwnerComm.all_gather_into``'s default (the NVSHMEM comm uses it): each segment given as
    its matrices; the owner's are packed and sent, every peer's land in the tensors named."""
    world = 3
    sizes = [[4, 3], [], [5]]  # rank 1 owns nothing in this group
    layout = plan_heap([SegmentShape(tuple(sum(s) for s in sizes), 4)], world)
    shared = ThreadedWorld(layout)
    values = [[torch.randn(n) for n in owned] for owned in sizes]
    got: dict[tuple[int, bool], list[list[torch.Tensor]]] = {}

    def rank_fn(rank: int) -> None:
        comm = NvshmemOwnerComm(shared.transport(rank), layout,
                                fallback=_CountingFallback(rank, world))
        for async_op in (True, False):
            parts = [[v.clone() if r == rank else torch.zeros_like(v) for v in values[r]]
                     for r in range(world)]
            pending = comm.all_gather_into(parts, async_op=async_op)
            pending.wait()
            pending.wait()  # idempotent
            got[(rank, async_op)] = parts
        comm.close()

    _run_threads(world, rank_fn)
    for (rank, async_op), parts in got.items():
        for r in range(world):
            for want, have in zip(values[r], parts[r], strict=True):
                assert torch.equal(have, want), (rank, async_op, r)


# -- the bounded exit path --------------------------------------------------------------------------
class _PeerGoneTransport(SimTransport):
    """A PE whose closing barrier waits for a peer that is gone (until ``peer_arrives`` is set)."""

    def __init__(self, world: ThreadedWorld, rank: int) -> None:
        super().__init__(world, rank)
        self.peer_arrives = threading.Event()

    def close(self) -> None:
        self.peer_arrives.wait()  # the barrier: returns only when the peer shows up
        super().close()


def _exit_comms(world: ThreadedWorld) -> tuple[NvshmemOwnerComm, NvshmemOwnerComm]:
    stuck = NvshmemOwnerComm(_PeerGoneTransport(world, 0), world.layout,
                             fallback=_CountingFallback(0, 2))
    after = NvshmemOwnerComm(world.transport(0), world.layout, fallback=_CountingFallback(0, 2))
    return stuck, after


def test_exit_path_gives_up_on_a_dead_peer(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """A barrier that never returns: the exit path returns within its bound, warns, and frees
    (finalises) nothing later, even when the stuck barrier returns after the deadline."""
    monkeypatch.setattr(nvshmem_backend, "_EXIT_EXPIRED", threading.Event())
    world = ThreadedWorld(plan_heap([SegmentShape((3, 5), 4)], 2))
    stuck, after = _exit_comms(world)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=nvshmem_backend.__name__):
        assert close_all(timeout_s=0.3) is False
    assert time.monotonic() - start < 2.0
    assert "did not finish within 0.3 s" in caplog.text and "without" in caplog.text
    stuck.transport.peer_arrives.set()  # the peer shows up after the deadline
    for thread in threading.enumerate():
        if thread.name == "matrixfsdp-nvshmem-exit":
            thread.join(5)
    assert stuck.transport.closed and not after.transport.closed, "closed after the deadline"
    nvshmem_backend._EXIT_EXPIRED.clear()
    assert close_all(timeout_s=5.0) is True and after.transport.closed  # live peers: in time
    assert close_all() is True  # nothing left open


def test_exit_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(nvshmem_backend.EXIT_TIMEOUT_ENV, raising=False)
    assert exit_timeout_s() == nvshmem_backend.DEFAULT_EXIT_TIMEOUT_S
    monkeypatch.setenv(nvshmem_backend.EXIT_TIMEOUT_ENV, "0.25")
    assert exit_timeout_s() == 0.25
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(nvshmem_backend.EXIT_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"MATRIXFSDP_NVSHMEM_EXIT_TIMEOUT_S='{bad}'"):
            exit_timeout_s()


_EXITING_PROCESS = """
import logging, time
logging.basicConfig(level=logging.WARNING)
from matrixfsdp.collectives.nvshmem_backend import NvshmemOwnerComm
from matrixfsdp.collectives.nvshmem_schedule import SegmentShape, plan_heap
from matrixfsdp.collectives.nvshmem_sim import ThreadedWorld
from tests.test_nvshmem import _exit_comms
world = ThreadedWorld(plan_heap([SegmentShape((3, 5), 4)], 2))
comms = _exit_comms(world)  # open at exit; the first one's barrier never returns
print(f"exiting at {time.time()}", flush=True)
"""


def test_process_with_a_dead_peer_exits_within_the_bound() -> None:
    """The real ``atexit`` handler: the interpreter exits (status 0) once the bound expires."""
    bound = 1.0
    env = {**os.environ, nvshmem_backend.EXIT_TIMEOUT_ENV: str(bound), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXITING_PROCESS)], env=env,
                          capture_output=True, text=True, timeout=120)
    exited = time.time()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "did not finish within 1 s" in proc.stderr, proc.stderr
    started_exit = float(proc.stdout.split("exiting at ")[1])
    assert exited - started_exit < bound + 10.0, f"exit took {exited - started_exit:.1f} s"


# -- the capability probe ---------------------------------------------------------------------------
def _facts(**overrides: object) -> LocalFacts:
    base = dict(rank=0, cuda_available=True, device_type="cuda", import_error=None,
                heap_required=1 << 20, heap_available=1 << 30, hosts=("a", "a"), devices=(0, 1),
                peer_access=True)
    base.update(overrides)
    return LocalFacts(**base)  # type: ignore[arg-type]


def test_probe_reasons() -> None:
    assert local_reason(_facts()) == (ProbeReason.OK, "")
    cases = {
        ProbeReason.NO_CUDA: _facts(cuda_available=False),
        ProbeReason.NOT_CUDA_MESH: _facts(device_type="cpu"),
        ProbeReason.PACKAGE_MISSING: _facts(import_error="ModuleNotFoundError: nvshmem"),
        ProbeReason.HEAP_TOO_SMALL: _facts(heap_required=3 << 30),
        ProbeReason.SPANS_NODES: _facts(hosts=("a", "b")),
        ProbeReason.SHARED_DEVICE: _facts(devices=(0, 0)),
        ProbeReason.NO_PEER_ACCESS: _facts(peer_access=False),
    }
    for reason, facts in cases.items():
        got, detail = local_reason(facts)
        assert got is reason and detail, reason
        assert reason.describe()
    assert "NVSHMEM_SYMMETRIC_SIZE=3072M" in local_reason(cases[ProbeReason.HEAP_TOO_SMALL])[1]
    assert agree([0, 3, 1, 3]) == (ProbeReason.PACKAGE_MISSING, 1)
    assert agree([0, 0]) == (ProbeReason.OK, 0)
    assert parse_size(None) == 1 << 30 and parse_size("2G") == 2 << 30
    assert parse_size("512m") == 512 << 20 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE"):
        parse_size("lots")
