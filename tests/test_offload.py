"""Optimizer-state offload (``offload_state="cpu"``) and the ``collectives="nvshmem"`` fallback.

On CPU the offload layer runs its real control flow with host-to-host staging copies, so these
tests check exactness (bit for bit against on-device state), the staging bound, checkpoints and
the error paths; ``tests/test_nvshmem.py`` covers the NVSHMEM schedule itself.
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import matrixfsdp as mf
from matrixfsdp.collectives import TorchOwnerComm
from matrixfsdp.collectives.nvshmem_backend import NvshmemOwnerComm
from matrixfsdp.optim import matrix_optimizer_names
from matrixfsdp.optim.offload import HostOffload, OnDevice

from .checks import FREE_RUNNING_KWARGS
from .dist_utils import run_subtests, run_world, test_device
from .models import TinyTransformer, train_steps


def _model(**wrap: object) -> nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer()
    mf.fully_shard_matrix(model, **wrap)
    return model


def _opt(model: nn.Module, name: str, **kwargs: object) -> mf.MatrixOptimizer:
    kwargs = {**FREE_RUNNING_KWARGS.get(name, {}), **kwargs}
    return mf.MatrixOptimizer(model, optimizer=name, lr=0.01, weight_decay=0.1, tail_lr=1e-2,
                              **kwargs)



def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _assert_identical(a: tuple[nn.Module, torch.optim.Optimizer],
                      b: tuple[nn.Module, torch.optim.Optimizer], what: str) -> None:
    """This rank's parameters and optimizer state, bit for bit."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    params_b = dict(model_b.named_parameters())
    for fqn, p in model_a.named_parameters():
        assert torch.equal(_local(p.detach()), _local(params_b[fqn].detach())), f"{what}: {fqn}"
        state_a, state_b = opt_a.state.get(p, {}), opt_b.state.get(params_b[fqn], {})
        assert state_a.keys() == state_b.keys(), f"{what}: state keys of {fqn}"
        for key, value in state_a.items():
            assert torch.equal(_local(value), _local(state_b[key])), f"{what}: {fqn}.{key}"


def _exact_for(rank: int, world: int, name: str) -> None:
    plain, offloaded = _model(), _model()
    opt_plain = _opt(plain, name, batch_same_shape=False)  # CUDA's default batches: rounding
    opt_off = _opt(offloaded, name, offload_state="cpu")
    placement = opt_off._placement
    assert isinstance(placement, HostOffload) and isinstance(opt_plain._placement, OnDevice)
    for step in range(3):
        train_steps(plain, opt_plain, range(step, step + 1), rank, world)
        placement.reset_peaks()
        train_steps(offloaded, opt_off, range(step, step + 1), rank, world)
        owned = [p for p in opt_off.param_groups[0]["params"] if p.numel()]
        # by construction: at most two matrices staged; two when this rank owns two or more
        assert placement.peak_resident == min(2, len(owned)), (placement.peak_resident, len(owned))
        largest = sorted((sum(v.numel() * v.element_size() for k, v in opt_off.state[p].items()
                              if k != "step") for p in owned), reverse=True)
        assert placement.peak_resident_bytes <= sum(largest[:2])
        assert placement.resident == 0 and placement.resident_bytes == 0
    _assert_identical((plain, opt_plain), (offloaded, opt_off), f"offload {name}")
    for p in opt_off.param_groups[0]["params"]:  # state_dict() sees the host tensors
        for key, value in opt_off.state.get(p, {}).items():
            assert value.device.type == "cpu", key


def _checkpoint_round_trip(rank: int, world: int, root: str) -> None:
    model = _model()
    opt = _opt(model, "okls", offload_state="cpu")
    train_steps(model, opt, range(2), rank, world)
    path = Path(root) / "offload_ckpt"
    mf.checkpoint.save(path, model, opt, step=2)
    resumed = _model()
    opt_resumed = _opt(resumed, "okls", offload_state="cpu")
    mf.checkpoint.load(path, resumed, opt_resumed)
    _assert_identical((model, opt), (resumed, opt_resumed), "after load")
    on_device = _model()  # the same checkpoint loads into an optimizer without offload
    opt_on_device = _opt(on_device, "okls", batch_same_shape=False)
    mf.checkpoint.load(path, on_device, opt_on_device)
    for m, o in ((model, opt), (resumed, opt_resumed), (on_device, opt_on_device)):
        train_steps(m, o, range(2, 4), rank, world)
    _assert_identical((model, opt), (resumed, opt_resumed), "resumed with offload")
    _assert_identical((model, opt), (on_device, opt_on_device), "resumed without offload")


def _state_dict_round_trip(rank: int, world: int) -> None:
    model = _model()
    opt = _opt(model, "soap", offload_state="cpu")
    train_steps(model, opt, range(2), rank, world)
    other = _model()
    other.load_state_dict(model.state_dict())
    opt_other = _opt(other, "soap", offload_state="cpu")
    opt_other.load_state_dict(copy.deepcopy(opt.state_dict()))
    train_steps(model, opt, range(2, 3), rank, world)
    train_steps(other, opt_other, range(2, 3), rank, world)
    _assert_identical((model, opt), (other, opt_other), "state_dict round trip")


def _bad_offload_arguments(rank: int, world: int) -> None:
    model = _model()
    with pytest.raises(ValueError, match="offload_state must be None or 'cpu'"):
        _opt(model, "muon", offload_state="gpu")
    with pytest.raises(ValueError, match="batch_same_shape=False"):
        _opt(model, "muon", offload_state="cpu", batch_same_shape=True)
    with pytest.raises(NotImplementedError, match=r"torch\.optim class"):
        mf.MatrixOptimizer(model, optimizer=torch.optim.SGD, offload_state="cpu")
    assert _opt(model, "muon", offload_state="cpu").batch_same_shape is False


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _nvshmem_falls_back(rank: int, world: int) -> None:
    handler = _Records()
    log = logging.getLogger("matrixfsdp.collectives.nvshmem_backend")
    log.addHandler(handler)
    try:
        model = _model(collectives="nvshmem")
    finally:
        log.removeHandler(handler)
    nvshmem_lines = [m for m in handler.messages if "nvshmem" in m]
    state = mf.get_state(model)
    assert all(g.comm is state.comm for g in state.groups)
    if test_device().type == "cuda" and isinstance(state.comm, NvshmemOwnerComm):
        assert nvshmem_lines == [], nvshmem_lines  # it runs here: nothing to report
    else:
        assert len(nvshmem_lines) == 1, handler.messages
        reason = {"cpu": "CUDA is not available" if not torch.cuda.is_available()
                  else "not on CUDA", "cuda": "nvshmem4py is not importable"}
        assert reason[test_device().type] in nvshmem_lines[0], nvshmem_lines[0]
        assert isinstance(state.comm, TorchOwnerComm)
    auto = _model()
    assert isinstance(mf.get_state(auto).comm, TorchOwnerComm)  # "auto" never picks NVSHMEM
    opts = [_opt(m, "muon") for m in (model, auto)]
    for m, o in zip((model, auto), opts, strict=True):
        train_steps(m, o, range(2), rank, world)
    _assert_identical((model, opts[0]), (auto, opts[1]), "nvshmem fallback")
    with pytest.raises(ValueError, match="'nvshmem'"):
        _model(collectives="shmem")


def _world(rank: int, world: int, root: str) -> None:
    subtests = {f"exact_{name}": functools.partial(_exact_for, rank, world, name)
                for name in matrix_optimizer_names()}
    subtests["checkpoint_round_trip"] = functools.partial(_checkpoint_round_trip, rank, world, root)
    subtests["state_dict_round_trip"] = functools.partial(_state_dict_round_trip, rank, world)
    subtests["bad_offload_arguments"] = functools.partial(_bad_offload_arguments, rank, world)
    subtests["nvshmem_falls_back"] = functools.partial(_nvshmem_falls_back, rank, world)
    run_subtests(rank, subtests)


@pytest.mark.parametrize(("device", "world"), [
    ("cpu", 2), pytest.param("cuda", 1, marks=pytest.mark.gpu),
    pytest.param("cuda", 2, marks=pytest.mark.gpu)])
def test_offload_and_nvshmem_fallback(tmp_path: Path, device: str, world: int) -> None:
    run_world(world, _world, str(tmp_path), device=device)
