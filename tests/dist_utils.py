"""Run a function on a gloo world of N forked ranks; one world runs many subtests.

Process start-up dominates small distributed tests, so each test module spawns one world per
world size and runs all its checks there (as FSDP2's own suite does with ``run_subtests``).
Failures come back to pytest with every failing rank's traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_subtests", "run_world"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
            WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        )
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, traceback.format_exc()))


def run_world(world: int, fn: Callable, *args: Any, timeout: float = 600.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; raise on any failure."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    errors: dict[int, str] = {}
    try:
        for _ in range(world):
            rank, err = queue.get(timeout=timeout)
            if err is not None:
                errors[rank] = err
                break  # peers are likely blocked in a collective: stop waiting
    except Exception as exc:  # queue.Empty on timeout
        errors[-1] = f"timed out after {timeout}s waiting for ranks ({exc!r})"
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise AssertionError(f"distributed test failed on world size {world}:\n{text}")


def run_subtests(rank: int, subtests: dict[str, Callable[[], None]]) -> None:
    """Run named subtests in order; on failure say which one."""
    for name, subtest in subtests.items():
        try:
            subtest()
        except BaseException as exc:
            raise AssertionError(f"subtest {name!r} failed on rank {rank}: {exc}") from exc
