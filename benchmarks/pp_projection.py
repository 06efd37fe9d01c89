"""Projection: a 70B-class dense decoder at pp 8 x dp 8, matrixfsdp vs FSDP2 + reconstruction.

[Note: PP step projection]
Llama-3-70B (80 layers, d 8192, FFN 28672, 64 heads, 8 KV heads of dim 128): 10 layers per
stage, 70 block matrices per stage (q, o 8192 x 8192; k, v 1024 x 8192; gate, up 28672 x 8192;
down 8192 x 28672). Per GPU of one stage, per optimizer step, over its dp group of 8. **Assumed
figures, not measurements** (those of §17): Newton-Schulz GEMMs (5 iterations, the planner's
Muon FLOP model) at 400 TFLOP/s achieved; InfiniBand 50 GB/s per GPU and direction for the dp
collectives; bf16 gathers, fp32 gradients, master weights and Muon momentum.
- Gathers: both gather each layer's matrices M + 1 times per GPipe step with
  ``reshard_after_forward=True`` (measured in ``tests/test_pp.py``: FSDP2's count, ours equal),
  once per step with ``False``; the bytes of a gather are the same ((dp-1)/dp of the stage).
- Gradient reduction: once per step on both, whatever M (FSDP2's reduce-scatter, matrixfsdp's
  reduce-to-owners): (dp-1)/dp of the stage's fp32 gradients each way. Before issue 28
  matrixfsdp reduced after every microbatch (M times these bytes) and, with
  ``reshard_after_forward=False``, gathered again at every microbatch's forward.
- Optimizer step: matrixfsdp runs Muon on each matrix's owner (LPT over the 70 matrices' FLOPs,
  as the planner does), no byte. FSDP2 + reconstruction: every GPU all-gathers each matrix's
  fp32 momentum-updated gradient ((dp-1)/dp of the stage received), runs Newton-Schulz on every
  whole matrix of the stage and keeps its shard.
"""

from __future__ import annotations

import heapq

from matrixfsdp.planner import matrix_cost

__all__ = ["render_projection", "stage_matrices"]

TFLOPS = 400e12
IB_BYTES_PER_S = 50e9
DP, PP, LAYERS = 8, 8, 80
D, FFN, KV = 8192, 28672, 1024


def stage_matrices() -> list[tuple[int, int]]:
    layer = [(D, D), (KV, D), (KV, D), (D, D), (FFN, D), (FFN, D), (D, FFN)]
    return layer * (LAYERS // PP)


def _lpt(costs: list[float], bins: int) -> float:
    """The busiest owner's load under longest-processing-time-first placement."""
    heap = [0.0] * bins
    for cost in sorted(costs, reverse=True):
        heapq.heapreplace(heap, heap[0] + cost)
    return max(heap)


def projection(micro: int) -> dict[str, dict[str, float]]:
    shapes = stage_matrices()
    elements = sum(m * n for m, n in shapes)
    flops = [matrix_cost((m, n), "muon") for m, n in shapes]
    share = (DP - 1) / DP
    gather = share * elements * 2  # bf16, received per gather
    reduce = share * elements * 4  # fp32, sent (and received) once per step
    out = {}
    for name, gathers_raf, step_bytes, step_flops in (
            ("matrixfsdp", micro + 1, 0.0, _lpt(flops, DP)),
            ("FSDP2 + reconstruction", micro + 1, share * elements * 4, sum(flops)),
            ("matrixfsdp before issue 28", micro + 1, 0.0, _lpt(flops, DP))):
        per_step = micro if name.endswith("issue 28") else 1  # reduced every microbatch
        out[name] = {
            "gather_gb": gathers_raf * gather / 1e9, "gather_keep_gb": per_step * gather / 1e9,
            "reduce_gb": per_step * reduce / 1e9, "step_gb": step_bytes / 1e9,
            "step_compute_s": step_flops / TFLOPS, "step_comm_s": step_bytes / IB_BYTES_PER_S,
            "reduce_s": per_step * reduce / IB_BYTES_PER_S,
        }
    return out


def render_projection(micros: tuple[int, ...] = (1, 8, 32)) -> str:
    elements = sum(m * n for m, n in stage_matrices())
    lines = [f"Projection (assumed figures, see [Note: PP step projection]): Llama-3-70B at pp "
             f"{PP} x dp {DP}, per GPU of one stage ({elements / 1e9:.2f} B matrix elements) "
             "and optimizer step.", "",
             "| microbatches | strategy | gathers, raf=True / False (GB received) | gradient "
             "reduction (GB each way; s) | optimizer step bytes (GB) | optimizer step (s: "
             "NS compute + comm) |", "|---|---|---|---|---|---|"]
    for micro in micros:
        for name, r in projection(micro).items():
            lines.append(
                f"| {micro} | {name} | {r['gather_gb']:.1f} / {r['gather_keep_gb']:.1f} | "
                f"{r['reduce_gb']:.1f}; {r['reduce_s']:.2f} | {r['step_gb']:.1f} | "
                f"{r['step_compute_s'] + r['step_comm_s']:.2f} ({r['step_compute_s']:.2f} + "
                f"{r['step_comm_s']:.2f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_projection())
