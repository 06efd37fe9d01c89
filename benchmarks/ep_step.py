"""Expert parallelism: step time, bytes and peak memory of three Muon placements (issue 27).

``python -m benchmarks.run ep-step`` (or ``python -m benchmarks.ep_step``; ``--help``).

[Note: EP step benchmark]
- Model: ``EPBenchMoE``, ``layers`` blocks of a dense ``mix`` matrix (dim x dim, a stand-in for
  attention) and the tests' ``MoEBlock`` (a router ``gate``, top-2 over ``experts`` two-layer
  experts stored as stacks ``w_in (E, hidden, dim)``, ``w_out (E, dim, hidden)``, and the
  differentiable all-to-all token dispatch over ep); embedding and head untied. The expert
  stacks are ``distribute_tensor(..., mesh["ep"], [Shard(0)])`` before any wrapping, on the
  world mesh ``(efsdp, ep)``; the dense mesh is the 1-D world.
- Strategies, every one with Muon (momentum 0.95, Nesterov, the library's
  ``zeropower_via_newton_schulz`` and ``muon_adjusted_lr``; each expert its own matrix) on the
  matrices of matrixfsdp's plan and AdamW on the tail:
  - ``matrixfsdp``: ``fully_shard_matrix(model, dense, expert_mesh=mesh["efsdp"])`` +
    ``MatrixOptimizer``: each expert stack whole on an efsdp owner, the step local;
  - ``fsdp2_recon``: torchtitan's FSDP2-EP layout: ``fully_shard(experts, efsdp,
    shard_placement_fn=Shard(1))`` (the layout torchtitan picks when the local experts are
    fewer than efsdp; every expert matrix is then split over every efsdp rank), then each block
    and the root over the dense mesh, ``Shard(0)``; expert gradients summed over efsdp and
    divided by the whole world (``set_gradient_divide_factor``). Step: momentum on the shard,
    the Nesterov direction all-gathered per parameter (the local stack over efsdp, a dense
    matrix over the world), every rank orthogonalizes every gathered matrix and keeps its rows;
  - ``transient_owner`` (torchtitan DistMuon / Megatron layer-wise style): the same FSDP2
    storage; per group (each efsdp group for experts, the world for dense matrices) each matrix
    gets a transient step owner (the library's LPT, ``assign_step_owners``), one all-to-all
    sends every owner its matrices' direction rows, the owner orthogonalizes, a second
    all-to-all returns each rank its rows of the update.
- Timing: per repetition the strategies in rotated order, forward+backward and the optimizer
  step each between barriers (matrixfsdp's backward ends with ``quiesce``, so every reduction
  is in it, as FSDP2's end-of-backward wait); the slowest rank; medians over repetitions.
- Bytes: per rank and step, what the step sends to and receives from other ranks, counted from
  the tensors handed to the collectives (all-gather: (n - 1) x the local shard each way); the
  backend collectives of one step are also counted with the profiler (matrixfsdp: 0).
- Memory: after timing, one step per strategy under ``matrixfsdp.memory.LiveBytesTracker``
  tracking that strategy's parameters, gradients and optimizer state (as BENCHMARKS §9), peak per
  phase; every strategy holds one momentum buffer per matrix element.
- Agreement: after the last step every strategy's whole parameters against matrixfsdp's
  (relative Frobenius error, worst parameter); the three are the same optimizer.
- Projection: ``benchmarks/ep_projection.py`` ([Note: EP step projection]).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import matrixfsdp as mf
from matrixfsdp.memory import LiveBytesTracker
from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.optim.functional._linalg import dtype_from_name
from matrixfsdp.optim.functional.muon import muon_adjusted_lr, zeropower_via_newton_schulz
from matrixfsdp.optim.tp_step import assign_step_owners
from matrixfsdp.planner import matrix_cost

from .ep_model import STRATEGIES, EPBenchConfig, EPBenchMoE, loss_of, tokens_at
from .ep_projection import projections, render_projection
from .launch import run_world

__all__ = ["LABELS", "STRATEGIES", "EPBenchConfig", "EPBenchMoE", "main", "run_measured"]

LABELS = {
    "matrixfsdp": "(a) **matrixfsdp-EP** (experts owned whole on efsdp, local step)",
    "fsdp2_recon": "(b) FSDP2-EP + Muon by reconstruction (all-gather the direction)",
    "transient_owner": "(c) FSDP2-EP + transient-owner all-to-all (DistMuon-style)",
}
logger = logging.getLogger(__name__)
LR, WEIGHT_DECAY, TAIL_LR = 0.02, 0.01, 3e-3
PHASES = ("forward", "backward", "optimizer")


# -- strategies -----------------------------------------------------------------------------------
class _Muon:
    """The library's Muon pieces with the benchmark's config."""

    def __init__(self, ns_dtype: str) -> None:
        self.config = get_matrix_optimizer("muon").make_config({"ns_dtype": ns_dtype})

    def direction(self, buf: Tensor, grad: Tensor) -> Tensor:
        buf.lerp_(grad, 1 - self.config.momentum)
        return grad.lerp(buf, self.config.momentum) if self.config.nesterov else buf

    def orthogonalize(self, x: Tensor) -> Tensor:
        c = self.config
        return zeropower_via_newton_schulz(x, c.ns_coefficients, c.ns_steps, c.eps,
                                           dtype_from_name(c.ns_dtype))

    def apply(self, block: Tensor, ortho: Tensor, rows: int, cols: int) -> None:
        """Weight decay and the update on this rank's rows of a ``rows x cols`` matrix."""
        scale = muon_adjusted_lr(LR, self.config.adjust_lr_fn, rows, cols)
        block.mul_(1 - LR * WEIGHT_DECAY)
        block.add_(ortho.to(block.dtype), alpha=-scale)


class _EPStrategy:
    name = "base"

    def __init__(self, model: nn.Module, matrix_fqns: Sequence[str]) -> None:
        self.model = model
        self.matrix_fqns = tuple(matrix_fqns)

    def loss(self, tokens: Tensor) -> Tensor:
        return loss_of(self.model, tokens)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, int]:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def resident(self) -> list[Any]:
        params = list(self.model.parameters())
        return params + [p.grad for p in params] + self.state_tensors()

    def state_tensors(self) -> list[Tensor]:
        raise NotImplementedError

    def full_params(self) -> dict[str, Tensor]:
        return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                for n, p in self.model.named_parameters()}


class MatrixFSDPEP(_EPStrategy):
    name = "matrixfsdp"

    def __init__(self, model: nn.Module, dense: DeviceMesh, experts: DeviceMesh,
                 ns_dtype: str) -> None:
        mf.fully_shard_matrix(model, dense, expert_mesh=experts)
        super().__init__(model, [p.fqn for p in mf.get_plan(model).matrices])
        self.runtime = mf.get_state(model)
        self.opt = mf.MatrixOptimizer(model, optimizer="muon", lr=LR, weight_decay=WEIGHT_DECAY,
                                      tail_lr=TAIL_LR, ns_dtype=ns_dtype)

    def backward(self, loss: Tensor) -> None:
        loss.backward()
        mf.quiesce(self.model)

    def step(self) -> dict[str, int]:
        for group in self.runtime.groups:
            group.comm.counter.reset()
        self.opt.step()
        out = {"sent": 0, "recv": 0, "expert_sent": 0}
        for g in self.runtime.groups:
            stats = g.comm.counter.snapshot()["optimizer"]
            out["sent"] += stats["bytes_sent"]
            out["recv"] += stats["bytes_received"]
            if any(len(mp.shape) == 3 for mp in g.params):
                out["expert_sent"] += stats["bytes_sent"]
        return out

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def resident(self) -> list[Any]:
        return super().resident() + [mp.unsharded for mp in self.runtime.params.values()]

    def state_tensors(self) -> list[Tensor]:
        return [v for st in self.opt.state.values() for v in st.values()
                if isinstance(v, Tensor)]

    def full_params(self) -> dict[str, Tensor]:
        from tests.checks import full_values

        return {k: v for k, v in full_values(self.model).items() if v is not None}


@dataclass
class _Unit:
    """One matrix for Muon: a parameter (an expert stack's expert ``index``) of FSDP2 storage,
    this rank holding rows ``[rank * rows_local, ...)`` of it in its group."""

    fqn: str
    param: DTensor
    index: int | None
    group: dist.ProcessGroup

    def block(self, local: Tensor) -> Tensor:
        return local if self.index is None else local[self.index]

    def shape(self, n: int) -> tuple[int, int]:
        rows, cols = self.block(self.param.to_local()).shape
        return rows * n, cols


class _FSDP2EP(_EPStrategy):
    """torchtitan's FSDP2-EP storage; Muon on the matrices, AdamW on the tail."""

    def __init__(self, model: nn.Module, dense: DeviceMesh, experts: DeviceMesh,
                 matrix_fqns: Sequence[str], ns_dtype: str) -> None:
        world = dist.get_world_size()
        for block in model.layers:  # type: ignore[union-attr]
            fully_shard(block.moe.experts, mesh=experts, shard_placement_fn=lambda p: Shard(1))
            block.moe.experts.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
            block.moe.experts.set_gradient_divide_factor(float(world))
            fully_shard(block, mesh=dense)
        fully_shard(model, mesh=dense)
        super().__init__(model, matrix_fqns)
        params = dict(model.named_parameters())
        self.params = {f: params[f] for f in self.matrix_fqns}
        self.tail = torch.optim.AdamW([p for f, p in params.items() if f not in self.params],
                                      lr=TAIL_LR, weight_decay=0.0)
        self.groups = {"expert": experts.get_group(0), "dense": dense.get_group(0)}
        self.muon = _Muon(ns_dtype)
        self.bufs = {f: torch.zeros_like(p.to_local()) for f, p in self.params.items()}

    def _group(self, p: DTensor) -> dist.ProcessGroup:
        return self.groups["expert" if p.ndim == 3 else "dense"]

    def direction(self, fqn: str) -> Tensor:
        return self.muon.direction(self.bufs[fqn], self.params[fqn].grad.to_local())

    def directions(self) -> dict[str, Tensor]:
        return {f: self.direction(f) for f in self.params}

    def state_tensors(self) -> list[Tensor]:
        tail = [v for st in self.tail.state.values() for v in st.values() if isinstance(v, Tensor)]
        return list(self.bufs.values()) + tail


class FSDP2Recon(_FSDP2EP):
    name = "fsdp2_recon"

    @torch.no_grad()
    def step(self) -> dict[str, int]:
        moved = expert = 0
        for f, p in self.params.items():  # one direction alive at a time
            d, group = self.direction(f), self._group(p)
            n, me = dist.get_world_size(group), dist.get_rank(group)
            flat = d.new_empty((n * d.shape[0], *d.shape[1:]))
            dist.all_gather_into_tensor(flat, d.contiguous(), group=group)
            out = flat.view(n, *d.shape)
            moved += (n - 1) * d.nbytes
            expert += (n - 1) * d.nbytes if d.ndim == 3 else 0
            rows = d.shape[-2]
            whole = out.transpose(0, 1).flatten(1, 2) if d.ndim == 3 else out.flatten(0, 1)
            ortho = self.muon.orthogonalize(whole)
            self.muon.apply(p.to_local(), ortho[..., me * rows:(me + 1) * rows, :],
                            *whole.shape[-2:])
        self.tail.step()
        return {"sent": moved, "recv": moved, "expert_sent": expert}


class TransientOwner(_FSDP2EP):
    name = "transient_owner"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units: dict[str, list[_Unit]] = {"expert": [], "dense": []}
        for f, p in self.params.items():
            kind = "expert" if p.ndim == 3 else "dense"
            indices: list[int | None] = list(range(p.to_local().shape[0])) if p.ndim == 3 \
                else [None]
            self.units[kind] += [_Unit(f, p, i, self.groups[kind]) for i in indices]
        self.owners = {}
        for kind, units in self.units.items():
            n = dist.get_world_size(self.groups[kind])
            costs = [matrix_cost(u.shape(n), "muon") for u in units]
            self.owners[kind] = assign_step_owners(costs, n) if units else []

    @staticmethod
    def _exchange(send: list[list[Tensor]], recv_numel: list[int], group: dist.ProcessGroup,
                  like: Tensor) -> list[Tensor]:
        """One uneven all-to-all in ``group``: ``send[d]`` to rank d; what each rank sent us."""
        me = dist.get_rank(group)
        in_splits = [0 if d == me else sum(t.numel() for t in ts) for d, ts in enumerate(send)]
        out_splits = [0 if s == me else k for s, k in enumerate(recv_numel)]
        flat = [t.reshape(-1) for d, ts in enumerate(send) if d != me for t in ts]
        out = like.new_empty(sum(out_splits))
        dist.all_to_all_single(out, torch.cat(flat) if flat else like.new_empty(0), out_splits,
                               in_splits, group=group)
        return list(out.split(out_splits))

    @torch.no_grad()
    def _step_group(self, kind: str, dirs: dict[str, Tensor]) -> tuple[int, int]:
        """Gather each owner's matrices, orthogonalize, return the rows: (sent, received)."""
        units, owners, group = self.units[kind], self.owners[kind], self.groups[kind]
        if not units:
            return 0, 0
        n, me = dist.get_world_size(group), dist.get_rank(group)
        blocks = [u.block(dirs[u.fqn]) for u in units]
        owned = [[i for i, o in enumerate(owners) if o == r] for r in range(n)]
        numel = [sum(blocks[i].numel() for i in owned[r]) for r in range(n)]
        got = self._exchange([[blocks[i] for i in owned[d]] for d in range(n)],
                             [numel[me]] * n, group, blocks[0])
        parts = [() if s == me else got[s].split([blocks[i].numel() for i in owned[me]])
                 for s in range(n)]
        ortho = {}
        for j, i in enumerate(owned[me]):
            rows = [blocks[i] if s == me else parts[s][j].view_as(blocks[i]) for s in range(n)]
            ortho[i] = self.muon.orthogonalize(torch.cat(rows)).to(blocks[i].dtype)
        back = [[ortho[i].chunk(n)[d] for i in owned[me]] for d in range(n)]
        got = self._exchange(back, numel, group, blocks[0])
        for s in range(n):
            pieces = [ortho[i].chunk(n)[me] for i in owned[s]] if s == me else \
                got[s].split([blocks[i].numel() for i in owned[s]])
            for i, piece in zip(owned[s], pieces, strict=True):
                u = units[i]
                self.muon.apply(u.block(u.param.to_local()), piece.view_as(blocks[i]),
                                *u.shape(n))
        others = sum(numel) - numel[me]  # my rows of the matrices other ranks own
        item = blocks[0].element_size()
        return (others + (n - 1) * numel[me]) * item, ((n - 1) * numel[me] + others) * item

    def step(self) -> dict[str, int]:
        dirs = self.directions()
        out = {"sent": 0, "recv": 0, "expert_sent": 0}
        for kind in self.units:
            sent, recv = self._step_group(kind, dirs)
            out["sent"] += sent
            out["recv"] += recv
            out["expert_sent"] += sent if kind == "expert" else 0
        self.tail.step()
        return out


# -- the world ------------------------------------------------------------------------------------
def _build(cfg: EPBenchConfig, name: str, mesh: DeviceMesh, dense: DeviceMesh,
           matrix_fqns: Sequence[str]) -> _EPStrategy:
    from tests.ep_models import distribute_experts

    torch.manual_seed(0)
    model = distribute_experts(EPBenchMoE(cfg), mesh["ep"])
    if name == "matrixfsdp":
        return MatrixFSDPEP(model, dense, mesh["efsdp"], cfg.ns_dtype)
    cls = FSDP2Recon if name == "fsdp2_recon" else TransientOwner
    return cls(model, dense, mesh["efsdp"], matrix_fqns, cfg.ns_dtype)


def _timed_step(s: _EPStrategy, tokens: Tensor) -> dict[str, Any]:
    dist.barrier()
    start, cpu0 = time.perf_counter(), time.process_time()
    loss = s.loss(tokens)
    s.backward(loss)
    dist.barrier()
    mid, cpu1 = time.perf_counter(), time.process_time()
    moved = s.step()
    dist.barrier()
    end, cpu2 = time.perf_counter(), time.process_time()
    s.zero_grad()
    return {"fwd_bwd": mid - start, "step": end - mid, "total": end - start,
            "fwd_bwd_cpu": cpu1 - cpu0, "step_cpu": cpu2 - cpu1, "loss": loss.item(), **moved}


def _backend_calls(fn: Any) -> int:
    """Backend (gloo/NCCL) collectives issued while running ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith(("gloo:", "nccl:")))


def _memory(s: _EPStrategy, tokens: Tensor) -> dict[str, int]:
    """Peak live tensor bytes per phase of one step (BENCHMARKS §9's measurement)."""
    tracker = LiveBytesTracker().track(s.resident())
    start = tracker.current
    state: dict[str, Any] = {}
    with tracker:
        for phase, fn in (("forward", lambda: state.update(loss=s.loss(tokens))),
                          ("backward", lambda: s.backward(state["loss"])),
                          ("optimizer", s.step)):
            dist.barrier()
            with tracker.phase(phase):
                fn()
        del state["loss"]
    s.zero_grad()
    return {"start": start, **{ph: tracker.phases[ph].peak for ph in PHASES}}


def _deviation(strategies: dict[str, _EPStrategy]) -> dict[str, float]:
    """Worst relative Frobenius error of each strategy's parameters against matrixfsdp's."""
    full = {name: s.full_params() for name, s in strategies.items()}
    ref = full.get("matrixfsdp") or next(iter(full.values()))
    out = {}
    for name, params in full.items():
        out[name] = max(((params[k].double() - v.double()).norm() / v.double().norm()).item()
                        for k, v in ref.items())
    return out


def _worker(rank: int, world: int, cfg: EPBenchConfig) -> dict[str, Any]:
    del world
    warnings.filterwarnings("ignore", category=FutureWarning)  # tests' dist_fn all-to-all
    mesh = init_device_mesh("cpu", (cfg.efsdp, cfg.ep), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh("cpu", (cfg.world,), mesh_dim_names=("dp",))
    strategies: dict[str, _EPStrategy] = {}
    reference = _build(cfg, "matrixfsdp", mesh, dense, ())
    fqns = reference.matrix_fqns
    for name in cfg.strategies:
        strategies[name] = reference if name == "matrixfsdp" else _build(cfg, name, mesh, dense,
                                                                         fqns)
    names = list(strategies)
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(cfg.warmup + cfg.reps):
        tokens = tokens_at(cfg, rep, rank)
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            sample = _timed_step(strategies[name], tokens)
            if rep >= cfg.warmup:
                samples[name].append(sample)
    deviation = _deviation(strategies)
    extra = cfg.warmup + cfg.reps
    memory = {n: _memory(s, tokens_at(cfg, extra, rank)) for n, s in strategies.items()}
    calls = {}
    for name, s in strategies.items():
        s.backward(s.loss(tokens_at(cfg, extra + 1, rank)))
        dist.barrier()
        calls[name] = _backend_calls(s.step)
        s.zero_grad()
    return {"samples": samples, "memory": memory, "calls": calls, "deviation": deviation,
            "matrices": len(fqns), "expert_bytes": _expert_bytes(strategies)}


def _expert_bytes(strategies: dict[str, _EPStrategy]) -> int:
    """This rank's stored bytes of routed-expert matrices (FSDP2 storage: 1/efsdp of the local
    stacks); 0 without an FSDP2 strategy."""
    for s in strategies.values():
        if isinstance(s, _FSDP2EP):
            return sum(p.to_local().nbytes for p in s.params.values() if p.ndim == 3)
    return 0


# -- summary ----------------------------------------------------------------------------------------
def _summarize(cfg: EPBenchConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"config": asdict(cfg), "strategies": {},
                           "matrices": ranks[0]["matrices"],
                           "expert_bytes_per_rank": max(r["expert_bytes"] for r in ranks)}
    for name in cfg.strategies:
        fig: dict[str, Any] = {}
        for key in ("fwd_bwd", "step", "total"):
            slowest = [max(r["samples"][name][i][key] for r in ranks) for i in range(cfg.reps)]
            fig[key] = {"median_s": statistics.median(slowest), "samples_s": slowest}
        for key in ("fwd_bwd_cpu", "step_cpu"):  # CPU seconds of all ranks together
            fig[key] = statistics.median(sum(r["samples"][name][i][key] for r in ranks)
                                         for i in range(cfg.reps))
        for key in ("sent", "recv", "expert_sent"):
            fig[f"{key}_bytes"] = max(r["samples"][name][-1][key] for r in ranks)
        fig["calls"] = max(r["calls"][name] for r in ranks)
        fig["memory"] = {ph: max(r["memory"][name][ph] for r in ranks) for ph in PHASES}
        fig["peak"] = max(fig["memory"].values())
        fig["deviation"] = max(r["deviation"][name] for r in ranks)
        fig["losses"] = [s["loss"] for s in ranks[0]["samples"][name]]
        out["strategies"][name] = fig
    base = out["strategies"].get("fsdp2_recon")
    for fig in out["strategies"].values():
        if base is None:
            continue
        for key in ("fwd_bwd", "step", "total"):
            mine, theirs = fig[key]["samples_s"], base[key]["samples_s"]
            fig[key]["ratio"] = fig[key]["median_s"] / base[key]["median_s"]
            fig[key]["paired_ratio"] = statistics.median(
                a / b for a, b in zip(mine, theirs, strict=True))
        fig["peak_ratio"] = fig["peak"] / base["peak"]
        for key in ("fwd_bwd_cpu", "step_cpu"):
            fig[f"{key}_ratio"] = fig[key] / base[key]
    return out


def run_measured(cfg: EPBenchConfig) -> dict[str, Any]:
    """One gloo world of ``efsdp * ep`` ranks running ``cfg.strategies`` interleaved."""
    return _summarize(cfg, run_world(cfg.world, _worker, cfg))


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def render_measured(result: dict[str, Any]) -> str:
    cfg = EPBenchConfig(**{**result["config"], "strategies": tuple(result["config"]["strategies"])})
    lines = [
        f"gloo, world {cfg.world} = efsdp {cfg.efsdp} x ep {cfg.ep}; {cfg.layers} blocks of dim "
        f"{cfg.dim}, {cfg.experts} routed experts (top-2) of hidden {cfg.hidden} "
        f"({cfg.experts // cfg.ep} per ep rank), a dense dim x dim `mix` per block, vocab "
        f"{cfg.vocab}; {result['matrices']} Muon parameters (expert stacks, each expert its own "
        f"matrix); global batch {cfg.global_batch} x {cfg.seq_len} tokens; Muon with "
        f"{cfg.ns_dtype} Newton–Schulz; {cfg.reps} interleaved repetitions after {cfg.warmup} "
        f"warm-up; wall times of the slowest rank; ratios: medians ÷ (b)'s medians (paired: median "
        "over repetitions of the ratio in the same repetition); CPU: median over repetitions of "
        "the process CPU seconds summed over the ranks. Expert bytes stored per rank in FSDP2 "
        f"storage: {_mib(result['expert_bytes_per_rank'])} MiB.", "",
        "| strategy | fwd+bwd median (ms) | ÷ (b) (paired) | step median (ms) | ÷ (b) (paired) "
        "| total (ms) | CPU s of all ranks, fwd+bwd / step (÷ (b)) | step bytes sent / received per rank (MiB); experts' share sent | step "
        "collectives | peak live "
        "fwd / bwd / step (MiB) | peak ÷ (b) | params vs (a) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in result["strategies"].items():
        fb, st, tot, mem = f["fwd_bwd"], f["step"], f["total"], f["memory"]
        lines.append(
            f"| {LABELS[name]} | {fb['median_s'] * 1e3:.1f} | {fb.get('ratio', 1):.3f} "
            f"({fb.get('paired_ratio', 1):.3f}) | {st['median_s'] * 1e3:.1f} | "
            f"{st.get('ratio', 1):.3f} ({st.get('paired_ratio', 1):.3f}) | "
            f"{tot['median_s'] * 1e3:.1f} | {f['fwd_bwd_cpu']:.2f} "
            f"({f.get('fwd_bwd_cpu_ratio', 1):.3f}) / {f['step_cpu']:.2f} "
            f"({f.get('step_cpu_ratio', 1):.3f}) | {_mib(f['sent_bytes'])} / {_mib(f['recv_bytes'])}; "
            f"{_mib(f['expert_sent_bytes'])} | "
            f"{f['calls']} | {' / '.join(_mib(mem[ph]) for ph in PHASES)} | "
            f"{f.get('peak_ratio', 1):.3f} | {f['deviation']:.1e} |")
    return "\n".join(lines)


# -- command ---------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run ep-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", nargs="+", default=["2x2"], help="efsdp x ep, e.g. 2x2 1x4")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    defaults = EPBenchConfig()
    for name in ("reps", "warmup", "layers", "dim", "hidden", "experts", "vocab",
                 "global_batch", "seq_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--projection-only", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/ep_step.md"))
    return p.parse_args(argv)


def _configs(args: argparse.Namespace) -> list[EPBenchConfig]:
    fields = {k: getattr(args, k) for k in ("reps", "warmup", "layers", "dim", "hidden",
                                            "experts", "vocab", "global_batch", "seq_len")}
    out = []
    for world in args.worlds:
        efsdp, ep = (int(x) for x in world.split("x"))
        out.append(EPBenchConfig(efsdp=efsdp, ep=ep, strategies=tuple(args.strategies),
                                 ns_dtype=args.ns_dtype, **fields))
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    load = os.getloadavg()[0]
    measured = {}
    if not args.projection_only:
        for cfg in _configs(args):
            _log(f"world {cfg.world} (efsdp {cfg.efsdp} x ep {cfg.ep})")
            measured[f"{cfg.efsdp}x{cfg.ep}"] = run_measured(cfg)
    proj = projections()
    header = [f"Command: `python -m benchmarks.run ep-step {' '.join(argv)}`",
              f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; torch "
              f"{torch.__version__}; {os.cpu_count()} cores; load average {load:.1f} at start, "
              f"{os.getloadavg()[0]:.1f} at end; {time.time() - start:.0f} s", ""]
    text = "\n\n".join([*(render_measured(r) for r in measured.values()),
                         render_projection(proj)])
    report = "\n".join(header) + "\n" + text + "\n"
    print(report)
    if not args.projection_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"measured": measured, "projection": proj}, indent=1, default=str))
    return {"measured": measured, "projection": proj}


def _log(msg: str) -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[benchmarks ep-step %(asctime)s] "
                            "%(message)s", datefmt="%H:%M:%S")
    logger.info(msg)


if __name__ == "__main__":
    main()
