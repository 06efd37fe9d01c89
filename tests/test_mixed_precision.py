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
from .models import TinyTransformer, global_batch, lm_loss, local_batch, train_steps

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
    # Reference 1, exact: every rank's bf16 forward/backward replayed on one process, each local
    # gradient cast to fp32, summed and averaged in fp32. Only the fp32 summation order may differ.
    local = [_local_bf16_grads(ref, local_batch(tokens, r, world)) for r in range(world)]
    want = _mean(local, torch.float32)
    assert_close_dicts(got, want, 1e-6, "bf16 grads reduced in fp32")
    if world > 1:  # the check above can tell an fp32 reduction from a bf16 one
        bf16_reduced = _mean([{k: _bf16(v) for k, v in g.items()} for g in local], torch.bfloat16)
        with pytest.raises(AssertionError, match="relative error"):
            assert_close_dicts(bf16_reduced, want, 100 * 1e-6, "bf16 reduction")
    # Reference 2: single-process autocast (fp32 parameters, bf16 matmuls): the same semantics.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto_loss = lm_loss(ref, tokens)
    auto_loss.backward()
    assert_close_dicts(got, reference_values(ref, "grad"), 6e-2, "bf16 grad vs autocast")


def _bf16(t):
    return None if t is None else t.bfloat16()


def _local_bf16_grads(ref: torch.nn.Module, tokens: torch.Tensor) -> dict:
    """fp32 copies of the gradients a bf16 copy of ``ref`` computes on ``tokens``."""
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    lm_loss(ref16, tokens).backward()
    return {k: None if v is None else v.float() for k, v in reference_values(ref16, "grad").items()}


def _mean(grads: list[dict], dtype: torch.dtype) -> dict:
    """Sum in ``dtype`` (rounding after every add), divide by the count, return fp32."""
    out = {}
    for key in grads[0]:
        if grads[0][key] is None:
            out[key] = None
            continue
        total = grads[0][key].to(dtype)
        for g in grads[1:]:
            total = total + g[key].to(dtype)
        out[key] = (total / len(grads)).float()
    return out


def _masters_keep_fp32_precision(rank: int, world: int) -> None:
    _, model = _pair()
    mf.fully_shard_matrix(model, mp_policy=BF16)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, tail_lr=1e-2)
    train_steps(model, opt, range(3), rank, world)
    state = mf.get_state(model)
    for mp in state.params.values():
        if mp.is_owner:
            master = mp.sharded.detach()
            assert master.dtype == torch.float32
            assert not torch.equal(master, master.bfloat16().float()), f"{mp.fqn} lost fp32 bits"
            assert mp.unsharded.untyped_storage().nbytes() == 0, f"{mp.fqn} cast copy not freed"
    loss = lm_loss(model, local_batch(global_batch(9), rank, world))
    assert torch.isfinite(loss)


MICRO = 32  # micro-batches of one accumulated step


def _accumulated_reference(ref: torch.nn.Module, world: int, dtype: torch.dtype) -> dict:
    """Every rank's bf16 backward of every micro-batch replayed on one process, each gradient
    accumulated in ``dtype`` (rounding after every add), averaged over ranks in float64."""
    out: dict = {}
    for r in range(world):
        ref16 = copy.deepcopy(ref).to(torch.bfloat16)
        total: dict = {}
        for m in range(MICRO):
            (lm_loss(ref16, local_batch(global_batch(m), r, world)) / MICRO).backward()
            for fqn, p in ref16.named_parameters():
                if p.grad is not None:
                    total[fqn] = p.grad.to(dtype) + total[fqn] if fqn in total else p.grad.to(dtype)
                    p.grad = None
        for fqn, g in total.items():
            out[fqn] = out.get(fqn, 0) + g.double() / world
    return out


def _relative_errors(got: dict, want: dict) -> dict[str, float]:
    return {f: ((got[f].double() - w).norm() / w.norm()).item() for f, w in want.items()}


def _accumulation_pair(layout: str):
    """A reference and its wrapped bf16 copy: flat data parallel, HSDP 2 x 2, or EP (efsdp 2 x
    ep 2, expert stacks Shard(0) over ep)."""
    if layout == "ep":
        from .test_ep import ep_pair

        return ep_pair("efsdp2_ep2", mp_policy=BF16)
    ref, model = _pair()
    mesh = None
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    mf.fully_shard_matrix(model, mesh, mp_policy=BF16)
    return ref, model


def _accumulated(parts: list[dict], dtype: torch.dtype) -> dict:
    """The sum of ``parts`` (one gradient dict per micro-batch) accumulated in ``dtype``."""
    total: dict = {}
    for part in parts:
        for fqn, g in part.items():
            if g is not None:
                total[fqn] = g.to(dtype) + total[fqn] if fqn in total else g.to(dtype)
    return {fqn: g.double() for fqn, g in total.items()}


def _synced_every_micro(layout: str, rank: int, world: int) -> list[dict]:
    """The same wrapped model reducing every micro-batch: each one's averaged gradient (fp32)."""
    _, model = _accumulation_pair(layout)
    parts = []
    for m in range(MICRO):
        (lm_loss(model, local_batch(global_batch(m), rank, world)) / MICRO).backward()
        parts.append(full_values(model, "grad"))
        model.zero_grad(set_to_none=True)
    return parts


def _accumulation_in_reduce_dtype(rank: int, world: int, layout: str) -> None:
    """32 micro-batches with gradient sync off, bf16 compute, fp32 reduce_dtype: the matrices'
    gradients accumulate in fp32 as FSDP2's do (see [Note: accumulation in reduce_dtype]), so
    they match a float64-accumulated reference as closely as the FSDP2 tail's gradients do.

    Under EP an expert's bf16 gradient comes from every ep peer's tokens in one product, which a
    process replaying rank by rank rounds differently (9e-4 here, whatever the accumulation): its
    reference is the same model reducing every micro-batch, the fp32 results summed in float64.
    """
    ref, model = _accumulation_pair(layout)
    state = mf.get_state(model)
    for m in range(MICRO):
        mf.set_requires_gradient_sync(model, m == MICRO - 1)
        (lm_loss(model, local_batch(global_batch(m), rank, world)) / MICRO).backward()
        if m == 0:  # the no-sync backward moves each bf16 gradient into an fp32 accumulator
            held = [(mp.unsharded.grad, getattr(mp, "accumulated_grad", None))
                    for mp in state.params.values()]
    assert all(leaf is None for leaf, _ in held)
    assert {acc.dtype for _, acc in held if acc is not None} == {torch.float32}
    got = full_values(model, "grad")
    if layout == "ep":
        parts = _synced_every_micro(layout, rank, world)
        want, in_bf16 = _accumulated(parts, torch.float64), _accumulated(parts, torch.bfloat16)
    else:
        want = _accumulated_reference(ref, world, torch.float64)
        in_bf16 = _accumulated_reference(ref, world, torch.bfloat16)
    errors = _relative_errors(got, want)
    matrix = max(e for f, e in errors.items() if f in state.params)
    tail = max(e for f, e in errors.items() if f not in state.params)
    assert matrix <= max(2 * tail, 1e-6), f"matrices err by {matrix:.2e}, the FSDP2 tail {tail:.2e}"
    # The check can tell: gradients accumulated in bf16 (the leaf's dtype) err by far more.
    bf16 = _relative_errors(in_bf16, want)
    assert min(bf16[f] for f in state.params if f in bf16) > 100 * max(matrix, tail), bf16


def _world(rank: int, world: int) -> None:
    run_subtests(rank, {
        "grads_within_bf16_tolerance": functools.partial(_grads_within_bf16_tolerance, rank, world),
        "masters_keep_fp32_precision": functools.partial(_masters_keep_fp32_precision, rank, world),
    })


def _accumulation_world(rank: int, world: int, layouts: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    run_subtests(rank, {f"accumulation in reduce_dtype, {layout}": functools.partial(
        _accumulation_in_reduce_dtype, rank, world, layout) for layout in layouts})


@pytest.mark.parametrize("world", [1, 2])
def test_mixed_precision(world: int) -> None:
    run_world(world, _world)


@pytest.mark.parametrize(("world", "layouts"), [(2, ("flat",)), (4, ("hsdp", "ep"))])
def test_accumulation_in_reduce_dtype(world: int, layouts: tuple[str, ...]) -> None:
    run_world(world, _accumulation_world, layouts)
