"""The per-model runtime: hooks that drive every group through forward and backward.

[Note: one step of the matrix runtime]
- Root forward-pre: a new iteration starts (unless we are inside backward). Work left over from
  an iteration that stopped early (a prefix evaluation, an exception mid-forward, a forward with no
  backward) is retired first: see ``quiesce``.
- Group forward-pre: gather the group's matrices from their owners (owner-segment all-gather-v),
  or finish the gather prefetched for it; swap the unsharded leaves into the modules, and wrap the
  inputs that require grad in ``_PostBackward`` (an identity whose backward marks the group's
  backward as done). With prefetch on, the next group's gather is issued now, asynchronously.
- Group forward-post: swap the sharded parameters back; reshard (free non-owned storage) when
  ``reshard_after_forward`` or when grad is off; register pre-backward hooks on the outputs.
- Pre-backward (first gradient reaching a group's output): gather again if resharded (and prefetch
  the group that ran before it); the first one in a backward queues the end-of-backward callback.
- Post-backward (gradient reaching the group's inputs): the autograd engine runs every
  AccumulateGrad node as soon as it is ready (highest priority), so all of the group's parameter
  gradients are in place; complete the previous group's reduction (its owners' averaged
  gradients are computed and its buffers freed; under HSDP its owners' all-reduce over the
  replicate group starts instead, and the one before it completes), pack this group's gradients
  and start their reduction to the owners (async), and reshard. This event happens at the same point of the backward on every
  rank, also when some matrix got no gradient on some rank, so every rank issues the same
  collectives in the same order.
- End of backward: reduce groups whose post-backward never fired (their inputs needed no grad),
  in registration order; retire all pending work; land the owners' gradients in ``.grad`` (one
  host synchronisation for all groups' presence flags); reshard everything. Which stream each
  step runs on: [Note: streams].
Activation-checkpoint recomputation re-enters the forward hooks inside backward; they then only
swap parameters (``torch._C._current_graph_task_id() != -1`` tells us we are in backward).
In-flight collectives live in one ``WorkQueue`` (see [Note: pending work]): at most one
prefetched gather, one reduction and (HSDP) one replicate all-reduce. So at most two groups are
gathered at once (the one computing and the prefetched one), and at most one group's reduction
buffers exist at any moment: the previous group's are retired before the next group packs its
gradients (an all-reduce in flight holds only one owner's segment).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..collectives import OwnerComm, Phase, comm_phase
from ..planner import Plan
from .group import GradHandoff, GroupState, MatrixGroup, land_grads
from .matrix_param import MatrixParam
from .mesh import DataParallelMesh
from .pending import PendingWork, WorkKind, WorkQueue
from .streams import InFlight, RuntimeStreams

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
    ) -> None:
        self.root = root
        self.plan = plan
        self.groups = list(groups)
        self.comm = comm
        self.dp_mesh = mesh
        self.mesh = mesh.mesh  # the DeviceMesh the tail is sharded on (1-D, or 2-D for HSDP)
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.requires_grad_sync = True
        self.requires_all_reduce = True  # HSDP: all-reduce owned gradients over the replicas
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
        self._reset_iteration()

    # -- iteration bookkeeping --------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._forward_order: list[MatrixGroup] = []
        self._callback_queued = False
        for group in self.groups:
            group.begin_iteration()

    def _neighbor(self, order: Sequence[MatrixGroup], group: MatrixGroup, step: int) -> MatrixGroup | None:
        """The group ``step`` places after ``group`` in ``order`` (None at either end)."""
        for i, g in enumerate(order):
            if g is group:
                j = i + step
                return order[j] if 0 <= j < len(order) else None
        return None

    # -- hook registration ------------------------------------------------------------------------
    def register_hooks(self) -> None:
        self.root.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        for group in self.groups:
            module = group.module
            module.register_forward_pre_hook(
                functools.partial(self._pre_forward, group), with_kwargs=True
            )
            module.register_forward_hook(functools.partial(self._post_forward, group))

    # -- gathers through the queue ----------------------------------------------------------------
    def _unshard(self, group: MatrixGroup) -> None:
        """Make ``group`` unsharded now: finish its prefetched gather, or gather synchronously."""
        work = self.queue.take(WorkKind.GATHER, group)
        if work is not None:
            work.finish()
        group.unshard()  # no-op unless still sharded

    def _prefetch(self, group: MatrixGroup) -> None:
        if group.state is not GroupState.SHARDED:
            return
        self.queue.make_room(WorkKind.GATHER)
        group.unshard(async_op=True)
        self.queue.push(PendingWork(WorkKind.GATHER, group, finish=group.wait_unshard,
                                    discard=group.reshard, event=group.gather_event))

    def _reshard(self, group: MatrixGroup) -> None:
        work = self.queue.take(WorkKind.GATHER, group)
        if work is not None:
            work.drop()
        group.reshard()

    # -- forward ----------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: object) -> None:
        if not in_backward():
            if self._forward_order:
                self._last_forward_order = self._forward_order
            self.retire_pending()
            self._reset_iteration()

    def _pre_forward(
        self, group: MatrixGroup, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        recompute = in_backward()
        with comm_phase(Phase.BACKWARD if recompute else Phase.FORWARD):
            self._unshard(group)
            if self.prefetch and not recompute:
                nxt = self._neighbor(self._last_forward_order, group, +1)
                if nxt is not None:
                    self._prefetch(nxt)
        group.use_unsharded()
        if recompute or not torch.is_grad_enabled() or not group.trainable:
            return args, kwargs
        return self._register_post_backward(group, args, kwargs)

    def _register_post_backward(self, group: MatrixGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        index = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not index:
            return args, kwargs
        group.backwards_pending += 1
        wrapped = _PostBackward.apply(functools.partial(self._post_backward, group),
                                      *(flat[i] for i in index))
        for i, tensor in zip(index, wrapped, strict=True):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    def _post_forward(
        self, group: MatrixGroup, module: nn.Module, args: object, output: object
    ) -> object:
        group.use_sharded()
        if in_backward():  # activation-checkpoint recomputation
            return output
        if group not in self._forward_order:
            self._forward_order.append(group)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(group)
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._pre_backward, group))
        return output

    # -- backward ---------------------------------------------------------------------------------
    def _pre_backward(self, group: MatrixGroup, grad: torch.Tensor) -> None:
        self._queue_final_callback()
        with comm_phase(Phase.BACKWARD):
            self._unshard(group)
            if self.prefetch:
                previous = self._neighbor(self._forward_order, group, -1)
                if previous is not None and not previous.grads_reduced:
                    self._prefetch(previous)

    def _post_backward(self, group: MatrixGroup) -> None:
        group.backwards_pending -= 1
        if group.backwards_pending > 0:  # the module ran more than once: wait for its last backward
            return
        if self.requires_grad_sync:
            with comm_phase(Phase.BACKWARD):
                self._reduce(group)
        self._reshard(group)  # its backward is complete: free non-owned storage now

    def _reduce(self, group: MatrixGroup) -> None:
        if group.grads_reduced or not group.trainable:
            return
        group.grads_reduced = True
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
        try:
            with comm_phase(Phase.BACKWARD):
                if self.requires_grad_sync:
                    for group in self.groups:  # registration order: the same on every rank
                        self._reduce(group)
                self._drain()
        finally:  # also when landing raised (see [Note: presence flags]): leave no gathered copy
            for group in self.groups:
                group.reshard()
                group.use_sharded()
            self._last_forward_order = self._forward_order
            self._reset_iteration()

    # -- control ----------------------------------------------------------------------------------
    def retire_pending(self) -> None:
        """Retire every pending collective and reshard every group (matrices only; local)."""
        self._drain()
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
        self.retire_pending()
        if self._fsdp_modules is None:
            self._fsdp_modules = [m for m in self.root.modules() if isinstance(m, FSDPModule)]
        for module in self._fsdp_modules:
            _reshard_tail(module)

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


def _reshard_tail(module: FSDPModule) -> None:
    """Register FSDP2's sharded parameters again, whatever state a forward left them in.

    ``FSDPModule.reshard()`` keeps a ``reshard_after_forward=False`` group (the root's) unsharded
    while its forward has not completed, e.g. after an exception mid-forward; its next forward
    would then compute with the stale unsharded copy. FSDP2's own state-dict hooks reshard with
    ``_to_sharded()``; do the same where it exists.
    """
    module.reshard()
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older FSDP2: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    for group in groups:
        to_sharded = getattr(group, "_to_sharded", None)
        if to_sharded is not None:
            to_sharded()
