"""``MatrixOptimizer.zero_grad`` clears gradients held for accumulation (sync off).

A step abandoned mid-accumulation (a NaN loss, a skipped batch): micro-batches ran with gradient
sync off, then ``opt.zero_grad()``, then a synced backward. Its gradients must be that backward's
alone, matrices and FSDP2 tail alike, with fp32 compute and under bf16 mixed precision (where the
matrices hold fp32 accumulators). Stock FSDP2 keeps held gradients across ``zero_grad`` and
leaks them into the next reduction (see [Note: zero_grad and held gradients] in
``runtime/state.py``); a plain ``torch.optim`` optimizer drops them with
``get_state(model).discard_held_grads()``. World 2, gloo, against one process.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf

from .checks import assert_close_dicts, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch
from .test_mixed_precision import _local_bf16_grads, _mean

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _expected(ref: torch.nn.Module, tokens: torch.Tensor, world: int, bf16: bool) -> dict:
    """One synced backward on ``tokens``: the ranks' mean gradient, computed on one process."""
    if bf16:  # every rank's bf16 backward replayed, reduced in fp32
        return _mean([_local_bf16_grads(ref, local_batch(tokens, r, world)) for r in range(world)],
                     torch.float32)
    ref = copy.deepcopy(ref)
    (sum(lm_loss(ref, local_batch(tokens, r, world)) for r in range(world)) / world).backward()
    return reference_values(ref, "grad")


def _abandoned_accumulation(rank: int, world: int, bf16: bool, plain_optimizer: bool) -> None:
    torch.manual_seed(0)
    ref = TinyTransformer(dim=16, hidden=40, layers=2)
    model = mf.fully_shard_matrix(copy.deepcopy(ref), mp_policy=BF16 if bf16 else None)
    state = mf.get_state(model)
    if plain_optimizer:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = mf.MatrixOptimizer(model, "muon", ns_dtype="float32")
    mf.set_requires_gradient_sync(model, False)
    for m in range(2):  # two micro-batches of a step that is then abandoned
        lm_loss(model, local_batch(global_batch(50 + m), rank, world)).backward()
    held = [mp for mp in state.params.values()
            if mp.unsharded.grad is not None or mp.accumulated_grad is not None]
    assert held, "no matrix holds an accumulated gradient: the test would prove nothing"
    opt.zero_grad()
    if plain_optimizer:  # torch.optim's zero_grad keeps FSDP2's semantics: drop them explicitly
        assert state.discard_held_grads()
    left = [mp.fqn for mp in held if mp.unsharded.grad is not None or mp.accumulated_grad is not None]
    mf.set_requires_gradient_sync(model, True)
    tokens = global_batch(0)
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    want = _expected(ref, tokens, world, bf16)
    assert_close_dicts(full_values(model, "grad"), want, 1e-6, "gradient after zero_grad")
    assert not left, f"zero_grad left held gradients of {left}"
    opt.step()  # the next step trains normally
    opt.zero_grad()


def _world(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    run_subtests(rank, {
        "fp32": functools.partial(_abandoned_accumulation, rank, world, False, False),
        "bf16 compute, fp32 reduce": functools.partial(_abandoned_accumulation, rank, world,
                                                       True, False),
        "torch.optim + discard_held_grads": functools.partial(_abandoned_accumulation, rank,
                                                              world, True, True),
    })


def test_zero_grad_drops_abandoned_accumulation() -> None:
    run_world(2, _world)
