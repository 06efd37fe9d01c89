"""One training rank: ``torchrun --nproc-per-node N -m matrixfsdp.launch.train --config C``.

``matrixfsdp train`` validates the configuration, writes it to ``OUT/config.json`` and starts this
module on every rank through torchrun's machinery; multi-node runs use torchrun's rendezvous flags.
Restarts, resuming and failing are described in [Note: restarts] (``faults.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import matrixfsdp as mf

from ..checkpoint._dist import on_coordinator
from . import faults
from .config import TrainConfig, load_config
from .data import ByteCorpus
from .model import GPT, parallelize_gpt

__all__ = ["main", "train"]

logger = logging.getLogger(__name__)

_FAIL_AT_STEP_ENV = "MATRIXFSDP_FAIL_AT_STEP"  # tests: die abruptly at this step, like a kill
PROGRESS_DESC_ENV = "MATRIXFSDP_PROGRESS_DESC"  # progress-bar label (matrixfsdp compare sets it)


@dataclass
class RunContext:
    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    out: Path
    corpus: ByteCorpus
    model: GPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def data_rank(self) -> int:
        """Which share of the global batch this rank takes (tp ranks share one; tp innermost)."""
        return self.rank // self.cfg.tp

    @property
    def data_world(self) -> int:
        return self.world // self.cfg.tp

    @property
    def checkpoint_root(self) -> Path:
        return self.out / "checkpoints"


def _init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    use_cuda = torch.cuda.is_available() and os.environ.get("MATRIXFSDP_DEVICE", "") != "cpu"
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        faults.init_process_group("nccl" if use_cuda else "gloo", cfg.collective_timeout_s)
    return dist.get_rank(), dist.get_world_size(), device


def _meshes(cfg: TrainConfig, world: int,
            device: torch.device) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The data-parallel mesh (``None``: flat over every rank) and the tp mesh (``None``: no TP)."""
    if cfg.tp == 1:
        return (mf.init_hsdp_mesh(replicate=cfg.replicate, device_type=device.type)
                if cfg.replicate > 1 else None), None  # HSDP: (replicate, shard); None: flat
    if world % (cfg.replicate * cfg.tp):
        raise ValueError(f"replicate ({cfg.replicate}) x tp ({cfg.tp}) must divide the world "
                         f"size ({world})")
    shard = world // (cfg.replicate * cfg.tp)
    mesh = init_device_mesh(device.type, (cfg.replicate, shard, cfg.tp),
                            mesh_dim_names=("replicate", "shard", "tp"))
    dp = mesh["replicate", "shard"] if cfg.replicate > 1 else mesh["shard"]
    return dp, mesh["tp"]


def _lr_lambda(cfg: TrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _build(cfg: TrainConfig) -> RunContext:
    rank, world, device = _init_distributed(cfg)
    if cfg.global_batch % (world // cfg.tp):
        raise ValueError(f"global_batch ({cfg.global_batch}) must be divisible by the data-"
                         f"parallel size ({world // cfg.tp} = world {world} / tp {cfg.tp}); a "
                         "resumed run may use any data-parallel size that divides it")
    torch.manual_seed(cfg.seed)
    corpus = ByteCorpus(cfg.corpus_bytes, cfg.val_fraction)
    model = GPT(cfg.model).to(device)
    cost = "bytes" if cfg.optimizer == "adamw" else cfg.optimizer
    mesh, tp_mesh = _meshes(cfg, world, device)
    if tp_mesh is not None:
        parallelize_gpt(model, tp_mesh)
    mf.fully_shard_matrix(model, mesh, reshard_after_forward=cfg.reshard_after_forward,
                          planner=cost, replicate_presence_flags=cfg.replicate_presence_flags)
    kwargs = dict(cfg.optimizer_kwargs)
    if cfg.optimizer == "muon" and device.type == "cpu":
        kwargs.setdefault("ns_dtype", "float32")  # bf16 GEMMs are slow on CPUs
    optimizer = mf.MatrixOptimizer(
        model, optimizer=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
        tail_lr=cfg.tail_lr, tail_weight_decay=cfg.tail_weight_decay,
        skip_nonfinite=cfg.skip_nonfinite, **kwargs,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    return RunContext(cfg, rank, world, device, Path(cfg.out), corpus, model, optimizer, scheduler)


def _resume(ctx: RunContext) -> int:
    """Load the latest complete checkpoint (rank 0 picks it for all); returns its step."""
    path = faults.agree_on_checkpoint(ctx.checkpoint_root, ctx.rank, ctx.device)
    if path is None:
        if ctx.rank == 0:
            logger.warning("resume: no complete checkpoint under %s yet; starting from step 0",
                           ctx.checkpoint_root)
        return 0
    info = mf.checkpoint.load(path, ctx.model, ctx.optimizer)
    step = int(info["step"])
    ctx.scheduler.last_epoch = step  # the schedule is a pure function of the step
    factor = _lr_lambda(ctx.cfg)(step)
    for group in ctx.optimizer.param_groups:
        group["lr"] = group["initial_lr"] * factor
    extra = info["extra"] if isinstance(info["extra"], dict) else {}
    ctx.optimizer.skipped_steps = int(extra.get("skipped_steps", 0))
    if ctx.rank == 0:
        ctx.metrics = [m for m in _read_metrics(ctx.out / "metrics.jsonl") if m["step"] <= step]
        if [m["step"] for m in ctx.metrics] != list(range(1, step + 1)):
            logger.warning("metrics.jsonl lacks rows for some of steps 1..%d", step)
        logger.info("resumed from %s at step %d (world size %d)", path, step, ctx.world)
    return step


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl``; a line cut short by a kill (only ever the last) is dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("metrics.jsonl: dropping an incomplete line %r", line[:80])
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _global_mean(value: torch.Tensor, world: int) -> float:
    value = value.detach().float().reshape(1).clone()
    dist.all_reduce(value)
    return value.item() / world


def _train_step(ctx: RunContext, step: int) -> dict[str, Any]:
    cfg, state = ctx.cfg, mf.get_state(ctx.model)
    batch = ctx.corpus.batch("train", step, cfg.global_batch, cfg.model.seq_len, cfg.seed)
    per = cfg.global_batch // ctx.data_world
    local = batch[ctx.data_rank * per : (ctx.data_rank + 1) * per].to(ctx.device)
    before = state.comm.counter.snapshot()
    _sync(ctx.device)
    t0 = time.perf_counter()
    loss = ctx.model.loss(local)
    _sync(ctx.device)
    t1 = time.perf_counter()
    loss.backward()
    faults.inject_nan_grad(step, ctx.rank, ctx.model.parameters())
    _sync(ctx.device)
    t2 = time.perf_counter()
    grad_norm = mf.clip_grad_norm_(ctx.model, cfg.grad_clip) if cfg.grad_clip else None
    lr = ctx.optimizer.param_groups[0]["lr"]
    ctx.optimizer.step()  # skips on every rank alike if the global grad norm is inf/NaN
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.scheduler.step()
    _sync(ctx.device)
    t3 = time.perf_counter()
    after = state.comm.counter.snapshot()
    comm = {phase: after[phase]["bytes_sent"] - before[phase]["bytes_sent"] for phase in after}
    return {
        "step": step + 1, "loss": _global_mean(loss, ctx.world), "lr": lr,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "skipped": bool(getattr(ctx.optimizer, "last_step_skipped", False)),
        "skipped_steps": int(getattr(ctx.optimizer, "skipped_steps", 0)),
        "time_forward": t1 - t0, "time_backward": t2 - t1, "time_optimizer": t3 - t2,
        "time_step": t3 - t0, "tokens_per_s": cfg.global_batch * cfg.model.seq_len / (t3 - t0),
        "matrix_comm_bytes_sent": comm, "peak_rss_mib": _peak_memory_mib(ctx.device),
    }


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _per_rank_bytes(ctx: RunContext, record: dict[str, Any]) -> dict[str, list[int]]:
    """Every rank's optimizer-state bytes and matrix bytes sent this step (one all-gather)."""
    optimizer = ctx.optimizer
    assert isinstance(optimizer, mf.MatrixOptimizer)  # built by _build
    mine = torch.tensor([optimizer.matrix_state_bytes() + optimizer.tail_state_bytes(),
                         sum(record["matrix_comm_bytes_sent"].values())], dtype=torch.int64,
                        device=ctx.device)
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(gathered, mine)
    return {"optimizer_state_bytes": [int(t[0]) for t in gathered],
            "matrix_comm_bytes_sent_per_rank": [int(t[1]) for t in gathered]}


@torch.no_grad()
def _evaluate(ctx: RunContext, step: int) -> float:
    cfg, per, me = ctx.cfg, ctx.cfg.global_batch // ctx.data_world, ctx.data_rank
    total = torch.zeros((), device=ctx.device)
    for i in range(cfg.eval_batches):
        batch = ctx.corpus.batch("val", i, cfg.global_batch, cfg.model.seq_len, cfg.seed)
        total += ctx.model.loss(batch[me * per : (me + 1) * per].to(ctx.device))
    return _global_mean(total / cfg.eval_batches, ctx.world)


def _save(ctx: RunContext, step: int) -> None:
    path = mf.checkpoint.step_dir(ctx.checkpoint_root, step)
    extra = {"config": ctx.cfg.model_dump(),
             "skipped_steps": int(getattr(ctx.optimizer, "skipped_steps", 0))}
    mf.checkpoint.save(path, ctx.model, ctx.optimizer, step=step, extra=extra)

    def prune() -> None:
        done = sorted(p for p in ctx.checkpoint_root.glob("step_*") if p.is_dir() and p != path)
        for old in done[: max(0, len(done) - (ctx.cfg.keep_checkpoints - 1))]:
            mf.checkpoint.remove_checkpoint(old)

    # Rank 0's file operations end in an agreement: a failure there raises on every rank.
    on_coordinator(prune, None, "removing old checkpoints")


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> list[dict[str, Any]]:
    """Run the training loop on this rank; returns the metrics (complete on rank 0).

    Resumes from the latest checkpoint when ``resume`` is set or torchrun restarted the workers;
    see [Note: restarts] for the rules (and ``overwrite``).
    """
    ctx = _build(cfg)
    mode = faults.agree_on_start(ctx.out, ctx.rank, ctx.device, resume=resume, overwrite=overwrite)
    start = _resume(ctx) if mode is faults.StartMode.RESUME else 0
    progress = _progress(ctx, start)
    fail_at = int(os.environ.get(_FAIL_AT_STEP_ENV, "-1"))
    with _MetricsWriter(ctx) as writer:
        for step in range(start, cfg.steps):
            if step == fail_at:
                os._exit(17)  # simulate a killed job (no cleanup, no final checkpoint)
            faults.inject_fault(step, ctx.rank)
            record = _train_step(ctx, step)
            if record["step"] % cfg.eval_every == 0 or record["step"] == cfg.steps:
                record["val_loss"] = _evaluate(ctx, step)
                record.update(_per_rank_bytes(ctx, record))
            writer.write(record)
            if record["step"] % cfg.checkpoint_every == 0 or record["step"] == cfg.steps:
                writer.sync()  # the rows up to a checkpoint are on disk before it is
                _save(ctx, record["step"])
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
    if progress is not None:
        progress.close()
    _finish(ctx)
    return ctx.metrics


def _finish(ctx: RunContext) -> None:
    """The report on rank 0, then an agreement every rank waits for: all leave together (a rank
    tearing down early can abort gloo peers), and a failed report raises on every rank."""
    from . import report

    on_coordinator(lambda: report.write_report(ctx.out, ctx.metrics, ctx.cfg,
                                               ctx.corpus.unigram_loss(), mf.get_plan(ctx.model)),
                   None, "writing the report")


def _progress(ctx: RunContext, start: int):
    if ctx.rank != 0:
        return None
    from tqdm import tqdm

    desc = os.environ.get(PROGRESS_DESC_ENV) or f"train {ctx.cfg.optimizer}"
    return tqdm(total=ctx.cfg.steps, initial=start, desc=desc, unit="step", dynamic_ncols=True)


class _MetricsWriter:
    """Rank 0 rewrites ``metrics.jsonl`` from the resumed prefix, then appends one line per step.

    The rewrite goes through a temporary file and a rename, so a kill during it loses no row.
    """

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.file = None

    def __enter__(self) -> _MetricsWriter:
        if self.ctx.rank == 0:
            self.ctx.out.mkdir(parents=True, exist_ok=True)
            path = self.ctx.out / "metrics.jsonl"
            tmp = path.with_name(".metrics.jsonl.tmp")
            with tmp.open("w") as stream:
                stream.writelines(json.dumps(record) + "\n" for record in self.ctx.metrics)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(tmp, path)
            self.file = path.open("a")
        return self

    def sync(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def write(self, record: dict[str, Any]) -> None:
        self.ctx.metrics.append(record)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="matrixfsdp.launch.train", description=__doc__)
    parser.add_argument("--config", help="YAML/JSON training config (defaults if omitted)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="move an existing run in the output directory aside and start over")
    args, rest = parser.parse_known_args(argv)
    from .cli import config_overrides

    cfg = load_config(args.config, **config_overrides(rest))
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    with faults.exit_on_failure(cfg.collective_timeout_s):
        train(cfg, resume=args.resume, overwrite=args.overwrite)
        if dist.is_initialized():
            dist.destroy_process_group()
    faults.exit_now(0)


if __name__ == "__main__":
    main()
