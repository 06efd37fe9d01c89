"""Expert parallelism under the training patterns users write, against one process.

At world 4 (efsdp 2 x ep 2, and HSDP 2 x 1 x 2 for accumulation), ``TinyEPMoE`` with its experts
on ep: two forwards before one backward, reentrant and non-reentrant activation checkpointing per
block (the all-to-all dispatch is recomputed in backward), accumulation with gradient sync off
then on, an expert stack frozen after wrapping and unfrozen again, and bf16 mixed precision.
Checked: gradients after the first backward (<= 1e-6 relative) and parameters after each of 3
SGD-momentum steps (<= 1e-5); bf16 against single-process autocast, with fp32 masters.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf

from .checks import assert_close_dicts, float64_rtols, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .ep_models import TinyEPMoE, distribute_experts
from .models import global_batch, lm_loss, local_batch
from .test_ep import ep_meshes

WORLD = 4
Run = Callable[[nn.Module, list[torch.Tensor], list[int], bool], None]


def _mean_loss(model: nn.Module, tokens: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    return sum(lm_loss(model, local_batch(tokens, r, WORLD)) for r in ranks) / len(ranks)


def one_forward(model: nn.Module, tokens: list[torch.Tensor], ranks: list[int], ep: bool) -> None:
    _mean_loss(model, tokens[0], ranks).backward()


def two_forwards(model: nn.Module, tokens: list[torch.Tensor], ranks: list[int], ep: bool) -> None:
    (_mean_loss(model, tokens[0], ranks) + 0.5 * _mean_loss(model, tokens[1], ranks)).backward()


def accumulate(model: nn.Module, tokens: list[torch.Tensor], ranks: list[int], ep: bool) -> None:
    if ep:
        mf.set_requires_gradient_sync(model, False)
    _mean_loss(model, tokens[0], ranks).backward()
    if ep:
        mf.set_requires_gradient_sync(model, True)
    _mean_loss(model, tokens[1], ranks).backward()


def _freeze_expert(model: nn.Module, step: int) -> None:
    """Freeze one expert stack after wrapping at step 1, unfreeze it at step 2."""
    model.layers[1].experts.w_out.requires_grad_(step != 1)


PATTERNS: dict[str, tuple[Run, bool | None, Callable | None]] = {
    "one_forward": (one_forward, None, None),
    "two_forwards": (two_forwards, None, None),
    "checkpoint_reentrant": (one_forward, True, None),
    "checkpoint_non_reentrant": (two_forwards, False, None),
    "accumulate": (accumulate, None, None),
    "freeze_expert": (one_forward, None, _freeze_expert),
}


def _run(rank: int, layout: str, name: str) -> None:
    run, reentrant, freeze = PATTERNS[name]
    dense, experts, ep = ep_meshes(layout)
    torch.manual_seed(0)
    ref = TinyEPMoE(reentrant=reentrant)
    model = distribute_experts(copy.deepcopy(ref), ep)
    mf.fully_shard_matrix(model, dense, expert_mesh=experts)
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        tokens = [global_batch(10 * step + k) for k in range(2)]
        for m, ranks, is_ep in ((ref, list(range(WORLD)), False), (model, [rank], True)):
            if freeze is not None:
                freeze(m, step)
            run(m, tokens, ranks, is_ep)
        if step == 0:
            rtols = float64_rtols(ref, lambda m, t=tokens: run(m, t, list(range(WORLD)), False))
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), rtols,
                               f"{name} grad")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_close_dicts(full_values(model), reference_values(ref), 1e-5,
                           f"{name} param after step {step + 1}")


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _bf16(rank: int, layout: str) -> None:
    """bf16 compute, fp32 reductions and masters: gradients near single-process autocast."""
    dense, experts, ep = ep_meshes(layout)
    torch.manual_seed(0)
    ref = TinyEPMoE()
    model = distribute_experts(copy.deepcopy(ref), ep)
    mf.fully_shard_matrix(model, dense, expert_mesh=experts, mp_policy=BF16)
    state = mf.get_state(model)
    for mp in state.params.values():
        assert mp.sharded.dtype == torch.float32 and mp.unsharded.dtype == torch.bfloat16
    tokens = global_batch(0)
    lm_loss(model, local_batch(tokens, rank, WORLD)).backward()
    for mp in state.params.values():
        if mp.is_owner and mp.sharded.grad is not None:
            assert mp.sharded.grad.dtype == torch.float32, mp.fqn
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _mean_loss(ref, tokens, list(range(WORLD)))
    loss.backward()
    assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), 6e-2,
                       "bf16 grad vs autocast")
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, tail_lr=1e-2)
    opt.step()
    for mp in state.params.values():
        if mp.is_owner:
            master = mp.sharded.detach()
            assert not torch.equal(master, master.bfloat16().float()), f"{mp.fqn} lost fp32 bits"


def _world(rank: int, world: int, layout: str, names: tuple[str, ...]) -> None:
    subtests = {name: functools.partial(_run, rank, layout, name) for name in names}
    if layout == "efsdp2_ep2":
        subtests["bf16"] = functools.partial(_bf16, rank, layout)
    run_subtests(rank, subtests)


@pytest.mark.parametrize("layout", ["efsdp2_ep2", "hsdp2_efsdp1_ep2"])
def test_ep_patterns(layout: str) -> None:
    names = tuple(PATTERNS) if layout == "efsdp2_ep2" else ("accumulate", "checkpoint_reentrant")
    run_world(WORLD, _world, layout, names)
