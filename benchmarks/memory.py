"""Peak memory per rank during a training step: ``python -m benchmarks.memory`` (see ``--help``).

For every model size and world size, each strategy runs alone in a fresh gloo world
(``worker.memory_worker``): after warm-up, the peak during forward, backward and the optimizer
step, as live tensor bytes and as RSS above the RSS before the model was built, on the busiest
rank. Then the analytic projection of the same peak for Llama-3 shapes at 8 and 64 ranks.
Writes markdown (``--out``) and JSON beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from matrixfsdp.launch.presets import PRESETS
from matrixfsdp.memory import matrix_memory
from matrixfsdp.planner import make_plan

from .analysis import PHASES, memory_figures
from .config import EXTRA_STRATEGIES, STRATEGY_LABELS, BenchConfig, ModelConfig, OptimConfig
from .config import STRATEGIES as ALL
from .launch import run_world
from .report import fmt_bytes
from .worker import memory_worker

__all__ = ["SIZES", "main", "project_peak", "run"]

SIZES: dict[str, dict[str, int]] = {
    "small": {"dim": 256, "layers": 4, "heads": 4, "mlp_hidden": 512},   # 6 MiB of matrices
    "large": {"dim": 768, "layers": 4, "heads": 12, "mlp_hidden": 1536},  # 72 MiB of matrices
    "wide": {"dim": 512, "layers": 4, "heads": 8, "mlp_hidden": 2048},  # 48 MiB; largest 4 MiB
    "deepwide": {"dim": 512, "layers": 16, "heads": 8, "mlp_hidden": 2048},  # 192 MiB, 4 MiB
    "tiny": {"dim": 32, "layers": 2, "heads": 2, "mlp_hidden": 64, "vocab": 64, "seq_len": 16},
    "deep": {"dim": 32, "layers": 48, "heads": 4, "mlp_hidden": 64},  # latency-bound, 0.8 MiB
}
STRATEGIES = ("fsdp2_sgdm", "fsdp2_recon", "matrixfsdp")
BASE, RECON, MF = STRATEGIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["small", "large"], choices=list(SIZES))
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="Muon's Newton–Schulz dtype (matrixfsdp; the baselines step SGD-m)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/memory.md"))
    return p.parse_args(argv)


def measure(size: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    fields = {"seq_len": args.seq_len, **SIZES[size]}
    cfg = BenchConfig(model=ModelConfig(**fields), optim=OptimConfig.for_name("muon", args.ns_dtype),
                      world_size=world, global_batch=args.global_batch, warmup=args.warmup,
                      steps=1, strategies=tuple(s for s in args.strategies
                                      if s in (*ALL, *EXTRA_STRATEGIES)))
    out: dict[str, Any] = {}
    for name in args.strategies:
        _log(f"{size}, world {world}: {name}")
        out[name] = memory_figures(run_world(world, memory_worker, cfg, name))
    torch.manual_seed(0)
    from .model import build_gpt

    model = build_gpt(cfg.model)
    sizes = [p.numel() * p.element_size() for n, p in model.named_parameters()
             if n.startswith("layers.") and p.ndim == 2]
    return {"figures": out, "matrix_bytes": sum(sizes), "largest_matrix": max(sizes),
            "model": dataclasses.asdict(cfg.model)}


# -- analytic projection ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per element: fp32 master weights, gradients and optimizer state, bf16 compute
    (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``)."""

    master: int = 4
    compute: int = 2
    reduce: int = 4


class UnitBytes(NamedTuple):
    """A communication unit's moving bytes on one rank: unsharded, gather buffers, gradients,
    reduction buffers (see ``project_peak``)."""

    unsharded: int
    gather: int
    grads: int
    reduce: int


def _units(specs: list[Any]) -> dict[str, list[Any]]:
    """torchtitan's FSDP2 units in forward order: embedding, each block, then norm + output."""
    units: dict[str, list[Any]] = {"embed": []}
    for s in specs:
        if s.group:
            units.setdefault(s.group, []).append(s)
    units["output"] = []
    for s in specs:
        if not s.group:
            units["embed" if "embed" in s.fqn else "output"].append(s)
    return units


def _fsdp_unit(numel: int, world: int, p: Precision) -> UnitBytes:
    """Stock FSDP2: all-gather output and unsharded parameters, unsharded gradients (compute
    dtype), reduce-scatter input (reduce dtype) and its output shard."""
    full = numel * p.compute
    return UnitBytes(full, full, full, int(numel * p.reduce * (1 + 1 / world)))


def _backward_peak(units: list[UnitBytes]) -> int:
    """Worst moment of backward: unit i computing (unsharded, its gradients), unit i-1 prefetched
    (unsharded + gather buffers), and one reduction in flight (unit i+1's, or unit i's once
    issued; FSDP2 and matrixfsdp both keep one)."""
    worst = 0
    for i, u in enumerate(units):
        prev = units[i - 1] if i > 0 else UnitBytes(0, 0, 0, 0)
        after = units[i + 1].reduce if i + 1 < len(units) else 0
        worst = max(worst, u.unsharded + prev.unsharded + prev.gather + u.grads
                    + max(after, u.reduce))
    return worst


def project_peak(preset: str, world: int, p: Precision = Precision()) -> dict[str, float]:
    """Peak bytes per rank during a step (busiest rank), activations excluded."""
    specs = [s._replace(dtype="float32") for s in PRESETS[preset].specs()]
    plan = make_plan(specs, world, "muon")
    units = _units(specs)
    numel = {u: sum(s.numel for s in members) for u, members in units.items()}
    tail = {u: sum(s.numel for s in members if s.role != "matrix") for u, members in units.items()}
    matrices = sum(s.numel for s in specs if s.role == "matrix")
    everything = sum(numel.values())
    largest = max(s.numel for s in specs if s.role == "matrix") * p.master
    # FSDP2: everything sharded by N; SGD-momentum state on matrices, AdamW's two on the tail.
    fsdp_static = (2 * everything + matrices + 2 * sum(tail.values())) / world * p.master
    fsdp_moving = _backward_peak([_fsdp_unit(n, world, p) for n in numel.values()])
    peaks = []
    for rank in range(world):
        mm = matrix_memory(plan, rank, reduce_itemsize=p.reduce, compute_itemsize=p.compute)
        moving = []
        for u in units:
            t = _fsdp_unit(tail[u], world, p)
            g = mm.groups.get(u)
            moving.append(t if g is None else UnitBytes(
                t.unsharded + g.gathered, t.gather + g.gather_buffers, t.grads + g.grads,
                t.reduce + g.reduce_buffers))
        static = 3 * mm.owned + 4 * sum(tail.values()) / world * p.master
        # the optimizer step: Newton-Schulz workspace of one matrix (bf16, ~2 copies)
        peaks.append(static + max(_backward_peak(moving), largest))
    return {
        "fsdp2_sgdm": fsdp_static + fsdp_moving,
        # reconstruction: per matrix, the full gradient and momentum (fp32) + the workspace
        "fsdp2_recon": fsdp_static + max(fsdp_moving, 3 * largest),
        "matrixfsdp": max(peaks),
        "model_bytes": everything * p.master,
        "imbalance": plan.imbalance("bytes"),
    }


# -- report -------------------------------------------------------------------------------------
def _peak(m: dict[str, Any], key: str) -> int:
    return max(m[key][ph] for ph in PHASES)


def render(results: dict[str, Any]) -> str:
    lines = ["# Peak memory per rank during a training step", "",
             f"Command: `{results['command']}`; {results['date']}; {results['wall_s']:.0f} s.", "",
             "| model | world | strategy | live fwd / bwd / opt | peak live | ÷ FSDP2+SGD-m | "
             "peak RSS Δ | ÷ FSDP2+SGD-m |", "|---|---|---|---|---|---|---|---|"]
    for size, worlds in results["measured"].items():
        for world, r in worlds.items():
            figs = r["figures"]
            base = figs.get(BASE)
            for name, m in figs.items():
                live = " / ".join(fmt_bytes(m["live"][ph]) for ph in PHASES)
                ratio = [f"{_peak(m, k) / _peak(base, k):.2f}x" if base else "-"
                         for k in ("live", "rss")]
                lines.append(f"| {size} ({fmt_bytes(r['matrix_bytes'])} of block matrices) | "
                             f"{world} | {STRATEGY_LABELS.get(name, name)} | {live} | "
                             f"{fmt_bytes(_peak(m, 'live'))} | {ratio[0]} | "
                             f"{fmt_bytes(_peak(m, 'rss'))} | {ratio[1]} |")
    lines += _render_owner_steps(results)
    lines += ["", "Projection (activations excluded), peak bytes per rank:", "",
              "| model | ranks | FSDP2 + SGD-m | FSDP2 + Muon recon | matrixfsdp + Muon | "
              "÷ SGD-m | plan max/mean bytes |", "|---|---|---|---|---|---|---|"]
    for (preset, world), pr in results["projection"].items():
        lines.append(f"| {preset} | {world} | {fmt_bytes(pr['fsdp2_sgdm'])} | "
                     f"{fmt_bytes(pr['fsdp2_recon'])} | {fmt_bytes(pr['matrixfsdp'])} | "
                     f"{pr['matrixfsdp'] / pr['fsdp2_sgdm']:.2f}x | {pr['imbalance']:.3f} |")
    return "\n".join(lines) + "\n"


def _render_owner_steps(results: dict[str, Any]) -> list[str]:
    """The largest owner step call's transient bytes per rank, beside the largest matrix."""
    lines = ["", f"Owner step transients per rank (Newton–Schulz in {results['ns_dtype']}; the "
             "largest of one `step_owned` call's peak above its start):", "",
             "| model | world | strategy | largest matrix | transient per rank | max ÷ largest |",
             "|---|---|---|---|---|---|"]
    for size, worlds in results["measured"].items():
        for world, r in worlds.items():
            largest = r["largest_matrix"]
            for name, m in r["figures"].items():
                per_rank = m.get("owner_step") or []
                if not any(per_rank):
                    continue
                cells = " / ".join(fmt_bytes(b) for b in per_rank)
                lines.append(f"| {size} | {world} | {STRATEGY_LABELS.get(name, name)} | "
                             f"{fmt_bytes(largest)} | {cells} | {max(per_rank) / largest:.2f}× |")
    return lines


def _log(msg: str) -> None:
    print(f"[benchmarks.memory {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    measured = {size: {world: measure(size, world, args) for world in args.worlds}
                for size in args.sizes}
    projection = {(preset, world): project_peak(preset, world)
                  for preset in ("llama3-8b", "llama3-70b") for world in (8, 64)}
    results = {"command": " ".join(["python -m benchmarks.memory", *argv]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "wall_s": time.time() - start, "measured": measured, "projection": projection,
               "ns_dtype": args.ns_dtype}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results))
    serializable = {**results, "projection": {f"{k[0]}@{k[1]}": v for k, v in projection.items()}}
    args.out.with_suffix(".json").write_text(json.dumps(serializable, indent=1))
    _log(f"wrote {args.out}")
    return results


def main() -> None:
    run()


if __name__ == "__main__":
    main()
