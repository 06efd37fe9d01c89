"""α–β communication model plus measured compute: fit on gloo loopback, check against the
measured small runs, and project Llama models on 8 nodes × 8 GPUs (flat and HSDP).

[Note: the cost model]
- A collective of logical size x bytes (see benchmarks.measure) costs α_op + β_op·x. On gloo
  loopback α_op, β_op are least-squares fits of the microbenchmark run inside each timing world.
- Measured-scale prediction, per rank: phase time = compute + Σ over the collectives the profiler
  counted on that rank; the max over ranks is compared with the measured phase time. Compute is
  measured single-process, single-threaded, interleaved with the strategies (forward+backward at
  the local batch; each matrix's step; tail AdamW), times the measured contention factor (a fixed
  GEMM workload on all ranks at once ÷ on one rank alone: ranks share the cores, and whatever
  else runs on the machine slows them too).
- Projection: the schedule of :mod:`benchmarks.schedule` on the model's plan, each op timed on a
  two-level topology (ring / pipelined chain / all-to-all bounded by each rank's busiest link),
  compute from FLOPs at an achieved GEMM rate; forward+backward = max(compute, communication)
  (FSDP2-style prefetch overlap), optimizer step = compute + communication (nothing to overlap),
  except the owner all-to-all Muon baseline, whose all-to-alls are pipelined with Newton–Schulz
  over W waves (one per block): max(compute, communication) + min(...) / W. A phase's
  communication is the busiest rank's sum over the collectives it takes part in (replicate
  groups of different shard coordinates run side by side).
- HSDP: a shard group is one node (NVLink), a replicate group one GPU per node (InfiniBand).
  *Inter-node bytes* per GPU and step: what a rank receives from ranks on other nodes under
  direct exchange (all-gather / reduce-scatter: (N-G)/N of the buffer, all-reduce: twice that,
  broadcast: the buffer if the root is remote, reduce: one buffer per remote peer at the root,
  all-to-all: the remote rows of the traffic matrix), busiest rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from matrixfsdp.planner import ParamSpec, Plan, make_plan, matrix_cost

from .schedule import (
    Dtypes,
    Op,
    Setup,
    inter_node_recv,
    is_hsdp,
    numel,
    owners_all,
    per_rank_calls,
    per_rank_recv,
    resident_model,
    schedule,
)
from .strategies.base import planner_for

__all__ = [
    "HSDP_MODELS",
    "HSDP_STRATEGIES",
    "PROJECTED",
    "Hardware",
    "LlamaShape",
    "fit_alpha_beta",
    "predict_measured",
    "project",
    "project_hsdp",
]


# -- fit ------------------------------------------------------------------------------------------
def fit_alpha_beta(samples_by_rank: Iterable[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per-op least squares of ``seconds = α + β·size`` (slowest rank per sample)."""
    worst: dict[tuple[str, int], float] = {}
    for samples in samples_by_rank:
        for s in samples:
            key = (s["op"], s["size"])
            worst[key] = max(worst.get(key, 0.0), s["seconds"])
    by_op: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (op, size), sec in worst.items():
        by_op[op].append((size, sec))
    fits = {}
    for op, pts in by_op.items():
        alpha, beta = _relative_least_squares(pts)
        resid = [abs(alpha + beta * x - y) / y for x, y in pts if y > 0]
        fits[op] = {"alpha_s": alpha, "beta_s_per_byte": beta,
                    "max_rel_err": max(resid) if resid else 0.0}
    return fits


def _relative_least_squares(pts: list[tuple[int, float]]) -> tuple[float, float]:
    """``(α, β) >= 0`` minimising Σ ((α + β·x − y) / y)² (small sizes weigh as much as big)."""
    w = [1.0 / (y * y) if y > 0 else 0.0 for _, y in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts, strict=True))
    det = sw * sxx - sx * sx
    if det <= 0:
        return max(sy / sw, 0.0) if sw else 0.0, 0.0
    beta = (sw * sxy - sx * sy) / det
    alpha = (sy - beta * sx) / sw
    if beta < 0:  # no bandwidth term resolvable: latency only
        return max(sy / sw, 0.0), 0.0
    if alpha < 0:  # bandwidth only, through the origin
        return 0.0, sxy / sxx
    return alpha, beta


def _comm_seconds(collectives: list[dict[str, Any]], phase: str,
                  fits: dict[str, dict[str, float]]) -> float:
    total = 0.0
    for c in collectives:
        if c["phase"] != phase:
            continue
        f = fits.get(c["op"]) or fits["all_reduce"]
        total += f["alpha_s"] + f["beta_s_per_byte"] * c["size"]
    return total


def _opt_compute(strategy: str, ref: dict[str, Any], owned: list[str], world: int) -> float:
    """``world``: the ranks sharing the tail (the shard size under HSDP)."""
    owned_step = sum(ref["per_matrix"][f] for f in owned)
    tail = ref["tail_adamw"] / world
    return {
        "ddp": ref["matrix_step"] + ref["tail_adamw"],
        "fsdp2_recon": ref["matrix_step"] + tail,
        # AdamW on every parameter ~ tail AdamW scaled by parameter count
        "fsdp2_adamw": ref["tail_adamw"] * ref["params_all"] / ref["params_tail"] / world,
    }.get(strategy, owned_step + tail)


def predict_measured(rank_results: list[dict[str, Any]], ref: dict[str, Any], world: int,
                     share: float, fits: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Predicted forward+backward and optimizer seconds per strategy (slowest rank).

    ``ref``: median single-process references; ``share``: the measured compute slowdown of
    ranks running at once (the contention probe).
    """
    fb_compute = ref["fwd_bwd"] * share
    out: dict[str, dict[str, float]] = {}
    for name in rank_results[0]["counted"]:
        fb, opt = [], []
        hsdp = is_hsdp(name)
        for r in rank_results:
            coll = r["counted"][name]["collectives"]
            fb.append(fb_compute + _comm_seconds(coll, "forward", fits)
                      + _comm_seconds(coll, "backward", fits))
            owned = r["owned_hsdp"] if hsdp else r["owned"]
            shard = world // r["hsdp_replicate"] if hsdp else world
            opt.append(_opt_compute(name.removesuffix("_hsdp"), ref, owned, shard) * share
                       + _comm_seconds(coll, "optimizer", fits))
        out[name] = {"fwd_bwd": max(fb), "optimizer": max(opt), "total": max(fb) + max(opt)}
    return out


# -- projection -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Documented H100-class numbers; every figure is an assumption printed with the projection."""

    name: str = "8 nodes x 8 H100 SXM (NVLink 4 in a node, 8x NDR 400 Gb/s InfiniBand per node)"
    nodes: int = 8
    gpus_per_node: int = 8
    gemm_tflops: float = 400.0  # achieved dense bf16 GEMM rate (H100 peak 989; ~40 %)
    nvlink_gbps: float = 450.0  # per GPU and direction (NVLink 4: 900 GB/s bidirectional)
    ib_gbps: float = 50.0  # per GPU and direction (one 400 Gb/s NIC per GPU)
    alpha_nvlink_s: float = 3e-6
    alpha_ib_s: float = 8e-6
    hbm_gbps: float = 3350.0  # for element-wise AdamW (28 bytes moved per parameter)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder: ``layers`` blocks of q/o (d×d), k/v (kv×d, grouped-query attention),
    gate/up (f×d), down (d×f); untied embedding and head; bf16 compute gathers, fp32
    gradients, master weights and state. Defaults: Llama-2-7B."""

    name: str = "Llama-2-7B"
    dim: int = 4096
    layers: int = 32
    ffn: int = 11008
    vocab: int = 32000
    heads: int = 32
    kv_heads: int = 32
    seq_len: int = 4096
    tokens_per_gpu: int = 16384  # 4 sequences per GPU and step: 1M-token global batch on 64 GPUs
    dtypes: Dtypes = field(default_factory=lambda: Dtypes(gather=2, grad=4, param=4, state=4))

    @classmethod
    def llama3_8b(cls) -> LlamaShape:
        """Llama-3-8B; 2 sequences of 8192 tokens per GPU (1M-token global batch on 64 GPUs)."""
        return cls(name="Llama-3-8B", dim=4096, layers=32, ffn=14336, vocab=128256, heads=32,
                   kv_heads=8, seq_len=8192, tokens_per_gpu=16384)

    @classmethod
    def llama3_70b(cls) -> LlamaShape:
        """Llama-3-70B; 2 sequences of 8192 tokens per GPU."""
        return cls(name="Llama-3-70B", dim=8192, layers=80, ffn=28672, vocab=128256, heads=64,
                   kv_heads=8, seq_len=8192, tokens_per_gpu=16384)

    def specs(self) -> list[ParamSpec]:
        d, f, kv = self.dim, self.ffn, self.dim // self.heads * self.kv_heads
        rows: list[tuple[str, tuple[int, ...], str, str]] = [("tok_embeddings.weight",
                                                              (self.vocab, d), "tail", "")]
        for i in range(self.layers):
            g = f"layers.{i}"
            rows += [(f"{g}.attention_norm.weight", (d,), "tail", g)]
            rows += [(f"{g}.attention.w{x}.weight", (d, d), "matrix", g) for x in "qo"]
            rows += [(f"{g}.attention.w{x}.weight", (kv, d), "matrix", g) for x in "kv"]
            rows += [(f"{g}.ffn_norm.weight", (d,), "tail", g),
                     (f"{g}.feed_forward.w1.weight", (f, d), "matrix", g),
                     (f"{g}.feed_forward.w3.weight", (f, d), "matrix", g),
                     (f"{g}.feed_forward.w2.weight", (d, f), "matrix", g)]
        rows += [("norm.weight", (d,), "tail", ""), ("output.weight", (self.vocab, d), "tail", "")]
        return [ParamSpec(fqn=n, shape=s, role=r, group=g) for n, s, r, g in rows]  # type: ignore[arg-type]

    def fwd_bwd_flops(self) -> float:
        """6·(matmul parameters)·tokens + causal attention 6·L·seq·d·tokens."""
        matmul = sum(numel(s.shape) for s in self.specs() if s.role == "matrix")
        matmul += self.vocab * self.dim  # the LM head
        t = self.tokens_per_gpu
        return 6.0 * matmul * t + 6.0 * self.layers * self.seq_len * self.dim * t


# Strategies ``project`` handles on a flat mesh, and the models of the HSDP projection.
PROJECTED = ("ddp", "fsdp2_recon", "gather_once", "zero1_owner", "matrixfsdp", "matrixfsdp_p2p",
             "fsdp2_adamw", "distmuon")
HSDP_STRATEGIES = ("matrixfsdp", "matrixfsdp_hsdp", "matrixfsdp_noflags_hsdp", "fsdp2_recon",
                   "fsdp2_recon_hsdp", "distmuon", "distmuon_hsdp", "fsdp2_adamw")
HSDP_MODELS = {"llama3-8b": LlamaShape.llama3_8b(), "llama3-70b": LlamaShape.llama3_70b()}


def _link(op: Op, hw: Hardware, setup: Setup) -> tuple[int, float, float]:
    """(group size, bandwidth, α) of the link class ``op`` runs on."""
    replicate, shard = setup.mesh_shape
    if op.group == "shard":  # a shard group is one node (shard <= GPUs per node)
        return shard, hw.nvlink_gbps * 1e9, hw.alpha_nvlink_s
    if op.group == "replicate":  # one rank per node
        return replicate, hw.ib_gbps * 1e9, hw.alpha_ib_s
    n = setup.world
    inter = n > hw.gpus_per_node
    return n, (hw.ib_gbps if inter else hw.nvlink_gbps) * 1e9, (
        hw.alpha_ib_s if inter else hw.alpha_nvlink_s)


def op_seconds(op: Op, hw: Hardware, setup: Setup) -> float:
    """One collective on the two-level topology (see [Note: the cost model])."""
    n, bw, alpha = _link(op, hw, setup)
    if op.kind in ("all_gather", "reduce_scatter"):
        return alpha * (n - 1) + (n - 1) / n * op.size / bw
    if op.kind == "all_reduce":
        return 2 * (alpha * (n - 1) + (n - 1) / n * op.size / bw)
    if op.kind in ("broadcast", "reduce"):
        return alpha * (n - 1) + op.size / bw
    assert op.traffic is not None
    node_of = ([0] * n if op.group == "shard"
               else [r // hw.gpus_per_node for r in range(n)])
    worst = 0.0
    for r in range(n):
        links = {"ib": [0, 0], "nv": [0, 0]}
        for peer in range(n):
            kind = "nv" if node_of[peer] == node_of[r] else "ib"
            links[kind][0] += op.traffic[r][peer]
            links[kind][1] += op.traffic[peer][r]
        worst = max(worst, max(links["ib"]) / (hw.ib_gbps * 1e9),
                    max(links["nv"]) / (hw.nvlink_gbps * 1e9))
    return alpha * (n - 1) + worst


def _phase_seconds(ops: list[Op], hw: Hardware, setup: Setup, phase: str) -> float:
    """The busiest rank's sum of the collectives it takes part in (parallel groups overlap)."""
    mine = [o for o in ops if o.phase == phase]
    seconds = [op_seconds(o, hw, setup) for o in mine]
    per_rank = [0.0] * setup.world
    for o, t in zip(mine, seconds, strict=True):
        for r, part in enumerate(per_rank_recv_parts(o, setup)):
            if part:
                per_rank[r] += t
    return max(per_rank, default=0.0)


def per_rank_recv_parts(op: Op, setup: Setup) -> list[bool]:
    calls = per_rank_calls([op], setup.world, setup.mesh_shape)
    return [c > 0 for c in calls]


def _elementwise_s(elements: float, hw: Hardware) -> float:
    return elements * 28.0 / (hw.hbm_gbps * 1e9)  # AdamW-like: 28 bytes moved per element


def _projected_opt_compute(strategy: str, setup: Setup, hw: Hardware, comm_s: float) -> float:
    """Optimizer step seconds: compute (+ the step's communication, overlapped for distmuon)."""
    rate = hw.gemm_tflops * 1e12
    base = strategy.removesuffix("_hsdp")
    costs = {p.fqn: matrix_cost(p.shape, setup.optimizer) for p in setup.plan.matrices}
    tail = sum(numel(p.shape) for p in setup.plan.tail)
    if base == "fsdp2_adamw":
        return _elementwise_s(sum(numel(p.shape) for p in setup.plan.params) / setup.shard, hw) + comm_s
    if base in ("ddp", "fsdp2_recon"):
        tail_share = tail if base == "ddp" else tail / setup.shard
        return sum(costs.values()) / rate + _elementwise_s(tail_share, hw) + comm_s
    owners = owners_all(setup)
    per_rank = [0.0] * setup.shard
    for fqn, c in costs.items():
        per_rank[owners[fqn]] += c
    compute = max(per_rank) / rate
    elementwise = _elementwise_s(tail / setup.shard, hw)
    if base == "distmuon":  # momentum on shards; all-to-alls pipelined with Newton–Schulz
        matrices = sum(numel(p.shape) for p in setup.plan.matrices)
        waves = max(1, len([u for u in setup.units() if setup.params_of(u, "matrix")]))
        overlapped = max(compute, comm_s) + min(compute, comm_s) / waves
        return overlapped + elementwise + _elementwise_s(matrices / setup.shard, hw)
    return compute + elementwise + comm_s


def _strategy_figures(name: str, setup: Setup, hw: Hardware, fb_compute: float) -> dict[str, Any]:
    ops = schedule(setup, name)
    world, shape = setup.world, setup.mesh_shape
    comm = {ph: _phase_seconds(ops, hw, setup, ph) for ph in ("forward", "backward", "optimizer")}
    calls = {ph: max(per_rank_calls([o for o in ops if o.phase == ph], world, shape), default=0)
             for ph in comm}
    recv = {ph: max(map(sum, zip(*[per_rank_recv(o, world, shape) for o in ops if o.phase == ph],
                                 strict=True)), default=0) for ph in comm}
    inter = [0] * world
    total = [0] * world
    for o in ops:
        inter = [a + b for a, b in zip(inter, inter_node_recv(o, world, shape, hw.gpus_per_node),
                                       strict=True)]
        total = [a + b for a, b in zip(total, per_rank_recv(o, world, shape), strict=True)]
    fb = max(fb_compute, comm["forward"] + comm["backward"])
    opt = _projected_opt_compute(name, setup, hw, comm["optimizer"])
    resident = max(resident_model(setup, name), key=lambda d: sum(d.values()))
    return {
        "fwd_bwd_s": fb, "fwd_bwd_compute_s": fb_compute,
        "fwd_bwd_comm_s": comm["forward"] + comm["backward"], "optimizer_s": opt,
        "optimizer_comm_s": comm["optimizer"], "total_s": fb + opt, "calls": calls,
        "recv_bytes": recv, "resident": resident, "inter_node_bytes": max(inter),
        "intra_node_bytes": max(t - i for t, i in zip(total, inter, strict=True)),
        "mesh_shape": list(shape), "plan_imbalance_bytes": setup.plan.imbalance("bytes"),
        "plan_imbalance_cost": setup.plan.imbalance("cost"),
    }


def project(optimizer: str, strategies: Iterable[str], hw: Hardware | None = None,
            shape: LlamaShape | None = None) -> dict[str, Any]:
    """Projected figures per flat strategy for ``shape`` on ``hw`` (seconds, calls, bytes)."""
    hw, shape = hw or Hardware(), shape or LlamaShape()
    plan: Plan = make_plan(shape.specs(), hw.world, planner_for(optimizer))
    setup = Setup(plan, optimizer, shape.dtypes, gloo=False)
    fb_compute = shape.fwd_bwd_flops() / (hw.gemm_tflops * 1e12)
    ideal = sum(matrix_cost(p.shape, optimizer) for p in plan.matrices) / hw.world / (
        hw.gemm_tflops * 1e12)
    out: dict[str, Any] = {"hardware": asdict(hw), "model": asdict(shape),
                           "plan_imbalance_cost": plan.imbalance("cost"),
                           "plan_imbalance_bound": plan.imbalance_bound("cost"),
                           "ideal_matrix_step_s": ideal, "strategies": {}}
    for name in strategies:
        out["strategies"][name] = _strategy_figures(name, setup, hw, fb_compute)
    return out


def project_hsdp(optimizer: str, shape: LlamaShape, hw: Hardware | None = None,
                 strategies: Iterable[str] = HSDP_STRATEGIES) -> dict[str, Any]:
    """Flat (64 ranks) against HSDP (one replica per node x its GPUs) for ``shape`` on ``hw``:
    the per-strategy figures of ``project`` plus inter- and intra-node bytes per GPU per step."""
    hw = hw or Hardware()
    fb_compute = shape.fwd_bwd_flops() / (hw.gemm_tflops * 1e12)
    setups = {}
    for replicate in (1, hw.nodes):
        plan = make_plan(shape.specs(), hw.world // replicate, planner_for(optimizer))
        setups[replicate] = Setup(plan, optimizer, shape.dtypes, gloo=False, replicate=replicate)
    out: dict[str, Any] = {"hardware": asdict(hw), "model": asdict(shape), "strategies": {}}
    for name in strategies:
        setup = setups[hw.nodes if is_hsdp(name) else 1]
        out["strategies"][name] = _strategy_figures(name, setup, hw, fb_compute)
    return out
