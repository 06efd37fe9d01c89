"""The training patterns users write, each against a single-process reference on the same batch.

Every pattern runs on each rank's share of a global batch and, in the reference, once per rank on
that rank's share (the reference's loss is the mean of the ranks' losses, the quantity the ranks'
averaged gradients descend): k >= 2 forwards before one backward (summed losses, chosen/rejected,
a shared tower on two inputs), a block called twice in one forward, reentrant and non-reentrant
activation checkpointing per block and around the whole model, two backwards through a retained
graph, ``torch.autograd.grad`` with respect to inputs, forwards under ``no_grad`` /
``inference_mode`` / ``eval()`` between steps, ranks taking different branches, accumulation with
sync off then on, ``zero_grad(set_to_none=False)``, and freezing or unfreezing matrices and whole
blocks after wrapping. Checked: gradients after the first backward (<= 1e-6 relative), parameters
after each of 3 SGD-momentum steps (<= 1e-5), and, counted at every gather, that at most two
groups' matrices are gathered at any moment (see [Note: backward completion]).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import matrixfsdp as mf
from matrixfsdp.runtime import GroupState, MatrixGroup

from .checks import assert_close_dicts, full_values, reference_values
from .dist_utils import device_type, run_subtests, run_world, test_device
from .models import Block, TinyTransformer, global_batch, lm_loss, local_batch

pytest.importorskip("transformers")
from benchmarks.hf_selection import build as build_hf
from benchmarks.hf_selection import lm_loss_fn as hf_loss_fn

GRAD_RTOL = 1e-6
PARAM_RTOL = 1e-5
STEPS = 3
DIM = 16

Batch = Callable[[int, int], torch.Tensor]  # (rank, k) -> that rank's k-th batch of this step


# -- models ----------------------------------------------------------------------------------------
class PatternTransformer(TinyTransformer):
    """TinyTransformer with a block order (a block may run twice) and a checkpointing mode."""

    def __init__(self, order: tuple[int, ...] = (0, 1, 2), reentrant: bool | None = None) -> None:
        super().__init__(layers=max(order) + 1)
        self.order, self.reentrant = order, reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i in self.order:
            layer = self.layers[i]
            x = layer(x) if self.reentrant is None else checkpoint(
                layer, x, use_reentrant=self.reentrant)
        return self.head(self.norm(x))


class Tower(nn.Module):
    """Blocks on float inputs (so a checkpoint around the whole model has an input needing grad)."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(DIM, 40) for _ in range(layers)])
        self.out = nn.Linear(DIM, 4)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=1.0 / p.shape[-1] ** 0.5)
            elif "bias" in name:
                nn.init.normal_(p, std=0.1)
        self.to(test_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def float_batch(step: int, k: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 10 * step + k)
    x = torch.randn(4 * world, 5, DIM, generator=g).to(test_device())
    return local_batch(x, rank, world)


# -- losses ----------------------------------------------------------------------------------------
def seq_logprob(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).log_softmax(-1)
    return logits.gather(-1, tokens[:, 1:, None]).squeeze(-1).sum(-1)


def _mean(losses: list[torch.Tensor]) -> torch.Tensor:
    return sum(losses) / len(losses)


# -- patterns: (model, batch, ranks) -> None, running the backward(s) ---------------------------------
def one_forward(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    _mean([lm_loss(model, batch(r, 0)) for r in ranks]).backward()


def summed_losses(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    """Three forwards before one backward."""
    _mean([lm_loss(model, batch(r, 0)) + 0.5 * lm_loss(model, batch(r, 1))
           + lm_loss(model, batch(r, 2)) for r in ranks]).backward()


def chosen_rejected(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    """A DPO-style loss: a chosen and a rejected sequence per example."""
    losses = [-F.logsigmoid(0.1 * (seq_logprob(model, batch(r, 0)) - seq_logprob(model, batch(r, 1))))
              .mean() for r in ranks]
    _mean(losses).backward()


def shared_tower(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    """A siamese loss: the same tower embeds two inputs."""
    def embed(r: int, k: int) -> torch.Tensor:
        return model(batch(r, k)[:, :-1]).mean(1)

    _mean([(embed(r, 0) - embed(r, 1)).pow(2).sum(-1).mean() for r in ranks]).backward()


def retain_graph_twice(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    loss = _mean([lm_loss(model, batch(r, 0)) for r in ranks])
    loss.backward(retain_graph=True)
    loss.backward()


def eval_between(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    """Evaluation forwards between steps: ``eval()`` with grad on and the graph dropped, then
    training, then ``no_grad`` and ``inference_mode`` between the backward and the step."""
    tokens = batch(ranks[0], 1)
    model.eval()
    model(tokens)  # a graph that is dropped without backward
    model.train()
    one_forward(model, batch, ranks)
    with torch.no_grad():
        model(tokens)
    with torch.inference_mode():
        model(tokens)


def different_branches(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    """Rank r runs block 1's extra branch when r is even, block 0's never."""
    losses = []
    for r in ranks:
        model.layers[1].use_unused = r % 2 == 0
        losses.append(lm_loss(model, batch(r, 0)))
    model.layers[1].use_unused = False
    _mean(losses).backward()


def accumulate(model: nn.Module, batch: Batch, ranks: list[int]) -> None:
    """Two micro-batches, sync off then on (on the reference, two plain backwards)."""
    for k in range(2):
        if mf.is_matrix_wrapped(model):
            mf.set_requires_gradient_sync(model, k == 1)
        _mean([lm_loss(model, batch(r, k)) for r in ranks]).backward()


def tower_loss(model: nn.Module, x: torch.Tensor, reentrant: bool | None) -> torch.Tensor:
    out = model(x) if reentrant is None else checkpoint(model, x, use_reentrant=reentrant)
    return out.pow(2).mean()


@dataclasses.dataclass(frozen=True)
class Pattern:
    name: str
    run: Callable[[nn.Module, Batch, list[int]], None] = one_forward
    order: tuple[int, ...] = (0, 1, 2)
    reentrant: bool | None = None  # per-block checkpointing mode
    set_to_none: bool = True
    freeze: Callable[[nn.Module, int], None] | None = None  # (model, step) before each step


def _freeze_schedule(model: nn.Module, step: int) -> None:
    """Freeze a matrix and a whole block after wrapping, unfreeze the block a step later."""
    named = dict(model.named_parameters())
    if step == 1:
        named["layers.0.up.weight"].requires_grad_(False)
        model.layers[2].requires_grad_(False)
    if step == 2:
        model.layers[2].requires_grad_(True)


def _freeze_prefix(model: nn.Module, step: int) -> None:
    """Fine-tuning's frozen prefix: the embedding and block 0 never need a gradient."""
    if step == 0:
        model.embed.requires_grad_(False)
        model.layers[0].requires_grad_(False)


PATTERNS = [
    Pattern("summed_losses", summed_losses),
    Pattern("chosen_rejected", chosen_rejected),
    Pattern("shared_tower", shared_tower),
    Pattern("block_called_twice", order=(0, 1, 1, 2)),
    Pattern("checkpoint_reentrant", reentrant=True),
    Pattern("checkpoint_non_reentrant", reentrant=False),
    Pattern("checkpoint_reentrant_two_forwards", summed_losses, reentrant=True),
    Pattern("retain_graph_twice", retain_graph_twice),
    Pattern("eval_between_steps", eval_between),
    Pattern("different_branches", different_branches),
    Pattern("accumulate_sync_off_on", accumulate),
    Pattern("zero_grad_keep_tensors", different_branches, set_to_none=False),
    Pattern("freeze_after_wrapping", freeze=_freeze_schedule),
    Pattern("freeze_with_reentrant_checkpoint", reentrant=True, freeze=_freeze_schedule),
    Pattern("frozen_prefix", freeze=_freeze_prefix),
]


# -- the driver ----------------------------------------------------------------------------------
def count_gathered(model: nn.Module) -> dict[str, object]:
    """Record the most groups gathered at once, checked after every gather starts, and which
    groups were gathered inside backward."""
    state = mf.get_state(model)
    seen: dict[str, object] = {"max": 0, "in_backward": set()}

    def unshard(group: MatrixGroup, original: Callable, *args: object, **kwargs: object) -> None:
        was_sharded = group.state is GroupState.SHARDED
        original(*args, **kwargs)
        gathered = sum(g.state is not GroupState.SHARDED for g in state.groups)
        seen["max"] = max(seen["max"], gathered)
        if was_sharded and torch._C._current_graph_task_id() != -1:
            seen["in_backward"].add(group.name)

    for group in state.groups:
        group.unshard = functools.partial(unshard, group, group.unshard)
    return seen


def _batch_of(tokens: list[torch.Tensor], world: int, rank: int, k: int) -> torch.Tensor:
    return local_batch(tokens[k], rank, world)


def _wrap(model: nn.Module, hsdp: bool, world: int) -> nn.Module:
    mesh = (init_device_mesh(device_type(), (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else None)
    return mf.fully_shard_matrix(model, mesh)


def _run_pattern(rank: int, world: int, pattern: Pattern, hsdp: bool) -> None:
    torch.manual_seed(0)
    ref = PatternTransformer(pattern.order, pattern.reentrant)
    model = _wrap(copy.deepcopy(ref), hsdp, world)
    gathered = count_gathered(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ref, model)]
    for step in range(STEPS):
        tokens = [global_batch(10 * step + k) for k in range(3)]
        for m, ranks in ((ref, list(range(world))), (model, [rank])):
            if pattern.freeze is not None:
                pattern.freeze(m, step)
            pattern.run(m, functools.partial(_batch_of, tokens, world), ranks)
        if step == 0:
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"),
                               GRAD_RTOL, f"{pattern.name} grad")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=pattern.set_to_none)
        assert_close_dicts(full_values(model), reference_values(ref), PARAM_RTOL,
                           f"{pattern.name} param after step {step + 1}")
    assert gathered["max"] <= 2, f"{pattern.name}: {gathered['max']} groups gathered at once"
    if pattern.freeze is _freeze_prefix:  # a frozen group computes in forward only
        assert "layers.0" not in gathered["in_backward"], gathered


def _run_tower(rank: int, world: int, reentrant: bool | None, hsdp: bool) -> None:
    """Checkpointing around the whole model, and ``torch.autograd.grad`` w.r.t. the inputs."""
    torch.manual_seed(0)
    ref = Tower()
    model = _wrap(copy.deepcopy(ref), hsdp, world)
    gathered = count_gathered(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ref, model)]
    for step in range(STEPS):
        xs = [float_batch(step, 0, r, world).requires_grad_() for r in range(world)]
        ref_loss = _mean([tower_loss(ref, x, reentrant) for x in xs])
        x = float_batch(step, 0, rank, world).requires_grad_()
        loss = tower_loss(model, x, reentrant)
        if reentrant is not True:  # torch's reentrant checkpoint refuses autograd.grad
            ref_input_grads = torch.autograd.grad(ref_loss, xs, retain_graph=True)
            (input_grad,) = torch.autograd.grad(loss, x, retain_graph=True)
            if step == 0:  # later steps start from parameters equal up to rounding only
                assert_close_dicts({"x": input_grad.cpu() / world},
                                   {"x": ref_input_grads[rank].cpu()}, GRAD_RTOL, "input grad")
        ref_loss.backward()
        loss.backward()
        if step == 0:
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"),
                               GRAD_RTOL, f"tower reentrant={reentrant} grad")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_close_dicts(full_values(model), reference_values(ref), PARAM_RTOL,
                           f"tower reentrant={reentrant} param after step {step + 1}")
    assert gathered["max"] <= 2, f"tower: {gathered['max']} groups gathered at once"


def _run_hf_llama(rank: int, world: int, reentrant: bool, hsdp: bool) -> None:
    """HF ``gradient_checkpointing_enable()`` on a HF Llama, both ``use_reentrant`` values."""
    ref = build_hf("llama")
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = _wrap(copy.deepcopy(ref), hsdp, world)
    gathered = count_gathered(model)
    loss_fn = hf_loss_fn("llama")
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ref, model)]
    for step in range(STEPS):
        tokens = global_batch(step)
        loss_fn(ref, tokens).backward()
        loss_fn(model, local_batch(tokens, rank, world)).backward()
        if step == 0:
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"),
                               GRAD_RTOL, f"HF llama reentrant={reentrant} grad")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_close_dicts(full_values(model), reference_values(ref), PARAM_RTOL,
                           f"HF llama reentrant={reentrant} param after step {step + 1}")
    assert gathered["max"] <= 2, f"HF llama: {gathered['max']} groups gathered at once"


def _autograd_grad_params_raises(rank: int, world: int, hsdp: bool) -> None:
    torch.manual_seed(0)
    model = _wrap(TinyTransformer(), hsdp, world)
    loss = lm_loss(model, local_batch(global_batch(0), rank, world))
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(loss, list(model.parameters()))


def _world(rank: int, world: int, hsdp: bool) -> None:
    subtests: dict[str, Callable[[], None]] = {
        p.name: functools.partial(_run_pattern, rank, world, p, hsdp) for p in PATTERNS
    }
    for reentrant in (None, True, False):
        subtests[f"tower_checkpoint_{reentrant}"] = functools.partial(
            _run_tower, rank, world, reentrant, hsdp)
    for reentrant in (True, False):
        subtests[f"hf_llama_gradient_checkpointing_reentrant_{reentrant}"] = functools.partial(
            _run_hf_llama, rank, world, reentrant, hsdp)
    subtests["autograd_grad_params_raises"] = functools.partial(
        _autograd_grad_params_raises, rank, world, hsdp)
    run_subtests(rank, subtests)


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (3, False), (4, False), (4, True)],
                         ids=["flat2", "flat3", "flat4", "hsdp2x2"])
def test_patterns(world: int, hsdp: bool) -> None:
    run_world(world, _world, hsdp)
