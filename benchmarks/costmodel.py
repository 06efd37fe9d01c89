"""α–β communication model plus measured compute: fit on gloo loopback, check against the
measured small runs, and project a Llama-2-7B-shaped model on 8 nodes × 8 GPUs.

[Note: the cost model]
- A collective of logical size x bytes (see benchmarks.measure) costs α_op + β_op·x. On gloo
  loopback α_op, β_op are least-squares fits of the microbenchmark run inside each timing world.
- Measured-scale prediction, per rank: phase time = compute + Σ over the collectives the profiler
  counted on that rank; the max over ranks is compared with the measured phase time. Compute is
  measured single-process, single-threaded, interleaved with the strategies (forward+backward at
  the local batch; each matrix's step; tail AdamW), times the measured contention factor (a fixed
  GEMM workload on all ranks at once ÷ on one rank alone: ranks share the cores, and whatever
  else runs on the machine slows them too).
- Projection: the schedule of :mod:`benchmarks.schedule` on the 7B plan, each op timed on a
  two-level topology (ring / pipelined chain / all-to-all bounded by each rank's busiest link),
  compute from FLOPs at an achieved GEMM rate; forward+backward = max(compute, communication)
  (FSDP2-style prefetch overlap), optimizer step = compute + communication (nothing to overlap).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from matrixfsdp.planner import ParamSpec, Plan, make_plan, matrix_cost

from .schedule import Dtypes, Op, Setup, numel, owners_all, per_rank_recv, resident_model, schedule
from .strategies.base import planner_for

__all__ = [
    "Hardware",
    "LlamaShape",
    "fit_alpha_beta",
    "predict_measured",
    "project",
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
        for r in rank_results:
            coll = r["counted"][name]["collectives"]
            fb.append(fb_compute + _comm_seconds(coll, "forward", fits)
                      + _comm_seconds(coll, "backward", fits))
            opt.append(_opt_compute(name, ref, r["owned"], world) * share
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
    """Llama-2-7B: 32 blocks of q/k/v/o (d×d), gate/up (f×d), down (d×f); untied 32000-token
    embedding and head; bf16 compute gathers, fp32 gradients, master weights and state."""

    dim: int = 4096
    layers: int = 32
    ffn: int = 11008
    vocab: int = 32000
    seq_len: int = 4096
    tokens_per_gpu: int = 16384  # 4 sequences per GPU and step: 1M-token global batch on 64 GPUs
    dtypes: Dtypes = field(default_factory=lambda: Dtypes(gather=2, grad=4, param=4, state=4))

    def specs(self) -> list[ParamSpec]:
        d, f = self.dim, self.ffn
        rows: list[tuple[str, tuple[int, ...], str, str]] = [("tok_embeddings.weight",
                                                              (self.vocab, d), "tail", "")]
        for i in range(self.layers):
            g = f"layers.{i}"
            rows += [(f"{g}.attention_norm.weight", (d,), "tail", g)]
            rows += [(f"{g}.attention.w{x}.weight", (d, d), "matrix", g) for x in "qkvo"]
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


def op_seconds(op: Op, hw: Hardware, world: int) -> float:
    """One collective on the two-level topology (see [Note: the cost model])."""
    inter = world > hw.gpus_per_node
    bw = (hw.ib_gbps if inter else hw.nvlink_gbps) * 1e9
    alpha = hw.alpha_ib_s if inter else hw.alpha_nvlink_s
    if op.kind in ("all_gather", "reduce_scatter"):
        return alpha * (world - 1) + (world - 1) / world * op.size / bw
    if op.kind == "all_reduce":
        return 2 * (alpha * (world - 1) + (world - 1) / world * op.size / bw)
    if op.kind in ("broadcast", "reduce"):
        return alpha * (world - 1) + op.size / bw
    assert op.traffic is not None
    worst = 0.0
    node = [r // hw.gpus_per_node for r in range(world)]
    for r in range(world):
        links = {"ib": [0, 0], "nv": [0, 0]}
        for peer in range(world):
            kind = "nv" if node[peer] == node[r] else "ib"
            links[kind][0] += op.traffic[r][peer]
            links[kind][1] += op.traffic[peer][r]
        worst = max(worst, max(links["ib"]) / (hw.ib_gbps * 1e9),
                    max(links["nv"]) / (hw.nvlink_gbps * 1e9))
    return alpha * (world - 1) + worst


def _projected_opt_compute(strategy: str, setup: Setup, hw: Hardware) -> float:
    rate = hw.gemm_tflops * 1e12
    costs = {p.fqn: matrix_cost(p.shape, setup.optimizer) for p in setup.plan.matrices}
    tail = sum(numel(p.shape) for p in setup.plan.tail)
    adamw = 28.0 / (hw.hbm_gbps * 1e9)
    if strategy == "fsdp2_adamw":
        return sum(numel(p.shape) for p in setup.plan.params) / setup.world * adamw
    if strategy in ("ddp", "fsdp2_recon"):
        tail_share = tail if strategy == "ddp" else tail / setup.world
        return sum(costs.values()) / rate + tail_share * adamw
    owners = owners_all(setup)
    per_rank = [0.0] * setup.world
    for fqn, c in costs.items():
        per_rank[owners[fqn]] += c
    return max(per_rank) / rate + tail / setup.world * adamw


def project(optimizer: str, strategies: Iterable[str], hw: Hardware | None = None,
            shape: LlamaShape | None = None) -> dict[str, Any]:
    """Projected figures per strategy for ``shape`` on ``hw`` (seconds, calls, bytes)."""
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
        ops = schedule(setup, name)
        comm = {ph: sum(op_seconds(o, hw, hw.world) for o in ops if o.phase == ph)
                for ph in ("forward", "backward", "optimizer")}
        calls = {ph: sum(o.phase == ph for o in ops) for ph in comm}
        recv = {ph: max(map(sum, zip(*[per_rank_recv(o, hw.world) for o in ops if o.phase == ph],
                                     strict=True)), default=0) for ph in comm}
        fb = max(fb_compute, comm["forward"] + comm["backward"])
        opt = _projected_opt_compute(name, setup, hw) + comm["optimizer"]
        resident = max(resident_model(setup, name), key=lambda d: sum(d.values()))
        out["strategies"][name] = {
            "fwd_bwd_s": fb, "fwd_bwd_compute_s": fb_compute,
            "fwd_bwd_comm_s": comm["forward"] + comm["backward"], "optimizer_s": opt,
            "optimizer_comm_s": comm["optimizer"], "total_s": fb + opt, "calls": calls,
            "recv_bytes": recv, "resident": resident,
        }
    return out
