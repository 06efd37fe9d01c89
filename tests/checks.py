"""Comparison helpers shared by the distributed tests."""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import matrixfsdp as mf
from matrixfsdp.optim import get_matrix_optimizer

from .dist_utils import test_device

# Hyperparameters for parity of the fp32 library with the float64 references (tests/references.py)
# across world sizes. Muon: fp32 Newton–Schulz (torch's bf16 amplifies fp32 reduction-order noise).
# Shampoo / EMA-Gram: relative eps 1e-4 instead of 1e-6, because inverse roots of near-zero
# eigenvalues of rank-deficient Grams amplify fp32 noise by about eps^(-1/2) (measured: 1.4e-5
# drift over 10 steps with eps 1e-6). SOAP: eps 1e-5 instead of 1e-8: Adam in the rotated basis
# normalises every rotated coordinate, so where the rotated gradient is at fp32 noise level the
# fp32 library and float64 disagree on its sign unless eps dominates that noise (measured on
# TinyTransformer, 10 steps: 4.5e-4 parameter drift with 1e-8, 3.7e-5 with 1e-6, 3.9e-6 with
# 1e-5; 1.5e-6 with a float64 model).
FREE_RUNNING_KWARGS: dict[str, dict] = {
    "muon": {"ns_dtype": "float32"},
    "shampoo": {"eps": 1e-4, "root_dtype": "float64"},
    "soap": {"eps": 1e-5},
    "emagram": {"eps": 1e-3, "root_dtype": "float64"},
}


def full_values(model: nn.Module, attr: str = "data") -> dict[str, torch.Tensor | None]:
    """Every parameter (``attr="data"``) or gradient (``"grad"``) of a wrapped model, whole, as
    host (CPU) copies whatever the test device.

    Collective: all ranks must call it. Matrices are broadcast from their owner inside the shard
    group (under HSDP: this rank's replica's values; a TP matrix's shards are then assembled over
    its tp group); a matrix whose owner has no gradient maps to None.
    """
    state = mf.get_state(model)
    group_of = {mp.fqn: g.comm.group for g in state.groups for mp in g.params}  # experts: efsdp
    device = test_device()
    out: dict[str, torch.Tensor | None] = {}
    for fqn, p in model.named_parameters():
        value = p.grad if attr == "grad" else p.detach()
        if fqn in state.params:
            mp = state.params[fqn]
            group = group_of[fqn]
            src = dist.get_global_rank(group, mp.owner_rank)
            present = torch.tensor([0 if value is None else 1], device=device)
            dist.broadcast(present, src=src, group=group)
            if not present.item():
                out[fqn] = None
                continue
            buf = (value.detach().clone() if mp.is_owner
                   else torch.empty(mp.shape, dtype=mp.dtype, device=device))
            dist.broadcast(buf, src=src, group=group)
            if mp.tp is not None:  # this tp rank's shard: the tp ranks assemble the whole
                buf = mp.tp.as_dtensor(buf).full_tensor()
            if mp.ep is not None:  # this ep rank's experts: the ep ranks assemble the stack
                buf = mp.ep.as_dtensor(buf).full_tensor()
            out[fqn] = _host(buf)
        elif isinstance(value, DTensor):
            out[fqn] = _host(_whole(value))
        else:
            out[fqn] = None if value is None else _host(value.detach())
    return out


def _whole(value: DTensor) -> torch.Tensor:
    """A DTensor's whole value. FSDP2's (Replicate, ...) Shard(0) layouts are gathered with
    blocking c10d all-gathers: two CI runs aborted on heap corruption inside the functional
    collectives' ``wait_tensor`` that ``full_tensor()`` runs on gloo. Other layouts (TP) use
    ``full_tensor()``."""
    placements = value.placements
    if not all(isinstance(p, Replicate) or p == Shard(0) for p in placements) or \
            sum(p == Shard(0) for p in placements) > 1:
        return value.full_tensor()  # a 1-rank full_tensor() aliases the shard: _host copies
    local = value.to_local().detach()
    for dim, placement in enumerate(placements):
        if placement != Shard(0):
            continue
        group = value.device_mesh.get_group(dim)
        world, rows = dist.get_world_size(group), value.shape[0]
        chunk = -(-rows // world)  # torch.chunk's split, as DTensor's Shard(0)
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        gathered = local.new_empty((chunk * world, *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        local = gathered[:rows]
    return local


def _host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy (never an alias of ``t``)."""
    return t.detach().to("cpu", copy=True)


def reference_values(model: nn.Module, attr: str = "data") -> dict[str, torch.Tensor | None]:
    """A one-process model's parameters or gradients, as host copies (see ``full_values``)."""
    out = {}
    for fqn, p in model.named_parameters():
        value = p.grad if attr == "grad" else p.detach()
        out[fqn] = None if value is None else _host(value)
    return out


def assert_close_dicts(
    got: dict[str, torch.Tensor | None],
    want: dict[str, torch.Tensor | None],
    rtol: float | Mapping[str, float],
    what: str,
) -> None:
    """Relative error ‖got − want‖ / max(‖want‖, tiny) ≤ rtol for every entry; None must match.
    ``rtol``: one bound, or one per FQN (``float64_rtols``)."""
    assert got.keys() == want.keys(), f"{what}: keys differ: {set(got) ^ set(want)}"
    for fqn in want:
        g, w = got[fqn], want[fqn]
        if w is None or g is None:
            assert g is None and w is None, f"{what} {fqn}: got {g is None=}, want {w is None=}"
            continue
        bound = rtol if isinstance(rtol, float | int) else rtol[fqn]
        err = _relative_error(g, w)
        assert err <= bound, f"{what} {fqn}: relative error {err:.3e} > {bound:.1e}"


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / max(want.norm().item(), 1e-30)).item()


# [Note: tolerances from float64]
# An fp32 result computed by a different summation order (shards, TP partial sums, microbatches,
# another machine's kernels) is compared with the one-process fp32 reference at a bound taken from
# the computation itself, not a constant: the same reference run in float64 gives each result's
# rounding error e (‖fp32 − float64‖ / ‖float64‖). Both fp32 results carry an error of that size,
# so their difference is at most about 2e; ROUNDING_SAFETY covers the spread of rounding errors
# between orderings (they are sums of many independent roundings: a few standard deviations), and
# each e is floored at the model's median so a tensor whose fp32 error happens to cancel does not
# get a bound below the network's rounding level. ``ROUNDING_FLOOR`` (a few fp32 ulps) keeps an
# exactly representable result from a zero bound.
ROUNDING_SAFETY = 4.0
ROUNDING_FLOOR = 4 * 2.0**-24


def float64_rtols(ref: nn.Module, backward: Callable[[nn.Module], object],
                  attr: str = "grad") -> dict[str, float]:
    """Per-FQN bounds for comparing an fp32 run with ``ref`` (fp32, ``backward`` already run on
    it) after ``backward``: see [Note: tolerances from float64]. ``attr="grad"``: gradients."""
    if attr != "grad":
        raise ValueError(f"float64_rtols: attr={attr!r}; only gradients are rerun in float64")
    ref64 = copy.deepcopy(ref).double()
    for p in ref64.parameters():
        p.grad = None
    backward(ref64)
    got32 = dict(ref.named_parameters())
    errs = {fqn: _relative_error(got32[fqn].grad, p.grad) for fqn, p in ref64.named_parameters()
            if p.grad is not None and got32[fqn].grad is not None}
    level = statistics.median(errs.values()) if errs else 0.0
    return {fqn: ROUNDING_SAFETY * max(err, level, ROUNDING_FLOOR) for fqn, err in errs.items()}


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    """Every parameter's optimizer state, whole, keyed by FQN, as host copies (collective;
    test-only pickling)."""
    state = mf.get_state(model)
    group_of = {mp.fqn: g.comm.group for g in state.groups for mp in g.params}  # experts: efsdp
    out: dict[str, dict] = {}
    for fqn, p in model.named_parameters():
        entry = opt.state.get(p, {})
        if fqn in state.params:
            mp = state.params[fqn]
            group = group_of[fqn]
            box = [{k: _host(v) for k, v in entry.items()} if mp.is_owner else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, mp.owner_rank),
                                       group=group)
            if mp.tp is not None:  # the whole state lives on the matrix's step owner alone
                rows: list = [None] * mp.tp.tp_size
                dist.all_gather_object(rows, box[0], group=mp.tp.group)
                box[0] = next((entry for entry in rows if entry), {})
            if mp.ep is not None:  # each ep rank's experts: stack the tensors along dim 0
                rows = [None] * mp.ep.ep_size
                dist.all_gather_object(rows, box[0], group=mp.ep.mesh.get_group(0))
                box[0] = {k: torch.cat([r[k] for r in rows]) if rows[0][k].ndim else rows[0][k]
                          for k in rows[0]}
            out[fqn] = box[0]
        else:
            out[fqn] = {k: _host(v.full_tensor() if isinstance(v, DTensor) else v)
                        for k, v in entry.items()}
    return out


def count_collectives(fn) -> int:
    """Backend collectives (gloo/NCCL, classic or functional) issued while running ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return sum(1 for n in names if n.startswith(("gloo:", "nccl:")))


class RegisteredStepReference:
    """One process, whole matrices: the registered optimizer ``name``'s step on each matrix of
    ``matrices`` (``MatrixOptimizer``'s math) and ``tail`` (a torch optimizer) on the rest."""

    def __init__(self, matrices: dict[str, nn.Parameter], tail: torch.optim.Optimizer, *,
                 name: str, lr: float, weight_decay: float, config: dict) -> None:
        self.spec = get_matrix_optimizer(name)
        self.hyper = {"lr": lr, "weight_decay": weight_decay, "initial_lr": lr,
                      "config": self.spec.make_config(config)}
        self.matrices = dict(sorted(matrices.items()))
        self.state = {f: self.spec.init_state_fn(p.detach(), self.hyper["config"])
                      for f, p in self.matrices.items()}
        self.tail = tail
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        """One step; every gradient is cleared after it."""
        self.steps += 1
        for fqn, p in self.matrices.items():
            if p.grad is not None:  # a matrix unused in this step gets none
                self.spec.step_fn(p, p.grad, self.state[fqn], step=self.steps, **self.hyper)
            p.grad = None
        self.tail.step()
        self.tail.zero_grad(set_to_none=True)
