"""Entry point: ``python -m benchmarks.run`` (see ``--help``).

For each matrix optimizer and world size: one gloo world that runs every strategy interleaved
step by step (with single-process references and a contention probe between rounds, then one
profiled step per strategy and a collective microbenchmark), then (unless ``--no-memory``) one
fresh world per strategy for its peak RSS; finally the cost-model fit, the 7B projection, and
the report as markdown (``--out``), JSON and PNG next to it.

``python -m benchmarks.run tp-step ...``: the optimizer step of tensor-parallel matrices, three
placements side by side plus the Llama-3-70B projection (``benchmarks/tp_step.py``, issue 22).

``python -m benchmarks.run ep-step ...``: expert parallelism, step time, bytes and peak memory of
matrixfsdp-EP against FSDP2-EP baselines plus the DeepSeek-V3 projection
(``benchmarks/ep_step.py``, issue 27).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .analysis import aggregate_world
from .config import (
    EXTRA_STRATEGIES,
    MEMORY_BASELINES,
    STRATEGIES,
    BenchConfig,
    ModelConfig,
    OptimConfig,
)
from .costmodel import HSDP_MODELS, PROJECTED, project, project_hsdp
from .launch import run_world
from .model import build_gpt
from .report import render_markdown, write_json, write_png
from .strategies import owner_plan, strategies_for
from .tp_step import main as tp_step_main
from .worker import memory_worker, timing_worker

__all__ = ["main", "parse_args", "run"]

TINY = {"dim": 32, "layers": 2, "heads": 2, "mlp_hidden": 64, "vocab": 64, "seq_len": 16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", nargs="+", default=["muon", "okls"])
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                   choices=(*STRATEGIES, *EXTRA_STRATEGIES))
    p.add_argument("--steps", type=int, default=5, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    for name, default in dataclasses.asdict(ModelConfig()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="Muon's Newton–Schulz dtype (fp32 makes trajectories comparable)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (for tests)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the per-strategy worlds measuring peak memory during the step")
    p.add_argument("--no-projection", action="store_true")
    p.add_argument("--comm-repeats", type=int, default=5)
    p.add_argument("--hsdp-replicate", type=int, default=2,
                   help="replicas of the HSDP strategies' (replicate, shard) mesh")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest.md"))
    return p.parse_args(argv)


def _configs(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, Any]]:
    fields = {k: getattr(args, k) for k in dataclasses.asdict(ModelConfig())}
    common: dict[str, Any] = {"global_batch": args.global_batch, "warmup": args.warmup,
                              "steps": args.steps, "strategies": tuple(args.strategies),
                              "comm_repeats": args.comm_repeats,
                              "hsdp_replicate": args.hsdp_replicate}
    if args.tiny:
        fields.update(TINY)
        common.update(comm_sizes=(1 << 10, 1 << 14, 1 << 16), comm_repeats=2)
    return ModelConfig(**fields), common


def _meta(argv: list[str], model_cfg: ModelConfig, cfg: BenchConfig) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    torch.manual_seed(0)
    model = build_gpt(model_cfg)
    plan = owner_plan(model, 1, cfg.optim.name)
    return {
        "command": " ".join(["python -m benchmarks.run", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "cores": os.cpu_count() or 1, "torch": torch.__version__,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(), "commit": commit,
        "params": sum(p.numel() for p in model.parameters()), "matrices": len(plan.matrices),
    }


def _log(msg: str) -> None:
    print(f"[benchmarks.run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_optimizer(opt: str, args: argparse.Namespace, model_cfg: ModelConfig,
                  common: dict[str, Any]) -> dict[str, Any]:
    """Every world size (then the projection) for one matrix optimizer."""
    optim = OptimConfig.for_name(opt, args.ns_dtype)
    common = {**common, "strategies": strategies_for(opt, common["strategies"])}
    base = BenchConfig(model=model_cfg, optim=optim, world_size=args.worlds[0], **common)
    out: dict[str, Any] = {"optim": dataclasses.asdict(optim), "worlds": {}}
    for world in args.worlds:
        cfg = base.replace(world_size=world)
        _log(f"{opt}: world {world}: interleaved timing of {len(cfg.strategies)} strategies")
        timing = run_world(world, timing_worker, cfg)
        memory = None
        if not args.no_memory:
            memory = {}
            for name in (*cfg.strategies, *MEMORY_BASELINES):
                _log(f"{opt}: world {world}: peak memory during the step of {name}")
                memory[name] = run_world(world, memory_worker, cfg, name)
        out["worlds"][world] = aggregate_world(cfg, timing, memory)
    if not args.no_projection:
        flat = [n for n in strategies_for(opt, tuple(args.strategies)) if n in PROJECTED]
        out["projection"] = project(opt, flat)
        if opt == "muon":
            out["hsdp_projection"] = {name: project_hsdp(opt, shape)
                                      for name, shape in HSDP_MODELS.items()}
    return out


def run(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(1)
    model_cfg, common = _configs(args)
    for w in args.worlds:
        BenchConfig(model=model_cfg, world_size=w, **common)  # validate before spending time
    first = BenchConfig(model=model_cfg, optim=OptimConfig.for_name(args.optimizers[0]), **common)
    results: dict[str, Any] = {
        "meta": _meta(argv, model_cfg, first),
        "config": {**dataclasses.asdict(first), "worlds": args.worlds},
        "runs": {},
    }
    start = time.time()
    for opt in args.optimizers:
        results["runs"][opt] = run_optimizer(opt, args, model_cfg, common)
    results["meta"]["wall_seconds"] = time.time() - start
    if hasattr(os, "getloadavg"):
        results["meta"]["load_average_end"] = os.getloadavg()[0]
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_markdown(results))
    write_json(results, out.with_suffix(".json"))
    write_png(results, out.with_suffix(".png"))
    _log(f"wrote {out}, {out.with_suffix('.json')}, {out.with_suffix('.png')} "
         f"in {time.time() - start:.0f}s")
    return results


def main() -> None:
    if sys.argv[1:2] == ["ep-step"]:  # issue 27: its own options (``ep-step --help``)
        from .ep_step import main as ep_step_main

        ep_step_main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["tp-step"]:  # issue 22: its own options (``tp-step --help``)
        tp_step_main(sys.argv[2:])
        return
    run()


if __name__ == "__main__":
    main()
