"""``torch.distributed.pipelining``'s split backward (zero-bubble schedules) on a wrapped stage.

[Note: zero-bubble schedules]
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` split each
microbatch's backward into two calls of ``torch.distributed.pipelining._backward``:
- ``stage_backward_input(..., weights=submod.parameters())`` maps every weight to its gradient
  accumulator (the autograd leaf's ``AccumulateGrad`` node), finds the graph nodes between the
  stage's inputs and those accumulators, computes only the input gradients and keeps the
  gradients flowing into those nodes;
- later, ``stage_backward_weight(submod.parameters(), param_groups)`` runs ``autograd.grad``
  from the kept nodes to the accumulators and adds each result to ``weight.grad`` of the
  parameter it finds for that accumulator.
Forward computes a matrix with its *unsharded leaf*, never with the sharded parameter that
``submod.parameters()`` shows outside forward (see [Note: sharded and unsharded matrix
parameters] in ``matrix_param.py``): the input step would find no accumulator of a matrix and the
weight step would give it no gradient (before this Note: silently, every matrix of every stage
but the first kept its values).

Pipelining calls ``set_is_last_backward(False)`` (with ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)``) on the stage module right before each of those calls,
and ``set_is_last_backward(True)`` at the end of the step (``perform_reduce_grad``). So from
``set_is_last_backward(False)`` until the next forward, the end of a backward, a reshard or
``set_is_last_backward(True)``, the wrapped model *exposes its leaves*: each matrix's module
registers its unsharded leaf (a TP or expert matrix: the local leaf, not the DTensor view forward
built on it). Both calls then find the accumulators forward used; the weight step writes each
matrix's gradient into its leaf's ``.grad``, where a backward's ``AccumulateGrad`` would have put
it, and the end of the step reduces the leaves' gradients once (sync is on again by then).

Reading an exposed leaf is never needed: the input step reads accumulators, the weight step
writes ``.grad``. A non-owner's leaf may hold no storage while exposed; the weight gradient of a
matrix used as ``x @ W.T`` (every ``nn.Linear``) reads the saved input and the output gradient,
never ``W``. A model whose weight gradient reads another matrix's values (``W2 @ W1`` with both
matrices) computes that gradient from the gathered copy only while it is kept
(``reshard_after_forward=False`` keeps every group gathered for the whole step).

The tail is FSDP2's, whose units have the same fault (FSDP2 alone, with
``reshard_after_forward=True``, gives every stage but the first wrong tail gradients under these
schedules): a unit resharded after forward registers its sharded parameters. The root's unit stays
gathered from forward to the end of the step; for any other unit (``tail_units="groups"``) the
exposure registers FSDP2's unsharded parameter objects too (FSDP2 keeps one per parameter, its
storage freed while resharded) and puts back the sharded one FSDP2 expects when it ends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch.distributed.fsdp import FSDPModule

from .tail import _param_groups, _registered

if TYPE_CHECKING:
    from .state import MatrixFSDPState

__all__ = ["expose_leaves", "hide_leaves"]

logger = logging.getLogger(__name__)


def expose_leaves(state: MatrixFSDPState) -> None:
    """Register every matrix's unsharded leaf in its module, and FSDP2's unsharded parameters of
    the tail units that are resharded now (see the Note)."""
    for mp in state.params.values():
        mp.module._parameters[mp.name] = mp.unsharded
    for fsdp_param in _resharded_tail_params(state):
        leaf = getattr(fsdp_param, "_unsharded_param", None)
        if leaf is not None:
            fsdp_param._setattr_on_modules(leaf)


def hide_leaves(state: MatrixFSDPState) -> None:
    """Undo ``expose_leaves`` (a parameter whose module holds another tensor is left alone)."""
    for mp in state.params.values():
        mp.use_sharded()
    for fsdp_param in _resharded_tail_params(state):
        leaf = getattr(fsdp_param, "_unsharded_param", None)
        if leaf is None or _registered(fsdp_param) is not leaf:
            continue
        post_forward = getattr(fsdp_param, "_sharded_post_forward_param", None)
        fsdp_param._setattr_on_modules(post_forward if post_forward is not None
                                       else fsdp_param.sharded_param)


def _resharded_tail_params(state: MatrixFSDPState) -> list[Any]:
    """FSDP2's parameters of the tail units whose group is not unsharded (read defensively:
    where FSDP2's internals differ, none)."""
    out: list[Any] = []
    for unit in state.root.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in _param_groups(unit._get_fsdp_state()):
            if getattr(group, "is_unsharded", True) or not hasattr(group, "fsdp_params"):
                continue
            out.extend(p for p in group.fsdp_params if hasattr(p, "_setattr_on_modules"))
    return out
