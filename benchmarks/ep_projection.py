"""Expert parallelism: the DeepSeek-V3 projection of the routed experts' Muon step (issue 27).

``python -m benchmarks.run ep-step --projection-only`` prints it. A model, not a measurement.

[Note: EP step projection]
- Model: DeepSeek-V3's routed experts only: 58 MoE layers x 256 experts, each three matrices
  (w1, w3: 2048 x 7168; w2: 7168 x 2048); dense matrices (attention, shared experts, the first
  three dense layers) are left out: they add to the baselines' bytes and not to matrixfsdp's.
- Mesh: EP 64 over 8 nodes x 8 GPUs (one ep group = 64 consecutive ranks, torchtitan's
  ``[efsdp, ep]`` order), so each ep rank holds 4 experts = 12 matrices per layer, 696 in all;
  ``efsdp`` copies of that ep group (world 64 x efsdp). The efsdp peers of a GPU sit in the other
  ep groups, on other nodes: every step byte of (b) and (c) crosses InfiniBand.
- FSDP2-EP storage: torchtitan shards a local stack ``Shard(1)`` over efsdp when efsdp exceeds the
  local expert count (4), so the table starts at efsdp 8; at efsdp <= 4 it shards ``Shard(0)``
  and each expert is whole on one rank, where a transient owner that is the holder moves nothing.
- Strategies, per GPU and optimizer step (fp32 directions and updates on the wire, as the CPU
  benchmark; bf16 halves (b)'s and (c)'s bytes):
  - (a) matrixfsdp: each local stack owned whole on an efsdp rank (the library's planner, Muon
    FLOPs); nothing moves; the busiest GPU orthogonalizes its stacks' matrices;
  - (b) reconstruction: the direction all-gathered over efsdp (receive (efsdp - 1) x the stored
    bytes), every efsdp rank orthogonalizes all 696 matrices;
  - (c) transient owner: each expert matrix to an LPT owner in its efsdp group and back: sent and
    received 2 (efsdp - 1) / efsdp x the stored bytes; the busiest GPU orthogonalizes
    ceil(696 / efsdp) matrices.
- Time: Newton–Schulz FLOPs (the planner's Muon model) at ``Hardware.gemm_tflops`` plus
  ``ELEMENTWISE_BYTES`` of HBM traffic per orthogonalized element; a collective costs alpha_ib
  (efsdp - 1) per bucket plus the busiest GPU's bytes each way / InfiniBand bandwidth, one bucket
  per layer and phase (58 gathers, and 58 returns for (c)). *Serial*: compute + communication;
  *overlapped*: max of the two (a lower bound: perfect overlap).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from matrixfsdp.planner import ParamSpec, make_plan, matrix_cost

from .costmodel import Hardware
from .tp_projection import ELEMENTWISE_BYTES

__all__ = ["DEEPSEEK_V3", "MoEShape", "project_ep", "projections", "render_projection"]


@dataclass(frozen=True)
class MoEShape:
    """Routed experts of a MoE: ``layers`` x ``experts`` x (w1, w3: ``ffn x dim``; w2:
    ``dim x ffn``)."""

    name: str
    layers: int
    experts: int
    dim: int
    ffn: int
    master_bytes: int = 4  # fp32 directions/updates on the wire and fp32 master weights

    @property
    def matrix_numel(self) -> int:
        return self.dim * self.ffn

    def local_matrices(self, ep: int) -> int:
        return self.layers * 3 * self.experts // ep

    def stacks(self, ep: int) -> list[ParamSpec]:
        """One ep rank's local stacks, as ``fully_shard_matrix`` plans them."""
        local = self.experts // ep
        shapes = {"w1": (local, self.ffn, self.dim), "w2": (local, self.dim, self.ffn),
                  "w3": (local, self.ffn, self.dim)}
        return [ParamSpec(f"layers.{i}.moe.experts.{w}", shape, role="matrix", mesh="expert")
                for i in range(self.layers) for w, shape in shapes.items()]


DEEPSEEK_V3 = MoEShape("DeepSeek-V3 (routed experts)", layers=58, experts=256, dim=7168,
                       ffn=2048)


def _seconds(matrices: int, shape: MoEShape, hw: Hardware) -> float:
    flops = matrices * matrix_cost((shape.ffn, shape.dim), "muon")
    elementwise = matrices * shape.matrix_numel * ELEMENTWISE_BYTES / (hw.hbm_gbps * 1e9)
    return flops / (hw.gemm_tflops * 1e12) + elementwise


def _ib_s(busiest: float, efsdp: int, collectives: int, hw: Hardware) -> float:
    return collectives * hw.alpha_ib_s * (efsdp - 1) + busiest / (hw.ib_gbps * 1e9)


def _figures(compute: float, comm: float, sent: float, recv: float, matrices: int,
             calls: int) -> dict[str, Any]:
    return {"compute_s": compute, "comm_s": comm, "sent_bytes": sent, "recv_bytes": recv,
            "serial_s": compute + comm, "overlapped_s": max(compute, comm),
            "matrices_busiest": matrices, "collectives": calls}


def project_ep(shape: MoEShape = DEEPSEEK_V3, ep: int = 64, efsdp: int = 8,
               hw: Hardware | None = None) -> dict[str, Any]:
    """Per-GPU Muon step of the routed experts for the three strategies ([Note: EP step
    projection])."""
    hw = hw or Hardware()
    total = shape.local_matrices(ep)
    stored = total * shape.matrix_numel * shape.master_bytes / efsdp  # FSDP2 storage per GPU
    plan = make_plan(shape.stacks(ep), efsdp, "muon", expert_grid=tuple(range(efsdp)))
    per_stack = shape.experts // ep
    owned = Counter(int(p.owner_rank) for p in plan.matrices)  # type: ignore[arg-type]
    mine = max(owned.values()) * per_stack
    transient = math.ceil(total / efsdp)
    share = (efsdp - 1) / efsdp * stored  # one phase of (c), busiest GPU, each way
    gather = (efsdp - 1) * stored  # (b): the rest of each local stack's direction
    strategies = {
        "matrixfsdp": _figures(_seconds(mine, shape, hw), 0.0, 0.0, 0.0, mine, 0),
        "fsdp2_recon": _figures(_seconds(total, shape, hw),
                                _ib_s(gather, efsdp, shape.layers, hw), gather, gather, total,
                                shape.layers),
        "transient_owner": _figures(_seconds(transient, shape, hw),
                                    2 * _ib_s(share, efsdp, shape.layers, hw), 2 * share,
                                    2 * share, transient, 2 * shape.layers),
    }
    return {"model": shape.name, "ep": ep, "efsdp": efsdp, "gpus": ep * efsdp,
            "local_experts": per_stack, "matrices_per_ep_rank": total,
            "stored_expert_bytes": stored, "plan_imbalance": plan.imbalance("cost"),
            "hardware": dataclasses.asdict(hw), "strategies": strategies}


def projections(efsdps: Sequence[int] = (8, 16, 32)) -> list[dict[str, Any]]:
    """DeepSeek-V3's routed experts at EP 64 (8 nodes x 8 GPUs) x efsdp 8, 16, 32."""
    return [project_ep(DEEPSEEK_V3, 64, e) for e in efsdps]


LABELS = {"matrixfsdp": "(a) **matrixfsdp-EP**", "fsdp2_recon": "(b) FSDP2-EP reconstruction",
          "transient_owner": "(c) transient-owner all-to-all"}


def render_projection(projections: Sequence[dict[str, Any]]) -> str:
    hw = projections[0]["hardware"]
    p0 = projections[0]
    lines = [
        f"**Projection (a model, not a measurement)**: {p0['model']}, 58 layers x 256 experts x "
        "3 matrices (w1, w3 2048 x 7168, w2 7168 x 2048), EP 64 over 8 nodes x 8 GPUs "
        f"({p0['local_experts']} experts = {p0['matrices_per_ep_rank']} matrices per ep rank) x "
        "efsdp; per GPU (busiest), per optimizer step. Assumed (`costmodel.Hardware`, H100 SXM "
        f"class): Newton–Schulz at "
        f"{hw['gemm_tflops']:.0f} TFLOP/s achieved plus {ELEMENTWISE_BYTES:.0f} B of HBM traffic "
        f"per orthogonalized element at {hw['hbm_gbps']:.0f} GB/s; InfiniBand "
        f"{hw['ib_gbps']:.0f} GB/s per GPU and direction, alpha {hw['alpha_ib_s'] * 1e6:.0f} us "
        "per peer, one bucket per layer and phase; fp32 on the wire; torchtitan's Shard(1) "
        "FSDP2 storage of the experts (efsdp > local experts).", "",
        "| efsdp (GPUs) | strategy | expert bytes stored per GPU (GB) | sent / received per GPU "
        "(GB) | NS matrices, busiest GPU | compute (s) | IB comm (s) | step serial (s) | "
        "overlapped, lower bound (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for p in projections:
        for name, f in p["strategies"].items():
            lines.append(
                f"| {p['efsdp']} ({p['gpus']}) | {LABELS[name]} | "
                f"{p['stored_expert_bytes'] / 1e9:.2f} | {f['sent_bytes'] / 1e9:.2f} / "
                f"{f['recv_bytes'] / 1e9:.2f} | {f['matrices_busiest']} | {f['compute_s']:.3f} | "
                f"{f['comm_s']:.3f} | {f['serial_s']:.3f} | {f['overlapped_s']:.3f} |")
    return "\n".join(lines)
