"""torchtitan 0.3.0's Llama3 debug model wrapped with ``fully_shard_matrix``'s defaults.

Its layers are a ``ModuleDict`` subclass and attention a fused ``wqkv``; on CPU each layer's inner
attention is torchtitan's ``ScaledDotProductAttention`` (see ``tests/titan_models.py``). At world
2: every ``wqkv``/``wo``/``w1``/``w2``/``w3`` weight is selected by default, 3 free-running Muon
steps equal one process, and ``set_gradient_divide_factor(1.0)`` on every FSDPModule with
torchtitan's loss rescaling (sum over local tokens / global token count) gives the matrices the
same gradients as the tail and as FSDP2 itself. Skipped when torchtitan is not installed
(``pip install -e '.[torchtitan]'``).
"""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import matrixfsdp as mf

from .checks import _whole, assert_close_dicts, full_values, reference_values
from .dist_utils import run_subtests, run_world

pytest.importorskip("torchtitan")
from .titan_models import (
    LR,
    MUON,
    TAIL,
    TAIL_LR,
    WD,
    MuonReference,
    batch,
    build_llama3,
    expected_matrices,
    shard,
    token_loss,
)

VOCAB = 2048  # the debug model's
# Measured at world 2, 3 free-running steps (largest relative error over all parameters):
# gradients 1.5e-7 / 1.4e-6 / 2.2e-6 (steps 2 and 3 start from parameters already apart),
# parameters 1.1e-6 / 1.7e-6 / 1.9e-6 after each step.
GRAD_RTOL = 1e-6  # one backward from equal parameters
STEP_GRAD_RTOL = 1e-5
PARAM_RTOL = 1e-5
logger = logging.getLogger(__name__)


def _max_error(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]
               ) -> float:
    """The largest relative error ‖got − want‖ / ‖want‖ over the parameters."""
    assert got.keys() == want.keys()
    worst = 0.0
    for fqn, w in want.items():
        g = got[fqn]
        assert (g is None) == (w is None), fqn
        if w is not None:
            worst = max(worst, ((g.double() - w.double()).norm() / w.double().norm()).item())
    return worst


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _selection(ref: nn.Module, model: nn.Module) -> None:
    want = expected_matrices(ref)
    assert len(want) == 5 * len(ref.layers) == 30
    selection = mf.get_plan(model).selection()
    assert set(selection.matrices) == want, set(selection.matrices) ^ want
    assert not selection.stacks
    # Every block is its own unit: six groups with matrices plus the root.
    assert {g.name for g in mf.get_state(model).groups} >= {f"layers.{i}" for i in range(6)}


def _muon_steps(rank: int, world: int, ref: nn.Module, model: nn.Module) -> None:
    reference = MuonReference(ref, expected_matrices(ref))
    opt = mf.MatrixOptimizer(model, "muon", lr=LR, weight_decay=WD, tail_lr=TAIL_LR,
                             tail_weight_decay=WD, tail_optimizer_kwargs=TAIL, **MUON)
    for step in range(3):  # free-running: each side from its own parameters
        tokens = batch(step, VOCAB)
        token_loss(ref, tokens).backward()
        token_loss(model, shard(tokens, rank, world)).backward()
        grad_err = _max_error(full_values(model, "grad"), reference_values(ref, "grad"))
        reference.step()
        opt.step()
        opt.zero_grad()
        param_err = _max_error(full_values(model), reference_values(ref))
        logger.info("step %d: grad %.2e, params %.2e", step + 1, grad_err, param_err)
        assert grad_err <= STEP_GRAD_RTOL, f"grads of step {step + 1}: {grad_err:.2e}"
        assert param_err <= PARAM_RTOL, f"params after step {step + 1}: {param_err:.2e}"


def _divide_factor(rank: int, world: int, ref: nn.Module) -> None:
    """torchtitan's reduction: ``set_gradient_divide_factor(1.0)`` everywhere, loss divided by
    the global token count. Matrices, tail and FSDP2's own tail all get the global-mean gradient."""
    model = mf.fully_shard_matrix(copy.deepcopy(ref))
    fsdp2 = copy.deepcopy(ref)
    for block in fsdp2.layers.values():
        fully_shard(block)
    fully_shard(fsdp2)
    for m in (*_units(model), *_units(fsdp2)):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    tokens = batch(7, VOCAB)
    ref.zero_grad()
    token_loss(ref, tokens).backward()
    want = reference_values(ref, "grad")
    global_tokens = tokens[:, 1:].numel()
    for m in (model, fsdp2):
        token_loss(m, shard(tokens, rank, world), global_tokens).backward()
    theirs = {n: _whole(p.grad) for n, p in fsdp2.named_parameters()}
    assert_close_dicts(theirs, want, GRAD_RTOL, "FSDP2 grad")
    ours = full_values(model, "grad")
    assert_close_dicts(ours, want, GRAD_RTOL, "grad")
    for fqn in expected_matrices(ref):  # a sum over the ranks, exactly as FSDP2's
        torch.testing.assert_close(ours[fqn], theirs[fqn], rtol=1e-6, atol=0)


def _world(rank: int, world: int) -> None:
    ref = build_llama3("debugmodel")
    model = mf.fully_shard_matrix(copy.deepcopy(ref))
    run_subtests(rank, {
        "selection": functools.partial(_selection, ref, model),
        "muon": functools.partial(_muon_steps, rank, world, ref, model),
        "divide_factor": functools.partial(_divide_factor, rank, world, ref),
    })


def test_llama3_debugmodel_world2() -> None:
    run_world(2, _world)
