"""Stream discipline and host synchronisations of the runtime (see [Note: streams]).

The eager (CUDA) control flow runs on CPU under ``tests/stream_check.py``'s happens-before
checker against a one-process reference; mutations that break one rule each must be caught, so
the checker is shown to have teeth. Host synchronisations are counted by construction.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from torch import nn

import matrixfsdp as mf
from matrixfsdp.devices import CudaOps, HostOps
from matrixfsdp.runtime import streams as runtime_streams

from .checks import assert_close_dicts, full_values, reference_values
from .dist_utils import run_subtests, run_world, test_device
from .models import TinyTransformer, global_batch, lm_loss, local_batch
from .stream_check import CheckedOps, checked_comms, checking, count_host_syncs


def _wrapped(**wrap: object) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = TinyTransformer(layers=3)
    model = copy.deepcopy(ref)
    mf.fully_shard_matrix(model, **wrap)
    return ref, model


def race_free_training(rank: int, world: int, *, steps: int = 2, mesh: object = None,
                       micro: int = 1, keep_reducing: bool = False, **wrap: object) -> CheckedOps:
    """SGD steps on the eager stream path under the checker; equal to one process; no race.

    ``micro`` micro-batches per step with gradient sync off for all but the last, or with
    ``keep_reducing`` (HSDP) reductions on and only the replicas' all-reduce off.
    """
    ref, model = _wrapped(mesh=mesh, **wrap)
    state = mf.get_state(model)
    ops = CheckedOps()
    checked_comms(state, ops)
    assert state.streams.eager and state.streams.gather != state.streams.reduce
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ranks, me = (world, rank) if mesh is None else (mesh.size(), mesh.get_rank())
    for step in range(steps):
        tokens = global_batch(step)
        for m in range(micro):  # the reference sees every rank's micro-batch m at once
            rows = [local_batch(local_batch(tokens, r, ranks), m, micro) for r in range(ranks)]
            lm_loss(ref, torch.cat(rows)).backward()
        local = local_batch(tokens, me, ranks)
        with checking(ops):
            for m in range(micro):
                if keep_reducing:
                    mf.set_requires_all_reduce(model, m == micro - 1)
                else:
                    mf.set_requires_gradient_sync(model, m == micro - 1)
                lm_loss(model, local_batch(local, m, micro)).backward()
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    assert not ops.violations, ops.violations
    for stream in (state.streams.gather, state.streams.reduce):
        assert ops.accesses.get(stream, 0) > 0, (stream, ops.accesses)
    if state.mesh_shape[0] > 1:
        assert ops.accesses.get(state.streams.all_reduce, 0) > 0, ops.accesses
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, "param")
    return ops


def _one_backward_violations(rank: int, world: int, mesh: object = None) -> list[str]:
    _, model = _wrapped(mesh=mesh)
    ops = CheckedOps()
    checked_comms(mf.get_state(model), ops)
    ranks, me = (world, rank) if mesh is None else (mesh.size(), mesh.get_rank())
    with checking(ops):
        lm_loss(model, local_batch(global_batch(0), me, ranks)).backward()
        mf.quiesce(model)
    return ops.violations


def _catches(rank: int, world: int, patch: object, expected: str, mesh: object = None) -> None:
    with patch:
        violations = _one_backward_violations(rank, world, mesh)
    assert any(expected in v for v in violations), violations


def _checker_has_teeth(rank: int, world: int) -> None:
    inflight = runtime_streams.InFlight

    def finish_without_wait(self: object) -> object:
        return self.complete()

    # Streams are named in creation order: side0 gather, side1 reduce, side2 all-reduce.
    # Compute reads the gathered matrices without waiting for the copy-out.
    _catches(rank, world, mock.patch.object(inflight, "finish", finish_without_wait),
             "races the write on side0")
    # An episode that does not wait for compute reads gradients and values not yet produced.
    _catches(rank, world, mock.patch.object(CheckedOps, "stream_waits_current",
                                            lambda self, stream: None), "races the write on compute")
    # Packed gradients dropped while the reduce stream reads them, without record_stream.
    _catches(rank, world, mock.patch.object(CheckedOps, "keep_until_done",
                                            lambda self, tensor, stream: None), "was freed while side1")


def hsdp_checker_has_teeth(rank: int, world: int, mesh: object) -> None:
    """The owned segment dropped while the all-reduce stream sums it, without record_stream."""
    keep = CheckedOps.keep_until_done

    def keep_but_all_reduce(self: CheckedOps, tensor: torch.Tensor, stream: str) -> None:
        if stream != "side2":
            keep(self, tensor, stream)

    _catches(rank, world, mock.patch.object(CheckedOps, "keep_until_done", keep_but_all_reduce),
             "was freed while side2", mesh)


def _is_step_counter(opt: torch.optim.Optimizer, t: torch.Tensor) -> bool:
    """Optimizer step counters: host tensors on every device, as torch.optim keeps them."""
    return t.device.type == "cpu" and any(s.get("step") is t for s in opt.state.values())


def _host_syncs(rank: int, world: int, *, checked: bool) -> None:
    """One synchronisation per backward (the presence flags), one per step (skip_nonfinite).

    ``checked``: the eager stream path under ``CheckedOps`` (CPU); else the device's own
    ``DeviceOps`` (the host stand-in on CPU, real streams on CUDA).
    """
    _, model = _wrapped()
    state = mf.get_state(model)
    if checked:
        checked_comms(state, CheckedOps())
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, skip_nonfinite=True)
    owns = bool(state.groups) and any(g.trainable_by[state.comm.rank] for g in state.groups)
    for step in range(3):
        loss = lm_loss(model, local_batch(global_batch(step), rank, world))
        with count_host_syncs() as backward:
            loss.backward()
        with count_host_syncs() as clip:
            mf.clip_grad_norm_(model, 1e9, norm_type=float("inf"))  # no Python max over tensors
            mf.clip_grad_norm_(model, 1.0)
        with count_host_syncs(functools.partial(_is_step_counter, opt)) as stepping:
            opt.step()
            opt.zero_grad()
        assert len(backward) == (1 if owns else 0), (step, backward)
        assert clip == [], clip
        assert len(stepping) == 1, (step, stepping)  # the skip decision: bool(isfinite(norm))
    if not checked:
        expected = CudaOps if test_device().type == "cuda" else HostOps
        assert type(state.streams.ops) is expected and state.streams.eager == expected.overlaps


def _world(rank: int, world: int) -> None:
    run_subtests(rank, {
        "race_free": functools.partial(race_free_training, rank, world),
        "race_free_no_reshard_two_micro": functools.partial(
            race_free_training, rank, world, reshard_after_forward=False, micro=2),
        "race_free_p2p_checkpointing": functools.partial(
            race_free_training, rank, world, steps=1, collectives="p2p"),
        "checker_has_teeth": functools.partial(_checker_has_teeth, rank, world),
        "host_syncs_host_path": functools.partial(_host_syncs, rank, world, checked=False),
        "host_syncs_eager_path": functools.partial(_host_syncs, rank, world, checked=True),
    })


def test_streams_and_host_syncs() -> None:
    run_world(2, _world)


@contextlib.contextmanager
def _cuda_syncs() -> Iterator[list[str]]:
    """Synchronising CUDA calls torch reports (``set_sync_debug_mode``), also from C++."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            calls: list[str] = []
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        calls.extend(str(w.message).splitlines()[0] for w in caught
                     if "synchroniz" in str(w.message))


def _cuda_sync_debug(rank: int, world: int) -> None:
    """The same bound as torch's own sync detector sees it (after a warm-up step)."""
    _, model = _wrapped()
    state = mf.get_state(model)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, skip_nonfinite=True)
    owns = any(g.trainable_by[state.comm.rank] for g in state.groups)
    for step in range(3):
        loss = lm_loss(model, local_batch(global_batch(step), rank, world))
        with _cuda_syncs() as backward:
            loss.backward()
        with _cuda_syncs() as stepping:
            mf.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
        if step:
            assert len(backward) <= (1 if owns else 0), (step, backward)
            assert len(stepping) <= 1, (step, stepping)


def _world_on_device(rank: int, world: int) -> None:
    run_subtests(rank, {
        "host_syncs": functools.partial(_host_syncs, rank, world, checked=False),
        "cuda_sync_debug": functools.partial(_cuda_sync_debug, rank, world),
    })


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_host_syncs_on_cuda(world: int) -> None:
    """The real stream path: the same bound (run it under TORCH_CUDA_SANITIZER=1 as well)."""
    run_world(world, _world_on_device, device="cuda")
