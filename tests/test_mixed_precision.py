"""Mixed precision: matrices gathered and computed in bf16, fp32 masters and reductions on owners."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf

from .checks import assert_close_dicts, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _pair():
    torch.manual_seed(0)
    ref = TinyTransformer()
    return ref, copy.deepcopy(ref)


def _grads_within_bf16_tolerance(rank: int, world: int) -> None:
    ref, model = _pair()
    mf.fully_shard_matrix(model, mp_policy=BF16)
    state = mf.get_state(model)
    masters = {fqn: mp.sharded.detach().clone() for fqn, mp in state.params.items() if mp.is_owner}
    for mp in state.params.values():
        assert mp.sharded.dtype == torch.float32 and mp.unsharded.dtype == torch.bfloat16
        assert not mp.pins_owner_storage  # a cast copy is gathered, the master stays fp32
    tokens = global_batch(0)
    loss = lm_loss(model, local_batch(tokens, rank, world))
    assert loss.dtype == torch.bfloat16
    loss.backward()
    for fqn, master in masters.items():  # forward/backward never round the fp32 master
        mp = state.params[fqn]
        assert torch.equal(mp.sharded.detach(), master), f"{fqn} master changed"
        if mp.sharded.grad is not None:
            assert mp.sharded.grad.dtype == torch.float32, fqn
    got = full_values(model, "grad")
    # Reference 1: the same semantics on one process (bf16 parameters and compute).
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    lm_loss(ref16, tokens).backward()
    want16 = {k: None if v is None else v.float() for k, v in reference_values(ref16, "grad").items()}
    assert_close_dicts(got, want16, 3e-2, "bf16 grad vs bf16 reference")
    # Reference 2: single-process autocast (fp32 parameters, bf16 matmuls).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto_loss = lm_loss(ref, tokens)
    auto_loss.backward()
    assert_close_dicts(got, reference_values(ref, "grad"), 6e-2, "bf16 grad vs autocast")


def _masters_keep_fp32_precision(rank: int, world: int) -> None:
    _, model = _pair()
    mf.fully_shard_matrix(model, mp_policy=BF16)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, tail_lr=1e-2)
    for step in range(3):
        lm_loss(model, local_batch(global_batch(step), rank, world)).backward()
        opt.step()
        opt.zero_grad()
    state = mf.get_state(model)
    for mp in state.params.values():
        if mp.is_owner:
            master = mp.sharded.detach()
            assert master.dtype == torch.float32
            assert not torch.equal(master, master.bfloat16().float()), f"{mp.fqn} lost fp32 bits"
            assert mp.unsharded.untyped_storage().nbytes() == 0, f"{mp.fqn} cast copy not freed"
    loss = lm_loss(model, local_batch(global_batch(9), rank, world))
    assert torch.isfinite(loss)


def _world(rank: int, world: int) -> None:
    run_subtests(rank, {
        "grads_within_bf16_tolerance": functools.partial(_grads_within_bf16_tolerance, rank, world),
        "masters_keep_fp32_precision": functools.partial(_masters_keep_fp32_precision, rank, world),
    })


@pytest.mark.parametrize("world", [1, 2])
def test_mixed_precision(world: int) -> None:
    run_world(world, _world)
