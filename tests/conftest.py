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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` (the CUDA cases of ``dist_utils.DEVICES``) skip without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
