"""How the runtime drives FSDP2, which owns the tail: resharding it, and recomputation.

[Note: FSDP2 and reentrant recomputation]
FSDP2 keeps a module's state in ``PRE_BACKWARD`` from its first pre-backward until the
end-of-backward callback, and a forward that starts in that state is taken for the recomputation
of non-reentrant activation checkpointing: it only unshards (no post-backward hook, no
pre-backward hooks, no reshard), because the pending backward of the original forward reduces.
Reentrant checkpointing recomputes a module once per forward call, each time followed by its own
nested backward; from the second recomputation of a module in one backward on (two forwards
before one backward, a block called twice), FSDP2 therefore registers nothing, the nested
backward's gradients stay on the unsharded parameters, and the module ends the backward
unsharded with unreduced gradients. Before FSDP2's own pre-forward hook, the runtime returns such
a state to ``IDLE`` when every parameter group of it has finished its post-backward (so no
backward of this module is pending): the recomputation then registers FSDP2's hooks as a forward
does, and its reduction adds to the gradient of the first, exactly. A non-reentrant
recomputation always runs while the module's backward is pending (a group in ``PRE_BACKWARD``)
and is left alone. FSDP2 internals are read defensively: where they differ, nothing changes.

[Note: the tail after forward]
FSDP2 does not reshard the root's parameters after forward (``reshard_after_forward=False``, the
backward that follows needs them). After a forward that no backward follows (evaluation under
``no_grad``, ``inference_mode``, or with grad on and the graph dropped) the root keeps that
gathered copy, and an optimizer step then updates the sharded parameters behind it: FSDP2's next
forward would compute with the stale copy (measured on torch 2.13: a ``no_grad`` forward between
backward and step moved the parameters 10% off a single process after 3 SGD steps). The runtime
reshards the tail after every root forward run without grad, and again before every root forward
(which then gathers fresh values); resharding an already sharded module is free. Not while an
earlier forward's backward is pending (microbatches: F F B B) or ``set_reshard_after_backward``
is off (pipelining's microbatches): FSDP2 keeps the root's unit gathered for those backwards, and
no optimizer step comes between (``MatrixOptimizer.step`` reshards everything first).

[Note: tail units]
Each group's matrices move with the runtime's collectives; the rest of the group's parameters (its
*tail*: norms, biases, 3-D expert stacks left to FSDP2) needs an FSDP2 unit. A unit per block
doubles the collectives per block (FSDP2's all-gather, re-gather and reduce-scatter beside the
runtime's): on gloo each costs a fixed latency, which made a model of 48 blocks of dim 32 take
1.1-1.2x FSDP2 alone for forward+backward. A block's norms and biases are a few KiB (for a 4096-wide
block, 32 KiB against its 200 MiB of matrices), so by default (``tail_units="auto"``) a group's
tail gets its own unit only past ``TAIL_UNIT_MIN_BYTES``; smaller tails join the root's unit,
which FSDP2 gathers once at the start of forward and keeps until its reduction at the end of
backward (the root does not reshard after forward). ``"groups"`` gives every group its unit
(``fully_shard`` on each block, the previous layout), ``"root"`` none.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = [
    "TAIL_UNIT_MIN_BYTES",
    "discard_tail_held_grads",
    "discard_tail_partial_sums",
    "refresh_tail_dtypes",
    "reset_finished_fsdp_state",
    "reshard_tail",
    "tail_has_unit",
]

TAIL_UNIT_MIN_BYTES = 1 << 20


def tail_has_unit(tail_units: str, tail_bytes: int) -> bool:
    """Whether a group's tail of ``tail_bytes`` gets its own FSDP2 unit (see [Note: tail
    units]); a pure function of the plan's shapes, so the same on every rank."""
    if tail_units == "groups":
        return True
    if tail_units == "root":
        return False
    return tail_bytes > TAIL_UNIT_MIN_BYTES

try:  # the enum of FSDP2's training states (torch >= 2.4)
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
except ImportError:  # pragma: no cover - other torch layouts: the reset is skipped
    TrainingState = None  # type: ignore[assignment,misc]


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older FSDP2: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def reshard_tail(module: FSDPModule) -> None:
    """Register FSDP2's sharded parameters again, whatever state a forward left them in.

    ``FSDPModule.reshard()`` keeps a ``reshard_after_forward=False`` group (the root's) unsharded
    while its forward has not completed, e.g. after an exception mid-forward; its next forward
    would then compute with the stale unsharded copy. FSDP2's own state-dict hooks reshard with
    ``_to_sharded()``; do the same where it exists. ``requires_grad`` set on an unsharded
    parameter (what ``model.parameters()`` shows while a module stays unsharded after a forward)
    is carried over to the sharded one first: FSDP2 copies it the other way at its next gather,
    so a freeze made then would be lost.
    """
    for group in _param_groups(module._get_fsdp_state()):
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            registered = _registered(fsdp_param)
            if unsharded is not None and registered is unsharded and \
                    unsharded.requires_grad != fsdp_param.sharded_param.requires_grad:
                fsdp_param.sharded_param.requires_grad_(unsharded.requires_grad)
    FSDPModule.reshard(module)  # FSDP2 only (the model's own method reshards the matrices too)
    for group in _param_groups(module._get_fsdp_state()):
        to_sharded = getattr(group, "_to_sharded", None)
        if to_sharded is not None:
            to_sharded()


def _registered(fsdp_param: Any) -> Any:
    """The tensor FSDP2 currently registers on the module for ``fsdp_param`` (None if unknown)."""
    infos = getattr(fsdp_param, "_module_info", None)
    if infos is None:
        return None
    return infos.module._parameters.get(infos.param_name)


def reset_finished_fsdp_state(module: nn.Module) -> None:
    """Before FSDP2's pre-forward of a recomputation: see [Note: FSDP2 and reentrant
    recomputation]."""
    if TrainingState is None or not isinstance(module, FSDPModule):
        return
    state = module._get_fsdp_state()
    groups = _param_groups(state)
    if (getattr(state, "_training_state", None) is TrainingState.PRE_BACKWARD and groups
            and all(getattr(g, "_training_state", None) is TrainingState.POST_BACKWARD
                    for g in groups)):
        state._training_state = TrainingState.IDLE


def discard_tail_partial_sums(module: FSDPModule) -> bool:
    """Drop FSDP2's HSDP partial reduce-scatter outputs kept while ``set_requires_all_reduce`` was
    off (FSDP2 itself keeps them across ``zero_grad``); True if one existed."""
    dropped = False
    for group in _param_groups(module._get_fsdp_state()):
        if getattr(group, "_partial_reduce_output", None) is not None:
            group._partial_reduce_output = None
            dropped = True
    return dropped


def refresh_tail_dtypes(module: FSDPModule) -> None:
    """Recompute FSDP2's mixed-precision dtypes of a group whose trainable set changed.

    FSDP2 derives a group's reduce and gradient dtypes from its parameters that require grad
    when it first runs; a group that was wholly frozen then has none, and once unfrozen it would
    assign bf16 gradients to fp32 parameters ("attempting to assign a gradient with dtype
    BFloat16 to a tensor with grad_dtype Float"). Called outside forward/backward, before a
    root forward: freezing or unfreezing the tail takes effect at the next forward.
    """
    for group in _param_groups(module._get_fsdp_state()):
        params = getattr(group, "fsdp_params", None)
        init_dtypes = getattr(group, "_init_mp_dtypes", None)
        if params is None or init_dtypes is None:
            continue
        flags = tuple(p.sharded_param.requires_grad for p in params)
        seen = getattr(group, "_matrixfsdp_trainable", None)
        group._matrixfsdp_trainable = flags
        if seen is not None and seen != flags:
            init_dtypes()


def discard_tail_held_grads(module: FSDPModule) -> bool:
    """Drop the gradients FSDP2 holds for a later reduce-scatter while gradient sync is off: the
    unsharded parameter's ``.grad`` and, under mixed precision, ``unsharded_accumulated_grad``.
    FSDP2 keeps them across ``zero_grad`` (they join the next synced backward's reduction);
    ``MatrixOptimizer.zero_grad`` drops them with the matrices' (see [Note: zero_grad and held
    gradients] in ``state.py``). True if one existed."""
    held = False
    for group in _param_groups(module._get_fsdp_state()):
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                fsdp_param.unsharded_accumulated_grad = None
                held = True
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                unsharded.grad = None
                held = True
    return held
