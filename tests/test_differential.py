"""Differential harness: seeded random configurations against a single-process reference.

Each seed draws a :class:`~tests.diff_models.DiffConfig` (model shape, usage pattern, world size
1-4, flat, 2x2 HSDP, dp x tp or HSDP x tp mesh, optimizer, mixed precision; see [Note: differential configurations]
in ``tests/diff_models.py``), wraps a seeded model with ``fully_shard_matrix``, trains it for 2
optimizer steps with the pattern on each rank's slice of the global batch, and compares it with
one process replaying the same pattern (see [Note: differential reference]).

Run: ``python -m pytest -q tests/test_differential.py`` runs the fixed CI seed set (``CI_SEEDS``,
every pattern, mesh and optimizer at least once); ``MATRIXFSDP_DIFF_SEEDS=200`` adds seeds
0..199 (``=a:b`` adds ``range(a, b)``); ``MATRIXFSDP_DIFF_TP_SEEDS=100`` adds as many
tensor-parallel seeds (``TP_SEED_BASE`` + 0..99, world 4 as dp 2 x tp 2; ``TP_CI_SEEDS`` are in
the fixed set); ``MATRIXFSDP_DIFF_HSDP_TP_SEEDS=100`` adds HSDP x tensor-parallel seeds
(``HSDP_TP_SEED_BASE`` + 0..99, world 4 as 1x2x2 or 2x1x2; ``HSDP_TP_CI_SEEDS`` are fixed);
``MATRIXFSDP_DIFF_EP_SEEDS=100`` adds expert-parallel seeds (``EP_SEED_BASE`` + 0..99, world 4
as replicate x efsdp x ep in ``EP_LAYOUTS``; ``EP_CI_SEEDS`` are fixed);
``MATRIXFSDP_DIFF_PP_SEEDS=100`` adds pipeline-parallel seeds (``PP_SEED_BASE`` + 0..99, world 4
as pp 2 x dp 2; ``PP_CI_SEEDS`` are fixed; see [Note: differential pipeline configurations] in
``tests/diff_pp.py``);
``MATRIXFSDP_DIFF_SEED=17`` (or ``=17,40``) runs only those. A failure names every failing
seed, its config, what differed and a one-line reproduction. ``python -m tests.test_differential 17`` prints a seed's config.
``MATRIXFSDP_DIFF_TAIL_ONLY=1`` selects no matrix but the rank-dependent branch and a singly
frozen matrix, so stock FSDP2 trains the rest: a failure that goes away with it, or stays only
on those two, is the matrix runtime's.

[Note: differential reference]
- Configs of one world size run one after another in one spawned world (up to
  ``SEEDS_PER_WORLD`` of them, then a fresh world: gloo keeps a destroyed group's threads until
  the process ends). Each config gets its own process groups (mesh) with a short timeout, so a
  rank that raises while its peers wait in a collective costs a timeout, not a hang; whether the
  config passed is then agreed by an ``all_gather_object`` on the default group, which every
  rank reaches. Rank 0 alone runs the reference and appends one JSON line per config to a
  results file the test reads.
- Data parallelism means: each rank's gradient is the gradient of its own loss; the runtime
  averages them. The reference replays every rank's computation on its own copy of the model
  (in bf16 under mixed precision, its micro-batches then accumulated in fp32 as FSDP2
  accumulates them) with that rank's tokens and branch choices, and averages their gradients in
  float64 at each backward that synchronizes. So the reference's loss is the
  mean of the ranks' losses, and patterns that depend on the rank (branches) are exact.
- Teacher forcing (see issue item 8: no error compounding through steps): each step starts the
  reference from the library's parameters; its gradients are compared after every backward that
  synchronizes (``GRAD_RTOL``); then the reference steps with the library's gradients, and the
  parameters (``PARAM_RTOL``) and the step's update (``UPDATE_RTOL``) are compared. Per-rank
  losses are compared too, and under HSDP every replica must hold bit-identical values.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp as mf

from .checks import FREE_RUNNING_KWARGS, full_optimizer_state, full_values
from .diff_ep import EP_CI_SEEDS, EpMeshes, distribute_experts, ep_feature_universe, ep_meshes
from .diff_models import (
    CI_SEEDS,
    HSDP_TP_CI_SEEDS,
    TP_CI_SEEDS,
    DiffConfig,
    build_model,
    call_tokens,
    draw_config,
    feature_universe,
    features,
    hsdp_tp_feature_universe,
    micro_loss,
    root_matrix_filter,
    selected_seeds,
    tp_feature_universe,
)
from .diff_pp import (
    PP_CI_SEEDS,
    draw_pp_config,
    pp_feature_universe,
    pp_selected_seeds,
    run_pp_configs,
)
from .dist_utils import run_world
from .test_optim_dist import LR, ReferenceStepper, _make_opt

GRAD_RTOL = 1e-6
# Mixed precision: the reference replays each rank's bf16 computation, but where a bf16 partial
# sum is rounded differs by component: autograd sums a tensor's uses in bf16, stock FSDP2
# reduces the tail after each use of a block (an fp32 sum of bf16 parts); micro-batches
# accumulate in fp32 everywhere, as FSDP2 accumulates them (the reference too, see ``_Harvest``). One bf16 rounding errs by <= 2^-8 of
# the magnitudes summed, which can exceed the (cancelling) sum itself: the error is measured
# against the larger of the gradient's norm and the summed norms of its parts (each rank's
# gradient of each backward, averaged). Measured over 60 mixed-precision seeds: at most 3.9e-3
# (2^-8); a lost use, micro-batch or rank errs by 0.3 to 1 on these models.
MP_GRAD_RTOL = 2e-2
# Matrices under mixed precision (no TP): the reference accumulates micro-batches as FSDP2 does
# (each backward's bf16 gradient added into an fp32 sum, see ``_Harvest``) and so must the
# library (see [Note: accumulation in reduce_dtype] in ``runtime/group.py``); a matrix's uses
# within one backward are summed in its bf16 leaf on both sides. So matrix gradients agree to
# fp32 rounding of the reductions: measured over the 46 mixed-precision seeds of 0..199 (39
# of them checked so), at most 2.2e-8. Summed in bf16 over 2-3 micro-batches, as before, they
# erred by 7.8e-4 to 2.1e-3, far under MP_GRAD_RTOL. One pattern does round differently: reentrant checkpointing of a group called
# more than once per backward reduces (or, sync off, accumulates) after each call's nested
# backward, an fp32 sum of bf16 parts where the reference sums the uses in bf16 (seed 292:
# 1.2e-3); such configs keep MP_GRAD_RTOL (``_matrix_sums_exact``).
MP_MATRIX_GRAD_RTOL = 1e-5
PARAM_RTOL = 1e-5
LOSS_RTOL = 1e-6
# Tensor parallelism (mesh "tp") computes a row-parallel layer as two partial products summed by
# an all-reduce, where one process runs one matmul: a different rounding of every activation
# after it. Measured over 200 TP seeds: in fp32 gradients within 1.6e-6 and losses within
# 1.2e-6; under mixed precision (the partial products round to bf16 before their sum)
# gradients within 2.9e-2 of their scale and losses within 0.01 (several bf16 ulps of logits
# whose cross entropy is small). A lost contribution still errs by 0.3 or more. 200 HSDP x TP
# seeds then found two bf16 configs at 5.1e-2 and 7.6e-2 (norms and biases of a TP block, whose
# sums over a few tokens cancel). Both err the same on the flat dp x tp mesh, by 0 without TP
# (bit-exact), and by 2.6e-6 at most in fp32: the partial products' bf16 rounding, not the
# runtime. The gradient tolerance sits halfway (geometrically) between 7.6e-2 and 0.3.
TP_RTOL = 1e-5
TP_MP_RTOL = 0.15
TP_MP_LOSS_RTOL = 5e-2
# The update of one teacher-forced step (same parameters and gradients), relative per tensor.
# SGD/AdamW: torch's own optimizer on both sides (measured: bit-identical). Matrix optimizers: the
# library's fp32 step against the float64 formulas of tests/references.py; measured maxima over
# 90 seeds: Muon (fp32 Newton-Schulz) 1.2e-5, Shampoo 1.9e-5, EMA-Gram 1.9e-5, SOAP 4.2e-5,
# OKLS 6.6e-5 (fp32 roots of the rank-deficient factors of small and non-square matrices, e.g.
# (4, d) routers); a wrong step is off by O(1). SOAP on a softmax router: its gradient's columns
# sum to zero, so the left factor has the all-ones null vector and the rotated gradient along it is
# rounding noise, 0 in float64 but ~6e-8 |G| in fp32, which Adam's ratio divides by eps (1e-5
# here): the update errs by ~3e-4 of the gradient's scale (measured 3.3e-4 median, 7.3e-4 max
# over 200 zero-sum (4, 12) gradients with unit entries; seed 1005 of an 800-seed sweep: 2.2e-4). The
# direction it moves in shifts every logit alike, which softmax ignores.
UPDATE_RTOL = {"sgd": 1e-6, "adamw": 1e-6, "muon": 1e-4, "shampoo": 1e-4, "emagram": 1e-4,
               "soap": 1e-3, "okls": 3e-4}
# Teacher forcing starts both sides from the same parameters: a parameter errs by its update's
# error. SOAP's may reach UPDATE_RTOL["soap"] of the update (the router's null direction), over
# PARAM_RTOL of the parameter once the update exceeds 1% of it (sweep seed 2000295: 3.7e-4 of an
# update 3% the router's size). So SOAP's parameters may err by what its update may.
PARAM_ERR_AS_UPDATE = frozenset({"soap"})
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
GROUP_TIMEOUT_S = 60  # per-config process groups: a stuck collective fails the config
STEPS = 2
SEEDS_PER_WORLD = 40
REPRODUCE = "MATRIXFSDP_DIFF_SEED={seed} python -m pytest -q tests/test_differential.py"
Grads = dict[str, "torch.Tensor | None"]


# -- comparisons -----------------------------------------------------------------------------------
def _relative_error(got: torch.Tensor, want: torch.Tensor, scale: float = 0.0) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).norm() / max(want.norm().item(), scale, 1e-30)).item()


def compare(got: Grads, want: Grads, rtol: float, what: str,
            scales: dict[str, float] | None = None) -> list[str]:
    """Every entry whose relative error exceeds ``rtol`` or whose presence differs, as text.

    ``scales`` measures an entry's error against the larger of the norm of ``want`` and its
    scale: under mixed precision the summed norms of the parts it adds up (see
    ``MP_GRAD_RTOL``), for SOAP's parameters their update's allowance (``PARAM_ERR_AS_UPDATE``).
    """
    out = []
    if got.keys() != want.keys():
        out.append(f"{what}: keys differ: {sorted(set(got) ^ set(want))}")
    for fqn in sorted(want.keys() & got.keys()):
        g, w = got[fqn], want[fqn]
        if g is None or w is None:
            if (g is None) != (w is None):
                out.append(f"{what} {fqn}: library {'None' if g is None else 'a tensor'}, "
                           f"reference {'None' if w is None else 'a tensor'}")
            continue
        err = _relative_error(g, w, (scales or {}).get(fqn, 0.0))
        if not err <= rtol:  # also NaN
            out.append(f"{what} {fqn}: relative error {err:.3e} > {rtol:.0e}")
    return out


def _only(values: Grads, fqns: set[str], inside: bool = True) -> Grads:
    """The entries of ``values`` in ``fqns`` (``inside=False``: the others)."""
    return {f: v for f, v in values.items() if (f in fqns) == inside}


def _matrix_sums_exact(cfg: DiffConfig) -> bool:
    """Whether the library sums each matrix's gradient parts where the reference does (see
    ``MP_MATRIX_GRAD_RTOL``): not under TP, nor reentrant checkpointing of repeated calls."""
    repeated = cfg.forwards != "single" or cfg.shape.repeat_block is not None
    return not cfg.is_tp and not (cfg.checkpoint.endswith("reentrant") and repeated)


def _plus(a: Grads, b: Grads) -> Grads:
    """``a + b`` where either may be None per entry (None + x = x), in float64."""
    return {f: b[f] if a[f] is None else a[f] if b[f] is None else a[f].double() + b[f]
            for f in a}


def _digest(values: Grads) -> str:
    h = hashlib.sha1()
    for fqn in sorted(values):
        t = values[fqn]
        data = b"-" if t is None else t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        h.update(fqn.encode() + bytes(data))
    return h.hexdigest()[:16]


# -- one rank's training (the library) -------------------------------------------------------------
def run_backward_phase(cfg: DiffConfig, model: nn.Module, rank: int, step: int,
                       set_sync: Callable[[bool], None] | None,
                       after_backward: Callable[[bool], None]) -> list[float]:
    """Every micro-batch of one step on ``rank``: ``after_backward(synced)`` after each backward."""
    losses = []
    for micro in range(cfg.accum):
        last = micro == cfg.accum - 1
        if set_sync is not None and cfg.accum > 1:
            set_sync(last)  # sync off for all but the last micro-batch
        loss = micro_loss(cfg, model, rank, step, micro)
        losses.append(float(loss.detach()))
        if last and cfg.retain_twice:
            loss.backward(retain_graph=True)
            after_backward(True)
        loss.backward()
        after_backward(last)
    return losses


def _set_frozen(model: nn.Module, fqns: tuple[str, ...], frozen: bool) -> None:
    for fqn, p in model.named_parameters():
        if fqn in fqns:
            p.requires_grad_(not frozen)


def _between_forward(cfg: DiffConfig, model: nn.Module, rank: int) -> None:
    """A forward that trains nothing, between step 0 and step 1."""
    if cfg.between.startswith("eval"):
        model.eval()
    grad_mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                 "eval_no_grad": torch.no_grad}.get(cfg.between, torch.enable_grad)
    with grad_mode():
        model(call_tokens(cfg, rank, 99, 0, 0))
    model.train()


def _config_mesh(cfg: DiffConfig, index: int
                 ) -> tuple[DeviceMesh | EpMeshes, list[dist.ProcessGroup]]:
    """Config ``index``'s mesh on fresh gloo groups with a short timeout (see the Note).

    Its dim names are unique: DTensor caches sharding decisions by mesh equality, which
    ignores the process groups, so two configs' equal meshes would share the first one's groups.
    """
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    rank = dist.get_rank()
    if cfg.mesh == "ep":
        return ep_meshes(cfg, index, GROUP_TIMEOUT_S)
    if cfg.mesh == "flat":
        group = dist.new_group(list(range(cfg.world)), timeout=timeout)
        return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"dp{index}",)), [group]
    # hsdp: (replicate, shard); tp: (dp, tp); hsdp_tp: (replicate, shard, tp); rank-major layout
    layout = torch.arange(cfg.world).view(cfg.mesh_shape)
    mine = []
    for dim in range(layout.ndim):  # every rank creates every group of every dim, in one order
        for ranks in layout.movedim(dim, -1).reshape(-1, layout.shape[dim]).tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine.append(group)
    kinds = {"hsdp": ("replicate", "shard"), "tp": ("dp", "tp"),
             "hsdp_tp": ("replicate", "shard", "tp")}[cfg.mesh]
    names = tuple(f"{kind}{index}" for kind in kinds)
    return DeviceMesh.from_group(mine, "cpu", mesh=layout, mesh_dim_names=names), mine


def _tail_only_filter(cfg: DiffConfig) -> Callable[[str, nn.Parameter], bool]:
    """``MATRIXFSDP_DIFF_TAIL_ONLY``: matrices only where stock FSDP2 is not valid (see
    [Note: differential configurations]): the rank-dependent branch, a singly frozen matrix."""
    kept = set(cfg.freeze) if len(cfg.freeze) == 1 else set()
    return lambda fqn, param: fqn.endswith(".branch.weight") or fqn in kept


def _wrap(cfg: DiffConfig, model: nn.Module, mesh: DeviceMesh | EpMeshes) -> None:
    shape = cfg.shape
    expert_mesh = None
    if isinstance(mesh, EpMeshes):  # experts over ep first, as torchtitan does; then owners
        distribute_experts(model, mesh)
        mesh, expert_mesh = mesh.dense, mesh.experts
    if cfg.is_tp:  # tensor parallelism first, as torchtitan does; then owners over dp
        *dp_names, tp_name = mesh.mesh_dim_names
        for i in cfg.tp_blocks:
            parallelize_module(model.layers[i], mesh[tp_name],
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
        mesh = mesh[tuple(dp_names)] if len(dp_names) > 1 else mesh[dp_names[0]]
    matrix_filter = root_matrix_filter if shape.root_matrices else None
    if os.environ.get("MATRIXFSDP_DIFF_TAIL_ONLY") == "1":  # stock FSDP2 (see the module doc)
        matrix_filter = _tail_only_filter(cfg)
    mf.fully_shard_matrix(
        model, mesh, expert_mesh=expert_mesh, matrix_filter=matrix_filter,
        reshard_after_forward=cfg.reshard_after_forward,
        mp_policy=BF16 if cfg.mixed_precision else None,
        planner=mf.LPTPlanner(stacks=cfg.stacks) if "moe" in shape.kinds else None,
        collectives=cfg.collectives,
    )
    if cfg.is_tp:  # the harness's own check: every parallelized MLP is a TP matrix pair
        tp_matrices = {f for f, mp in mf.get_state(model).params.items() if mp.tp is not None}
        want = {f"layers.{i}.{m}.weight" for i in cfg.tp_blocks for m in ("up", "down")}
        if tp_matrices != want:
            raise RuntimeError(f"TP matrices {sorted(tp_matrices)}, expected {sorted(want)}")


def _library_optimizer(cfg: DiffConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), **SGD)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **ADAMW)
    return _make_opt(model, cfg.optimizer, batch_same_shape=False,
                     **FREE_RUNNING_KWARGS.get(cfg.optimizer, {}))


@dataclasses.dataclass
class RankOutcome:
    """What one rank reports for one config (gathered on every rank, see the Note)."""

    error: str | None = None
    mismatches: list[str] = dataclasses.field(default_factory=list)  # rank 0: vs the reference
    losses: dict[str, float] = dataclasses.field(default_factory=dict)  # "step/micro" -> loss
    digests: list[str] = dataclasses.field(default_factory=list)  # HSDP: values seen per check


def _train(cfg: DiffConfig, rank: int, mesh: DeviceMesh, outcome: RankOutcome,
           reference_out: list) -> None:
    """Wrap, train 2 steps, compare on rank 0 (``reference_out`` gets the Reference)."""
    model = build_model(cfg.shape, cfg.seed)
    model.block_checkpoint = cfg.block_checkpoint
    if cfg.freeze and cfg.freeze_at == "before_wrap":
        _set_frozen(model, cfg.freeze, True)
    master = copy.deepcopy(model) if rank == 0 else None
    _wrap(cfg, model, mesh)
    if cfg.freeze and cfg.freeze_at == "after_wrap":
        _set_frozen(model, cfg.freeze, True)
        if master is not None:
            _set_frozen(master, cfg.freeze, True)
    opt = _library_optimizer(cfg, model)
    ref = Reference(cfg, master, mf.get_plan(model)) if rank == 0 else None
    reference_out.append(ref)
    # Read only right after wrapping and after each step: after a forward without backward the
    # tail's root FSDP2 module stays unsharded and its registered parameters are bf16 copies.
    start = full_values(model)
    for step in range(STEPS):
        if step == 1:
            _between_steps(cfg, model, rank, ref)
        snapshots: list[Grads] = []
        losses = run_backward_phase(cfg, model, cfg.data_rank(rank), step,
                                    functools.partial(mf.set_requires_gradient_sync, model),
                                    functools.partial(_snapshot, model, snapshots, outcome))
        outcome.losses.update({f"{step}/{m}": v for m, v in enumerate(losses)})
        opt.step()
        if cfg.optimizer == "soap":  # the reference adopts the library's first eigenbases
            state = full_optimizer_state(model, opt)  # collective
            if ref is not None:
                ref.library_state.clear()
                ref.library_state.update(state)
        after = full_values(model)
        outcome.digests.append(_digest(after))
        if ref is not None:
            try:
                outcome.mismatches += ref.check_step(step, start, snapshots, after)
            except Exception:  # the library run goes on: its peers are in its collectives
                outcome.mismatches.append(f"the reference raised (a harness bug or an invalid "
                                          f"config): {_short_traceback()}")
                ref = None
        opt.zero_grad(set_to_none=cfg.set_to_none)
        start = after


def _between_steps(cfg: DiffConfig, model: nn.Module, rank: int, ref: Reference | None) -> None:
    """Between step 0 and step 1: the forward that trains nothing, then (un)freezing."""
    if cfg.between != "none":
        _between_forward(cfg, model, cfg.data_rank(rank))
    if cfg.freeze and (cfg.freeze_at == "after_step0" or cfg.unfreeze_after_step0):
        frozen = cfg.freeze_at == "after_step0"
        _set_frozen(model, cfg.freeze, frozen)
        if ref is not None:
            _set_frozen(ref.master, cfg.freeze, frozen)


def _snapshot(model: nn.Module, snapshots: list[Grads], outcome: RankOutcome,
              synced: bool) -> None:
    """After a backward that synchronized: the library's whole gradients (collective)."""
    if synced:
        snapshots.append(full_values(model, "grad"))
        outcome.digests.append(_digest(snapshots[-1]))


# -- the reference (rank 0) ----------------------------------------------------------------------
@dataclasses.dataclass
class _Synced:
    """One rank's gradients at a synchronizing backward, and the summed norms of their parts
    (what each backward since the last one added)."""

    grads: Grads
    part_norms: dict[str, float]


class _Harvest:
    """``after_backward`` for a replica: collects a :class:`_Synced` at each synchronizing one.

    ``reduce_dtype`` (mixed precision): micro-batches accumulate as FSDP2 accumulates them with
    gradient sync off, each backward's bf16 gradient added into a sum in the reduction dtype
    (``FSDPParam.to_accumulated_grad_if_needed``), not summed in bf16 by autograd. Without it the
    replica's ``.grad`` accumulates in its own dtype, as FSDP2's does when no cast is needed.
    """

    def __init__(self, replica: nn.Module, reduce_dtype: torch.dtype | None = None) -> None:
        self.replica = replica
        self.reduce_dtype = reduce_dtype
        self.synced: list[_Synced] = []
        self._last: dict[str, torch.Tensor] = {}
        self._sums: dict[str, torch.Tensor] = {}  # in reduce_dtype
        self._norms: dict[str, float] = {}

    def __call__(self, synced: bool) -> None:
        for fqn, p in self.replica.named_parameters():
            if p.grad is None:
                continue
            if self.reduce_dtype is not None:  # p.grad is this backward's part alone
                part = p.grad.double()
                total = self._sums.get(fqn)
                self._sums[fqn] = p.grad.to(self.reduce_dtype) if total is None else \
                    total.add_(p.grad)
                p.grad = None
                grad = self._sums[fqn].double()
            else:
                grad = p.grad.double()
                part = grad - self._last[fqn] if fqn in self._last else grad
            self._norms[fqn] = self._norms.get(fqn, 0.0) + part.norm().item()
            self._last[fqn] = grad
        if synced:
            grads = {f: self._last.get(f) for f, _ in self.replica.named_parameters()}
            self.synced.append(_Synced(grads, self._norms))
            self.replica.zero_grad(set_to_none=True)
            self._last, self._sums, self._norms = {}, {}, {}


class Reference:
    """One process: replays every rank's pattern, steps teacher-forced (see the Note)."""

    def __init__(self, cfg: DiffConfig, master: nn.Module, plan: mf.Plan) -> None:
        self.cfg, self.master = cfg, master
        self.losses: dict[str, float] = {}  # "step/micro/rank" -> loss
        self.library_state: dict = {}
        matrices = {p.fqn for p in plan.params if p.role in ("matrix", "sharded_stack")}
        self.matrices = matrices
        params = master.parameters()
        if cfg.optimizer == "sgd":
            self.opt: object = torch.optim.SGD(params, **SGD)
        elif cfg.optimizer == "adamw":
            self.opt = torch.optim.AdamW(params, **ADAMW)
        else:
            self.opt = ReferenceStepper(master, matrices, cfg.optimizer, LR[cfg.optimizer],
                                        FREE_RUNNING_KWARGS.get(cfg.optimizer, {}),
                                        self.library_state.copy)

    def _replica_grads(self, step: int, rank: int) -> list[_Synced]:
        """``rank``'s local gradients at each synchronizing backward of ``step`` (float64)."""
        replica = copy.deepcopy(self.master)
        replica.zero_grad(set_to_none=True)
        if self.cfg.mixed_precision:
            replica.to(torch.bfloat16)
        harvest = _Harvest(replica, BF16.reduce_dtype if self.cfg.mixed_precision else None)
        losses = run_backward_phase(self.cfg, replica, rank, step, None, harvest)
        self.losses.update({f"{step}/{m}/{rank}": v for m, v in enumerate(losses)})
        return harvest.synced

    def expected_grads(self, step: int) -> list[tuple[Grads, dict[str, float]]]:
        """The averaged gradient the library must hold after each synchronizing backward, and
        the summed norms of its parts (see ``MP_GRAD_RTOL``)."""
        world = self.cfg.data_world
        per_rank = [self._replica_grads(step, r) for r in range(world)]
        running: Grads = {f: None if p.grad is None else p.grad.double()
                          for f, p in self.master.named_parameters()}
        scales = {f: 0.0 if g is None else g.norm().item() for f, g in running.items()}
        out = []
        for sync in range(len(per_rank[0])):
            total: Grads = {f: None for f in running}
            for synced in per_rank:
                total = _plus(total, synced[sync].grads)
                for f, norm in synced[sync].part_norms.items():
                    scales[f] += norm / world
            running = _plus(running, {f: None if g is None else g / world
                                      for f, g in total.items()})
            out.append((running, dict(scales)))
        return out

    def check_step(self, step: int, start: Grads, lib_grads: list[Grads],
                   lib_after: Grads) -> list[str]:
        """Compare one step; returns what differed (empty when it matches)."""
        cfg, params = self.cfg, dict(self.master.named_parameters())
        with torch.no_grad():
            for fqn, p in params.items():  # teacher forcing: the library's parameters
                p.copy_(start[fqn])
        want = self.expected_grads(step)
        rtol = {(False, False): GRAD_RTOL, (False, True): TP_RTOL, (True, False): MP_GRAD_RTOL,
                (True, True): TP_MP_RTOL}[cfg.mixed_precision, cfg.is_tp]
        out = [f"step {step}: {len(lib_grads)} synchronizing backwards, reference "
               f"{len(want)}"] if len(want) != len(lib_grads) else []
        tight = cfg.mixed_precision and _matrix_sums_exact(cfg)
        for k, (got, (expected, scales)) in enumerate(zip(lib_grads, want, strict=False)):
            what = f"step {step} grad after backward {k + 1}"
            if tight:  # the matrices at MP_MATRIX_GRAD_RTOL, the rest below
                out += compare(_only(got, self.matrices), _only(expected, self.matrices),
                               MP_MATRIX_GRAD_RTOL, f"{what} (matrix)", scales)
                got, expected = _only(got, self.matrices, False), _only(expected, self.matrices, False)
            out += compare(got, expected, rtol, what, scales if cfg.mixed_precision else None)
        for fqn, p in params.items():  # ... and its gradients
            g = lib_grads[-1][fqn] if lib_grads else None
            p.grad = None if g is None else g.to(p.dtype, copy=True)
        with torch.no_grad():
            self.opt.step()
        ref_after = {f: p.detach().clone() for f, p in params.items()}
        ref_update = {f: ref_after[f] - start[f] for f in start}
        allowed = UPDATE_RTOL[cfg.optimizer] / PARAM_RTOL  # see PARAM_ERR_AS_UPDATE
        out += compare(lib_after, ref_after, PARAM_RTOL, f"step {step} param",
                       {f: allowed * u.double().norm().item() for f, u in ref_update.items()}
                       if cfg.optimizer in PARAM_ERR_AS_UPDATE else None)
        out += compare({f: lib_after[f] - start[f] for f in start}, ref_update,
                       UPDATE_RTOL[cfg.optimizer], f"step {step} update")
        self.master.zero_grad(set_to_none=cfg.set_to_none)
        return out


# -- one config on every rank, agreed --------------------------------------------------------------
def _run_config(cfg: DiffConfig, rank: int, index: int) -> tuple[RankOutcome, Reference | None]:
    outcome, reference_out = RankOutcome(), []
    groups: list[dist.ProcessGroup] = []
    try:
        mesh, groups = _config_mesh(cfg, index)
        _train(cfg, rank, mesh, outcome, reference_out)
    except Exception as exc:  # reported below, agreed by every rank
        outcome.error = f"rank {rank} raised {type(exc).__name__}: {exc}\n{_short_traceback()}"
    if outcome.error is None:
        for group in groups:
            dist.destroy_process_group(group)
    return outcome, (reference_out[0] if reference_out else None)


def _short_traceback(lines: int = 14) -> str:
    return "\n".join(traceback.format_exc().rstrip().splitlines()[-lines:])


def _verdict(cfg: DiffConfig, outcomes: list[dict], ref: Reference | None) -> list[str]:
    """Rank 0: every reason ``cfg`` failed (empty: it passed)."""
    failures = [o["error"] for o in outcomes if o["error"] and "imed out" not in o["error"]]
    failures += [o["error"] for o in outcomes if o["error"] and "imed out" in o["error"]]
    failures += outcomes[0]["mismatches"]
    loss_rtol, loss_floor = LOSS_RTOL, 1e-30
    if cfg.is_tp:  # under mixed precision: relative to the loss, or to 1 when smaller
        loss_rtol, loss_floor = (TP_MP_LOSS_RTOL, 1.0) if cfg.mixed_precision else (TP_RTOL, 1e-30)
    if ref is not None and not failures:
        for rank, o in enumerate(outcomes):
            for key, loss in o["losses"].items():
                want = ref.losses.get(f"{key}/{cfg.data_rank(rank)}")
                if want is None or not abs(loss - want) <= loss_rtol * max(abs(want), loss_floor):
                    failures.append(f"loss step/micro {key} rank {rank}: library {loss!r}, "
                                    f"reference {want!r}")
        if cfg.mesh in ("hsdp", "hsdp_tp", "ep") and len({tuple(o["digests"]) for o in outcomes}) > 1:
            failures.append("HSDP replicas hold different values or gradients: "
                            f"{[o['digests'] for o in outcomes]}")
    return failures


def _world_main(rank: int, world: int, configs: list[DiffConfig], results: str) -> None:
    for index, cfg in enumerate(configs):
        outcome, ref = _run_config(cfg, rank, index)
        outcomes: list = [None] * world
        dist.all_gather_object(outcomes, dataclasses.asdict(outcome))  # every rank reaches it
        if rank == 0:
            failures = _verdict(cfg, outcomes, ref)
            with open(results, "a") as f:
                f.write(json.dumps({"seed": cfg.seed, "failures": failures}) + "\n")


# -- pytest ----------------------------------------------------------------------------------------
def _read_results(path: Path) -> dict[int, list[str]]:
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["seed"]] = record["failures"]
    return records


def run_seeds(world: int, seeds: list[int], results: Path) -> tuple[dict[int, list[str]], str]:
    """Every seed's failures (empty: passed). A world runs at most ``SEEDS_PER_WORLD`` seeds (a
    destroyed gloo group keeps its threads until the process ends). A world that dies (a rank
    aborted, e.g. by a gloo size mismatch) fails the seed it was running; a fresh world runs the
    seeds after it."""
    records: dict[int, list[str]] = {}
    remaining, trailing_crash = list(seeds), ""
    while remaining:
        batch, crash = remaining[:SEEDS_PER_WORLD], ""
        try:
            run_world(world, _world_main, [draw_config(s) for s in batch], str(results),
                      timeout=120 + 90 * len(batch))
        except AssertionError as exc:
            crash = str(exc)
        records.update(_read_results(results))
        unfinished = [s for s in batch if s not in records]
        if unfinished:  # the world died (or stopped) at the first of them
            reason = f"the world died running this seed: {crash[-2500:]}" if crash else "not run"
            records[unfinished[0]] = [reason]
        elif crash:
            trailing_crash = crash
        remaining = [s for s in remaining if s not in records]
    return records, trailing_crash


def _report(world: int, seeds: list[int], records: dict[int, list[str]], crash: str) -> str:
    failed = [s for s in seeds if records.get(s) or s not in records]
    lines = [f"differential harness, world {world}: {len(failed)} of {len(seeds)} seeds failed"]
    for seed in failed:
        reasons = records.get(seed, ["not run"])
        lines += [f"\nseed {seed}: {draw_config(seed).summary()}",
                  *(f"  {r}" for r in reasons[:10]),
                  *([f"  ... and {len(reasons) - 10} more"] if len(reasons) > 10 else []),
                  f"  reproduce: {REPRODUCE.format(seed=seed)}"]
    if crash:
        lines.append(f"\nthe world died after its last seed:\n{crash[-2500:]}")
    lines.append(f"\nfailing seeds: {','.join(map(str, failed))}")
    return "\n".join(lines)


def test_ci_seeds_cover_every_pattern() -> None:
    covered = set().union(*(features(draw_config(s)) for s in CI_SEEDS))
    assert feature_universe() <= covered, f"not covered: {sorted(feature_universe() - covered)}"


@pytest.mark.parametrize(("mesh", "seeds", "universe"), [
    ("tp", TP_CI_SEEDS, tp_feature_universe),
    ("hsdp_tp", HSDP_TP_CI_SEEDS, hsdp_tp_feature_universe),
    ("ep", EP_CI_SEEDS, ep_feature_universe),
])
def test_tp_ci_seeds_cover_every_pattern(mesh: str, seeds: tuple[int, ...],
                                         universe: Callable[[], set[str]]) -> None:
    configs = [draw_config(s) for s in seeds]
    assert all(c.mesh == mesh and (c.tp_blocks or mesh == "ep") for c in configs)
    covered = {f.removesuffix("@ranks") for c in configs for f in features(c)}
    missing = universe() - covered
    assert not missing, f"not covered: {sorted(missing)}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_differential(world: int, tmp_path: Path) -> None:
    seeds = [s for s in selected_seeds() if draw_config(s).world == world]
    if not seeds:
        pytest.skip(f"no selected seed draws world {world}")
    records, crash = run_seeds(world, seeds, tmp_path / "results.jsonl")
    if crash or any(records.get(s) or s not in records for s in seeds):
        raise AssertionError(_report(world, seeds, records, crash))


def test_pp_ci_seeds_cover_every_pattern() -> None:
    covered = set().union(*(draw_pp_config(s).features() for s in PP_CI_SEEDS))
    assert pp_feature_universe() <= covered, sorted(pp_feature_universe() - covered)


def test_differential_pp() -> None:
    """Pipeline-parallel seeds at world 4 (see ``tests/diff_pp.py``)."""
    seeds = pp_selected_seeds()
    if not seeds:
        pytest.skip("no selected pipeline seed")
    failed = []
    for start in range(0, len(seeds), SEEDS_PER_WORLD):
        batch = seeds[start:start + SEEDS_PER_WORLD]
        try:
            run_world(4, run_pp_configs, batch, timeout=120 + 60 * len(batch))
        except AssertionError as exc:
            failed.append(str(exc))
    assert not failed, "\n".join(failed)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        config = draw_config(int(arg))
        print(f"seed {arg}: {config.summary()}\n  {config}")
