"""Run a function on a forked gloo world and collect every rank's return value."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_world"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           results: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        out = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, out, None))
    except BaseException:  # every failure goes back to the parent with its traceback
        results.put((rank, None, traceback.format_exc()))


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 1800.0) -> list[Any]:
    """``[fn(rank, world, *args) for each rank]`` on ``world`` forked gloo ranks (one thread each)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    error = None
    try:
        while len(outs) < world:
            rank, out, err = results.get(timeout=timeout)
            if err is not None:
                error = f"rank {rank} failed:\n{err}"
                break
            outs[rank] = out
    except queue_mod.Empty:
        error = f"world of {world} timed out after {timeout:.0f}s"
    finally:
        for p in procs:
            p.join(timeout=5 if error else 120)
            if p.is_alive():
                p.kill()
                p.join()
    if error is not None:
        raise RuntimeError(error)
    return [outs[r] for r in range(world)]
