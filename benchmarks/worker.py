"""What each rank runs: the interleaved timing world (strategies, single-process references,
contention probe, collective microbenchmark) and the per-strategy memory worlds."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.memory import LiveBytesTracker

from .config import BenchConfig
from .measure import (
    count_by_dim,
    count_collectives,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    time_collectives,
    track_live_memory,
)
from .model import build_gpt, global_tokens, lm_loss, local_tokens
from .step_memory import owner_step_transients
from .strategies import Strategy, StrategyContext, build_strategy, owner_plan
from .strategies.base import MatrixStepper

__all__ = ["Reference", "memory_worker", "reference_round", "timing_worker"]


def _context(rank: int, world: int, cfg: BenchConfig) -> tuple[torch.nn.Module, StrategyContext]:
    torch.manual_seed(cfg.seed)
    base = build_gpt(cfg.model)
    mesh = init_device_mesh("cpu", (world,))
    return base, StrategyContext(cfg.optim, rank, world, mesh, owner_plan(base, world, cfg.optim.name),
                                 hsdp_replicate=cfg.hsdp_replicate)


def _tokens(cfg: BenchConfig, step: int, rank: int, world: int) -> torch.Tensor:
    return local_tokens(global_tokens(cfg.model, step, cfg.global_batch, cfg.seed), rank, world)


def timed_step(s: Strategy, tokens: torch.Tensor) -> dict[str, float]:
    """One training step with phase times (wall and process CPU); barriers fence the phases."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = s.forward(tokens)
    t1 = time.perf_counter()
    s.backward(loss)
    t2, c2 = time.perf_counter(), time.process_time()
    dist.barrier()
    t3, c3 = time.perf_counter(), time.process_time()
    s.step()
    s.zero_grad()
    t4, c4 = time.perf_counter(), time.process_time()
    return {"forward": t1 - t0, "fwd_bwd": t2 - t0, "optimizer": t4 - t3,
            "fwd_bwd_cpu": c2 - c0, "optimizer_cpu": c4 - c3, "loss": loss.item()}


def counted_step(s: Strategy, tokens: torch.Tensor, world: int) -> dict[str, Any]:
    """One step under the profiler, phase by phase; resident bytes after the optimizer step;
    every ``torch.distributed`` call with its mesh dim (``by_dim``: calls and bytes received per
    phase and dim). A strategy with groups smaller than the world (HSDP) is counted from those
    calls, which know their group sizes; the rest from the profiler's backend events."""
    dist.barrier()
    dims = s.mesh_dims()
    calls: list[tuple[str, Any]] = []
    with count_by_dim(dims, "forward") as tally:
        loss, fwd = count_collectives("forward", lambda: s.forward(tokens), world)
    calls += tally
    with count_by_dim(dims, "backward") as tally:
        _, bwd = count_collectives("backward", lambda: s.backward(loss), world)
    calls += tally
    with count_by_dim(dims, "optimizer") as tally:
        _, opt = count_collectives("optimizer", s.step, world)
    calls += tally
    resident = s.resident_bytes()
    s.zero_grad()
    by_dim: dict[str, dict[str, dict[str, int]]] = {}
    for dim, c in calls:
        slot = by_dim.setdefault(c.phase, {}).setdefault(dim, {"calls": 0, "recv": 0})
        slot["calls"] += 1
        slot["recv"] += c.recv
    counted = fwd + bwd + opt
    if len(set(dims.values())) > 1:
        counted = [c for _, c in calls]
    return {"collectives": [c.as_dict() for c in counted], "resident": resident,
            "loss": loss.item(), "by_dim": by_dim}


def timing_worker(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any]:
    """Every strategy in one world, stepped round-robin (order rotated each round)."""
    base, ctx = _context(rank, world, cfg)
    strategies = {n: build_strategy(n, copy.deepcopy(base), ctx) for n in cfg.strategies}
    ref = Reference(base, ctx) if rank == 0 else None
    del base
    names = list(cfg.strategies)
    records: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    references = []
    for step in range(cfg.warmup + cfg.steps):
        tokens = _tokens(cfg, step, rank, world)
        k = step % len(names)
        for name in names[k:] + names[:k]:
            rec = timed_step(strategies[name], tokens)
            rec["measured"] = float(step >= cfg.warmup)
            records[name].append(rec)
        rec = reference_round(ref, tokens)
        if step >= cfg.warmup:
            references.append(rec)
    tokens = _tokens(cfg, cfg.warmup + cfg.steps, rank, world)
    counted = {}
    for name, s in strategies.items():
        runtime = mf.get_state(s.model) if mf.is_matrix_wrapped(s.model) else None
        if runtime is not None:
            runtime.comm.counter.reset()
        counted[name] = counted_step(s, tokens, world)
        if runtime is not None:
            counter = runtime.comm.counter
            counted[name]["library_counter"] = counter.snapshot()
            counted[name]["library_by_dim"] = {d: counter.snapshot(d) for d in counter.by_dim}
    owned = [p.fqn for p in ctx.plan.owned_by(rank)]
    shard = world // cfg.hsdp_replicate if world % cfg.hsdp_replicate == 0 else world
    hsdp_plan = owner_plan(build_gpt(cfg.model), shard, cfg.optim.name)  # shapes only
    return {"rank": rank, "records": records, "counted": counted, "owned": owned,
            "owned_hsdp": [p.fqn for p in hsdp_plan.owned_by(rank % shard)],
            "hsdp_replicate": world // shard,
            "references": references,
            "comm_samples": time_collectives(cfg.comm_sizes, cfg.comm_repeats)}


def memory_worker(rank: int, world: int, cfg: BenchConfig, name: str) -> dict[str, Any]:
    """One strategy alone in a fresh process: peak memory *during* each phase of a step.

    After the warm-up steps (so optimizer state exists), one step phase by phase with the
    kernel's RSS high-water mark reset before each phase (glibc told to unmap freed memory at once,
    so RSS follows live memory), then one step under a ``LiveBytesTracker`` that follows every
    tensor (live tensor bytes; parameters, gradients and optimizer state included), recording
    each owner step call's transient bytes (``step_memory.owner_step_transients``).
    """
    live = track_live_memory()
    before = rss_bytes()
    reset_ok = reset_peak_rss()
    base, ctx = _context(rank, world, cfg)
    s = build_strategy(name, base, ctx)
    del base
    step = 0
    for step in range(max(cfg.warmup, 1)):
        timed_step(s, _tokens(cfg, step, rank, world))
    rss = _phase_peaks(s, _tokens(cfg, step + 1, rank, world))
    tracked = s.resident_tensors()
    tracker = LiveBytesTracker().track(*tracked.values())
    start = tracker.current
    with tracker, owner_step_transients(tracker) as owner_steps:
        _phase_peaks(s, _tokens(cfg, step + 2, rank, world), tracker)
    return {"rank": rank, "rss_before": before, "peak_rss": max(rss.values()),
            "rss_by_phase": rss, "live_start": start,
            "live_by_phase": {ph: p.peak for ph, p in tracker.phases.items()},
            "owner_steps": owner_steps, "hwm_reset": reset_ok, "live_tracking": live}


def _phase_peaks(s: Strategy, tokens: torch.Tensor,
                 tracker: LiveBytesTracker | None = None) -> dict[str, int]:
    """One step; the RSS high-water mark of each phase (and the tracker's phases if given)."""
    peaks: dict[str, int] = {}
    state: dict[str, Any] = {}
    phases = {"forward": lambda: state.update(loss=s.forward(tokens)),
              "backward": lambda: s.backward(state["loss"]), "optimizer": s.step}
    for phase, fn in phases.items():
        dist.barrier()
        reset_peak_rss()
        with tracker.phase(phase) if tracker is not None else contextlib.nullcontext():
            fn()
        peaks[phase] = peak_rss_bytes()
    del state["loss"]
    s.zero_grad()
    return peaks


class Reference:
    """Single-process references, run by rank 0 alone between rounds (the other ranks wait in a
    barrier), so they see the same machine load as the strategies: forward+backward of a plain
    model at the local batch, the whole matrix step (each matrix timed), AdamW on the tail."""

    def __init__(self, base: torch.nn.Module, ctx: StrategyContext) -> None:
        self.model = copy.deepcopy(base)
        params = dict(self.model.named_parameters())
        self.matrices = {f: params[f] for f in ctx.matrix_fqns}
        self.tail_opt = torch.optim.AdamW([p for f, p in params.items() if f not in self.matrices],
                                          lr=ctx.optim.tail_lr)
        self.stepper = MatrixStepper(ctx.optim)

    def run(self, tokens: torch.Tensor) -> dict[str, Any]:
        start = time.perf_counter()
        lm_loss(self.model, tokens).backward()
        out: dict[str, Any] = {"fwd_bwd": time.perf_counter() - start, "per_matrix": {}}
        with torch.no_grad():
            cpu = time.process_time()
            for f, p in self.matrices.items():
                start = time.perf_counter()
                self.stepper.step(f, p, p.grad)
                out["per_matrix"][f] = time.perf_counter() - start
            start = time.perf_counter()
            self.tail_opt.step()
            out["tail_adamw"] = time.perf_counter() - start
            out["optimizer_cpu"] = time.process_time() - cpu
        out["matrix_step"] = sum(out["per_matrix"].values())
        self.model.zero_grad(set_to_none=True)
        return out


def _probe_work() -> float:
    """A fixed fp32 GEMM workload (~the model's matmul sizes); returns its wall time."""
    a, b = torch.ones(256, 512), torch.ones(512, 256)
    start = time.perf_counter()
    for _ in range(40):
        a @ b
    return time.perf_counter() - start


def reference_round(ref: Reference | None, tokens: torch.Tensor) -> dict[str, Any]:
    """Rank 0 runs the references alone, then the contention probe: the same GEMM workload
    timed on rank 0 alone and on every rank at once (their ratio is the compute slowdown ranks
    see from sharing cores, with whatever else runs on the machine)."""
    out: dict[str, Any] = {}
    dist.barrier()
    if ref is not None:
        out["reference"] = ref.run(tokens)
        out["probe_alone"] = _probe_work()
    dist.barrier()
    out["probe_all"] = _probe_work()
    return out
