"""FSDPModule methods on a wrapped model drive the matrices, with FSDP2's meaning on the same model."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining.stage import _PipelineStageBase

import matrixfsdp as mf
from matrixfsdp.collectives import Phase

from .checks import _whole, assert_close_dicts, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

GRAD_RTOL = 1e-6


def _models(**kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = TinyTransformer()
    model = copy.deepcopy(ref)
    mf.fully_shard_matrix(model, **kwargs)
    return ref, model


def _fsdp2(ref: nn.Module) -> nn.Module:
    """FSDP2 itself on the same model: every block, then the root."""
    model = copy.deepcopy(ref)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def _fsdp2_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else _whole(p.grad) for n, p in model.named_parameters()}


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


# -- set_gradient_divide_factor --------------------------------------------------------------------
def _divide_factor(rank: int, world: int, tail_units: str) -> None:
    """torchtitan's call (1.0 on every FSDPModule): gradients are sums, matrices and tail alike."""
    ref, model = _models(tail_units=tail_units)
    fsdp2 = _fsdp2(ref)
    for m in (*_units(model), *_units(fsdp2)):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    tokens = global_batch(0)
    lm_loss(ref, tokens).backward()
    for m in (model, fsdp2):
        lm_loss(m, local_batch(tokens, rank, world)).backward()
    summed = {k: None if v is None else v * world for k, v in reference_values(ref, "grad").items()}
    ours = full_values(model, "grad")
    assert_close_dicts(_fsdp2_grads(fsdp2), summed, GRAD_RTOL, "fsdp2 grad")
    assert_close_dicts(ours, summed, GRAD_RTOL, "grad")
    # Another factor: sum / 3 everywhere.
    for m in _units(model):
        m.set_gradient_divide_factor(3.0)
    for p in model.parameters():
        p.grad = None
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    thirds = {k: None if v is None else v * world / 3.0 for k, v in reference_values(ref, "grad").items()}
    assert_close_dicts(full_values(model, "grad"), thirds, GRAD_RTOL, "grad / 3")


# -- pipelining's microbatch path ------------------------------------------------------------------
def _reduce_grad_end_of_step(model: nn.Module) -> None:
    """torch.distributed.pipelining's own perform_reduce_grad on the stage module."""
    _PipelineStageBase.perform_reduce_grad(types.SimpleNamespace(submod=model), 1)


def _pipelined_step(rank: int, world: int, micro: int, ref: nn.Module,
                    model: nn.Module) -> dict[str, dict[str, int]]:
    tokens = global_batch(0)
    local = local_batch(tokens, rank, world)
    rows = [local_batch(local_batch(tokens, r, world), m, micro)
            for m in range(micro) for r in range(world)]
    (lm_loss(ref, torch.cat(rows))).backward()
    counter = mf.get_state(model).comm.counter
    counter.reset()
    for m in range(micro):  # as stage.backward_maybe_with_nosync does for FSDP modules
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        (lm_loss(model, local_batch(local, m, micro)) / micro).backward()
    during = counter.snapshot()
    counter.reset()
    _reduce_grad_end_of_step(model)
    end = counter.snapshot()[Phase.BACKWARD.value]
    assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL,
                       f"grad micro={micro}")
    return {"during": during, "end": end}


def _pipelining(rank: int, world: int) -> None:
    counts = {}
    for micro in (1, 4):
        ref, model = _models()
        counts[micro] = _pipelined_step(rank, world, micro, ref, model)
        state = mf.get_state(model)
        assert state.requires_grad_sync and state.reshard_after_backward
        assert state.resident_matrix_bytes() == sum(
            mp.numel * mp.dtype.itemsize for mp in state.params.values() if mp.is_owner)
    if world == 1:
        return
    groups = len(mf.get_state(model).groups)
    # One reduction per group at the end of the step, whatever the microbatch count.
    assert counts[4]["end"] == counts[1]["end"], counts
    assert counts[1]["end"]["calls"] == groups, counts
    for micro in (1, 4):  # microbatches: gathers only, as FSDP2 under reshard_after_backward=False:
        during = counts[micro]["during"]  # kept after backward, so later forwards gather nothing,
        assert during[Phase.FORWARD.value]["calls"] == groups, counts  # resharded after forward,
        assert during[Phase.BACKWARD.value]["calls"] == micro * groups, counts  # regathered


# -- the other methods -----------------------------------------------------------------------------
def _sync_method(rank: int, world: int) -> None:
    """model.set_requires_gradient_sync (FSDP2's method) for accumulation: no traffic, exact."""
    ref, model = _models()
    tokens = global_batch(1)
    local = local_batch(tokens, rank, world)
    counter = mf.get_state(model).comm.counter
    for m in range(2):
        rows = [local_batch(local_batch(tokens, r, world), m, 2) for r in range(world)]
        lm_loss(ref, torch.cat(rows)).backward()
        model.set_requires_gradient_sync(m == 1)
        model.set_requires_all_reduce(m == 1)
        counter.reset()
        lm_loss(model, local_batch(local, m, 2)).backward()
        snap = counter.snapshot()
        if m == 0:
            assert snap[Phase.BACKWARD.value]["calls"] == snap[Phase.FORWARD.value]["calls"]
    assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL,
                       "grad")


def _reshard_and_unshard(rank: int, world: int) -> None:
    ref, model = _models()
    state = mf.get_state(model)
    owned = state.resident_matrix_bytes()
    full = sum(mp.numel * mp.dtype.itemsize for mp in state.params.values())
    model.set_reshard_after_forward(False)
    loss = lm_loss(model, local_batch(global_batch(0), rank, world))
    assert state.resident_matrix_bytes() == full  # kept after forward, as FSDP2 keeps it
    loss.backward()
    model.set_reshard_after_forward(True)
    model.unshard()
    assert state.resident_matrix_bytes() == full
    model.reshard()
    assert state.resident_matrix_bytes() == owned
    model.unshard()
    state.comm.counter.reset()
    with torch.no_grad():
        model(global_batch(0)[:, :-1])
    assert state.comm.counter.snapshot()[Phase.FORWARD.value]["calls"] == 0  # already gathered
    assert state.resident_matrix_bytes() == owned  # forward resharded them
    model.set_force_sum_reduction_for_comms(True)
    for p in model.parameters():
        p.grad = None
    ref.zero_grad()
    tokens = global_batch(2)
    lm_loss(ref, tokens).backward()
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL, "grad")


def _refused(rank: int, world: int) -> None:
    _, model = _models(tail_units="groups")
    with pytest.raises(NotImplementedError, match="set_modules_to_forward_prefetch"):
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
    with pytest.raises(NotImplementedError, match="set_modules_to_backward_prefetch"):
        model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
    with pytest.raises(NotImplementedError, match="set_requires_gradient_sync"):
        model.layers[0].set_requires_gradient_sync(False)
    assert mf.get_state(model).requires_grad_sync  # refused: nothing changed
    model.set_requires_gradient_sync(False)  # the root, recursively: every group
    assert not mf.get_state(model).requires_grad_sync
    model.layers[0].set_gradient_divide_factor(1.0)  # one unit: its group only
    factors = {g.name: g.gradient_divide_factor for g in mf.get_state(model).groups}
    assert factors["layers.0"] == 1.0 and factors["layers.1"] is None, factors


# -- a torchtitan-style layer dict, wrapped with the defaults --------------------------------------
class _LayerDict(nn.ModuleDict):
    """torchtitan keeps its layers in a subclass of nn.ModuleDict keyed "0", "1", ..."""


class _DictTransformer(TinyTransformer):
    def __init__(self) -> None:
        super().__init__()
        blocks = list(self.layers)
        del self.layers
        self.layers = _LayerDict({str(i): b for i, b in enumerate(blocks)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x))


def _module_dict_defaults(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = _DictTransformer()
    model = copy.deepcopy(ref)
    mf.fully_shard_matrix(model)
    block_weights = {n for n, p in ref.named_parameters()
                     if n.startswith("layers.") and p.ndim == 2}
    assert set(mf.get_plan(model).selection().matrices) == block_weights
    assert [g.name for g in mf.get_state(model).groups] == [f"layers.{i}" for i in range(3)]
    for m in _units(model):  # torchtitan's call
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    tokens = global_batch(3)
    lm_loss(ref, tokens).backward()
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    summed = {k: None if v is None else v * world for k, v in reference_values(ref, "grad").items()}
    assert_close_dicts(full_values(model, "grad"), summed, GRAD_RTOL, "grad")


def _world(rank: int, world: int) -> None:
    run_subtests(rank, {
        "module_dict_defaults": functools.partial(_module_dict_defaults, rank, world),
        "divide_factor_auto": functools.partial(_divide_factor, rank, world, "auto"),
        "divide_factor_groups": functools.partial(_divide_factor, rank, world, "groups"),
        "pipelining_one_reduction": functools.partial(_pipelining, rank, world),
        "sync_method": functools.partial(_sync_method, rank, world),
        "reshard_and_unshard": functools.partial(_reshard_and_unshard, rank, world),
        "refused": functools.partial(_refused, rank, world),
    })


@pytest.mark.parametrize("world", [2])
def test_fsdp_methods(world: int) -> None:
    run_world(world, _world)
