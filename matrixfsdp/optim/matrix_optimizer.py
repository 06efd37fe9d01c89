"""``MatrixOptimizer``: a matrix optimizer on owners plus AdamW on the FSDP2 tail, one Optimizer.

Param group 0 (``kind="matrix"``) holds every matrix's sharded parameter in plan order: the whole
matrix on its owner, an empty tensor elsewhere. Empty ones are skipped and never get state, so the
step of each matrix runs on its owner alone and issues no collective. Param group 1
(``kind="tail"``) holds the FSDP2 DTensors and is stepped by a stock ``torch.optim.AdamW`` that
shares this optimizer's ``state`` and group dicts, so ``state_dict()``, LR schedulers and DCP see
one ordinary optimizer. ``add_param_group`` adds a group of either kind, routed by whether the
runtime manages its parameters as matrices (``param_groups.py``).

With ``skip_nonfinite=True`` a step whose global gradient norm is inf/NaN is skipped on every rank
alike; see [Note: skipping non-finite steps] in ``matrixfsdp.nonfinite``.

TP matrices (``parallelize_module`` before ``fully_shard_matrix``; [Note: TP matrices]) are stepped
whole: their TP shards meet on a step owner in the owner row's tp group, which keeps their state
(see [Note: TP step exchange] in ``matrixfsdp.optim.tp_step``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from ..api import get_state, global_grad_norm
from ..collectives import Phase, comm_phase
from ..nonfinite import discard_global_norm, take_global_norm
from ..runtime.optim_state_view import install_optimizer_state_view
from .agreement import StepFailures, agree_on_step, finite_flags, is_all_zero, probe_torch_class
from .flat_state import MatrixState, owner_state_names
from .layouts import (
    MatrixLayout,
    SplitSpec,
    matrix_layout,
    refuse_other_split,
    resolve_split,
    split_key,
)
from .owner_step import (
    OwnedMatrix,
    StepBatching,
    batch_owned,
    init_owned_state,
    local,
    owned_blocks,
    resolve_batching,
    step_owned,
    write_back_rows,
)
from .param_groups import (
    MatrixParamGroups,
    build_matrix_group,
    build_tail_optimizer,
    check_rates,
    check_torch_class,
    matrix_params,
    state_placement,
)
from .registry import MatrixOptimizerSpec
from .tp_step import TpMatrix, WholeStepper, step_tp_matrices, tp_step_owners

__all__ = ["MatrixOptimizer", "state_bytes"]

logger = logging.getLogger(__name__)


class MatrixOptimizer(MatrixParamGroups, torch.optim.Optimizer):
    """Matrix optimizer for owned matrices + tail optimizer for FSDP2 shards.

    Args:
        model: a model wrapped by ``fully_shard_matrix``.
        optimizer: a registered name (``"muon"``, ``"shampoo"``, ``"soap"``, ``"okls"``,
            ``"emagram"``, ``"adamw"``, or one added by ``register_matrix_optimizer``) or a
            single-device ``torch.optim.Optimizer`` class (e.g. ``torch.optim.Muon``) applied to
            the matrices this rank owns.
        lr, weight_decay: the matrices' learning rate and decoupled weight decay.
        tail_optimizer: ``"adamw"`` or a ``torch.optim.Optimizer`` class for the tail.
        tail_lr, tail_weight_decay: the tail's learning rate and weight decay.
        tail_optimizer_kwargs: extra keyword arguments for the tail optimizer.
        batch_same_shape: step same-shape owned matrices as one ``(B, m, n)`` batch (one bmm /
            batched eigh instead of B small calls; the result equals the unbatched step up to
            rounding). ``None`` (default) batches on CUDA, where it saves kernel launches, and
            not on CPU, where stacking measured slower (Muon 136 vs 111 ms) and costs memory.
            A ``StepBatching`` sets the cap on the bytes one batch stacks (default: the larger
            of the largest matrix's and 16 MiB; see [Note: owner step transients]).
        split: step fused matrices as separate blocks (see [Note: matrix views]): a mapping
            from a matrix FQN or ``fnmatch`` pattern to a number of equal blocks or to the block
            sizes along the output dim of its ``(out, in)`` matrix (e.g. ``{"*.attn.c_attn.weight":
            3}`` for GPT-2's q|k|v, ``{"*.experts.gate_up_proj": 2}`` for gate|up), to any sets
            of rows (a ``RowLayout`` or a list of row index lists; ``qkv_row_layout(n_heads,
            n_kv_heads, head_dim, per="qkv"|"head")`` for torchtitan's interleaved ``wqkv``),
            or a callable ``(fqn, out_in_shape) -> any of those | None``. ``None`` (default):
            no split.
        offload_state: ``"cpu"`` keeps owned matrices' optimizer state in host memory (pinned on
            CUDA), staged onto the device two matrices at a time while stepping, with the next
            matrix's copy-in overlapping the current one's math (see [Note: optimizer state
            offload]); results equal on-device state bit for bit. ``None`` (default): on device.
        skip_nonfinite: skip a step whose global gradient norm is inf or NaN, on every rank
            alike: parameters and optimizer state stay unchanged, gradients are cleared, and
            ``skipped_steps`` / ``last_step_skipped`` record it. The decision reuses the norm of
            a ``clip_grad_norm_`` call made since the last step (no extra collective), else
            costs one scalar all-reduce (see [Note: skipping non-finite steps]).
        agree_on_error: opt-in. Make any failure in an owner's local step (an exception, or a
            NaN/inf gradient) the same ``MatrixStepError`` on every rank, naming the matrix's
            FQN and step, at the cost of one 4-byte all-reduce per step. The default
            (``False``) keeps the step free of collectives and still never lets a NaN/inf
            gradient or a non-converging eigensolver stop one rank alone: a matrix whose
            gradient is not finite is skipped on its owner, with a warning naming its FQN and
            step, and listed in ``nonfinite_matrices`` (see [Note: step agreement] in
            ``matrixfsdp.optim.agreement``).
        **optimizer_kwargs: the matrix optimizer's hyperparameters (e.g. Muon's ``momentum``,
            ``nesterov``, ``ns_steps``; OKLS's ``beta1``, ``beta2``, ``eps``).

    Recommended hyperparameters: the keyword defaults above are Muon's; each built-in optimizer
    has its own, from its reference implementation and checked on ``matrixfsdp train``'s default
    task ([Note: recommended hyperparameters] in ``matrixfsdp.optim.defaults``; ``matrixfsdp
    train`` applies them unless you set a value)::

        rec = matrixfsdp.optim.recommended_hyperparameters("soap")
        opt = MatrixOptimizer(model, optimizer="soap", **rec.matrix_optimizer_kwargs())

    ========  =======  =====  =============================================  ==========
    name      lr       wd     key hyperparameters                            tail lr
    ========  =======  =====  =============================================  ==========
    muon      0.02     0.01   momentum 0.95, Nesterov, 5 Newton-Schulz steps  3e-3
    okls      0.09434  0.0303 beta1 0.9684, beta2 0.9482, eps 1e-9 (AdamC)    3e-3
    soap      3e-3     0.01   betas (0.95, 0.95), precondition_frequency 10  3e-3
    shampoo   3e-3     1e-5   betas (0.9, 0.999), Adam grafting, roots/step  3e-3
    emagram   0.06     0.01   betas (0.95, 0.95), eps 1e-6 (relative)        3e-3
    adamw     3e-3     0.01   betas (0.9, 0.999), eps 1e-8                   = lr
    ========  =======  =====  =============================================  ==========
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: str | type[torch.optim.Optimizer] = "muon",
        lr: float = 0.02,
        weight_decay: float = 0.0,
        tail_optimizer: str | type[torch.optim.Optimizer] = "adamw",
        tail_lr: float = 3e-4,
        tail_weight_decay: float = 0.0,
        *,
        tail_optimizer_kwargs: Mapping[str, Any] | None = None,
        batch_same_shape: bool | StepBatching | None = None,
        split: SplitSpec | None = None,
        offload_state: str | None = None,
        skip_nonfinite: bool = False,
        agree_on_error: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        check_rates(lr=lr, weight_decay=weight_decay, tail_lr=tail_lr,
                    tail_weight_decay=tail_weight_decay)
        runtime = get_state(model)
        self._runtime = runtime
        matrices, fqns = matrix_params(model, runtime)
        orientation = {p.fqn: p.orientation for p in runtime.plan.params}
        self._orientation = {id(p): orientation[f] for p, f in zip(matrices, fqns, strict=True)}
        self._fqn_of = {id(p): f for p, f in zip(matrices, fqns, strict=True)}
        if not matrices:
            logger.warning(
                "matrixfsdp: MatrixOptimizer(%r) got zero matrices: the plan selected none, so the "
                "tail optimizer steps every parameter; check fully_shard_matrix's matrix_filter "
                "(get_plan(model).selection() lists the tail)", optimizer,
            )
        matrix_ids = {id(p) for p in matrices}
        self._matrix_ids = frozenset(matrix_ids)
        self._tail_args = (tail_optimizer, tail_lr, tail_weight_decay, dict(tail_optimizer_kwargs or {}))
        tail = [p for p in model.parameters() if id(p) not in matrix_ids]
        self._spec, self._matrix_cls, matrix_group = build_matrix_group(
            optimizer, matrices, lr, weight_decay, optimizer_kwargs
        )
        matrix_group["split"] = resolve_split(split, runtime.plan, fqns)
        if self._matrix_cls is not None:
            self._check_matrix_class(matrix_group, fqns, orientation)
        self._tp = _tp_entries(runtime, self._matrix_cls, self._spec)
        self._tp_elsewhere = {id(mp.sharded) for mp in runtime.params.values()
                              if getattr(mp, "tp", None) is not None and not mp.is_owner}
        self._tail_inner = build_tail_optimizer(tail_optimizer, tail, tail_lr, tail_weight_decay,
                                                tail_optimizer_kwargs or {})
        groups = [matrix_group]
        if self._tail_inner is not None:
            tail_group = self._tail_inner.param_groups[0]
            tail_group["kind"] = "tail"
            groups.append(tail_group)
        self._matrix_inners: dict[int, torch.optim.Optimizer] = {}  # torch class, per group
        super().__init__(groups, {})
        self._config_cache: tuple[tuple, Any] | None = None
        self._layout_cache: tuple[tuple, dict[int, MatrixLayout]] | None = None
        asked = getattr(batch_same_shape, "same_shape", batch_same_shape)  # StepBatching or bool
        self._placement = state_placement(offload_state, matrices, runtime.plan.sharded_stacks,
                                          self._matrix_cls, asked)
        self.step_batching = resolve_batching(
            batch_same_shape, any(p.is_cuda for p in matrices) and not self._placement.offloaded)
        self.batch_same_shape = self.step_batching.same_shape
        self._init_step_records(skip_nonfinite, agree_on_error)
        self._wrap_state()
        self._link_inner()
        self.register_load_state_dict_pre_hook(refuse_other_split, prepend=True)
        # state_dict()/load_state_dict() show every matrix's state on every rank, as matrix
        # DTensors, and a load keeps the state's dtypes (see [Note: optimizer state-dict view]).
        install_optimizer_state_view(self, keep_dtypes=True)

    def _check_matrix_class(self, group: dict[str, Any], fqns: list[str],
                            orientation: dict[str, str]) -> None:
        """What a torch.optim class for the matrices cannot do, refused before any step."""
        assert self._matrix_cls is not None
        plan = self._runtime.plan
        check_torch_class(self._matrix_cls, group["split"],
                          [f for f in fqns if orientation[f] != "out_in"])
        probe_torch_class(self._matrix_cls, group, plan.params, set(fqns))
        if plan.sharded_stacks:
            raise NotImplementedError(
                f"a torch.optim class cannot step the expert slices of sharded stacks "
                f"{[p.fqn for p in plan.sharded_stacks]}; register a step function "
                "(register_matrix_optimizer) or wrap with planner=LPTPlanner(stacks='whole')"
            )

    def _init_step_records(self, skip_nonfinite: bool, agree_on_error: bool) -> None:
        self.skip_nonfinite = bool(skip_nonfinite)
        self.agree_on_error = bool(agree_on_error)
        self._steps_called = 0
        self.nonfinite_matrices: list[tuple[int, str]] = []  # (step, fqn) skipped on this rank
        self.skipped_steps = 0  # steps skipped for a non-finite gradient norm (this process)
        self.last_step_skipped = False
        self.tp_step_bytes = 0  # bytes this rank sent in tp groups in the last step (TP matrices)

    def _wrap_state(self) -> None:
        """``state`` as a ``MatrixState`` (see [Note: flat optimizer state])."""
        ref = weakref.ref(self)

        def names_of(param: Any) -> list[str] | None:
            optimizer = ref()
            return None if optimizer is None else owner_state_names(optimizer, param)

        self.state = MatrixState(self.state, names_of)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_fqn_of" in self.__dict__ and not isinstance(self.state, MatrixState):
            self._wrap_state()  # torch's load_state_dict installs a plain defaultdict

    def _link_inner(self) -> None:
        """Point the inner optimizers at this optimizer's state and group dicts (one truth)."""
        if self._tail_inner is not None:
            self._tail_inner.state = self.state
            self._tail_inner.param_groups = [g for g in self.param_groups if g["kind"] == "tail"]
        for inner in self._matrix_inners.values():
            inner.state = self.state

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with every matrix's state on every rank, as matrix DTensors
        scattered from the owner (``step`` plain): collective over the model's mesh, like
        ``model.state_dict()`` (see [Note: optimizer state-dict view])."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, through the hooks of [Note: optimizer state-dict view]: takes this
        optimizer's ``state_dict()`` (matrix DTensors), a full one, or an owner-only one, and
        keeps the loaded state's dtypes. Collective when the state holds DTensors."""
        super().load_state_dict(state_dict)
        self._config_cache = None
        self._link_inner()

    # -- stepping ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._runtime.quiesce()  # no gather may read a parameter while it is being stepped
        with comm_phase(Phase.OPTIMIZER), record_function("matrixfsdp::optimizer_step"):
            self.tp_step_bytes = 0
            self.last_step_skipped = self.skip_nonfinite and self._nonfinite_grad_norm()
            if self.last_step_skipped:
                self.zero_grad(set_to_none=True)
                return loss
            discard_global_norm(self._runtime)
            self._steps_called += 1
            failures = StepFailures(self._steps_called) if self.agree_on_error else None
            for index, group in enumerate(self.param_groups):
                if group.get("kind") == "matrix":
                    self._step_matrices(index, group, failures)
            if failures is not None:  # one scalar all-reduce: the same verdict on every rank
                agree_on_step(self._runtime, failures)
            if self._tail_inner is not None:  # once, over every tail group
                self._tail_inner.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient, as on one device: ``.grad`` and the gradients held for a later
        reduction while gradient sync is off (matrices and FSDP2 tail; HSDP partial sums), which
        stock FSDP2 keeps (see [Note: zero_grad and held gradients] in ``runtime/state.py``)."""
        discard_global_norm(self._runtime)  # a recorded norm describes the cleared gradients
        self._runtime.discard_held_grads()  # an abandoned accumulation must not leak into the next
        super().zero_grad(set_to_none=set_to_none)

    def _nonfinite_grad_norm(self) -> bool:
        """Collective (or free after clipping): is the global gradient norm inf/NaN?"""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = take_global_norm(self._runtime, grads)
        if norm is None:
            norm = global_grad_norm(self._runtime.root)
        if bool(torch.isfinite(norm)):
            return False
        self.skipped_steps += 1
        log = logger.warning if self._runtime.comm.rank == 0 else logger.debug
        log("matrixfsdp: skipped an optimizer step: the global gradient norm is %s (%d skipped "
            "so far); parameters and optimizer state are unchanged", float(norm), self.skipped_steps)
        return True

    def _step_matrices(self, index: int, group: dict[str, Any],
                       failures: StepFailures | None = None) -> None:
        # Sharded stacks are DTensors: every rank keeps (possibly empty) state for them, so all
        # ranks agree on the state's keys; plain matrices have state on their owner only, TP
        # matrices on their step owner (the TP step below).
        owned = [p for p in group["params"] if id(p) not in self._tp and p.grad is not None
                 and (isinstance(p, DTensor) or p.numel() > 0)]
        tp_owned = [p for p in group["params"] if id(p) in self._tp and _tp_steps(p)]
        if not owned and not tp_owned:
            return
        if not tp_owned and self._only_materializes(group, owned):
            self._owned_items(owned, self._spec, self._config(group, self._spec),
                              self._layouts(group), {}, count_step=False)
            return
        if failures is not None:
            failures.watch([self._fqn_of[id(p)] for p in owned], [local(p.grad) for p in owned])
        elif not self.skip_nonfinite:  # skip_nonfinite=True: the global norm is finite already
            owned = self._skip_nonfinite([self._fqn_of[id(p)] for p in owned], owned)
        if self._matrix_cls is not None:
            try:
                self._step_with_torch_class(index, group)
            except Exception as exc:  # agreed on every rank by agree_on_step
                if failures is None:
                    raise
                failures.record([self._fqn_of[id(p)] for p in owned], exc)
            return
        spec = self._spec
        assert spec is not None  # one of the two is always set by build_matrix_group
        config = self._config(group, spec)
        hyper = {"lr": group["lr"], "weight_decay": group["weight_decay"],
                 "initial_lr": group["initial_lr"], "config": config}
        layouts = self._layouts(group)
        try:
            self._step_owned(owned, spec, config, layouts, hyper, failures)
        except Exception as exc:  # e.g. building state; agreed on every rank by agree_on_step
            if failures is None:
                raise
            failures.record([self._fqn_of[id(p)] for p in owned], exc)
        if tp_owned:
            matrices = [TpMatrix(fqn, p, tp, owner, layouts[id(p)])
                        for p in tp_owned for fqn, tp, owner in (self._tp[id(p)],)]
            on_nonfinite = None if failures is not None or self.skip_nonfinite else \
                self._skip_nonfinite
            stepper = WholeStepper(spec, hyper, self.state, self._placement, self.step_batching,
                                   failures, on_nonfinite)
            self.tp_step_bytes += step_tp_matrices(matrices, stepper).bytes_sent

    def _skip_nonfinite(self, fqns: list[str], params: list[Any]) -> list[Any]:
        """The entries of ``params`` whose gradient is finite (one host read); the others are
        skipped on this owner before anything of them changes (see [Note: step agreement])."""
        grads = [local(p.grad) if isinstance(p, torch.Tensor) else p.grad for p in params]
        flags = finite_flags(grads)
        kept = []
        for fqn, p, finite in zip(fqns, params, flags, strict=True):
            if finite:
                kept.append(p)
                continue
            self.nonfinite_matrices.append((self._steps_called, fqn))
            if isinstance(p, torch.Tensor):
                p.grad = None  # a torch.optim class then skips it too
            logger.warning(
                "matrixfsdp: optimizer step %d skipped matrix %r on its owner: its gradient holds "
                "NaN/inf (dropped; parameter and state unchanged; the other matrices stepped). "
                "Pass skip_nonfinite=True to skip the whole step on every rank, or "
                "agree_on_error=True to raise on every rank", self._steps_called, fqn)
        return kept

    def _step_owned(
        self, owned: list[nn.Parameter], spec: MatrixOptimizerSpec, config: Any,
        layouts: dict[int, MatrixLayout], hyper: dict[str, Any], failures: StepFailures | None,
    ) -> None:
        fqn_of: dict[int, str] = {}
        items = self._owned_items(owned, spec, config, layouts, fqn_of)
        for batch in self._placement.staged(batch_owned(items, self.step_batching)):
            try:
                step_owned(spec, batch, hyper)
            except Exception as exc:  # owner-local: agreed on every rank by agree_on_step
                if failures is None:
                    raise
                fqns = list(dict.fromkeys(fqn_of[id(item.grad)] for item in batch))
                failures.record(fqns, exc, [item.grad for item in batch], batch[0].step)
        write_back_rows(items)  # blocks of a row layout were stepped as gathered copies

    def _only_materializes(self, group: dict[str, Any], owned: list[nn.Parameter]) -> bool:
        """A zero-gradient, lr=0 first step (torchtitan's ``init_optim_state``, which makes
        state for its checkpointer): create each matrix's fresh state and step nothing, so
        training after it is training without it. The check costs one reduction per matrix, on
        lr=0 steps only; torch's own state for the tail steps as torch.optim does."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            return False  # reading it would sync the device every step; torchtitan's lr=0 is a host tensor
        if self._matrix_cls is not None or not owned or float(lr) != 0.0:
            return False
        if any(self.state.get(p) for p in owned):
            return False
        return all(is_all_zero(local(p.grad)) for p in owned)

    def _owned_items(
        self, owned: list[nn.Parameter], spec: MatrixOptimizerSpec, config: Any,
        layouts: dict[int, MatrixLayout], fqn_of: dict[int, str], count_step: bool = True,
    ) -> list[OwnedMatrix]:
        items = []
        for p in owned:
            state = self.state[p]
            if not state:
                state.update(init_owned_state(p, spec, config, layouts[id(p)]))
            self._placement.adopt(state)
            if not count_step:
                continue
            state["step"] += 1
            if local(p).numel() == 0:
                continue  # a rank with no experts of this stack: nothing to compute
            blocks = owned_blocks(p, state, layouts[id(p)])
            fqn_of.update((id(item.grad), self._fqn_of[id(p)]) for item in blocks)
            items += blocks
        return items

    def _layouts(self, group: dict[str, Any]) -> dict[int, MatrixLayout]:
        """Each matrix's orientation (from the plan) and blocks (from the group's ``split``)."""
        split = group.get("split") or {}
        key = split_key(split)
        if self._layout_cache is None or self._layout_cache[0] != key:
            layouts = {pid: matrix_layout(self._orientation[pid], split.get(fqn))
                       for pid, fqn in self._fqn_of.items()}
            self._layout_cache = (key, layouts)
        return self._layout_cache[1]

    def _step_with_torch_class(self, index: int, group: dict[str, Any]) -> None:
        cls = self._matrix_cls
        assert cls is not None  # checked by the caller
        inner = self._matrix_inners.get(index)
        if inner is None:
            owned_all = [p for p in group["params"] if p.numel() > 0]
            inner = cls(owned_all, **group["matrix_kwargs"], lr=group["lr"],
                        weight_decay=group["weight_decay"])
            self._matrix_inners[index] = inner
            self._link_inner()
        inner_group = inner.param_groups[0]
        inner_group["lr"], inner_group["weight_decay"] = group["lr"], group["weight_decay"]
        inner.step()

    def _config(self, group: dict[str, Any], spec: MatrixOptimizerSpec) -> Any:
        kwargs = group["matrix_kwargs"]
        key = tuple(sorted((k, _freeze(v)) for k, v in kwargs.items()))
        if self._config_cache is None or self._config_cache[0] != key:
            self._config_cache = (key, spec.make_config(kwargs))
        return self._config_cache[1]

    # -- reporting --------------------------------------------------------------------------------
    def tp_step_owner(self, param: torch.Tensor) -> int | None:
        """The tp rank that keeps TP matrix ``param``'s whole state: its step owner on the
        owner row, ``-1`` on other rows; ``None`` for a parameter that is no TP matrix (see
        [Note: TP step exchange])."""
        if id(param) in self._tp:
            return self._tp[id(param)][2]
        return -1 if id(param) in self._tp_elsewhere else None

    def matrix_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds for matrices (owned ones only, by design)."""
        return state_bytes(self.state[p] for g in self.param_groups if g.get("kind") == "matrix"
                           for p in g["params"] if p in self.state)

    def tail_state_bytes(self) -> int:
        """Bytes of this rank's local tail optimizer state (its FSDP2 shards)."""
        return state_bytes(self.state[p] for g in self.param_groups if g.get("kind") == "tail"
                           for p in g["params"] if p in self.state)


def state_bytes(states: Iterable[Mapping[str, Any]]) -> int:
    """Local bytes of the tensors in optimizer state entries (DTensors count their shard)."""
    total = 0
    for state in states:
        for value in state.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                total += value.untyped_storage().nbytes() if value.numel() else 0
    return total


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _tp_steps(p: nn.Parameter) -> bool:
    """Does this owner-row TP shard take part in the TP step? Its gradient says; an empty TP
    shard (``torch.chunk`` sizes) without one follows ``requires_grad`` (see [Note: TP step
    exchange]: every tp rank of the row must agree)."""
    return p.grad is not None or (p.numel() == 0 and p.requires_grad)


def _tp_entries(
    runtime: Any, matrix_cls: type | None, spec: MatrixOptimizerSpec | None
) -> dict[int, tuple[str, Any, int]]:
    """``id(TP shard) -> (fqn, TpLayout, step owner)`` for the TP matrices of this rank's owner
    row, step owners from plan order; a torch.optim class cannot step TP matrices."""
    tp_params = [mp for mp in runtime.params.values() if getattr(mp, "tp", None) is not None]
    if tp_params and matrix_cls is not None:
        mp = tp_params[0]
        raise NotImplementedError(
            f"MatrixOptimizer(optimizer={matrix_cls.__name__}) cannot step the TP matrix "
            f"{mp.fqn!r} (TP shard {tuple(mp.shape)} of global shape {mp.tp.global_shape}; "
            f"{len(tp_params)} TP matrices in all): a torch.optim class would step TP shards, not "
            "whole matrices; use a registered name (e.g. optimizer='muon'), which steps each TP "
            "matrix whole on one tp rank"
        )
    row = [mp for mp in tp_params if mp.is_owner]
    assert spec is not None or not row  # a torch.optim class was refused above
    owners = tp_step_owners([(mp.fqn, mp.tp) for mp in row], spec.name if spec else "")
    return {id(mp.sharded): (mp.fqn, mp.tp, owner) for mp, owner in zip(row, owners, strict=True)}
