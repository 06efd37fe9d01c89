"""Tensor parallelism: the Llama-3-70B projection of the TP optimizer step (issue 22).

``python -m benchmarks.run tp-step --projection-only`` prints it; the shared TP matrix list
(``TpSpec``, ``row_specs``, ``step_owners``) lives here for ``benchmarks/tp_step.py`` too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from matrixfsdp.optim.tp_step import (
    TP_STEP_BUCKET_BYTES,
    assign_step_owners,
    bucket_plan,
    step_cost,
)
from matrixfsdp.planner import make_plan, matrix_cost

from .costmodel import Hardware, LlamaShape

__all__ = ["ELEMENTWISE_BYTES", "Bucket", "TpSpec", "project_tp", "projections",
           "render_projection", "row_specs", "simulate_buckets", "step_owners", "tp_specs"]

COLWISE = ("wq", "wk", "wv", "w1", "w3")  # Shard(0) of (out, in); wo, w2 Shard(1)


class TpSpec(NamedTuple):
    """One TP matrix: index in the model's list, FQN, global ``(out, in)`` shape, TP shard dim."""

    index: int
    fqn: str
    shape: tuple[int, int]
    shard_dim: int

    def shard_shape(self, tp: int) -> tuple[int, int]:
        shape = list(self.shape)
        shape[self.shard_dim] //= tp
        return (shape[0], shape[1])


def tp_specs(shape: LlamaShape) -> list[TpSpec]:
    """The decoder's TP matrices in plan order (tail parameters are not TP-sharded here)."""
    out = []
    for spec in shape.specs():
        if spec.role == "matrix":
            name = spec.fqn.split(".")[-2]
            out.append(TpSpec(len(out), spec.fqn, (spec.shape[0], spec.shape[1]),
                              0 if name in COLWISE else 1))
    return out


def row_specs(shape: LlamaShape, dp: int) -> list[list[TpSpec]]:
    """Per dp owner row, its TP matrices in plan order (the library's planner, Muon FLOPs)."""
    plan = make_plan(shape.specs(), dp, "muon")
    owner = {p.fqn: int(p.owner_rank) for p in plan.matrices}  # type: ignore[arg-type]
    rows: list[list[TpSpec]] = [[] for _ in range(dp)]
    for spec in tp_specs(shape):
        rows[owner[spec.fqn]].append(spec)
    return rows


def step_owners(row: Sequence[TpSpec], tp: int) -> list[int]:
    """The library's step-owner assignment of a row (LPT over Muon FLOPs of global shapes)."""
    return assign_step_owners([step_cost(s.shape, "muon") for s in row], tp)


# -- projection ------------------------------------------------------------------------------------
# [Note: TP step projection]
# - Per GPU of one owner row's tp group (tp ranks on one node, NVLink); dp owner rows from the
#   library's planner over the dp (HSDP: shard) size, step owners from ``assign_step_owners``.
#   HSDP replicas step the same rows redundantly, so the step's figures do not change with the
#   replicate size; no optimizer byte crosses dp in any of the three strategies.
# - Compute: the planner's Muon FLOPs (5 Newton-Schulz iterations) at ``Hardware.gemm_tflops``
#   plus ELEMENTWISE_BYTES per orthogonalized element at HBM bandwidth (momentum, Nesterov
#   lerp, casts, norm, update; the step owner's packing and concatenation included).
# - Bytes per element: the row's master parameter and gradient (``LlamaShape.dtypes``: fp32);
#   ``duplicated`` gathers the fp32 direction. ``step_owner``: per matrix, each non-owner sends its
#   parameter and gradient shards to the step owner and receives its updated parameter shard.
# - A collective costs alpha (tp - 1) + (busiest GPU's max(sent, received)) / NVLink bandwidth.
# - Serial: bucket by bucket, exchange then step then return. Overlapped: ``simulate_buckets``,
#   the library's schedule; ``step_owner`` uses the library's buckets (TP_STEP_BUCKET_BYTES of
#   whole parameter + gradient), ``waves`` is a what-if: bucket j = the j-th largest matrix of
#   every step owner (not implemented in the library).
ELEMENTWISE_BYTES = 40.0


class Bucket(NamedTuple):
    """One bucket of the library's TP step: seconds of step math per tp rank, and of its two
    exchanges (each an ``all_to_all_single`` of the whole tp group)."""

    compute: tuple[float, ...]
    gather_s: float
    return_s: float


def simulate_buckets(buckets: Sequence[Bucket]) -> float:
    """Wall seconds of ``step_tp_matrices``'s schedule ([Note: TP step exchange]).

    Each rank: wait gather k, issue gather k+1, step its part of bucket k, issue return k, wait
    return k-1. Collectives run one at a time in issue order (one communicator), each starting
    once every rank has issued it. So bucket k+2 cannot start before bucket k is stepped: with
    one matrix per bucket at most two step owners compute at once.
    """
    clock = [0.0] * len(buckets[0].compute)
    queue = 0.0

    def collective(seconds: float) -> float:
        nonlocal queue
        queue = max(max(clock), queue) + seconds
        return queue

    gather_end = collective(buckets[0].gather_s)
    return_end: float | None = None
    for k, bucket in enumerate(buckets):
        clock = [max(t, gather_end) for t in clock]
        if k + 1 < len(buckets):
            gather_end = collective(buckets[k + 1].gather_s)
        clock = [t + c for t, c in zip(clock, bucket.compute, strict=True)]
        previous, return_end = return_end, collective(bucket.return_s)
        if previous is not None:
            clock = [max(t, previous) for t in clock]
    assert return_end is not None
    return max(max(clock), return_end)


def _serial(buckets: Sequence[Bucket]) -> float:
    return sum(b.gather_s + max(b.compute) + b.return_s for b in buckets)


@dataclass(frozen=True)
class _Row:
    """What one owner row's tp group moves and computes, per matrix."""

    specs: Sequence[TpSpec]
    tp: int
    hw: Hardware
    param_bytes: int
    grad_bytes: int

    def seconds(self, shape: tuple[int, int]) -> float:
        elementwise = math.prod(shape) * ELEMENTWISE_BYTES / (self.hw.hbm_gbps * 1e9)
        return matrix_cost(shape, "muon") / (self.hw.gemm_tflops * 1e12) + elementwise

    def link_s(self, busiest_bytes: float) -> float:
        return self.hw.alpha_nvlink_s * (self.tp - 1) + busiest_bytes / (self.hw.nvlink_gbps * 1e9)

    def shard(self, s: TpSpec) -> int:
        return math.prod(s.shard_shape(self.tp))


def _owner_traffic(row: _Row, bucket: Sequence[int], owners: Sequence[int]
                   ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per tp rank: bytes sent and received in the gather and in the return exchange."""
    tp = row.tp
    g_sent, g_recv, r_sent, r_recv = ([0.0] * tp for _ in range(4))
    for i in bucket:
        shard, owner = row.shard(row.specs[i]), owners[i]
        for r in range(tp):
            if r != owner:
                g_sent[r] += shard * (row.param_bytes + row.grad_bytes)
                g_recv[owner] += shard * (row.param_bytes + row.grad_bytes)
                r_sent[owner] += shard * row.param_bytes
                r_recv[r] += shard * row.param_bytes
    return g_sent, g_recv, r_sent, r_recv


def _owner_buckets(row: _Row, groups: Sequence[Sequence[int]], owners: Sequence[int]
                   ) -> tuple[list[Bucket], list[float], list[float]]:
    buckets, sent, recv = [], [0.0] * row.tp, [0.0] * row.tp
    for group in groups:
        g_sent, g_recv, r_sent, r_recv = _owner_traffic(row, group, owners)
        compute = tuple(sum(row.seconds(row.specs[i].shape) for i in group if owners[i] == r)
                        for r in range(row.tp))
        gather = max(max(a, b) for a, b in zip(g_sent, g_recv, strict=True))
        back = max(max(a, b) for a, b in zip(r_sent, r_recv, strict=True))
        buckets.append(Bucket(compute, row.link_s(gather), row.link_s(back)))
        sent = [a + b + c for a, b, c in zip(sent, g_sent, r_sent, strict=True)]
        recv = [a + b + c for a, b, c in zip(recv, g_recv, r_recv, strict=True)]
    return buckets, sent, recv


def _library_groups(row: _Row, owners: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """``tp_step.bucket_plan``: waves of every step owner's j-th largest matrix, merged while
    each step owner's whole param + grad bytes stay within ``bucket_bytes``."""
    nbytes = [math.prod(s.shape) * (row.param_bytes + row.grad_bytes) for s in row.specs]
    return bucket_plan(nbytes, owners, [float(n) for n in nbytes], bucket_bytes)


def _duplicated_groups(row: _Row, bucket_bytes: int) -> list[list[int]]:
    """Duplicated's buckets: consecutive runs within ``bucket_bytes`` of whole param + grad."""
    groups: list[list[int]] = []
    total = 0
    for i, s in enumerate(row.specs):
        nbytes = math.prod(s.shape) * (row.param_bytes + row.grad_bytes)
        if not groups or total + nbytes > bucket_bytes:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += nbytes
    return groups


def _wave_groups(row: _Row, owners: Sequence[int]) -> list[list[int]]:
    """Bucket j: the j-th largest matrix of every step owner."""
    mine = [sorted((i for i, o in enumerate(owners) if o == r),
                   key=lambda i: -matrix_cost(row.specs[i].shape, "muon")) for r in range(row.tp)]
    return [[m[j] for m in mine if j < len(m)] for j in range(max(map(len, mine)))]


def _figures(buckets: Sequence[Bucket], sent: Sequence[float], recv: Sequence[float],
             exact: bool) -> dict[str, Any]:
    compute = [sum(b.compute[r] for b in buckets) for r in range(len(sent))]
    return {"exact": exact, "compute_s": max(compute), "sent_bytes": max(sent),
            "recv_bytes": max(recv), "comm_s": sum(b.gather_s + b.return_s for b in buckets),
            "serial_s": _serial(buckets), "overlapped_s": simulate_buckets(buckets),
            "buckets": len(buckets)}


def _row_figures(row: _Row) -> dict[str, dict[str, Any]]:
    tp, specs = row.tp, row.specs
    blockwise = [Bucket(tuple(row.seconds(s.shard_shape(tp)) for _ in range(tp)), 0.0, 0.0)
                 for s in specs]
    dup_buckets, dup_bytes = [], [0.0] * tp
    for group in _duplicated_groups(row, TP_STEP_BUCKET_BYTES):
        nbytes = (tp - 1) * sum(row.shard(specs[i]) for i in group) * row.grad_bytes
        compute = sum(row.seconds(specs[i].shape) for i in group)
        dup_buckets.append(Bucket((compute,) * tp, row.link_s(nbytes), 0.0))
        dup_bytes = [b + nbytes for b in dup_bytes]
    owners = step_owners(specs, tp)
    lib = _owner_buckets(row, _library_groups(row, owners, TP_STEP_BUCKET_BYTES), owners)
    waves = _owner_buckets(row, _wave_groups(row, owners), owners)
    return {"blockwise": _figures(blockwise, [0.0] * tp, [0.0] * tp, False),
            "duplicated": _figures(dup_buckets, dup_bytes, dup_bytes, True),
            "step_owner": _figures(*lib, True), "waves": _figures(*waves, True)}


def project_tp(shape: LlamaShape, tp: int = 8, dp: int = 8, replicate: int = 1,
               hw: Hardware | None = None) -> dict[str, Any]:
    """Per-GPU optimizer-step figures of the three strategies, busiest owner row
    ([Note: TP step projection]). ``dp``: the owner-sharding size (HSDP: the shard size)."""
    hw = hw or Hardware()
    rows = [_Row(r, tp, hw, shape.dtypes.param, shape.dtypes.grad) for r in row_specs(shape, dp)
            if r]
    per_row = [_row_figures(r) for r in rows]
    worst = {name: max((f[name] for f in per_row), key=lambda x: x["overlapped_s"])
             for name in per_row[0]}
    tokens = shape.tokens_per_gpu  # per tp group (one dp rank)
    return {"model": shape.name, "tp": tp, "dp": dp, "replicate": replicate,
            "gpus": tp * dp * replicate, "hardware": dataclasses.asdict(hw),
            "matrices_per_row": max(len(r.specs) for r in rows), "strategies": worst,
            "fwd_bwd_s": shape.fwd_bwd_flops() / tp / (hw.gemm_tflops * 1e12),
            "tokens_per_tp_group": tokens, "dp_bytes": 0}


# -- report ------------------------------------------------------------------------------------------
PROJECTION_LABELS = {
    "blockwise": "(a) blockwise (NS per TP shard; not exact)",
    "duplicated": "(b) duplicated (all-gather; every GPU NS on every matrix)",
    "step_owner": "(c) **this design** (library buckets: waves of every step owner's j-th "
                  "largest matrix, within 64 MiB per step owner)",
    "waves": "(c'') this design, one wave per bucket (no merging of small waves)",
}


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def render_projection(projections: Sequence[dict[str, Any]]) -> str:
    """The projection as markdown: one table per configuration, assumptions first."""
    hw = projections[0]["hardware"]
    lines = [
        f"Assumed (not measured): {hw['name']}; Newton–Schulz GEMMs at {hw['gemm_tflops']:.0f} "
        f"TFLOP/s achieved (~40 % of the 989 TFLOP/s dense bf16 peak); NVLink "
        f"{hw['nvlink_gbps']:.0f} GB/s per GPU and direction, alpha {hw['alpha_nvlink_s'] * 1e6:.0f}"
        f" us per peer; InfiniBand {hw['ib_gbps']:.0f} GB/s per GPU (unused: no step byte crosses "
        f"dp); HBM {hw['hbm_gbps']:.0f} GB/s for {ELEMENTWISE_BYTES:.0f} bytes of element-wise "
        "traffic per orthogonalized element; fp32 master parameters, gradients and momentum.", ""]
    for p in projections:
        mesh = (f"TP {p['tp']} x DP {p['dp']}" if p["replicate"] == 1 else
                f"TP {p['tp']} x ({p['replicate']} x {p['dp']}) HSDP")
        lines += [f"{p['model']}, {mesh} = {p['gpus']} GPUs; busiest owner row "
                  f"({p['matrices_per_row']} TP matrices), busiest GPU, per optimizer step:", "",
                  "| strategy | exact | NS compute (s) | tp bytes sent / received per GPU (GB) "
                  "| tp comm (s) | step, serial (s) | step, overlapped (s) | dp bytes |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, f in p["strategies"].items():
            lines.append(
                f"| {PROJECTION_LABELS[name]} | {'yes' if f['exact'] else 'no'} | "
                f"{f['compute_s']:.3f} | {_gb(f['sent_bytes'])} / {_gb(f['recv_bytes'])} | "
                f"{f['comm_s']:.3f} | {f['serial_s']:.3f} | **{f['overlapped_s']:.3f}** | 0 |")
        lines += ["", f"For scale: forward+backward of {p['tokens_per_tp_group']} tokens per tp "
                  f"group (one micro-batch) is {p['fwd_bwd_s']:.2f} s per GPU at the same GEMM "
                  "rate.", ""]
    return "\n".join(lines)


def projections() -> list[dict[str, Any]]:
    """Llama-3-70B at TP 8 x DP 8 and TP 8 x (8 x 8) HSDP."""
    shape = LlamaShape.llama3_70b()
    return [project_tp(shape, 8, 8, 1), project_tp(shape, 8, 8, 8)]
