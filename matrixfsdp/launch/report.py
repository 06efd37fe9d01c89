"""End-of-run outputs of ``matrixfsdp train``: a loss plot (PNG) and a one-screen summary."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..planner import Plan
from .config import TrainConfig

__all__ = ["plot_losses", "steady_medians", "summarize", "write_report"]


def plot_losses(metrics: list[dict[str, Any]], unigram: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train", lw=1)
    val = [m for m in metrics if "val_loss" in m]
    ax.plot([m["step"] for m in val], [m["val_loss"] for m in val], "o-", label="validation")
    ax.axhline(unigram, color="gray", ls="--", lw=1, label=f"unigram baseline ({unigram:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def steady_medians(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of the per-step timings over the steady state (the first 20% of steps dropped)."""
    steady = metrics[len(metrics) // 5 :] or metrics
    return {k: statistics.median(m[k] for m in steady)
            for k in ("time_forward", "time_backward", "time_optimizer", "time_step", "tokens_per_s")}


def summarize(metrics: list[dict[str, Any]], cfg: TrainConfig, unigram: float, plan: Plan) -> str:
    steady = metrics[len(metrics) // 5 :] or metrics
    med = steady_medians(metrics)
    val = [m["val_loss"] for m in metrics if "val_loss" in m]
    comm = steady[-1]["matrix_comm_bytes_sent"]
    lines = [
        f"matrixfsdp train: {cfg.optimizer}, {plan.world_size} ranks, {len(plan.matrices)} matrices "
        f"(max/mean bytes {plan.imbalance('bytes'):.3f})",
        f"steps {metrics[-1]['step']}/{cfg.steps}  final train loss {metrics[-1]['loss']:.4f}  "
        f"val loss {val[-1] if val else float('nan'):.4f}  unigram baseline {unigram:.4f}",
        f"median step {med['time_step'] * 1e3:.1f} ms = forward {med['time_forward'] * 1e3:.1f} + "
        f"backward {med['time_backward'] * 1e3:.1f} + optimizer {med['time_optimizer'] * 1e3:.1f} ms; "
        f"{med['tokens_per_s']:.0f} tokens/s",
        f"matrix collectives per step, bytes sent by rank 0: forward {comm['forward']}, "
        f"backward {comm['backward']}, optimizer {comm['optimizer']}"
        + (" (the clip-norm scalar only)" if cfg.grad_clip else ""),
        f"peak memory rank 0: {metrics[-1]['peak_rss_mib']:.0f} MiB",
    ]
    return "\n".join(lines)


def write_report(out: Path, metrics: list[dict[str, Any]], cfg: TrainConfig, unigram: float,
                 plan: Plan) -> str:
    if not metrics:
        return ""
    plot_losses(metrics, unigram, out / "loss.png", f"{cfg.optimizer} on {plan.world_size} ranks")
    text = summarize(metrics, cfg, unigram, plan)
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)  # the CLI's final screen (rank 0 only)
    return text
