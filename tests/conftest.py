from __future__ import annotations

import os

import pytest
import torch

# Two cores on CI: keep every process single-threaded (spawned ranks inherit this via fork).
torch.set_num_threads(1)

TEST_DEVICE_ENV = "MATRIXFSDP_TEST_DEVICE"


def pytest_configure(config: pytest.Config) -> None:
    # A GPU session asks for CUDA explicitly: then a machine without it is an error, not a skip.
    if os.environ.get(TEST_DEVICE_ENV, "cpu") not in ("cpu", "cuda"):
        raise pytest.UsageError(f"{TEST_DEVICE_ENV} must be 'cpu' or 'cuda'")
    if os.environ.get(TEST_DEVICE_ENV) == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}=cuda but torch.cuda.is_available() is False")


# A differential sweep (tests/test_differential.py) is bounded by its worlds' own timeout, which
# grows with the seeds a world runs; pytest-timeout's fixed one would cut it short.
# The pipeline sweep (test_differential_pp) too: 240 seeds ran past the 900 s limit.
SWEEP_ENV = ("MATRIXFSDP_DIFF_SEEDS", "MATRIXFSDP_DIFF_TP_SEEDS", "MATRIXFSDP_DIFF_HSDP_TP_SEEDS",
             "MATRIXFSDP_DIFF_EP_SEEDS", "MATRIXFSDP_DIFF_PP_SEEDS", "MATRIXFSDP_DIFF_SEED")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` (the CUDA cases of ``dist_utils.DEVICES``) skip without CUDA; a
    differential sweep runs without pytest-timeout's limit."""
    if any(os.environ.get(name, "").strip() for name in SWEEP_ENV):
        for item in items:
            if item.name.startswith("test_differential[") or item.name == "test_differential_pp":
                item.add_marker(pytest.mark.timeout(0))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
