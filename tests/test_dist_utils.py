"""The test harness itself: a rank that crashes in native code is named, with its stack."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from .dist_utils import run_world


def _abort_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)  # as glibc does on heap corruption
    dist.barrier()


def _exit_rank_zero(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(30)  # a peer that would outlive the test if the harness waited for it


def test_a_rank_killed_by_a_signal_is_reported_with_its_stack() -> None:
    with pytest.raises(AssertionError) as failure:
        run_world(2, _abort_rank_one)
    text = str(failure.value)
    assert text.index("--- rank 1 ---") < text.index("--- rank 0 ---")  # the crash comes first
    assert "died of SIGABRT without reporting" in text
    assert "in _abort_rank_one" in text  # the crashing Python frame, from faulthandler


def test_a_rank_that_exits_without_reporting_fails_the_test_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 ---\nexited with code 3 without reporting"):
        run_world(2, _exit_rank_zero)
    assert time.monotonic() - start < 20  # noticed by polling, not at the 600 s timeout
