"""MatrixOptimizer on owners against single-process references, step by step and free-running.

The references are torch.optim.Muon / AdamW and the float64 formulas of tests/references.py,
never the library's own step functions.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from unittest import mock

import pytest
import torch
from torch import nn

import matrixfsdp as mf
from matrixfsdp.optim import get_matrix_optimizer, matrix_optimizer
from matrixfsdp.optim.owner_step import step_owned

from .checks import (
    FREE_RUNNING_KWARGS,
    assert_close_dicts,
    count_collectives,
    full_optimizer_state,
    full_values,
    reference_values,
)
from .dist_utils import DEVICES, run_subtests, run_world, test_device
from .models import TinyTransformer, global_batch, lm_loss, local_batch
from .references import check_eigenbasis, make_reference

MATRIX_OPTIMIZERS = ["muon", "shampoo", "soap", "okls", "emagram"]
LR = {"muon": 0.02, "shampoo": 0.01, "soap": 0.01, "okls": 0.01, "emagram": 0.01}
FREE_RUNNING_DTYPE = {"soap": torch.float64}


def _pair(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = TinyTransformer().to(dtype)
    return ref, copy.deepcopy(ref)


# Per-step update tolerance against the float64 reference, relative per matrix. The library keeps
# fp32 state: Shampoo / EMA-Gram fp32 eigh roots, SOAP fp32 bases, OKLS fp32 Scaled CANS (~3e-5).
# Measured maxima at worlds 2 and 4: Shampoo 1.4e-5, SOAP 4.1e-6, OKLS 5.1e-5, EMA-Gram 2.0e-5.
UPDATE_RTOL = {"shampoo": 5e-5, "soap": 2e-5, "okls": 1e-4, "emagram": 5e-5}


class ReferenceStepper:
    """Single-process reference: the float64 formulas of tests/references.py per matrix (not the
    library's step functions) and torch's AdamW for the tail.

    Hyperparameters not given are the library config's defaults (data, not math). For SOAP,
    ``library_state()`` returns the library's gathered optimizer state: the step-1 eigenbases
    of rank-deficient factors are arbitrary inside their null spaces, so the reference checks
    the library's choice against its own float64 factors and adopts it.
    """

    def __init__(self, model: nn.Module, matrix_fqns: set[str], name: str, lr: float,
                 kwargs: dict, library_state=None) -> None:
        params = dict(model.named_parameters())
        self.matrices = {f: params[f] for f in matrix_fqns}
        hyper = dataclasses.asdict(get_matrix_optimizer(name).make_config(kwargs))
        self.lr = lr
        self.refs = {}
        for fqn, p in self.matrices.items():
            extra = {}
            if name == "soap":
                extra["pick_basis"] = functools.partial(_library_basis, library_state, fqn)
            self.refs[fqn] = make_reference(name, tuple(p.shape), **hyper, **extra)
        self.tail = torch.optim.AdamW(
            [p for f, p in params.items() if f not in matrix_fqns], lr=1e-2, weight_decay=0.1
        )

    @torch.no_grad()
    def step(self) -> None:
        for fqn, p in self.matrices.items():
            if p.grad is not None:
                # The float64 references compute on the host (their state lives there).
                W = self.refs[fqn].step(p.double().cpu(), p.grad.cpu(), lr=self.lr,
                                        weight_decay=0.1, initial_lr=self.lr)
                p.copy_(W)
        self.tail.step()

    def zero_grad(self) -> None:
        for p in self.matrices.values():
            p.grad = None
        self.tail.zero_grad()


def _library_basis(library_state, fqn, QL, QR, L, R, *, index):
    """The library's step-1 SOAP bases for ``fqn`` (slice ``index`` of a stack), checked."""
    state = library_state()[fqn]
    q_l, q_r = state["Q_L"], state["Q_R"]
    if index is not None:
        q_l, q_r = q_l[index], q_r[index]
    return check_eigenbasis(q_l, L), check_eigenbasis(q_r, R)


def _make_opt(model: nn.Module, name: str, **kwargs) -> mf.MatrixOptimizer:
    return mf.MatrixOptimizer(model, optimizer=name, lr=LR.get(name, 0.02), weight_decay=0.1,
                              tail_lr=1e-2, tail_weight_decay=0.1, **kwargs)


def _load_reference(ref: nn.Module, params: dict, grads: dict) -> None:
    with torch.no_grad():
        for fqn, p in ref.named_parameters():
            p.copy_(params[fqn])
            p.grad = None if grads[fqn] is None else grads[fqn].to(p.device, copy=True)


def _step_by_step(rank: int, world: int, name: str, steps: int = 3) -> None:
    """Each step: reduced grads == full-batch grads (1e-6); the step on the same params and grads
    == the reference's (torch.optim.Muon for Muon; float64 formulas otherwise)."""
    ref, model = _pair()
    mf.fully_shard_matrix(model)
    plan = mf.get_plan(model)
    matrix_fqns = {p.fqn for p in plan.matrices}
    kwargs = FREE_RUNNING_KWARGS.get(name, {}) if name != "muon" else {}
    opt = _make_opt(model, name, batch_same_shape=False, **kwargs)
    library_state = {}
    if name == "muon":  # the reference is torch's own Muon + AdamW
        params = dict(ref.named_parameters())
        ref_matrix = torch.optim.Muon([params[f] for f in sorted(matrix_fqns)], lr=0.02,
                                      weight_decay=0.1)
        ref_tail = torch.optim.AdamW([p for f, p in params.items() if f not in matrix_fqns],
                                     lr=1e-2, weight_decay=0.1)
    else:
        stepper = ReferenceStepper(ref, matrix_fqns, name, LR[name], kwargs, library_state.copy)
    for step in range(steps):
        tokens = global_batch(step)
        before = full_values(model)
        state_before = full_optimizer_state(model, opt) if name == "muon" else {}
        _load_reference(ref, before, {f: None for f in before})
        lm_loss(ref, tokens).backward()
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        grads = full_values(model, "grad")
        assert_close_dicts(grads, reference_values(ref, "grad"), 1e-6, f"{name} step {step} grad")
        _load_reference(ref, before, grads)
        params = dict(ref.named_parameters())
        opt.step()
        if name == "muon":
            for fqn, st in state_before.items():
                target = ref_matrix if fqn in matrix_fqns else ref_tail
                if st:  # host copies: steps stay on the host, as torch.optim keeps them
                    target.state[params[fqn]] = {
                        k: v.clone() if k == "step" else v.to(params[fqn].device, copy=True)
                        for k, v in st.items()}
            ref_matrix.step()
            ref_tail.step()
        else:
            if name == "soap" and step == 0:
                library_state.update(full_optimizer_state(model, opt))
            stepper.step()
        after = full_values(model)
        want = {f: params[f].detach().cpu() - before[f] for f in before}
        got = {f: after[f] - before[f] for f in before}
        tail = [f for f in before if f not in matrix_fqns]
        assert_close_dicts({f: got[f] for f in tail}, {f: want[f] for f in tail}, 1e-6,
                           f"{name} step {step} tail update")
        rtol = 1e-6 if name == "muon" else UPDATE_RTOL[name]
        assert_close_dicts({f: got[f] for f in matrix_fqns}, {f: want[f] for f in matrix_fqns},
                           rtol, f"{name} step {step} matrix update")
        opt.zero_grad()


def _free_running(rank: int, world: int, name: str, steps: int = 10) -> None:
    """10 free-running steps agree with one process stepping the float64 reference within 1e-5."""
    ref, model = _pair(FREE_RUNNING_DTYPE.get(name, torch.float32))
    mf.fully_shard_matrix(model)
    matrix_fqns = {p.fqn for p in mf.get_plan(model).matrices}
    kwargs = FREE_RUNNING_KWARGS.get(name, {})
    opt = _make_opt(model, name, **kwargs)
    library_state = {}
    stepper = ReferenceStepper(ref, matrix_fqns, name, LR[name], kwargs, library_state.copy)
    for step in range(steps):
        tokens = global_batch(step)
        lm_loss(ref, tokens).backward()
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        opt.step()
        if name == "soap" and step == 0:
            library_state.update(full_optimizer_state(model, opt))
        stepper.step()
        stepper.zero_grad()
        opt.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, f"{name} free-running")


def _zero_collectives_and_owner_state(rank: int, world: int, name: str) -> None:
    _, model = _pair()
    mf.fully_shard_matrix(model)
    runtime = mf.get_state(model)
    opt = _make_opt(model, name)
    for step in range(2):
        lm_loss(model, local_batch(global_batch(step), rank, world)).backward()
        runtime.comm.counter.reset()
        assert count_collectives(opt.step) == 0, "the optimizer step communicated"
        assert runtime.comm.counter.snapshot()["optimizer"]["calls"] == 0
        opt.zero_grad()
    expected = 0
    for mp in runtime.params.values():
        if mp.is_owner and mp.requires_grad and "unused" not in mp.fqn:
            assert mp.sharded in opt.state, f"owner lacks state for {mp.fqn}"
            expected += sum(v.numel() * v.element_size() for k, v in opt.state[mp.sharded].items()
                            if k != "step") + 4
        else:
            assert mp.sharded not in opt.state, f"state exists off-owner for {mp.fqn}"
    assert opt.matrix_state_bytes() == expected
    if name == "muon":  # Muon's state is one momentum buffer per owned matrix: m·n·4 bytes
        owned = sum(mp.numel * 4 + 4 for mp in runtime.params.values()
                    if mp.is_owner and "unused" not in mp.fqn)
        assert opt.matrix_state_bytes() == owned
    # Clipping adds exactly one scalar all-reduce (none at world size 1).
    lm_loss(model, local_batch(global_batch(5), rank, world)).backward()
    assert count_collectives(lambda: mf.clip_grad_norm_(model, 1.0)) == (world > 1)


def _clip_matches_reference(rank: int, world: int) -> None:
    for norm_type in (2.0, float("inf")):
        ref, model = _pair()
        mf.fully_shard_matrix(model)
        tokens = global_batch(0)
        lm_loss(ref, tokens).backward()
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type=norm_type)
        got = mf.clip_grad_norm_(model, 0.5, norm_type=norm_type)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        grads = full_values(model, "grad")
        assert_close_dicts(grads, reference_values(ref, "grad"), 1e-6, f"clipped {norm_type}")


def _torch_class_and_scheduler(rank: int, world: int) -> None:
    """torch.optim.Muon as the matrix class equals the built-in Muon; schedulers drive both."""
    _, model_a = _pair()
    _, model_b = _pair()
    mf.fully_shard_matrix(model_a)
    mf.fully_shard_matrix(model_b)
    opt_a = _make_opt(model_a, "muon", batch_same_shape=False)  # as the class: one at a time
    opt_b = mf.MatrixOptimizer(model_b, optimizer=torch.optim.Muon, lr=0.02, weight_decay=0.1,
                               tail_lr=1e-2, tail_weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt_a, opt_b)]
    for step in range(3):
        for model, opt, sched in zip((model_a, model_b), (opt_a, opt_b), scheds, strict=True):
            lm_loss(model, local_batch(global_batch(step), rank, world)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert opt_a.param_groups[0]["lr"] == pytest.approx(0.02 / 4)
    assert opt_a.param_groups[1]["lr"] == pytest.approx(1e-2 / 4)
    assert_close_dicts(full_values(model_b), full_values(model_a), 0.0, "torch.optim.Muon")


def _state_dict_round_trip(rank: int, world: int) -> None:
    _, model_a = _pair()
    mf.fully_shard_matrix(model_a)
    opt_a = _make_opt(model_a, "okls")
    for step in range(2):
        lm_loss(model_a, local_batch(global_batch(step), rank, world)).backward()
        opt_a.step()
        opt_a.zero_grad()
    _, model_b = _pair()
    mf.fully_shard_matrix(model_b)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = _make_opt(model_b, "okls")
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch does not copy tensors
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        lm_loss(model, local_batch(global_batch(7), rank, world)).backward()
        opt.step()
    assert_close_dicts(full_values(model_b), full_values(model_a), 0.0, "resumed")


def _batched_equals_unbatched(rank: int, world: int, name: str) -> None:
    """Stacking same-shape owned matrices into (B, m, n) changes only rounding; batches form."""
    sizes: list[int] = []

    def recording_step_owned(spec, batch, hyper):
        sizes.append(len(batch))
        return step_owned(spec, batch, hyper)

    models, opts = [], []
    for batched in (True, False):
        _, model = _pair()
        mf.fully_shard_matrix(model)
        models.append(model)
        opts.append(_make_opt(model, name, batch_same_shape=batched, **FREE_RUNNING_KWARGS.get(name, {})))
    for step in range(3):
        for model, opt in zip(models, opts, strict=True):
            lm_loss(model, local_batch(global_batch(step), rank, world)).backward()
            if opt.batch_same_shape:
                with mock.patch.object(matrix_optimizer, "step_owned", recording_step_owned):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
    shapes = [tuple(p.shape) for p in opts[0].param_groups[0]["params"] if p in opts[0].state]
    largest = max(sizes, default=0)
    if len(shapes) > len(set(shapes)):  # this rank owns same-shape matrices: they were stacked
        assert largest >= 2, f"rank {rank} owns {shapes} but stepped batches of {sorted(set(sizes))}"
    widest = torch.tensor([largest], device=test_device())
    torch.distributed.all_reduce(widest, op=torch.distributed.ReduceOp.MAX)
    assert widest.item() >= 2, f"no batch formed at world {world}: the test tests nothing"
    assert_close_dicts(full_values(models[0]), full_values(models[1]), 1e-5, f"{name} batched")


def _bad_hyperparameters(rank: int, world: int) -> None:
    _, model = _pair()
    mf.fully_shard_matrix(model)
    with pytest.raises(ValueError, match="lr"):
        mf.MatrixOptimizer(model, "muon", lr=-1.0)
    with pytest.raises(ValueError, match="tail_weight_decay"):
        mf.MatrixOptimizer(model, "muon", tail_weight_decay=-0.1)
    with pytest.raises(ValueError, match="betas"):
        mf.MatrixOptimizer(model, "shampoo", betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="beta1"):
        mf.MatrixOptimizer(model, "okls", beta1=1.5)
    with pytest.raises(ValueError, match="momentum"):
        mf.MatrixOptimizer(model, "muon", momentum=-0.5)
    with pytest.raises(ValueError, match="unknown matrix optimizer 'adafactorx'"):
        mf.MatrixOptimizer(model, "adafactorx")
    with pytest.raises(ValueError, match="does not take"):
        mf.MatrixOptimizer(model, "muon", betas=(0.9, 0.9))


def _world(rank: int, world: int) -> None:
    subtests = {}
    if world > 1:
        for name in MATRIX_OPTIMIZERS:
            subtests[f"step_by_step_{name}"] = functools.partial(_step_by_step, rank, world, name)
    for name in MATRIX_OPTIMIZERS:
        subtests[f"free_running_{name}"] = functools.partial(_free_running, rank, world, name)
    if world > 1:
        for name in ("muon", "okls"):
            subtests[f"zero_collectives_{name}"] = functools.partial(
                _zero_collectives_and_owner_state, rank, world, name
            )
        subtests["clip_matches_reference"] = functools.partial(_clip_matches_reference, rank, world)
        subtests["torch_class_and_scheduler"] = functools.partial(
            _torch_class_and_scheduler, rank, world
        )
        subtests["state_dict_round_trip"] = functools.partial(_state_dict_round_trip, rank, world)
        subtests["bad_hyperparameters"] = functools.partial(_bad_hyperparameters, rank, world)
    for name in MATRIX_OPTIMIZERS:
        subtests[f"batched_{name}"] = functools.partial(_batched_equals_unbatched, rank, world, name)
    run_subtests(rank, subtests)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_matrix_optimizer(device: str, world: int) -> None:
    run_world(world, _world, device=device)
