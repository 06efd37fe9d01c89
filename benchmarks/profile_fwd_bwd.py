"""Where forward+backward time goes: matrixfsdp against stock FSDP2, profiled side by side.

Usage::

    python -m benchmarks.profile_fwd_bwd --world 2 --steps 12

Runs the two strategies (``fsdp2_adamw`` and ``matrixfsdp``; more with ``--strategies``)
interleaved in one gloo world, times forward+backward per step (slowest rank, median), then
profiles ``--profiled`` more steps of each and prints, per strategy, rank 0's CPU time split into
categories (see ``CATEGORIES``) and the top operators by self CPU time on the main thread.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from .config import BenchConfig, OptimConfig, add_model_flags, model_from_flags
from .launch import run_world
from .strategies import build_strategy
from .worker import _context, _tokens

__all__ = ["CATEGORIES", "main"]

# (category, predicate on an aten/record_function name), first match wins; main thread only.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("gemm (mm/addmm/bmm/linear)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention", ("aten::_scaled_dot_product", "aten::_efficient_attention")),
    ("copies (copy_/cat/repeat/split)", ("aten::copy_", "aten::cat", "aten::repeat",
                                        "aten::split", "aten::_to_copy", "aten::clone")),
    ("allocation (empty/resize_)", ("aten::empty", "aten::resize_", "aten::zeros")),
    ("collective issue/wait (c10d)", ("c10d::", "_c10d_functional::", "aten::_wait")),
]


def _categorize(events: list[Any]) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Self CPU seconds of main-thread events by category, and by operator."""
    main = min(e.thread for e in events) if events else 0
    by_cat: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.thread != main or e.name.startswith("ProfilerStep"):
            continue
        sec = e.self_cpu_time_total / 1e6
        by_op[e.name] += sec
        for cat, prefixes in CATEGORIES:
            if e.name.startswith(prefixes):
                by_cat[cat] += sec
                break
        else:
            by_cat["other ops / Python"] += sec
    return dict(by_cat), sorted(by_op.items(), key=lambda kv: -kv[1])[:12]


def _fwd_bwd(s: Any, tokens: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    s.backward(s.forward(tokens))
    elapsed = time.perf_counter() - start
    s.zero_grad()
    return elapsed


def profile_worker(rank: int, world: int, cfg: BenchConfig, profiled: int) -> dict[str, Any]:
    base, ctx = _context(rank, world, cfg)
    strategies = {n: build_strategy(n, copy.deepcopy(base), ctx) for n in cfg.strategies}
    times: dict[str, list[float]] = {n: [] for n in strategies}
    names = list(strategies)
    for step in range(cfg.warmup + cfg.steps):
        tokens = _tokens(cfg, step, rank, world)
        for name in names[step % len(names):] + names[: step % len(names)]:
            t = _fwd_bwd(strategies[name], tokens)
            if step >= cfg.warmup:
                times[name].append(t)
    out: dict[str, Any] = {"times": times, "profiles": {}}
    tokens = _tokens(cfg, 0, rank, world)
    for name, s in strategies.items():
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(profiled):
                s.backward(s.forward(tokens))
                s.zero_grad()
            wall = (time.perf_counter() - start) / profiled
        cats, ops = _categorize(list(prof.events()))
        out["profiles"][name] = {"wall": wall,
                                 "categories": {k: v / profiled for k, v in cats.items()},
                                 "top": [(k, v / profiled) for k, v in ops]}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_fwd_bwd", description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=["fsdp2_adamw", "matrixfsdp"])
    add_model_flags(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = model_from_flags(args)
    cfg = BenchConfig(model=model, optim=OptimConfig.for_name("muon"),
                      world_size=args.world, warmup=2, steps=args.steps,
                      strategies=tuple(args.strategies))
    results = run_world(args.world, profile_worker, cfg, args.profiled)
    print(f"# forward+backward, world {args.world}, {args.steps} interleaved steps, model {model}")
    steps = {name: [max(r["times"][name][i] for r in results) for i in range(args.steps)]
             for name in args.strategies}
    first = args.strategies[0]
    for name in args.strategies:
        per_step = steps[name]
        prof = results[0]["profiles"][name]
        # per-step ratios to the first strategy, run back to back: robust to load drifting
        paired = statistics.median(a / b for a, b in zip(per_step, steps[first], strict=True))
        print(f"\n## {name}: median {statistics.median(per_step) * 1e3:.1f} ms (slowest rank), "
              f"paired ÷ {first} {paired:.3f}; profiled wall {prof['wall'] * 1e3:.1f} ms/step "
              f"on rank 0")
        for cat, sec in sorted(prof["categories"].items(), key=lambda kv: -kv[1]):
            print(f"  {cat:36s} {sec * 1e3:8.1f} ms")
        print("  top self-CPU operators (main thread):")
        for op, sec in prof["top"]:
            print(f"    {op:50s} {sec * 1e3:8.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
