"""The per-model runtime: hooks that drive every group through forward and backward.

[Note: one step of the matrix runtime]
- Root forward-pre: a new iteration starts (unless we are inside backward).
- Group forward-pre: gather the group's matrices from their owners (owner-segment all-gather-v),
  swap the unsharded leaves into the modules, and wrap the inputs that require grad in
  ``_PostBackward`` (an identity whose backward marks the group's backward as done). With
  prefetch on, the next group's gather is issued now, asynchronously.
- Group forward-post: swap the sharded parameters back; reshard (free non-owned storage) when
  ``reshard_after_forward`` or when grad is off; register pre-backward hooks on the outputs.
- Pre-backward (first gradient reaching a group's output): gather again if resharded (and prefetch
  the group that ran before it); the first one in a backward queues the end-of-backward callback.
- Post-backward (gradient reaching the group's inputs): the autograd engine runs every
  AccumulateGrad node as soon as it is ready (highest priority), so all of the group's parameter
  gradients are in place; reduce them to their owners (async) and reshard. This event happens at
  the same point of the backward on every rank, also when some matrix got no gradient on some
  rank, so every rank issues the same collectives in the same order.
- End of backward: reduce groups whose post-backward never fired (their inputs needed no grad),
  in registration order; wait on all; hand owners their averaged gradients; reshard everything.
Activation-checkpoint recomputation re-enters the forward hooks inside backward; they then only
swap parameters (``torch._C._current_graph_task_id() != -1`` tells us we are in backward).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..collectives import OwnerComm, Phase, comm_phase
from ..planner import Plan
from .group import MatrixGroup, PendingReduce
from .matrix_param import MatrixParam

__all__ = ["MatrixFSDPState", "in_backward"]

logger = logging.getLogger(__name__)


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
        mesh: object,
        reshard_after_forward: bool,
        prefetch: bool = True,
    ) -> None:
        self.root = root
        self.plan = plan
        self.groups = list(groups)
        self.comm = comm
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.requires_grad_sync = True
        self.params: dict[str, MatrixParam] = {p.fqn: p for g in self.groups for p in g.params}
        self._last_forward_order: list[MatrixGroup] = []
        self._reset_iteration()

    # -- iteration bookkeeping --------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._forward_order: list[MatrixGroup] = []
        self._pending_calls: dict[int, int] = {}  # group id -> forward calls awaiting backward
        self._issued: list[PendingReduce] = []
        self._reduced: set[int] = set()
        self._callback_queued = False

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

    # -- forward ----------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: object) -> None:
        if not in_backward():
            if self._forward_order:
                self._last_forward_order = self._forward_order
            self._reset_iteration()

    def _pre_forward(
        self, group: MatrixGroup, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        recompute = in_backward()
        with comm_phase(Phase.BACKWARD if recompute else Phase.FORWARD):
            group.unshard()
            group.wait_unshard()
            if self.prefetch and not recompute:
                nxt = self._neighbor(self._last_forward_order, group, +1)
                if nxt is not None:
                    nxt.unshard(async_op=True)
        group.use_unsharded()
        if recompute or not torch.is_grad_enabled() or not group.trainable:
            return args, kwargs
        return self._register_post_backward(group, args, kwargs)

    def _register_post_backward(self, group: MatrixGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        index = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not index:
            return args, kwargs
        self._pending_calls[id(group)] = self._pending_calls.get(id(group), 0) + 1
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
            if self.prefetch:
                previous = self._neighbor(self._forward_order, group, -1)
                if previous is not None and id(previous) not in self._reduced:
                    previous.unshard(async_op=True)

    def _post_backward(self, group: MatrixGroup) -> None:
        remaining = self._pending_calls.get(id(group), 1) - 1
        self._pending_calls[id(group)] = remaining
        if remaining > 0:  # the module ran more than once: wait for its last backward
            return
        if self.requires_grad_sync:
            with comm_phase(Phase.BACKWARD):
                self._reduce(group)
        group.reshard()  # its backward is complete: free non-owned storage now

    def _reduce(self, group: MatrixGroup) -> None:
        if id(group) in self._reduced or not group.trainable:
            return
        self._reduced.add(id(group))
        self._issued.append(group.reduce_grads())

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        with comm_phase(Phase.BACKWARD):
            if self.requires_grad_sync:
                for group in self.groups:  # registration order: the same on every rank
                    self._reduce(group)
            for reduce in self._issued:
                reduce.group.finish_reduce(reduce)
        for group in self.groups:
            group.reshard()
            group.use_sharded()
        self._last_forward_order = self._forward_order
        self._reset_iteration()

    # -- control ----------------------------------------------------------------------------------
    def resident_matrix_bytes(self) -> int:
        """Bytes of matrix storage this rank holds right now (owned shards + any gathered)."""
        return sum(g.resident_bytes() for g in self.groups)
