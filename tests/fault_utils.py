"""Worlds of forked ranks that tests can kill, stop and time (unlike ``run_world``).

Each rank runs ``target(rank, world, *args)`` with torchrun's environment variables set and its
stdout/stderr in ``<log_dir>/rank<r>.log``; nothing is initialized for it (``matrixfsdp train``'s
``main`` creates its own process group). Forking skips the interpreter start and torch import.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .dist_utils import _free_port, cpu_rank_context

__all__ = ["TINY_TRAIN", "metric_steps", "read_metrics", "start_world", "train_rank", "wait_exit"]

# The embedded GPT at test size; global_batch 12 divides world sizes 1, 2, 3 and 4.
TINY_TRAIN = [
    "--set", "corpus_bytes=60000", "--set", "model.dim=32", "--set", "model.hidden=64",
    "--set", "model.layers=2", "--set", "model.heads=2", "--set", "model.seq_len=32",
    "--set", "warmup_steps=2", "--set", "global_batch=12", "--set", "eval_batches=1",
    "--set", "eval_every=100", "--set", "checkpoint_every=4", "--set", "keep_checkpoints=10",
]


def _rank_entry(rank: int, world: int, port: int, env: dict[str, str], log_dir: str,
                target: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **env,
    )
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (pytest swapped them)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    root = logging.getLogger()
    for handler in list(root.handlers):  # pytest's capture handlers were inherited by the fork
        root.removeHandler(handler)
    torch.set_num_threads(1)
    target(rank, world, *args)


def start_world(world: int, target: Callable, *args: Any, log_dir: Path,
                env: dict[str, str] | None = None) -> list[mp.Process]:
    """Fork ``world`` ranks running ``target``; returns the processes (already started)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx = cpu_rank_context()
    port = _free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, env or {}, str(log_dir), target, args))
             for r in range(world)]
    for p in procs:
        p.start()
    return procs


def wait_exit(procs: list[mp.Process], timeout: float) -> list[int | None]:
    """Exit codes once all exited (None for a rank still alive at ``timeout``, then killed)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def train_rank(rank: int, world: int, argv: list[str]) -> None:
    """``matrixfsdp.launch.train`` on this rank, as torchrun would start it."""
    from matrixfsdp.launch.train import main

    main(argv)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def metric_steps(out: Path) -> list[int]:
    return [row["step"] for row in read_metrics(out)]
