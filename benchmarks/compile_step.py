"""Per-block ``torch.compile`` on a wrapped model beside FSDP2-compiled: ``python -m benchmarks.compile_step``.

Usage::

    python -m benchmarks.compile_step --world 2 --steps 10 [--backend inductor]

One gloo world runs four models of the benchmark GPT side by side, interleaved step by step:
stock FSDP2 eager, stock FSDP2 with every block compiled (``block.compile()``, after
``fully_shard``), matrixfsdp eager and matrixfsdp with every block compiled (after
``fully_shard_matrix``). Prints the median forward+backward time (slowest rank) of each after
``--warmup`` steps (which include compilation), the compiled ÷ eager ratio of each, and
matrixfsdp-compiled ÷ FSDP2-compiled.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import matrixfsdp as mf

from .config import ModelConfig, add_model_flags, model_from_flags
from .launch import run_world
from .model import build_gpt, global_tokens, lm_loss, local_tokens

__all__ = ["main"]

VARIANTS = ("fsdp2", "fsdp2_compiled", "matrixfsdp", "matrixfsdp_compiled")


def _build(variant: str, base: torch.nn.Module, backend: str) -> torch.nn.Module:
    model = copy.deepcopy(base)
    if variant.startswith("fsdp2"):
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    else:
        mf.fully_shard_matrix(model)
    if variant.endswith("compiled"):
        for block in model.layers:
            block.compile(backend=backend)
    return model


def compile_worker(rank: int, world: int, cfg: ModelConfig, steps: int, warmup: int,
                   backend: str) -> dict[str, list[float]]:
    torch.manual_seed(0)
    base = build_gpt(cfg)
    models = {v: _build(v, base, backend) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(warmup + steps):
        tokens = local_tokens(global_tokens(cfg, step, 8, 0), rank, world)
        order = VARIANTS[step % 4:] + VARIANTS[: step % 4]
        for variant in order:
            model = models[variant]
            dist.barrier()
            start = time.perf_counter()
            lm_loss(model, tokens).backward()
            elapsed = time.perf_counter() - start
            for p in model.parameters():
                p.grad = None
            if step >= warmup:
                times[variant].append(elapsed)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_step", description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", default="inductor")
    add_model_flags(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = model_from_flags(args)
    results = run_world(args.world, compile_worker, cfg, args.steps, args.warmup, args.backend)
    slowest: dict[str, Any] = {v: [max(r[v][i] for r in results) for i in range(args.steps)]
                               for v in VARIANTS}
    median = {v: statistics.median(slowest[v]) for v in VARIANTS}
    print(f"# forward+backward with per-block torch.compile (backend {args.backend}), world "
          f"{args.world}, {args.steps} interleaved steps after {args.warmup} warm-up, {cfg}")
    print("| variant | median ms | compiled ÷ eager |\n|---|---:|---:|")
    for v in VARIANTS:
        eager = v.removesuffix("_compiled")
        ratio = f"{median[v] / median[eager]:.3f}" if v != eager else ""
        print(f"| {v} | {median[v] * 1e3:.1f} | {ratio} |")
    print(f"\nmatrixfsdp compiled ÷ FSDP2 compiled: "
          f"{median['matrixfsdp_compiled'] / median['fsdp2_compiled']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
