"""``TorchOwnerComm``'s choice of forms, without a process group: the reduction in rounds is
refused off gloo (see [Note: rounds need gloo]); ``"auto"`` never picks it there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from matrixfsdp.collectives.torch_backend import TorchOwnerComm, reduce_form

ALTERNATIVES = r"reduce_impl='reduce'.*'alltoall'"


@contextmanager
def _fake_group(backend: str, world: int = 2) -> Iterator[None]:
    """The default group as ``TorchOwnerComm`` sees it: rank 0 of ``world`` on ``backend``."""
    with mock.patch("torch.distributed.get_rank", return_value=0), \
            mock.patch("torch.distributed.get_world_size", return_value=world), \
            mock.patch("torch.distributed.get_backend", return_value=backend):
        yield


def test_rounds_refused_off_gloo() -> None:
    for backend in ("nccl", "xccl", "ucc"):
        with pytest.raises(ValueError, match=rf"gloo only.*'{backend}'.*{ALTERNATIVES}"):
            reduce_form("rounds", gloo=False, backend=backend)
    with pytest.raises(ValueError, match="a backend other than gloo"):
        reduce_form("rounds", gloo=False)
    assert reduce_form("rounds", gloo=True) == "rounds"
    for impl in ("alltoall", "reduce", "allreduce"):  # every other form runs anywhere
        assert reduce_form(impl, gloo=False, backend="nccl") == impl
    assert reduce_form("p2p", gloo=False) == "reduce"


def test_auto_picks_rounds_on_gloo_only() -> None:
    assert reduce_form("auto", gloo=False, backend="nccl") == "reduce"
    assert reduce_form("auto", gloo=True) == "rounds"


def test_comm_refuses_rounds_on_nccl() -> None:
    with _fake_group("nccl"), pytest.raises(ValueError, match=rf"'nccl'.*{ALTERNATIVES}"):
        TorchOwnerComm(reduce_impl="rounds")
    with _fake_group("nccl"):
        comm = TorchOwnerComm()  # "auto": in-place reduces on NCCL
    assert reduce_form(comm.reduce_impl, gloo=comm._on_gloo(torch.zeros(1))) == "reduce"
    with _fake_group("gloo"):
        assert TorchOwnerComm(reduce_impl="rounds").reduce_impl == "rounds"


def test_comm_refuses_rounds_per_call_on_a_mixed_backend() -> None:
    """``"cpu:nccl,cuda:gloo"``: the rounds are accepted for the group, and refused (before any
    communication) for tensors that NCCL carries."""
    with _fake_group("cpu:nccl,cuda:gloo"):
        comm = TorchOwnerComm(reduce_impl="rounds")
    assert comm._backend_of(torch.zeros(1)) == "nccl"
    with pytest.raises(ValueError, match=rf"'nccl'.*{ALTERNATIVES}"):
        comm.reduce_to_owners(torch.zeros(6), [4, 2])
