"""Surviving faults in ``matrixfsdp train``: starting, restarting and failing cleanly.

[Note: restarts]
- *Start.* A torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) always resumes from the latest
  complete checkpoint of the run's output directory (from step 0 if none was written yet). A
  fresh launch into a directory that already holds checkpoints must say what it wants:
  ``--resume`` continues, ``--overwrite`` moves the old run aside (``OUT.old-<time>``, nothing is
  deleted) and starts over; neither is an error naming both flags.
- *Resume.* Rank 0 picks the checkpoint and broadcasts its name, so every rank loads the same one.
  Data order is a function of the step and the global batch (never of the world size), the LR
  schedule a function of the step, RNG states and the count of skipped steps come from the
  checkpoint, and the metrics file is rewritten (atomically) to the rows up to the checkpoint's
  step. The resumed run therefore repeats exactly the steps after that checkpoint and saves only
  at later steps: a checkpoint completed before a kill is never written again.
- *Rendezvous.* torchrun's c10d rendezvous shares one TCP store between the agent and every
  worker generation by default. Worker process groups use fixed keys, so a restarted generation
  can read the addresses of the dead one and fail with ``Gloo connectFullMesh failed ...
  Connection refused``. ``matrixfsdp train`` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: each
  rendezvous round then gives the workers a new store on a new port. A worker launched by a
  torchrun that still shares its store (a direct ``torchrun -m matrixfsdp.launch.train``, or the
  static rendezvous of ``--master-addr/--master-port``) prefixes the process group's keys with the
  restart count instead. Every agent of a job counts restarts alike, except a node that joins an
  elastic job after failures: multi-node elastic jobs should set the variable (the CLI does).
- *No hangs.* The process group is created with ``timeout=collective_timeout_s`` (default 300 s,
  not torch's 30 min for gloo): a rank whose peer died or hangs raises within that time (a dead
  peer's closed sockets usually fail it at once), logs which rank failed and why, and exits
  non-zero so torchrun restarts the workers. NCCL aborts a timed-out collective through its
  watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set to 1 here unless the user set it).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

__all__ = [
    "FAULTS_ENV",
    "RunExistsError",
    "StartMode",
    "agree_on_checkpoint",
    "agree_on_start",
    "exit_now",
    "exit_on_failure",
    "init_process_group",
    "inject_fault",
    "inject_nan_grad",
    "move_aside",
    "resolve_start",
    "restart_count",
]

logger = logging.getLogger(__name__)

FAULTS_ENV = "MATRIXFSDP_FAULTS"  # tests: "attempt:rank:step,..." -> that rank SIGKILLs itself
NAN_GRAD_ENV = "MATRIXFSDP_NAN_GRAD"  # tests: "rank:step,..." -> a NaN in that rank's gradient
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Words in gloo/NCCL errors raised when a peer died or stopped answering.
_PEER_LOST = ("timeout", "timed out", "connection", "closed", "reset by peer", "broken pipe",
              "nccl", "gloo")


class StartMode(enum.Enum):
    FRESH = "fresh"
    RESUME = "resume"


class RunExistsError(ValueError):
    """A fresh launch would start over in a directory that holds another run's checkpoints."""


def restart_count() -> int:
    """How many times torchrun restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resolve_start(out: Path, *, resume: bool, overwrite: bool, restarts: int) -> StartMode:
    """Whether this launch resumes or starts fresh (see [Note: restarts]); raises on ambiguity."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other; pass one of them")
    if restarts > 0 or resume:
        return StartMode.RESUME
    from ..checkpoint import latest

    found = latest(Path(out) / "checkpoints")
    if found is not None and not overwrite:
        raise RunExistsError(
            f"{out} already holds a run with checkpoints (latest: {found.name}); pass --resume to "
            "continue it, or --overwrite to move it aside and start over"
        )
    return StartMode.FRESH


def move_aside(out: Path) -> Path | None:
    """Rename a non-empty ``out`` to ``out.old-<time>`` (never deleting it); returns the new name."""
    out = Path(out)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out.with_name(f"{out.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = out.with_name(f"{out.name}.old-{stamp}-{n}")
    os.rename(out, target)
    logger.warning("--overwrite: moved the previous run %s to %s", out, target)
    return target


# -- process group ---------------------------------------------------------------------------------
def init_process_group(backend: str, timeout_s: float) -> None:
    """``init_process_group`` with a collective timeout and a fresh store per torchrun attempt."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    # The agent's store outlives worker generations: keep each generation's keys apart.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"matrixfsdp/attempt_{restart_count()}/", store)
    dist.init_process_group(backend, store=prefixed, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def agree_on_checkpoint(root: Path, rank: int, device: torch.device) -> Path | None:
    """Collective: rank 0's ``latest(root)``, the same path on every rank (None if none)."""
    from ..checkpoint import latest

    name, failure = b"", None
    if rank == 0:
        try:
            found = latest(root)
            name = b"" if found is None else found.name.encode()
        except Exception as exc:  # forwarded: every rank must leave, not wait in a collective
            failure = exc
            logger.exception("resume: looking for the latest checkpoint under %s failed", root)
    length = torch.tensor([-1 if failure else len(name)], dtype=torch.int64, device=device)
    with record_function("matrixfsdp::agree_on_checkpoint"):
        dist.broadcast(length, src=0)
        if int(length.item()) < 0:
            if failure is not None:
                raise failure
            raise RuntimeError(f"resume: rank 0 failed to look for a checkpoint under {root}; "
                               "its log holds the cause")
        data = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
        if rank == 0 and name:
            data.copy_(torch.frombuffer(bytearray(name), dtype=torch.uint8))
        if data.numel():
            dist.broadcast(data, src=0)
    return Path(root) / bytes(data.cpu().tolist()).decode() if data.numel() else None


# -- failing -----------------------------------------------------------------------------------------
def inject_fault(step: int, rank: int) -> None:
    """Tests and benchmarks: SIGKILL this rank before ``step`` if ``MATRIXFSDP_FAULTS`` says so."""
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return
    here = (restart_count(), rank, step)
    for item in spec.split(","):
        if tuple(int(x) for x in item.split(":")) == here:
            logger.error("fault injection: SIGKILL rank %d before step %d (attempt %d)",
                         rank, step, here[0])
            logging.shutdown()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def inject_nan_grad(step: int, rank: int, params: Iterator[torch.nn.Parameter]) -> None:
    """Tests: put a NaN into this rank's first non-empty local gradient if ``MATRIXFSDP_NAN_GRAD``
    names ``rank:step``."""
    spec = os.environ.get(NAN_GRAD_ENV)
    if not spec or (rank, step) not in {tuple(int(x) for x in i.split(":")) for i in spec.split(",")}:
        return
    for p in params:
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if grad is not None and grad.numel():
            grad.view(-1)[0] = float("nan")
            logger.warning("fault injection: NaN in a gradient on rank %d at step %d", rank, step)
            return


@contextlib.contextmanager
def exit_on_failure(timeout_s: float) -> Iterator[None]:
    """Turn any failure of a rank into one clear log line and a non-zero exit, without hanging."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        text = str(exc).lower()
        peer = isinstance(exc, (RuntimeError, dist.DistError)) and any(s in text for s in _PEER_LOST)
        cause = ("lost its peers (a rank died or hangs; collectives time out after "
                 f"collective_timeout_s={timeout_s:g} s)") if peer else "failed"
        logger.error("rank %d %s: %s: %s. Exiting; under torchrun --max-restarts the workers "
                     "restart and resume from the latest checkpoint.", rank, cause,
                     type(exc).__name__, exc, exc_info=not peer)
        exit_now(1)  # no process-group teardown: it can block on a dead peer


def exit_now(code: int) -> None:
    """Flush logs and stdio, then end the process without interpreter finalization.

    A finished gloo rank can still have a worker thread releasing the last reference to an earlier
    collective's tensors (a barrier keeps the works issued before it); if that happens while
    Python finalizes, the thread cannot take the GIL and the process aborts (``terminate called
    without an active exception``, seen 3 times in 29 four-rank runs). Skipping finalization
    after every file is closed avoids it.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def agree_on_start(out: Path, rank: int, device: torch.device, *, resume: bool,
                   overwrite: bool) -> StartMode:
    """Collective: rank 0 resolves the start mode (moving an old run aside for ``overwrite``)."""
    modes = list(StartMode)
    code, error = -1, None
    if rank == 0:
        try:
            mode = resolve_start(out, resume=resume, overwrite=overwrite, restarts=restart_count())
            if mode is StartMode.FRESH and overwrite:
                move_aside(out)
            code = modes.index(mode)
        except Exception as exc:  # forwarded: every rank must leave, not wait in a collective
            error = exc
    flag = torch.tensor([code], dtype=torch.int64, device=device)
    if dist.is_initialized():
        with record_function("matrixfsdp::agree_on_start"):
            dist.broadcast(flag, src=0)
    if error is not None:
        raise error
    if int(flag.item()) < 0:
        raise RunExistsError(f"rank 0 refused to start in {out}; see its log")
    return modes[int(flag.item())]
