"""The per-model runtime: hooks that drive every group through forward and backward.

[Note: one step of the matrix runtime]
- Root forward-pre (outside backward): work left over from a forward that stopped early (a prefix
  evaluation, an exception mid-forward, a forward with no backward) is retired first: see
  ``quiesce``. Nothing else is reset: several forwards may precede one backward.
- Group forward-pre: follow ``requires_grad`` changes of the matrices (see
  ``MatrixGroup.refresh_trainable``); gather the group's matrices from their owners
  (owner-segment all-gather-v), or finish the gather prefetched for it; swap the unsharded leaves
  into the modules; with grad enabled, wrap the inputs that require grad in ``_PostBackward`` (an
  identity whose backward marks this call's backward through the group as done). With prefetch
  on, the next group's gather is issued now, asynchronously.
- Group forward-post: swap the sharded parameters back; reshard (free non-owned storage) when
  ``reshard_after_forward`` or when grad is off; register pre-backward hooks on the outputs.
- Pre-backward (first gradient reaching a group's output): gather again if resharded (and prefetch
  the group that ran before it) and swap the unsharded leaves in until the group's post-backward
  (checkpointing that wraps ``forward`` itself, as Hugging Face's does, recomputes without the
  module's hooks); the first hook of a backward queues the end-of-backward callback.
- Post-backward (gradient reaching the group's inputs of one call): the group is resharded; when
  no other call's backward is pending, its reduction starts (see [Note: backward completion]):
  complete the previous group's reduction (its owners' averaged gradients are computed and its
  buffers freed; under HSDP its owners' all-reduce over the replicate group starts instead, and
  the one before it completes), pack this group's gradients and start their reduction to the
  owners (async). This event happens at the same point of the backward on every rank, also when
  some matrix got no gradient on some rank, so every rank issues the same collectives in the
  same order.
- End of backward: reduce the groups that may hold gradients not reduced yet, in registration
  order; retire all pending work; land the owners' gradients in ``.grad`` (one host
  synchronisation for all groups' presence flags); reshard everything. Which stream each step
  runs on: [Note: streams].
Activation-checkpoint recomputation re-enters the forward hooks inside backward
(``torch._C._current_graph_task_id() != -1``); see [Note: backward completion].
In-flight collectives live in one ``WorkQueue`` (see [Note: pending work]): at most one
prefetched gather, one reduction and (HSDP) one replicate all-reduce. So at most two groups are
gathered at once (the one computing and the prefetched one), and at most one group's reduction
buffers exist at any moment: the previous group's are retired before the next group packs its
gradients (an all-reduce in flight holds only one owner's segment).

[Note: backward completion]
A group's gradients may be reduced as soon as every backward that adds to them has run, and the
decision must fall at the same point of the backward on every rank (collectives match by order).
Autograd sums every use of a leaf (two forwards, a block called twice) in one AccumulateGrad node
that runs at the highest priority once its last contribution is in, so when the last pending
call's ``_PostBackward`` of a group has run, its leaves hold their gradients. Per group:
- ``calls_pending`` counts forward calls with grad whose ``_PostBackward`` has not run; the one
  that brings it to zero reduces (if ``needs_reduce``). Every call's post-backward reshards, so
  k forwards before one backward still gather at most two groups at a time (a later call's
  backward gathers again).
- ``needs_reduce`` marks gradients that may have accumulated since the group's last reduction:
  set by a forward with grad, a recomputation and a pre-backward; cleared by a reduction.
- Reductions are linear and landing adds into ``.grad``, so reducing a group twice in one backward
  (reentrant checkpointing of two forwards, ``retain_graph`` backwards, a callback that came
  early) gives the same gradient as reducing once.
- Reentrant activation checkpointing runs the forward under ``no_grad`` (no call is counted) and
  recomputes inside backward, in the outer backward's graph task, then runs a nested backward.
  The recomputation queues the outer end-of-backward callback and, having no pending call,
  registers one (its inputs are fresh leaves that require grad), so the nested backward's
  post-backward reduces and reshards the group. A non-reentrant recomputation happens while the
  forward's call is still pending, so it registers none.
- A recomputed group whose backward has not started (``backward_running``: between its
  pre-backward and post-backward) is *parked*: it stays gathered, with pre-backward hooks on the
  recomputation's outputs, until another group is gathered, which reshards it first. A block's
  own recomputation is followed by its backward at once (no second gather); a recomputation of
  the whole model gathers one group after another, and each is gathered again by its backward.
- The end-of-backward callback reduces every group with ``needs_reduce`` (the same set on every
  rank: it follows which groups ran, not which gradients exist), then forgets the calls: a
  forward whose graph was dropped without backward cannot hold back later reductions. With
  gradient sync off (accumulation), ``needs_reduce`` survives until a synced backward.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..collectives import OwnerComm, Phase, comm_phase
from ..nonfinite import discard_global_norm
from ..planner import Plan
from .group import GradHandoff, GroupState, MatrixGroup, land_grads
from .matrix_param import MatrixParam
from .mesh import DataParallelMesh
from .pending import PendingWork, WorkKind, WorkQueue
from .streams import InFlight, RuntimeStreams
from .tail import (
    discard_tail_held_grads,
    discard_tail_partial_sums,
    refresh_tail_dtypes,
    reset_finished_fsdp_state,
    reshard_tail,
)

__all__ = ["DEFAULT_IN_FLIGHT", "MatrixFSDPState", "in_backward"]

logger = logging.getLogger(__name__)

# How many collectives of each kind may be in flight (see [Note: pending work]).
DEFAULT_IN_FLIGHT: dict[WorkKind, int] = {
    WorkKind.GATHER: 1, WorkKind.REDUCE: 1, WorkKind.ALL_REDUCE: 1,
}


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a group's inputs; its backward runs once the group's backward is complete."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


class MatrixFSDPState:
    """Everything the runtime knows about one wrapped model."""

    def __init__(
        self,
        *,
        root: nn.Module,
        plan: Plan,
        groups: Sequence[MatrixGroup],
        comm: OwnerComm,
        mesh: DataParallelMesh,
        reshard_after_forward: bool,
        prefetch: bool = True,
        streams: RuntimeStreams | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.root = root
        self.tp_mesh = tp_mesh  # the tp mesh of a TP-parallelized model (see [Note: TP matrices])
        self.experts: Any = None  # ExpertMesh of an expert-parallel model (runtime/experts.py)
        self.plan = plan
        self.groups = list(groups)
        self.comm = comm
        self.dp_mesh = mesh
        self.mesh = mesh.mesh  # the DeviceMesh the tail is sharded on (1-D, or 2-D for HSDP)
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.requires_grad_sync = True
        self.requires_all_reduce = True  # HSDP: all-reduce owned gradients over the replicas
        # FSDP2's set_reshard_after_backward (see [Note: FSDPModule methods] in fsdp_methods.py):
        # with it off, groups stay gathered after backward ("held") until a forward reshards them.
        self.reshard_after_backward = True
        self._held: set[int] = set()  # ids of groups kept unsharded by reshard_after_backward/unshard()
        self.is_last_backward = True  # recorded (FSDP2's set_is_last_backward); no effect on matrices
        self.post_optim_event: Any = None  # the next forward waits on it before gathering
        self.params: dict[str, MatrixParam] = {p.fqn: p for g in self.groups for p in g.params}
        self.queue = WorkQueue.with_limits(DEFAULT_IN_FLIGHT)
        # The side streams every group shares (see [Note: streams]).
        self.streams = streams if streams is not None else RuntimeStreams()
        for group in self.groups:
            group._streams = self.streams
        # Finished reductions whose gradients land at the end of backward: (handoff, event).
        self._landing: list[tuple[GradHandoff, Any]] = []
        self._fsdp_modules: list[FSDPModule] | None = None  # found on first quiesce()
        self._last_forward_order: list[MatrixGroup] = []
        self._forward_order: list[MatrixGroup] = []
        self._root_forward_running = False
        self._root_unsharded_for: MatrixGroup | None = None
        self._tail_in_root: dict[str, bool] = {}
        self._end_backward()

    # -- iteration bookkeeping --------------------------------------------------------------------
    def _end_backward(self) -> None:
        """Forget this backward's forward calls (see [Note: backward completion])."""
        if self._forward_order:
            self._last_forward_order = self._forward_order
        self._forward_order: list[MatrixGroup] = []
        self._parked: list[MatrixGroup] = []  # recomputed, gathered, backward not started
        self._callback_queued = False
        self._grad_forward_pending = False
        for group in self.groups:
            group.end_backward(accumulating=not self.requires_grad_sync)

    def _neighbor(self, order: Sequence[MatrixGroup], group: MatrixGroup, step: int) -> MatrixGroup | None:
        """The group ``step`` places after ``group`` in ``order`` (None at either end)."""
        for i, g in enumerate(order):
            if g is group:
                j = i + step
                return order[j] if 0 <= j < len(order) else None
        return None

    # -- hook registration ------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """Every hook runs eagerly under ``torch.compile`` (see ``_eager``)."""
        matrices = {id(p.sharded) for p in self.params.values()}
        self._tail_in_root = {  # groups with a tail but no FSDP2 unit (see [Note: tail units])
            g.name: not isinstance(g.module, FSDPModule)
            and any(id(p) not in matrices for p in g.module.parameters())
            for g in self.groups}
        self.root.register_forward_pre_hook(_eager(self._root_pre_forward), prepend=True)
        self.root.register_forward_hook(_eager(self._root_post_forward))  # after FSDP2's
        for module in self.root.modules():  # before FSDP2's own pre-forward hooks
            if isinstance(module, FSDPModule):
                module.register_forward_pre_hook(_eager(_before_fsdp_pre_forward), prepend=True)
        for group in self.groups:
            module = group.module
            module.register_forward_pre_hook(
                _eager(functools.partial(self._pre_forward, group)), with_kwargs=True
            )
            module.register_forward_hook(_eager(functools.partial(self._post_forward, group)))

    # -- gathers through the queue ----------------------------------------------------------------
    def _unshard(self, group: MatrixGroup) -> None:
        """Make ``group`` unsharded now: finish its prefetched gather, or gather synchronously."""
        work = self.queue.take(WorkKind.GATHER, group)
        if work is not None:
            work.finish()
        elif group.state is GroupState.SHARDED:
            self._evict_parked(group)
        group.unshard()  # no-op unless still sharded

    def hold_unsharded(self, group: MatrixGroup) -> None:
        """FSDP2's ``unshard()``: gather ``group`` now and keep it until a reshard."""
        with comm_phase(Phase.FORWARD):
            self._unshard(group)
        self._held.add(id(group))
        group.use_unsharded()

    def _prefetch(self, group: MatrixGroup) -> None:
        if group.state is not GroupState.SHARDED:
            return
        self._evict_parked(group)
        self.queue.make_room(WorkKind.GATHER)
        group.unshard(async_op=True)
        self.queue.push(PendingWork(WorkKind.GATHER, group, finish=group.wait_unshard,
                                    discard=group.reshard, event=group.gather_event))

    def _reshard(self, group: MatrixGroup) -> None:
        self._held.discard(id(group))
        work = self.queue.take(WorkKind.GATHER, group)
        if work is not None:
            work.drop()
        group.reshard()
        group.use_sharded()

    def _evict_parked(self, keep: MatrixGroup) -> None:
        """Reshard recomputed groups whose backward has not started (see [Note: backward
        completion]) before another group is gathered; their pre-backward gathers them again."""
        parked, self._parked = self._parked, []
        for group in parked:
            if group is keep or group.backward_running:
                continue
            self._reshard(group)

    # -- forward ----------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: object) -> None:
        MatrixParam.end_init_window(self.params.values())  # [Note: matrix init RNG]
        if in_backward():  # a recomputation (activation checkpointing around the whole model)
            self._queue_final_callback()
            return
        self._drain()
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None:  # FSDP2's set_post_optim_event: gathers follow the optimizer's work
            event.wait()
        for group in self.groups:  # held groups stay gathered (FSDP2's reshard_after_backward),
            if id(group) not in self._held and not (  # and, as FSDP2 keeps them, groups kept
                    not self.reshard_after_forward and group.calls_pending):  # for a backward
                group.reshard()
            group.use_sharded()
        # A forward that had no backward may have left the tail unsharded; one whose backward is
        # pending (microbatches) or with reshard_after_backward off (pipelining) keeps it, as
        # FSDP2 keeps the root's unit, for the backward.
        if not self._grad_forward_pending and self.reshard_after_backward:
            self._reshard_tail()
        self._root_forward_running = True
        if self._forward_order:  # a new forward: its groups are recorded again
            self._last_forward_order, self._forward_order = self._forward_order, []

    def _root_post_forward(self, module: nn.Module, args: object, output: object) -> None:
        if in_backward():
            return
        self._root_forward_running = False
        if not torch.is_grad_enabled():
            self._reshard_tail()  # no backward follows (see [Note: the tail after forward])
        else:
            self._grad_forward_pending = True  # until the end of a backward

    def _tail_from_root(self, group: MatrixGroup, starting: bool) -> None:
        """A group called on its own (not inside the model's forward) whose tail lives in the
        root's FSDP2 unit (see [Note: tail units]): unshard that unit around the call."""
        if starting:
            if self._root_forward_running or not self._tail_in_root.get(group.name):
                return
            if torch.is_grad_enabled():
                raise NotImplementedError(
                    f"module {group.name!r} was called on its own with grad enabled, but its "
                    "parameters that are not matrices (norms, biases) live in the root's FSDP2 "
                    "unit (fully_shard_matrix(..., tail_units='auto')), whose gradients only a "
                    "forward of the whole model reduces; call the whole model, run the module "
                    "under torch.no_grad(), or wrap with tail_units='groups'"
                )
            FSDPModule.unshard(self.root)  # type: ignore[arg-type]  # the tail only
            self._root_unsharded_for = group
        elif self._root_unsharded_for is group:
            self._root_unsharded_for = None
            reshard_tail(self.root)  # type: ignore[arg-type]

    def _pre_forward(
        self, group: MatrixGroup, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        recompute = in_backward()
        if recompute:
            self._queue_final_callback()
        else:
            self._tail_from_root(group, starting=True)
            group.refresh_trainable()
        with comm_phase(Phase.BACKWARD if recompute else Phase.FORWARD):
            self._unshard(group)
            if self.prefetch and not recompute:
                nxt = self._neighbor(self._last_forward_order, group, +1)
                if nxt is not None:
                    self._prefetch(nxt)
        if torch.is_grad_enabled():
            if group.trainable:
                group.needs_reduce = True
            if not recompute or group.calls_pending == 0:  # else non-reentrant: it is pending
                args, kwargs = self._register_post_backward(group, args, kwargs)
        # After the post-backward node: a TP matrix's DTensor view is created now, so autograd
        # runs the view's backward (a later node) before the post-backward reads its gradient.
        group.use_unsharded()
        return args, kwargs

    def _register_post_backward(self, group: MatrixGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        index = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not index:
            return args, kwargs
        group.calls_pending += 1
        wrapped = _PostBackward.apply(functools.partial(self._post_backward, group),
                                      *(flat[i] for i in index))
        for i, tensor in zip(index, wrapped, strict=True):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    def _post_forward(
        self, group: MatrixGroup, module: nn.Module, args: object, output: object
    ) -> object:
        if in_backward():  # a recomputation (see [Note: backward completion])
            if not group.backward_running:
                group.use_sharded()
                self._parked.append(group)
                self._register_pre_backward(group, output)
            return output
        group.use_sharded()
        self._tail_from_root(group, starting=False)
        if group not in self._forward_order:
            self._forward_order.append(group)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(group)
        self._register_pre_backward(group, output)
        return output

    def _register_pre_backward(self, group: MatrixGroup, output: object) -> None:
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._pre_backward, group))

    # -- backward ---------------------------------------------------------------------------------
    def _pre_backward(self, group: MatrixGroup, grad: torch.Tensor) -> None:
        self._queue_final_callback()
        group.backward_running = True
        if group.trainable:
            group.needs_reduce = True
        with comm_phase(Phase.BACKWARD):
            self._unshard(group)
            group.use_unsharded()  # a recomputation that bypasses module hooks computes with them
            if self.prefetch:
                order = self._forward_order or self._last_forward_order
                previous = self._neighbor(order, group, -1)
                if previous is not None and previous.calls_pending > 0:
                    self._prefetch(previous)

    def _post_backward(self, group: MatrixGroup) -> None:
        """One forward call's backward through ``group`` has run (see [Note: backward completion])."""
        self._queue_final_callback()
        group.backward_running = False
        group.calls_pending = max(group.calls_pending - 1, 0)
        if group.calls_pending == 0 and self.requires_grad_sync:
            with comm_phase(Phase.BACKWARD):
                self._reduce(group)
        elif group.calls_pending == 0:  # sync off: [Note: accumulation in reduce_dtype]
            group.accumulate_grads()
        if self.reshard_after_backward:
            self._reshard(group)  # free non-owned storage now; another call's backward regathers
        else:
            self._held.add(id(group))
            group.use_sharded()

    def _reduce(self, group: MatrixGroup) -> None:
        if not group.needs_reduce or not group.trainable:
            return
        group.needs_reduce = False
        # Retire the previous reduction first (its owners' gradients land, its buffers go), so
        # that this group's buffers are allocated only after those are freed.
        self.queue.make_room(WorkKind.REDUCE)
        reduce = group.reduce_grads()
        self.queue.push(PendingWork(WorkKind.REDUCE, group, event=reduce.event,
                                    finish=functools.partial(self._finish_reduce, group, reduce)))

    def _finish_reduce(self, group: MatrixGroup, reduce: InFlight) -> None:
        """Complete a reduction; under HSDP its owners' all-reduce over the replicas starts now."""
        outcome = group.finish_reduce(reduce, all_reduce=self.requires_all_reduce)
        if isinstance(outcome, GradHandoff):
            self._landing.append((outcome, reduce.event))
        elif outcome is not None:  # issued before the previous one is waited: they overlap
            self.queue.push(PendingWork(WorkKind.ALL_REDUCE, group, event=outcome.event,
                                        finish=functools.partial(self._finish_all_reduce, outcome)))

    def _finish_all_reduce(self, work: InFlight[GradHandoff]) -> None:
        handoff = work.complete()
        assert handoff is not None  # an all-reduce is only issued for owned gradients
        self._landing.append((handoff, work.event))

    def _drain(self) -> None:
        """Retire all pending work, then land every finished reduction's gradients.

        Compute waits each landing event first; the host then reads all presence flags at once
        (the runtime's one host synchronisation per backward, see [Note: streams]).
        """
        self.queue.drain()
        landing, self._landing = self._landing, []
        if landing:
            ops = self.streams.ops
            for _, event in landing:
                ops.current_waits(event)
            land_grads([handoff for handoff, _ in landing])

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        discard_global_norm(self)  # a clip norm recorded before this backward is stale
        try:
            with comm_phase(Phase.BACKWARD):
                for group in self.groups:  # registration order: the same on every rank
                    if self.requires_grad_sync:
                        self._reduce(group)
                    else:  # what no post-backward moved yet ([Note: accumulation in reduce_dtype])
                        group.accumulate_grads()
                self._drain()
        finally:  # also when landing raised: leave no gathered copy behind (unless held)
            for group in self.groups:
                if self.reshard_after_backward or group.state is not GroupState.UNSHARDED:
                    self._held.discard(id(group))
                    group.reshard()
                else:
                    self._held.add(id(group))
                group.use_sharded()
            self._end_backward()

    def flush_reductions(self) -> None:
        """Outside backward: what the end of backward does, for pipelining's end of step.

        ``torch.distributed.pipelining`` runs every microbatch's backward with gradient sync off
        and then calls FSDP2's ``_root_post_backward_final_callback`` itself (see [Note:
        FSDPModule methods] in ``fsdp_methods.py``): with sync on, the groups whose gradients
        accumulated are reduced once, landed, and resharded. A no-op while this model's own
        end-of-backward callback is queued (that callback does the same).
        """
        if not self._callback_queued:
            self._final_callback()

    # -- control ----------------------------------------------------------------------------------
    def retire_pending(self) -> None:
        """Retire every pending collective and reshard every group (matrices only; local)."""
        self._drain()
        self._held.clear()
        for group in self.groups:
            group.reshard()
            group.use_sharded()

    def quiesce(self) -> None:
        """Leave no collective in flight and no gathered copy behind (call before mutating).

        Every pending collective completes: reductions hand owners their gradients, prefetched
        gathers are waited and dropped (they would hold values from before the mutation). Every
        group is resharded with its sharded parameters registered (also after an exception
        mid-forward left unsharded leaves in a module), and FSDP2 reshards the tail. Local: it
        issues no collective. ``MatrixOptimizer.step`` and the checkpoint load paths call it.
        """
        if in_backward():
            raise RuntimeError("matrixfsdp: quiesce() cannot run inside backward")
        MatrixParam.end_init_window(self.params.values())  # [Note: matrix init RNG]
        self.retire_pending()
        self._reshard_tail()
        self._root_forward_running, self._root_unsharded_for = False, None
        self._grad_forward_pending = False

    def _find_fsdp_modules(self) -> list[FSDPModule]:
        if self._fsdp_modules is None:
            self._fsdp_modules = [m for m in self.root.modules() if isinstance(m, FSDPModule)]
        return self._fsdp_modules

    def _reshard_tail(self) -> None:
        for module in self._find_fsdp_modules():
            reshard_tail(module)
            refresh_tail_dtypes(module)

    def discard_partial_sums(self) -> bool:
        """Drop the owners' partial sums kept for the replicas (HSDP accumulation with
        ``set_requires_all_reduce(False)``); True if any existed. Called when gradients are
        cleared (``MatrixOptimizer.zero_grad``, a skipped step): a partial sum belongs to the
        gradients it was reduced from."""
        dropped = [group.discard_unreduced() for group in self.groups]
        dropped += [discard_tail_partial_sums(m) for m in self._find_fsdp_modules()]
        return any(dropped)

    # [Note: zero_grad and held gradients]
    # With gradient sync off, gradients wait for a later synced backward outside ``.grad``: in the
    # matrices' unsharded leaves or reduce-dtype accumulators ([Note: accumulation in
    # reduce_dtype] in ``group.py``), in FSDP2's unsharded tail parameters, and under HSDP with
    # ``set_requires_all_reduce(False)`` in owners' partial sums. Stock FSDP2 keeps all of them
    # across ``model.zero_grad()`` / ``optimizer.zero_grad()``, so a step abandoned
    # mid-accumulation (a NaN loss, a skipped batch) leaks its micro-batches into the next
    # reduction. ``MatrixOptimizer.zero_grad`` clears every gradient, as ``zero_grad`` does on one
    # device: the held ones too, matrices and tail alike (``discard_held_grads``; local, no
    # collective: which groups reduce next stays the same on every rank). A plain
    # ``torch.optim`` optimizer's ``zero_grad`` behaves as FSDP2's; call
    # ``get_state(model).discard_held_grads()`` there.
    def discard_held_grads(self) -> bool:
        """Drop every gradient held for a later reduction (see [Note: zero_grad and held
        gradients]): the matrices', FSDP2's tail's and the HSDP partial sums; True if any
        existed. Outside backward; local."""
        held = [group.discard_accumulated() for group in self.groups]
        held += [discard_tail_held_grads(m) for m in self._find_fsdp_modules()]
        held.append(self.discard_partial_sums())
        return any(held)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(replicate, shard)``: ``(1, N)`` on a flat mesh (see [Note: HSDP mesh])."""
        return self.dp_mesh.shape

    @property
    def replica_rank(self) -> int:
        """This rank's replica (its coordinate on the replicate dim; 0 on a flat mesh)."""
        return self.dp_mesh.replica_rank

    def resident_matrix_bytes(self) -> int:
        """Bytes of matrix storage this rank holds right now (owned shards + any gathered)."""
        return sum(g.resident_bytes() for g in self.groups)


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, run eagerly under ``torch.compile`` as FSDP2 runs its own hooks: a compiled block
    (``torch.compile(block)`` after wrapping) traces its body in one graph, while gathers,
    reductions and bookkeeping run between graphs."""
    import torch._dynamo  # lazily: only wrapping pays its import

    return torch._dynamo.disable(hook, recursive=True)


def _before_fsdp_pre_forward(module: nn.Module, args: object) -> None:
    if in_backward():  # a recomputation (see [Note: FSDP2 and reentrant recomputation])
        reset_finished_fsdp_state(module)
