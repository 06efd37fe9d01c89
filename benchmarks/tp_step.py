"""Tensor parallelism: the Muon step of TP matrices, three placements side by side (issue 22).

``python -m benchmarks.run tp-step`` (or ``python -m benchmarks.tp_step``; ``--help``).

[Note: TP step benchmark]
- Matrices: the TP matrices of a Llama-style decoder (``costmodel.LlamaShape``): q/k/v and
  gate/up ColwiseParallel (``Shard(0)`` of ``(out, in)``), o and down RowwiseParallel
  (``Shard(1)``); the dp owner rows come from the library's planner on global shapes (Muon FLOPs),
  as ``fully_shard_matrix`` plans them. The step exchange runs in each row's tp group.
- Strategies, every one from the library's functional Muon (same momentum, the same
  ``zeropower_via_newton_schulz`` and ``muon_adjusted_lr``), so only the placement differs:
  - ``blockwise`` (Megatron-core's ``TensorParallelMuon(mode="blockwise")``): Newton–Schulz on
    each TP shard, lr scaled by the shard's shape as Megatron does; no bytes; not exact;
  - ``duplicated``: momentum on the shard, the Nesterov direction all-gathered in the tp group
    (one ``all_gather_into_tensor`` per bucket, the next one in flight), every tp rank
    orthogonalizes every whole matrix and keeps its slice; exact, ``tp`` x redundant compute;
  - ``step_owner`` (this design): ``matrixfsdp.optim.tp_step.step_tp_matrices`` with the
    library's ``WholeStepper`` and default buckets; ``step_owner_1``: one matrix per bucket
    (the regime of large models, where every matrix exceeds ``TP_STEP_BUCKET_BYTES``).
- Gradients: a power-law spectrum (singular values ``1/(j+1)``, random singular vectors), fresh
  each step, the same for every strategy, so every strategy's momentum is the same; weight decay
  0, so an update is ``-lr s NS(direction)`` and updates compare across strategies at any step.
- Timing: per repetition, the strategies in rotated order, each step between two barriers, the
  slowest rank's time; medians over repetitions. Bytes: what each rank sends to other tp ranks.
- Deviation: after the timed steps, one more step of each strategy from its own parameters; the
  relative Frobenius error of each update against ``step_owner``'s (whole matrices: squared norms
  summed over the tp shards), and the sine of the angle between them (free of the lr scale).
- Projection: ``benchmarks/tp_projection.py`` ([Note: TP step projection]).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.optim.functional._linalg import dtype_from_name
from matrixfsdp.optim.functional.muon import muon_adjusted_lr, zeropower_via_newton_schulz
from matrixfsdp.optim.tp_step import (
    TP_STEP_BUCKET_BYTES,
    TpMatrix,
    WholeStepper,
    assign_step_owners,
    bucket_plan,
    step_tp_matrices,
)
from matrixfsdp.planner import matrix_cost
from matrixfsdp.runtime.tp import tp_layout_of

from .costmodel import LlamaShape
from .launch import run_world
from .tp_projection import (
    ELEMENTWISE_BYTES,
    Bucket,
    TpSpec,
    project_tp,
    projections,
    render_projection,
    row_specs,
    simulate_buckets,
    step_owners,
    tp_specs,
)

__all__ = [
    "ELEMENTWISE_BYTES",
    "STRATEGIES",
    "Bucket",
    "TpBenchConfig",
    "TpSpec",
    "main",
    "project_tp",
    "render_projection",
    "row_specs",
    "run_measured",
    "simulate_buckets",
    "step_owners",
    "tp_specs",
]

STRATEGIES = ("blockwise", "duplicated", "step_owner", "step_owner_1")
LABELS = {
    "blockwise": "(a) blockwise, Megatron-style (NS per TP shard)",
    "duplicated": "(b) duplicated (all-gather, every tp rank NS on every matrix)",
    "step_owner": "(c) **this design** (step-owner exchange, default buckets)",
    "step_owner_1": "(c') this design, one matrix per bucket",
}
EXACT = {"blockwise": False, "duplicated": True, "step_owner": True, "step_owner_1": True}
LR = 0.02
BENCH_SHAPE = LlamaShape(name="bench", dim=384, layers=2, ffn=1024, vocab=256, heads=6,
                         kv_heads=2, seq_len=16, tokens_per_gpu=16)


# -- measured: the three placements on one owner row's tp group ----------------------------------
@dataclass(frozen=True)
class TpBenchConfig:
    shape: LlamaShape = BENCH_SHAPE
    tp: int = 2
    dp: int = 1
    reps: int = 9
    warmup: int = 2
    strategies: tuple[str, ...] = STRATEGIES
    ns_dtype: str = "float32"

    def __post_init__(self) -> None:
        for spec in tp_specs(self.shape):
            if spec.shape[spec.shard_dim] % self.tp:
                raise ValueError(f"{spec.fqn} {spec.shape}: dim {spec.shard_dim} is not a "
                                 f"multiple of tp={self.tp} (the benchmark needs even TP shards)")
        unknown = set(self.strategies) - set(STRATEGIES)
        if unknown:
            raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")


class Strategy(Protocol):
    params: list[Tensor]

    def step(self, grads: Sequence[Tensor]) -> int: ...


class _Muon(NamedTuple):
    """Functional Muon's pieces with the benchmark's config (lr of the global shape)."""

    config: Any

    def direction(self, buf: Tensor, grad: Tensor) -> Tensor:
        buf.lerp_(grad, 1 - self.config.momentum)
        return grad.lerp(buf, self.config.momentum) if self.config.nesterov else buf

    def orthogonalize(self, x: Tensor) -> Tensor:
        c = self.config
        return zeropower_via_newton_schulz(x, c.ns_coefficients, c.ns_steps, c.eps,
                                           dtype_from_name(c.ns_dtype))

    def apply(self, param: Tensor, ortho: Tensor, shape: tuple[int, int]) -> None:
        param.add_(ortho, alpha=-muon_adjusted_lr(LR, self.config.adjust_lr_fn, *shape))


@dataclass
class Blockwise:
    """Newton–Schulz on each TP shard with the shard shape's lr scale; no communication
    (Megatron-core ``TensorParallelMuon(mode="blockwise")``)."""

    params: list[Tensor]
    muon: _Muon
    bufs: list[Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.bufs = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor]) -> int:
        for p, buf, g in zip(self.params, self.bufs, grads, strict=True):
            ortho = self.muon.orthogonalize(self.muon.direction(buf, g))
            self.muon.apply(p, ortho, (p.shape[0], p.shape[1]))  # the shard's scale, as Megatron
        return 0


@dataclass
class Duplicated:
    """Direction shards all-gathered per bucket; every rank orthogonalizes every whole matrix."""

    specs: Sequence[TpSpec]
    params: list[Tensor]
    muon: _Muon
    group: dist.ProcessGroup
    bucket_bytes: int = TP_STEP_BUCKET_BYTES
    bufs: list[Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.bufs = [torch.zeros_like(p) for p in self.params]

    def _buckets(self) -> list[list[int]]:
        buckets: list[list[int]] = []
        total = 0
        for i, p in enumerate(self.params):
            nbytes = p.nbytes * dist.get_world_size(self.group)
            if not buckets or total + nbytes > self.bucket_bytes:
                buckets.append([])
                total = 0
            buckets[-1].append(i)
            total += nbytes
        return buckets

    def _start(self, bucket: list[int], dirs: Sequence[Tensor]) -> tuple[Tensor, Any]:
        inp = torch.cat([dirs[i].reshape(-1) for i in bucket])
        out = inp.new_empty(inp.numel() * dist.get_world_size(self.group))
        return out, dist.all_gather_into_tensor(out, inp, group=self.group, async_op=True)

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor]) -> int:
        size, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        dirs = [self.muon.direction(b, g) for b, g in zip(self.bufs, grads, strict=True)]
        buckets, sent = self._buckets(), 0
        pending = self._start(buckets[0], dirs)
        for k, bucket in enumerate(buckets):
            out, work = pending
            work.wait()
            if k + 1 < len(buckets):
                pending = self._start(buckets[k + 1], dirs)
            per_rank = out.view(size, -1)
            sent += (size - 1) * per_rank[0].nbytes
            offset = 0
            for i in bucket:
                n, spec = dirs[i].numel(), self.specs[i]
                parts = [per_rank[r, offset:offset + n].view(dirs[i].shape) for r in range(size)]
                ortho = self.muon.orthogonalize(torch.cat(parts, spec.shard_dim))
                local = ortho.narrow(spec.shard_dim, me * dirs[i].shape[spec.shard_dim],
                                     dirs[i].shape[spec.shard_dim])
                self.muon.apply(self.params[i], local, spec.shape)
                offset += n
        return sent


@dataclass
class StepOwner:
    """The library's TP step exchange (``step_tp_matrices`` + ``WholeStepper``)."""

    matrices: list[TpMatrix]
    stepper: WholeStepper
    bucket_bytes: int = TP_STEP_BUCKET_BYTES

    @property
    def params(self) -> list[Tensor]:
        return [m.param for m in self.matrices]

    def step(self, grads: Sequence[Tensor]) -> int:
        for m, g in zip(self.matrices, grads, strict=True):
            m.param.grad = g
        return step_tp_matrices(self.matrices, self.stepper,
                                bucket_bytes=self.bucket_bytes).bytes_sent


def _full_init(spec: TpSpec) -> Tensor:
    gen = torch.Generator().manual_seed(1000 + spec.index)
    return torch.randn(spec.shape, generator=gen) / math.sqrt(spec.shape[1])


def _full_grad(spec: TpSpec, step: int) -> Tensor:
    """A gradient with singular values ``1/(j+1)`` (random singular vectors)."""
    gen = torch.Generator().manual_seed(7919 * spec.index + 104729 * step + 1)
    m, n = spec.shape
    k = min(m, n)
    left = torch.randn(m, k, generator=gen) / (torch.arange(k) + 1.0)
    return left @ torch.randn(k, n, generator=gen) / math.sqrt(k * max(m, n))


def _shard(full: Tensor, spec: TpSpec, tp: int, rank: int) -> Tensor:
    return full.chunk(tp, spec.shard_dim)[rank].clone()


def _strategies(cfg: TpBenchConfig, mesh: DeviceMesh, row: Sequence[TpSpec]
                ) -> dict[str, Strategy]:
    tp_rank, tp = mesh["tp"].get_local_rank(), cfg.tp
    spec = get_matrix_optimizer("muon")
    config = spec.make_config({"ns_dtype": cfg.ns_dtype})
    muon = _Muon(config)
    inits = [_full_init(s) for s in row]
    shards = [lambda s=s, w=w: _shard(w, s, tp, tp_rank) for s, w in zip(row, inits, strict=True)]
    out: dict[str, Strategy] = {}
    for name in cfg.strategies:
        if name == "blockwise":
            out[name] = Blockwise([f() for f in shards], muon)
        elif name == "duplicated":
            out[name] = Duplicated(row, [f() for f in shards], muon, mesh["tp"].get_group())
        else:
            matrices = []
            for s, w, owner in zip(row, inits, step_owners(row, tp), strict=True):
                dtensor = distribute_tensor(w, mesh["tp"], [Shard(s.shard_dim)],
                                            src_data_rank=None)
                layout = tp_layout_of(s.fqn, dtensor, mesh["dp"])
                assert layout is not None
                param = nn.Parameter(dtensor.to_local().clone())
                matrices.append(TpMatrix(s.fqn, param, layout, owner))
            hyper = {"lr": LR, "weight_decay": 0.0, "initial_lr": LR, "config": config}
            out[name] = StepOwner(matrices, WholeStepper(spec, hyper, {}),
                                  1 if name == "step_owner_1" else TP_STEP_BUCKET_BYTES)
    return out


def _timed(strategy: Strategy, grads: Sequence[Tensor]) -> tuple[float, int]:
    dist.barrier()
    start = time.perf_counter()
    sent = strategy.step(grads)
    dist.barrier()
    return time.perf_counter() - start, sent


def _deviation(strategies: dict[str, Strategy], grads: Sequence[Tensor], total: int,
               row: Sequence[TpSpec]) -> dict[str, Any]:
    """Per strategy and matrix (global index): ``||dW - dW_ref||^2``, ``<dW, dW_ref>`` and
    ``||dW||^2`` summed over the tp shards, and ``||dW_ref||^2``; the reference is
    ``step_owner`` (else ``duplicated``)."""
    deltas = {}
    for name, strategy in strategies.items():
        before = [p.detach().clone() for p in strategy.params]
        strategy.step(grads)
        deltas[name] = [p.detach() - b for p, b in zip(strategy.params, before, strict=True)]
    ref = "step_owner" if "step_owner" in deltas else "duplicated"
    sums = torch.zeros(len(deltas), 3, total, dtype=torch.float64)
    ref_sq = torch.zeros(total, dtype=torch.float64)
    for j, name in enumerate(deltas):
        for s, d, r in zip(row, deltas[name], deltas[ref], strict=True):
            d, r = d.double(), r.double()
            sums[j, :, s.index] = torch.stack([(d - r).pow(2).sum(), (d * r).sum(),
                                               d.pow(2).sum()])
            ref_sq[s.index] = r.pow(2).sum()
    dist.all_reduce(sums)
    dist.all_reduce(ref_sq)
    out: dict[str, Any] = {"reference": ref, "ref_sq": ref_sq.tolist()}
    for j, name in enumerate(deltas):
        out[name] = dict(zip(("err_sq", "dot", "self_sq"), sums[j].tolist(), strict=True))
    return out


def _deviation_figures(dev: dict[str, Any], name: str, specs: Sequence[TpSpec]
                       ) -> dict[str, Any]:
    """Relative error of the updates over all matrices, the sine of the angle between them
    (scale-free), and the relative error per matrix kind (worst over blocks)."""
    mine, ref_sq = dev[name], dev["ref_sq"]
    total_ref, total_self = sum(ref_sq), sum(mine["self_sq"])
    cos = sum(mine["dot"]) / math.sqrt(max(total_ref * total_self, 1e-300))
    per_matrix = [math.sqrt(e / max(r, 1e-300)) for e, r in zip(mine["err_sq"], ref_sq,
                                                                strict=True)]
    return {"deviation": math.sqrt(sum(mine["err_sq"]) / total_ref),
            "direction_deviation": math.sqrt(max(0.0, 1.0 - min(cos, 1.0) ** 2)),
            "deviation_by_kind": _by_kind(specs, per_matrix)}


def _worker(rank: int, world: int, cfg: TpBenchConfig) -> dict[str, Any]:
    del rank, world
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    row = row_specs(cfg.shape, cfg.dp)[mesh["dp"].get_local_rank()]
    strategies = _strategies(cfg, mesh, row)
    tp_rank = mesh["tp"].get_local_rank()
    times: dict[str, list[float]] = {n: [] for n in strategies}
    sent: dict[str, int] = {}
    names = list(strategies)
    for rep in range(cfg.warmup + cfg.reps):
        grads = [_shard(_full_grad(s, rep), s, cfg.tp, tp_rank) for s in row]
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            seconds, sent[name] = _timed(strategies[name], [g.clone() for g in grads])
            if rep >= cfg.warmup:
                times[name].append(seconds)
    grads = [_shard(_full_grad(s, cfg.warmup + cfg.reps), s, cfg.tp, tp_rank) for s in row]
    deviation = _deviation(strategies, grads, len(tp_specs(cfg.shape)), row)
    return {"times": times, "sent": sent, "deviation": deviation,
            "row": [s.index for s in row], "dp_rank": mesh["dp"].get_local_rank()}


def _gflop(cfg: TpBenchConfig, name: str) -> float:
    """Modelled Newton–Schulz GFLOP of the busiest rank per step (planner's Muon FLOPs)."""
    worst = 0.0
    for row in row_specs(cfg.shape, cfg.dp):
        whole = [matrix_cost(s.shape, "muon") for s in row]
        if name == "blockwise":
            load = sum(matrix_cost(s.shard_shape(cfg.tp), "muon") for s in row)
        elif name == "duplicated":
            load = sum(whole)
        else:
            owners = step_owners(row, cfg.tp)
            load = max(sum(c for c, o in zip(whole, owners, strict=True) if o == r)
                       for r in range(cfg.tp))
        worst = max(worst, load)
    return worst / 1e9


def _summarize(cfg: TpBenchConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    specs = tp_specs(cfg.shape)
    dev = ranks[0]["deviation"]
    out: dict[str, Any] = {"reference": dev["reference"], "strategies": {}}
    for name in cfg.strategies:
        slowest = [max(r["times"][name][i] for r in ranks) for i in range(cfg.reps)]
        out["strategies"][name] = {
            "median_s": statistics.median(slowest), "samples_s": slowest,
            "sent_max_rank": max(r["sent"][name] for r in ranks),
            "sent_per_row": [sum(r["sent"][name] for r in ranks if r["dp_rank"] == d)
                             for d in range(cfg.dp)],
            "gflop_busiest_rank": _gflop(cfg, name),
            **_deviation_figures(dev, name, specs),
        }
    base = out["strategies"].get("duplicated")
    for fig in out["strategies"].values():
        fig["ratio_to_duplicated"] = fig["median_s"] / base["median_s"] if base else None
        fig["paired_ratio_to_duplicated"] = statistics.median(
            a / b for a, b in zip(fig["samples_s"], base["samples_s"], strict=True)
        ) if base else None
    return out


def _by_kind(specs: Sequence[TpSpec], per_matrix: Sequence[float]) -> dict[str, float]:
    """Worst relative deviation per matrix kind (wq, wk, ..., w2) over the layers."""
    kinds: dict[str, float] = {}
    for s, e in zip(specs, per_matrix, strict=True):
        kind = s.fqn.split(".")[-2]
        kinds[kind] = max(kinds.get(kind, 0.0), e)
    return kinds


def run_measured(cfg: TpBenchConfig) -> dict[str, Any]:
    """One gloo world of ``dp * tp`` ranks timing ``cfg.strategies`` interleaved."""
    ranks = run_world(cfg.dp * cfg.tp, _worker, cfg)
    return _summarize(cfg, ranks)


# -- schedule check: the library's pipeline with sleeping step math ---------------------------------
def _sleep_worker(rank: int, world: int, count: int, sleep_s: float, bucket_bytes: int,
                  reps: int) -> list[float]:
    del rank
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    matrices = []
    owners = assign_step_owners([1.0] * count, world)
    for i in range(count):
        full = torch.zeros(8 * world, 8)
        dtensor = distribute_tensor(full, mesh["tp"], [Shard(0)], src_data_rank=None)
        layout = tp_layout_of(f"m{i}", dtensor, mesh["dp"])
        assert layout is not None
        param = nn.Parameter(dtensor.to_local().clone())
        param.grad = torch.zeros_like(param)
        matrices.append(TpMatrix(f"m{i}", param, layout, owners[i]))

    def sleep(wholes: Sequence[Any]) -> None:
        time.sleep(sleep_s * len(wholes))

    out = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        step_tp_matrices(matrices, sleep, bucket_bytes=bucket_bytes)
        dist.barrier()
        out.append(time.perf_counter() - start)
    return out


def schedule_check(tp: int = 4, count: int = 8, sleep_s: float = 0.1,
                   reps: int = 3) -> dict[str, Any]:
    """``step_tp_matrices`` with step math replaced by ``time.sleep`` (no CPU: ``tp`` ranks
    "compute" at once even on 2 cores): measured wall time against ``simulate_buckets``."""
    out: dict[str, Any] = {"tp": tp, "matrices": count, "sleep_s": sleep_s}
    owners = assign_step_owners([1.0] * count, tp)
    waves = bucket_plan([1] * count, owners, [1.0] * count, 0)  # one wave per bucket
    for label, bucket_bytes, groups in (("one bucket", TP_STEP_BUCKET_BYTES, [range(count)]),
                                        ("one matrix per step owner per bucket", 1, waves)):
        ranks = run_world(tp, _sleep_worker, count, sleep_s, bucket_bytes, reps)
        measured = statistics.median(max(r[i] for r in ranks) for i in range(reps))
        buckets = [Bucket(tuple(sleep_s * sum(owners[i] == r for i in g) for r in range(tp)),
                          0.0, 0.0) for g in groups]
        out[label] = {"measured_s": measured, "simulated_s": simulate_buckets(buckets),
                      "ideal_s": sleep_s * max(owners.count(r) for r in range(tp))}
    return out


def render_measured(cfg: TpBenchConfig, result: dict[str, Any]) -> str:
    shape = cfg.shape
    lines = [f"gloo, world {cfg.dp * cfg.tp} (dp {cfg.dp} x tp {cfg.tp}); {shape.layers} blocks "
             f"of dim {shape.dim}, FFN {shape.ffn}, {shape.heads} heads, {shape.kv_heads} KV heads "
             f"({len(tp_specs(shape))} TP matrices); Muon, {cfg.ns_dtype} Newton–Schulz; "
             f"{cfg.reps} interleaved repetitions after {cfg.warmup} warm-up; times of the "
             "slowest rank; paired: the median over repetitions of the step's time / the "
             "duplicated step's in the same repetition.", "",
             "| strategy | exact | step median (ms) | ÷ duplicated (paired) | NS GFLOP, busiest rank "
             "| bytes sent per rank (max) / per tp group | update deviation vs exact: relative "
             "error / sine of angle |", "|---|---|---|---|---|---|---|"]
    for name, f in result["strategies"].items():
        lines.append(
            f"| {LABELS[name]} | {'yes' if EXACT[name] else 'no'} | {f['median_s'] * 1e3:.1f} | "
            f"{f['ratio_to_duplicated']:.3f} ({f['paired_ratio_to_duplicated']:.3f}) | "
            f"{f['gflop_busiest_rank']:.3g} | {f['sent_max_rank'] / 2**20:.2f} MiB"
            f" / {max(f['sent_per_row']) / 2**20:.2f} MiB | {f['deviation']:.2e} / "
            f"{f['direction_deviation']:.2e} |")
    block = result["strategies"].get("blockwise")
    if block:
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in block["deviation_by_kind"].items())
        lines += ["", f"Blockwise relative error per matrix kind (worst over blocks): {kinds}."]
    return "\n".join(lines)


def render_schedule(check: dict[str, Any]) -> str:
    lines = [f"`step_tp_matrices` at tp {check['tp']}, {check['matrices']} equal matrices, the "
             f"step math replaced by a {check['sleep_s'] * 1e3:.0f} ms sleep per matrix:", "",
             "| buckets | measured (ms) | simulated (ms) | ideal max per step owner (ms) |",
             "|---|---|---|---|"]
    for label in ("one bucket", "one matrix per step owner per bucket"):
        f = check[label]
        lines.append(f"| {label} | {f['measured_s'] * 1e3:.0f} | {f['simulated_s'] * 1e3:.0f} | "
                     f"{f['ideal_s'] * 1e3:.0f} |")
    return "\n".join(lines)


# -- command ---------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run tp-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", nargs="+", default=["1x2"], help="dp x tp meshes, e.g. 1x2 2x2")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    for name in ("dim", "layers", "ffn", "heads", "kv_heads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int,
                       default=getattr(BENCH_SHAPE, name))
    p.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--projection-only", action="store_true")
    p.add_argument("--no-schedule-check", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/tp_step.md"))
    return p.parse_args(argv)


def _measure(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[list[str], dict]:
    shape = dataclasses.replace(BENCH_SHAPE, **{k: getattr(args, k) for k in
                                                ("dim", "layers", "ffn", "heads", "kv_heads")})
    parts, data = [], {}
    for world in args.worlds:
        dp, tp = (int(x) for x in world.split("x"))
        cfg = TpBenchConfig(shape, tp, dp, args.reps, args.warmup, tuple(args.strategies),
                            args.ns_dtype)
        log(f"world {dp * tp} (dp {dp} x tp {tp}): {len(cfg.strategies)} strategies")
        result = run_measured(cfg)
        parts.append(render_measured(cfg, result))
        data[world] = result
    if not args.no_schedule_check:
        log("schedule check (tp 4, sleeping step math)")
        check = schedule_check()
        parts.append(render_schedule(check))
        data["schedule_check"] = check
    return parts, data


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(f"[benchmarks tp-step {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
              flush=True)

    start = time.time()
    header = [f"Command: `python -m benchmarks.run tp-step {' '.join(argv or sys.argv[1:])}`",
              f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
              f"torch {torch.__version__}; {os.cpu_count()} cores; load average "
              f"{os.getloadavg()[0]:.1f} at start", ""]
    parts, data = ([], {}) if args.projection_only else _measure(args, log)
    proj = projections()
    text = "\n\n".join([*parts, render_projection(proj)])
    if hasattr(os, "getloadavg"):
        header[1] += f", {os.getloadavg()[0]:.1f} at end; {time.time() - start:.0f} s"
    report = "\n".join(header) + "\n" + text + "\n"
    print(report)
    if not args.projection_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"measured": data, "projection": proj}, indent=1, default=str))
    return {"measured": data, "projection": proj}


if __name__ == "__main__":
    main()
