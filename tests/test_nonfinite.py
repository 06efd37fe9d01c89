"""Non-finite steps are skipped on every rank alike and leave no trace (skip_nonfinite=True)."""

from __future__ import annotations

import functools
import logging

import torch
from torch.distributed.tensor import DTensor

import matrixfsdp as mf

from .checks import count_collectives, full_optimizer_state, full_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

BAD_STEP = 2


def _model_and_opt() -> tuple[torch.nn.Module, mf.MatrixOptimizer]:
    torch.manual_seed(0)
    model = TinyTransformer()
    mf.fully_shard_matrix(model)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, weight_decay=0.1, tail_lr=1e-2,
                             tail_weight_decay=0.1, skip_nonfinite=True, ns_dtype="float32")
    return model, opt


def _poison(model: torch.nn.Module, rank: int, where: str, value: float) -> str:
    """Write ``value`` into one gradient element held by ``rank`` (an owned matrix or a tail shard)."""
    state = mf.get_state(model)
    for fqn, p in model.named_parameters():
        is_matrix = fqn in state.params
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if grad is None or grad.numel() == 0 or is_matrix != (where == "matrix"):
            continue
        grad.view(-1)[0] = value
        return fqn
    raise AssertionError(f"rank {rank} holds no {where} gradient to poison")


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"params": full_values(model), "state": full_optimizer_state(model, opt)}


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            _assert_same(x, y, f"{what} {key}")
        else:
            assert (x is None and y is None) or torch.equal(x, y), f"{what}: {key} differs"


def _skip_is_consistent_and_traceless(rank: int, world: int, where: str, value: float,
                                       clip: bool) -> None:
    """One rank's gradient gets inf/NaN: every rank skips; the run equals one without that step."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    optim_logger = logging.getLogger("matrixfsdp.optim.matrix_optimizer")
    optim_logger.addHandler(handler)
    model, opt = _model_and_opt()
    ref, ref_opt = _model_and_opt()
    poisoned_rank = world - 1
    for step in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            if m is ref and step == BAD_STEP:
                continue  # the reference never sees the bad step's batch
            lm_loss(m, local_batch(global_batch(step), rank, world)).backward()
            bad = m is model and step == BAD_STEP
            if bad and rank == poisoned_rank:
                _poison(m, rank, where, value)
            if clip:
                norm = mf.clip_grad_norm_(m, 1.0)
                assert torch.isfinite(norm) != bad, (step, norm)
            if not bad:
                o.step()
                assert not o.last_step_skipped
                o.zero_grad()
                continue
            before = _snapshot(m, o)
            calls = count_collectives(o.step)
            # The decision reuses the clip norm; without clipping it costs one scalar all-reduce.
            assert calls == (0 if clip or world == 1 else 1), calls
            assert o.last_step_skipped and o.skipped_steps == 1
            assert all(p.grad is None for p in m.parameters()), "grads not cleared"
            _assert_same(_snapshot(m, o), before, f"skipped step ({where})")
            o.zero_grad()
    assert opt.skipped_steps == 1 and ref_opt.skipped_steps == 0
    _assert_same(full_values(model), full_values(ref), "params vs the reference")
    _assert_same(full_optimizer_state(model, opt), full_optimizer_state(ref, ref_opt),
                 "optimizer state vs the reference")
    optim_logger.removeHandler(handler)
    if rank == 0:
        assert any("skipped an optimizer step" in r.getMessage() for r in records), records


def _finite_steps_cost_one_scalar(rank: int, world: int) -> None:
    """Without clipping, skip_nonfinite's check is the only optimizer-phase collective."""
    model, opt = _model_and_opt()
    runtime = mf.get_state(model)
    lm_loss(model, local_batch(global_batch(0), rank, world)).backward()
    runtime.comm.counter.reset()
    assert count_collectives(opt.step) == (world > 1)
    stats = runtime.comm.counter.snapshot()["optimizer"]
    assert stats["calls"] == (world > 1) and stats["bytes_sent"] == 4 * (world > 1)
    assert not opt.last_step_skipped and opt.skipped_steps == 0


def _later_backward_invalidates_clip_norm(rank: int, world: int) -> None:
    """A finite norm recorded by clip_grad_norm_ is not reused after another backward: a NaN that
    the second backward brings is seen, and the step is skipped on every rank."""
    model, opt = _model_and_opt()
    tokens = local_batch(global_batch(0), rank, world)
    lm_loss(model, tokens).backward()
    assert torch.isfinite(mf.clip_grad_norm_(model, 1.0))
    loss = lm_loss(model, tokens)
    (loss * (float("nan") if rank == world - 1 else 1.0)).backward()  # accumulates a NaN
    before = _snapshot(model, opt)
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    _assert_same(_snapshot(model, opt), before, "step after a NaN backward")


def _world(rank: int, world: int) -> None:
    cases = {
        "inf_in_owned_matrix_clipped": ("matrix", float("inf"), True),
        "nan_in_tail_shard_unclipped": ("tail", float("nan"), False),
        "inf_in_tail_shard_clipped": ("tail", float("-inf"), True),
    }
    subtests = {name: functools.partial(_skip_is_consistent_and_traceless, rank, world, *args)
                for name, args in cases.items()}
    subtests["later_backward_invalidates_clip_norm"] = functools.partial(
        _later_backward_invalidates_clip_norm, rank, world)
    subtests["finite_steps_cost_one_scalar"] = functools.partial(
        _finite_steps_cost_one_scalar, rank, world)
    run_subtests(rank, subtests)


def test_nonfinite_steps_skipped_on_every_rank() -> None:
    run_world(2, _world)
