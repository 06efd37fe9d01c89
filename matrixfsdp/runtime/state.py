"""The per-model runtime: hooks that drive every group through forward and backward.

[Note: one step of the matrix runtime]
- Root forward-pre: a new iteration starts (unless we are inside backward).
- Group forward-pre: gather the group's matrices from their owners (owner-segment all-gather-v),
  swap the unsharded leaves into the modules.
- Group forward-post: swap the sharded parameters back; reshard (free non-owned storage) when
  ``reshard_after_forward`` or when grad is off; register pre-backward hooks on the outputs.
- Pre-backward (first gradient reaching a group's output): gather again if resharded; the first
  one in a backward queues the end-of-backward callback.
- Post-accumulate-grad on each unsharded leaf: once every trainable matrix of a group has its
  gradient, the group becomes *ready*. Reductions are issued strictly in *reduce order* (the
  reverse of this iteration's forward-post order), so every rank issues the same collectives in the
  same order even when a matrix is unused on some rank: a group waits for its predecessors.
- End of backward: issue the remaining reductions (unused matrices included, or ranks deadlock),
  wait on all, hand owners their averaged gradients, reshard every group.
Activation-checkpoint recomputation re-enters the forward hooks inside backward; they then only
swap parameters (``torch._C._current_graph_task_id() != -1`` tells us we are in backward).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from ..collectives import OwnerComm, Phase, comm_phase
from ..planner import Plan
from .group import MatrixGroup, PendingReduce
from .matrix_param import MatrixParam

__all__ = ["MatrixFSDPState", "in_backward"]

logger = logging.getLogger(__name__)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class MatrixFSDPState:
    """Everything the runtime knows about one wrapped model."""

    def __init__(
        self,
        *,
        root: nn.Module,
        plan: Plan,
        groups: Sequence[MatrixGroup],
        comm: OwnerComm,
        mesh: object,
        reshard_after_forward: bool,
    ) -> None:
        self.root = root
        self.plan = plan
        self.groups = list(groups)
        self.comm = comm
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.requires_grad_sync = True
        self.params: dict[str, MatrixParam] = {p.fqn: p for g in self.groups for p in g.params}
        self._handles: list[object] = []
        self._reset_iteration()

    # -- iteration bookkeeping --------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._forward_order: list[MatrixGroup] = []
        self._ready: set[int] = set()
        self._fired: dict[int, set[int]] = {}  # group id -> ids of leaves whose grad arrived
        self._issued: list[PendingReduce] = []
        self._issued_groups: set[int] = set()
        self._callback_queued = False

    def _reduce_order(self) -> list[MatrixGroup]:
        """Reverse forward order, then groups that did not run (registration order)."""
        ran = list(reversed(self._forward_order))
        seen = {id(g) for g in ran}
        order = ran + [g for g in self.groups if id(g) not in seen]
        return [g for g in order if g.trainable]

    # -- hook registration ------------------------------------------------------------------------
    def register_hooks(self) -> None:
        self._handles.append(
            self.root.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        )
        for group in self.groups:
            module = group.module
            self._handles.append(
                module.register_forward_pre_hook(functools.partial(self._pre_forward, group))
            )
            self._handles.append(
                module.register_forward_hook(functools.partial(self._post_forward, group))
            )
            for p in group.trainable:
                self._handles.append(
                    p.unsharded.register_post_accumulate_grad_hook(
                        functools.partial(self._post_accumulate_grad, group)
                    )
                )

    # -- forward ----------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: object) -> None:
        if not in_backward():
            self._reset_iteration()

    def _pre_forward(self, group: MatrixGroup, module: nn.Module, args: object) -> None:
        with comm_phase(Phase.BACKWARD if in_backward() else Phase.FORWARD):
            group.unshard()
            group.wait_unshard()
        group.use_unsharded()

    def _post_forward(
        self, group: MatrixGroup, module: nn.Module, args: object, output: object
    ) -> object:
        group.use_sharded()
        if in_backward():  # activation-checkpoint recomputation
            return output
        if group not in self._forward_order:
            self._forward_order.append(group)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            group.reshard()
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._pre_backward, group))
        return output

    # -- backward ---------------------------------------------------------------------------------
    def _pre_backward(self, group: MatrixGroup, grad: torch.Tensor) -> None:
        self._queue_final_callback()
        with comm_phase(Phase.BACKWARD):
            group.unshard()
            group.wait_unshard()

    def _post_accumulate_grad(self, group: MatrixGroup, param: torch.Tensor) -> None:
        self._queue_final_callback()
        fired = self._fired.setdefault(id(group), set())
        fired.add(id(param))
        # Count arrivals in *this* backward: earlier no-sync micro-batches leave grads behind.
        if not self.requires_grad_sync or len(fired) < len(group.trainable):
            return
        self._ready.add(id(group))
        self._issue_ready_reductions()

    def _issue_ready_reductions(self, force: bool = False) -> None:
        """Issue reductions in reduce order, stopping at the first group not ready (unless forced)."""
        with comm_phase(Phase.BACKWARD):
            for group in self._reduce_order():
                if id(group) in self._issued_groups:
                    continue
                if not force and id(group) not in self._ready:
                    return
                self._issued.append(group.reduce_grads())
                self._issued_groups.add(id(group))
                group.reshard()  # its backward is complete: free non-owned storage now

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        if self.requires_grad_sync:
            self._issue_ready_reductions(force=True)
        with comm_phase(Phase.BACKWARD):
            for reduce in self._issued:
                reduce.group.finish_reduce(reduce)
        for group in self.groups:
            group.reshard()
            group.use_sharded()
        self._reset_iteration()

    # -- control ----------------------------------------------------------------------------------
    def reshard_all(self) -> None:
        for group in self.groups:
            group.reshard()
            group.use_sharded()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()  # type: ignore[attr-defined]
        self._handles.clear()

    def resident_matrix_bytes(self) -> int:
        """Bytes of matrix storage this rank holds right now (owned shards + any gathered)."""
        return sum(g.resident_bytes() for g in self.groups)
