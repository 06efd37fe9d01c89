"""The differential harness's reference: tolerances, comparisons and one process replaying every
rank (``tests/test_differential.py`` drives it).

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
import hashlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf

from .checks import FREE_RUNNING_KWARGS
from .diff_models import DiffConfig, micro_loss
from .test_optim_dist import LR, ReferenceStepper

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
