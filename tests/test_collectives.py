"""``TorchOwnerComm``'s choice of forms, without a real process group: the reduction in rounds
is refused off gloo (see [Note: rounds need gloo]); ``"auto"`` never picks it there; on a
backend that coalesces, a group's broadcasts or reduces are one launch (see [Note: one launch
per group])."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from matrixfsdp.collectives import torch_backend
from matrixfsdp.collectives.torch_backend import TorchOwnerComm, backend_coalesces, reduce_form

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


# -- one launch per group ------------------------------------------------------------------------
@contextmanager
def _coalescing_world(world: int = 4) -> Iterator[list[list[str]]]:
    """Rank 0 of torch's fake process group (its ops move no data, but it coalesces), taken for
    a backend that coalesces; yields, per coalesced block entered, the ops issued inside it."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    blocks: list[list[str]] = []
    inside: list[list[str]] = []
    real_manager = torch_backend._coalescing_manager

    @contextmanager
    def counting_manager(*args: object, **kwargs: object) -> Iterator[object]:
        with real_manager(*args, **kwargs) as launch:
            inside.append([])
            yield launch
        blocks.append(inside.pop())

    def op(name: str, real: object) -> object:
        def issue(*args: object, **kwargs: object) -> object:
            (inside[-1] if inside else outside).append(name)
            return real(*args, **kwargs)  # type: ignore[operator]
        return issue

    outside: list[str] = []
    try:
        with mock.patch.object(torch_backend, "backend_coalesces", return_value=True), \
                mock.patch.object(torch_backend, "_coalescing_manager", counting_manager), \
                mock.patch.object(dist, "broadcast", op("broadcast", dist.broadcast)), \
                mock.patch.object(dist, "reduce", op("reduce", dist.reduce)):
            yield blocks
        assert not outside, f"ops issued outside a coalesced block: {outside}"
    finally:
        dist.destroy_process_group()


def test_broadcasts_and_reduces_are_one_launch_where_the_backend_coalesces() -> None:
    parts = [[torch.ones(3), torch.ones(2)], [], [torch.ones(4)], [torch.ones(5), torch.ones(1)]]
    with _coalescing_world() as blocks:
        comm = TorchOwnerComm(gather_impl="broadcast", reduce_impl="reduce")
        for async_op in (True, False):
            pending = comm.all_gather_into(parts, async_op=async_op)
            assert blocks[-1] == ["broadcast"] * 5  # every owner's every matrix, in one block
            assert len(pending._works) == (1 if async_op else 0)  # the block's one work
            pending.wait()
            _, pending = comm.reduce_to_owners(torch.ones(9), [4, 0, 2, 3], async_op=async_op)
            assert blocks[-1] == ["reduce"] * 3  # the non-empty segments, in one block
            assert len(pending._works) == (1 if async_op else 0)
            pending.wait()
        assert len(blocks) == 4


def test_coalescing_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(torch_backend.COALESCE_ENV, "0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with mock.patch.object(torch_backend, "backend_coalesces", return_value=True):
            comm = TorchOwnerComm(gather_impl="broadcast")
            assert not comm.coalesce
            pending = comm.all_gather_into([[torch.ones(2)], [torch.ones(2)], [], []],
                                           async_op=True)
            assert len(pending._works) == 2  # one broadcast each
        assert TorchOwnerComm(coalesce=True).coalesce
    finally:
        dist.destroy_process_group()


def test_gloo_and_fake_groups_do_not_claim_coalescing() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert not backend_coalesces(None, torch.device("cpu"))  # torch's fake group says so
        assert not backend_coalesces(None, torch.device("meta"))  # no backend for the device
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_one_launch_per_group_on_nccl(tmp_path: Path) -> None:
    """On one GPU: the coalesced forms launch once per call (profiler's ``nccl:coalesced``),
    the one-by-one forms once per op, and both keep the values (see benchmarks/gpu.py §6)."""
    from benchmarks.gpu import SIZES, one_launch_per_group

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        rows = one_launch_per_group(SIZES["tiny"], torch.device("cuda", 0))
    finally:
        dist.destroy_process_group()
    assert len(rows) == 4 and all(row["ok"] for row in rows), rows
