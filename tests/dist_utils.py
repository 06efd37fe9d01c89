"""Run a function on a world of N ranks; one world runs many subtests.

Process start-up dominates small distributed tests, so each test module spawns one world per
world size and runs all its checks there (as FSDP2's own suite does with ``run_subtests``).
Failures come back to pytest with every failing rank's traceback.

The test device: ``run_world(..., device="cpu")`` forks gloo ranks on the CPU (the default, and
all CI runs); ``device="cuda"`` spawns NCCL ranks, rank ``r`` on ``cuda:r``, and skips with
"needs N CUDA devices" where the machine has fewer. Inside a rank ``test_device()`` names the
device: the test models, batches and comparison helpers (``tests/models.py``,
``tests/checks.py``) put their tensors there, so a test body is the same on both. ``DEVICES``
parametrizes a test over both, the CUDA case marked ``gpu`` (skipped without CUDA, see
``conftest.py``): ``MATRIXFSDP_TEST_DEVICE=cuda python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

__all__ = ["DEVICES", "cpu_rank_context", "device_type", "run_subtests", "run_world", "test_device"]

# Parametrize a test over the test devices: the CUDA case carries the ``gpu`` marker.
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))

_device = torch.device("cpu")  # this process's test device, set in each rank by run_world


def test_device() -> torch.device:
    """The device this rank's tensors, models and process group use."""
    return _device


test_device.__test__ = False  # a helper, not a test, for pytest's collector


def device_type() -> str:
    """``test_device().type``, e.g. for ``init_device_mesh``."""
    return _device.type


def cpu_rank_context() -> Any:
    """How CPU ranks are started: forked, except on a CUDA/ROCm build of torch.

    There the autograd engine starts its device threads at the first backward of the test
    process (some tests run one in-process), and a child forked after that cannot run autograd
    ("Unable to handle autograd's threading in combination with fork-based multiprocessing").
    A fork server forked before any test ran (torch preloaded, so ranks still start fast) avoids
    it; rank functions and their arguments must then pickle. CPU-only builds (CI) fork.
    """
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "matrixfsdp"])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, device: str, fn: Callable, args: tuple,
           queue: Any, fault_dir: str) -> None:
    global _device
    # A rank killed by a signal (a crash in native code) reports nothing through the queue:
    # its Python stacks go to a file the parent attaches to the failure (see ``_deaths``).
    fault_file = open(os.path.join(fault_dir, f"rank{rank}"), "w")  # noqa: SIM115 (lives on)
    faulthandler.enable(file=fault_file, all_threads=True)
    try:
        torch.set_num_threads(1)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
            WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        )
        timeout = datetime.timedelta(seconds=120)
        if device == "cuda":
            _deterministic_cuda()
            _device = torch.device("cuda", rank)
            torch.cuda.set_device(_device)
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                    device_id=_device)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, traceback.format_exc()))


def _deterministic_cuda() -> None:
    """fp32 math and run-to-run identical kernels, as on the CPU: the tests compare against fp32
    references and, after a checkpoint round trip, bit for bit."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for backend in ("flash", "mem_efficient", "cudnn"):  # attention: the plain math kernels
        enable = getattr(torch.backends.cuda, f"enable_{backend}_sdp", None)
        if enable is not None:
            enable(False)


def run_world(world: int, fn: Callable, *args: Any, device: str = "cpu",
              timeout: float = 600.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks on ``device``; raise on any failure.

    CPU: forked gloo ranks (see ``cpu_rank_context``). CUDA: spawned NCCL ranks (``fn`` and ``args`` must pickle), one GPU
    each; skipped when the machine has fewer than ``world`` GPUs.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < world:
            pytest.skip(f"needs {world} CUDA devices (this machine has {available})")
    ctx = mp.get_context("spawn") if device == "cuda" else cpu_rank_context()
    queue = ctx.Queue()
    port = _free_port()
    fault_dir = tempfile.mkdtemp(prefix="matrixfsdp-ranks-")
    procs = [
        ctx.Process(target=_child, args=(r, world, port, device, fn, args, queue, fault_dir))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    errors: dict[int, str] | None = None
    reported: set[int] = set()  # the ranks that reported success
    try:
        errors = _collect_reports(queue, procs, timeout, reported)
    finally:
        failed = errors is None or bool(errors) or _any_died(procs, reported)
        killed = set()
        for rank, p in enumerate(procs):
            p.join(timeout=5 if failed else 60)
            if p.is_alive():
                p.kill()
                p.join()
                killed.add(rank)
    deaths = _deaths(procs, set(errors) | reported | killed, fault_dir) if failed else {}
    errors.update(deaths)
    shutil.rmtree(fault_dir, ignore_errors=True)
    if errors:
        first = sorted(errors, key=lambda r: (r not in deaths, r))  # a crash explains the rest
        text = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in first)
        raise AssertionError(f"distributed test failed on world size {world} ({device}):\n{text}")


def _collect_reports(queue: Any, procs: list[Any], timeout: float,
                     done: set[int]) -> dict[int, str]:
    """Every rank's report (successes are added to ``done``), or the first failure: an error,
    a rank that died without reporting (noticed within a second, not at the timeout), or the
    timeout. A rank that crashes after reporting success (at exit) is not a failure here."""
    deadline = time.monotonic() + timeout
    while len(done) < len(procs):
        try:
            rank, err = queue.get(timeout=1.0)
        except queue_module.Empty:
            if _any_died(procs, done):
                return {}  # a rank died: ``_deaths`` says which and how
            if time.monotonic() > deadline:
                return {-1: f"timed out after {timeout}s waiting for ranks"}
            continue
        if err is not None:
            return {rank: err}  # peers are likely blocked in a collective: stop waiting
        done.add(rank)
    return {}


def _any_died(procs: list[Any], skip: set[int] = frozenset()) -> bool:
    """Whether a rank (not in ``skip``) ended with a non-zero exit code or a signal."""
    return any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in skip)


def _deaths(procs: list[Any], skip: set[int], fault_dir: str) -> dict[int, str]:
    """The ranks (not in ``skip``: reported, or killed here) that ended abnormally without
    reporting, with the Python stacks faulthandler wrote when a signal killed them."""
    deaths = {}
    for rank, p in enumerate(procs):
        code = p.exitcode
        if rank in skip or code in (None, 0):
            continue
        if code > 0:
            deaths[rank] = f"exited with code {code} without reporting"
            continue
        try:
            with open(os.path.join(fault_dir, f"rank{rank}")) as f:
                stacks = f.read(4000)  # the crashing thread first, innermost frame on top
        except OSError:
            stacks = ""
        deaths[rank] = (f"died of {signal.Signals(-code).name} without reporting; its stacks:\n"
                        f"{stacks or '(none written)'}")
    return deaths


def run_subtests(rank: int, subtests: dict[str, Callable[[], None]]) -> None:
    """Run named subtests in order; on failure say which one."""
    for name, subtest in subtests.items():
        try:
            subtest()
        except BaseException as exc:
            raise AssertionError(f"subtest {name!r} failed on rank {rank}: {exc}") from exc
