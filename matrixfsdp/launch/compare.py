"""``matrixfsdp compare``: train several optimizers with their defaults on one task, side by side.

Every optimizer runs ``matrixfsdp train``'s job (``matrixfsdp.launch.train`` under torchrun) with
one configuration that differs only in the optimizer and its recommended hyperparameters (see
[Note: recommended hyperparameters] in ``matrixfsdp.optim.defaults``): same seed (so the same
initial weights), same data order, same global batch, steps and world size. Each run lives in
``OUT/<optimizer>/`` (``config.json``, ``metrics.jsonl``, checkpoints, its own ``loss.png`` and
``summary.txt``). At the end ``OUT/compare.png`` plots validation and training loss against steps
and against training seconds, one line per optimizer, and ``OUT/compare.md`` holds the table.

[Note: resuming a comparison]
Each optimizer's run is in one of three states (``RunState``): *finished* (its metrics reach the
last step and its summary was written) is never rerun; *partial* (it has a checkpoint) resumes
from the latest checkpoint exactly as ``matrixfsdp train --resume`` does; *new* starts from step
0. So a killed comparison, run again with the same command, continues where it stopped. A run
directory whose ``config.json`` differs from the configuration asked for is an error naming the
differing fields, never a silent mix of two experiments.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

from .config import OPTIMIZER_NAMES, ConfigError, TrainConfig, load_config

__all__ = [
    "DEFAULT_OUT",
    "ComparisonRow",
    "RunState",
    "compare",
    "comparison_configs",
    "comparison_row",
    "comparison_table",
    "parse_optimizers",
    "plot_comparison",
    "run_state",
]

logger = logging.getLogger(__name__)

DEFAULT_OUT = "runs/compare"
_MIB = 2**20


class RunState(Enum):
    """See [Note: resuming a comparison]."""

    FINISHED = "finished"
    PARTIAL = "partial"
    NEW = "new"


class ComparisonRow(NamedTuple):
    """One optimizer's line of the comparison table."""

    optimizer: str
    lr: float
    final_val_loss: float
    tokens_per_s: float
    optimizer_ms: float  # median optimizer time per step (steady state)
    state_bytes_max: int | None  # optimizer state (matrix + tail) of the busiest rank
    comm_bytes_per_step: int | None  # matrix collective bytes sent by all ranks in one step
    train_seconds: float  # sum of the per-step times (forward + backward + optimizer)


def parse_optimizers(text: str) -> list[str]:
    """``"muon,okls"`` -> ``["muon", "okls"]``; unknown or repeated names raise ``ConfigError``."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in OPTIMIZER_NAMES]
    if unknown or not names:
        raise ConfigError(f"--optimizers: unknown optimizer(s) {unknown or [text]}; "
                          f"choose from {', '.join(OPTIMIZER_NAMES)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"--optimizers: {', '.join(repeated)} given more than once")
    return names


def comparison_configs(config_path: str | None, overrides: dict[str, Any],
                       optimizers: list[str]) -> list[TrainConfig]:
    """One validated config per optimizer: the shared settings, that optimizer, ``OUT/<name>``.

    Hyperparameters the file or ``--set`` fix (say ``lr``) apply to every optimizer; the others
    come from each optimizer's recommended defaults.
    """
    base_out = Path(overrides.get("out") or DEFAULT_OUT)
    return [load_config(config_path, **{**overrides, "optimizer": name, "out": str(base_out / name)})
            for name in optimizers]


def _metrics(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_state(cfg: TrainConfig) -> tuple[RunState, int]:
    """This optimizer's run state and the step it would start from (see the Note above)."""
    out = Path(cfg.out)
    saved = out / "config.json"
    if saved.is_file():
        try:
            stored = json.loads(saved.read_text())
        except ValueError as exc:
            raise ConfigError(f"{saved} is not valid JSON ({exc}); delete {out} to rerun it") from None
        wanted = cfg.model_dump(mode="json")
        differ = sorted(k for k in stored.keys() | wanted.keys() if stored.get(k) != wanted.get(k))
        if differ:
            raise ConfigError(f"{out} holds a run with another configuration ({', '.join(differ)} "
                              f"differ); use another --out or delete {out}")
    try:
        metrics = _metrics(out)
    except ValueError:  # a line cut by a kill: not finished; the resume rewrites the file
        metrics = []
    if metrics and metrics[-1]["step"] >= cfg.steps and (out / "summary.txt").is_file():
        return RunState.FINISHED, cfg.steps
    from ..checkpoint import latest, read_layout

    checkpoint = latest(out / "checkpoints")
    if checkpoint is not None:
        return RunState.PARTIAL, int(read_layout(checkpoint).step)
    return RunState.NEW, 0


def _launch(cfg: TrainConfig, *, resume: bool, label: str) -> bool:
    """Train ``cfg`` on ``cfg.nproc`` local ranks under torchrun; False if a rank failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from . import faults
    from .train import PROGRESS_DESC_ENV

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
    argv = ["--nproc-per-node", str(cfg.nproc), "--standalone", "-m", "matrixfsdp.launch.train",
            "--config", str(out / "config.json"), *(["--resume"] if resume else [])]
    os.environ.setdefault(faults.SHARE_STORE_ENV, "1")  # as matrixfsdp train: see [Note: restarts]
    os.environ[PROGRESS_DESC_ENV] = label
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        logger.error("compare: %s failed (%s); run the same command again to resume it", cfg.optimizer,
                     exc.name)
        return False
    finally:
        os.environ.pop(PROGRESS_DESC_ENV, None)
    return True


def _fmt_seconds(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


class _Eta:
    """Overall time left = steps left x seconds per step measured so far (start-up included)."""

    def __init__(self, steps_left: int) -> None:
        self.steps_left, self.steps_done, self.seconds = steps_left, 0, 0.0

    def record(self, steps: int, seconds: float) -> None:
        self.steps_left -= steps
        self.steps_done += steps
        self.seconds += seconds

    def text(self, current_steps: int = 0, current_seconds: float = 0.0) -> str:
        steps, seconds = self.steps_done + current_steps, self.seconds + current_seconds
        if not steps:
            return "overall ETA after the first steps"
        return f"overall ETA {_fmt_seconds((self.steps_left - current_steps) * seconds / steps)}"


class _ProgressLogger(threading.Thread):
    """Logs the running optimizer's step and the overall ETA every ``interval`` seconds."""

    def __init__(self, cfg: TrainConfig, start: int, eta: _Eta, label: str,
                 interval: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.cfg, self.start_step, self.eta, self.label, self.interval = cfg, start, eta, label, interval
        self.t0, self.stopped = time.perf_counter(), threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                metrics = _metrics(Path(self.cfg.out))
            except (ValueError, OSError):  # a line being written right now: next time
                continue
            step = metrics[-1]["step"] if metrics else self.start_step
            done = max(0, step - self.start_step)
            logger.info("%s: step %d/%d, %s", self.label, step, self.cfg.steps,
                        self.eta.text(done, time.perf_counter() - self.t0))

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def compare(configs: list[TrainConfig], *, command: str = "") -> list[ComparisonRow] | None:
    """Train every config not yet finished, then write the plot and table; None if a run failed."""
    states = [run_state(cfg) for cfg in configs]  # raises before any work on a config mismatch
    eta = _Eta(sum(cfg.steps - start for cfg, (_, start) in zip(configs, states, strict=True)))
    for i, (cfg, (state, start)) in enumerate(zip(configs, states, strict=True), 1):
        label = f"compare {i}/{len(configs)} {cfg.optimizer}"
        if state is RunState.FINISHED:
            logger.info("%s: finished earlier, not rerun", label)
            continue
        how = f"resuming from step {start}" if state is RunState.PARTIAL else "starting"
        logger.info("%s: %s (lr %g; %s)", label, how, cfg.lr, eta.text())
        t0 = time.perf_counter()
        watcher = _ProgressLogger(cfg, start, eta, label)
        watcher.start()
        try:
            ok = _launch(cfg, resume=state is RunState.PARTIAL, label=label)
        finally:
            watcher.stop()
        if not ok:
            return None
        eta.record(cfg.steps - start, time.perf_counter() - t0)
        logger.info("%s: done in %s (%s)", label, _fmt_seconds(time.perf_counter() - t0), eta.text())
    runs = {cfg.optimizer: _metrics(Path(cfg.out)) for cfg in configs}
    rows = [comparison_row(cfg, runs[cfg.optimizer]) for cfg in configs]
    out = Path(configs[0].out).parent
    unigram = _unigram(configs[0])
    plot_comparison(runs, out / "compare.png", unigram=unigram,
                    title=f"{configs[0].steps} steps, global batch {configs[0].global_batch}, "
                          f"{configs[0].nproc} ranks, seed {configs[0].seed}")
    (out / "compare.md").write_text(_markdown(rows, configs[0], unigram, command))
    return rows


def _unigram(cfg: TrainConfig) -> float:
    from .data import ByteCorpus

    return ByteCorpus(cfg.corpus_bytes, cfg.val_fraction).unigram_loss()


def comparison_row(cfg: TrainConfig, metrics: list[dict[str, Any]]) -> ComparisonRow:
    """The table line of one finished run (medians over the steady state, as ``summary.txt``)."""
    from .report import steady_medians

    med = steady_medians(metrics)
    evals = [m for m in metrics if "val_loss" in m]
    last = evals[-1] if evals else {}
    state = last.get("optimizer_state_bytes")
    comm = last.get("matrix_comm_bytes_sent_per_rank")
    return ComparisonRow(
        optimizer=cfg.optimizer, lr=float(cfg.lr or 0.0),
        final_val_loss=float(last.get("val_loss", math.nan)),
        tokens_per_s=med["tokens_per_s"], optimizer_ms=med["time_optimizer"] * 1e3,
        state_bytes_max=max(state) if state else None, comm_bytes_per_step=sum(comm) if comm else None,
        train_seconds=sum(m["time_step"] for m in metrics),
    )


def comparison_table(rows: list[ComparisonRow]) -> str:
    """The markdown table of ``rows``."""
    def mib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / _MIB:.2f}"

    lines = ["| optimizer | lr | final val loss | tokens/s | optimizer ms/step | "
             "optimizer state MiB/rank (max) | matrix collective MiB/step (all ranks) | train s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r.final_val_loss):
        lines.append(f"| {r.optimizer} | {r.lr:g} | {r.final_val_loss:.4f} | {r.tokens_per_s:.0f} | "
                     f"{r.optimizer_ms:.1f} | {mib(r.state_bytes_max)} | "
                     f"{mib(r.comm_bytes_per_step)} | {r.train_seconds:.0f} |")
    return "\n".join(lines) + "\n"


def _markdown(rows: list[ComparisonRow], cfg: TrainConfig, unigram: float, command: str) -> str:
    head = [f"# Optimizer comparison: {cfg.steps} steps, global batch {cfg.global_batch} x "
            f"{cfg.model.seq_len} bytes, {cfg.nproc} ranks, seed {cfg.seed}", ""]
    if command:
        head += [f"Command: `{command}`", ""]
    head += [f"Sorted by final validation loss (nats/byte; unigram baseline {unigram:.3f}). "
             "Timings are medians over the last 80% of steps; train s sums the step times "
             "(evaluation, checkpoints and start-up excluded). Each optimizer's settings are in "
             "its `config.json` (`defaults_applied` lists those taken from its defaults).", ""]
    return "\n".join(head) + "\n" + comparison_table(rows)


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_comparison(runs: dict[str, list[dict[str, Any]]], path: Path, *, unigram: float | None,
                    title: str) -> None:
    """Validation and training loss vs steps and vs training seconds, one line per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=80, sharey="row")
    window = max(1, min(20, max((len(m) for m in runs.values()), default=1) // 20))
    for color, (name, metrics) in zip(plt.cm.tab10.colors, runs.items(), strict=False):
        if not metrics:
            continue
        steps = [m["step"] for m in metrics]
        seconds = _cumsum(m["time_step"] for m in metrics)
        train = _smooth([m["loss"] for m in metrics], window)
        val = [(m["step"], seconds[i], m["val_loss"]) for i, m in enumerate(metrics) if "val_loss" in m]
        axes[0, 0].plot([v[0] for v in val], [v[2] for v in val], "o-", ms=3, color=color, label=name)
        axes[0, 1].plot([v[1] for v in val], [v[2] for v in val], "o-", ms=3, color=color)
        axes[1, 0].plot(steps, train, lw=1, color=color)
        axes[1, 1].plot(seconds, train, lw=1, color=color)
    for ax, ylabel in ((axes[0, 0], "validation loss"), (axes[1, 0], f"train loss ({window}-step mean)")):
        ax.set_ylabel(f"{ylabel} (nats/byte)")
    for ax in axes[1]:
        ax.set_xlabel("step" if ax is axes[1, 0] else "training seconds (step times, summed)")
    for ax in axes.flat:
        if unigram is not None:
            ax.axhline(unigram, color="gray", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    _focus(axes, runs, unigram)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title + ("" if unigram is None else f"; dashed: unigram baseline {unigram:.2f}"))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cumsum(values: Any) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def _focus(axes: Any, runs: dict[str, list[dict[str, Any]]], unigram: float | None) -> None:
    """Zoom the y axes from the best loss to a bit above the unigram baseline (the first steps'
    ~5.5 nats would flatten the rest) once most evaluations are below that baseline."""
    vals = [m["val_loss"] for metrics in runs.values() for m in metrics if "val_loss" in m]
    if not vals:
        return
    low = min(vals)
    top = unigram + 0.2 if unigram is not None and statistics.median(vals) < unigram else max(vals)
    for row in axes:
        row[0].set_ylim(low - 0.05 * (top - low), top)


def run_cli(config_path: str | None, optimizers: str, rest: list[str], command: str) -> int:
    """``matrixfsdp compare``: 0 on success, 1 if a run failed, 2 on a configuration error."""
    import sys

    from .cli import config_overrides

    try:
        names = parse_optimizers(optimizers)
        overrides = config_overrides(rest, prog="matrixfsdp compare")
        if overrides.pop("optimizer", None) is not None:
            raise ConfigError("matrixfsdp compare takes --optimizers a,b,c (not --optimizer)")
        configs = comparison_configs(config_path, overrides, names)
        for cfg in configs:
            run_state(cfg)  # a mismatching run directory fails before anything starts
    except ConfigError as exc:
        print(f"matrixfsdp compare: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    t0 = time.perf_counter()
    rows = compare(configs, command=command)
    if rows is None:
        return 1
    out = Path(configs[0].out).parent
    print(comparison_table(rows), flush=True)  # the CLI's final screen
    print(f"matrixfsdp compare: {len(rows)} optimizers in {_fmt_seconds(time.perf_counter() - t0)}; "
          f"wrote {out / 'compare.png'} and {out / 'compare.md'}", flush=True)
    return 0
