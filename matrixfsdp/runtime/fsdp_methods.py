"""FSDP2's ``FSDPModule`` methods on a wrapped model drive the matrices as well as the tail.

[Note: FSDPModule methods]
FSDP2-aware code (torchtitan, ``torch.distributed.pipelining``) drives a model through the methods
of ``FSDPModule``. ``fully_shard_matrix`` makes the root (and any group with a tail unit of its own)
an ``FSDPModule`` whose methods first do what FSDP2 does for the tail, then the same for the
matrices. Each matrix group belongs to one FSDP2 unit: its module's, when the group has a tail unit
of its own (``tail_units="groups"``), else the root's. A method called without ``recurse`` acts on
the groups of that unit; with ``recurse=True`` on the groups of every unit under the module.

Honoured, with FSDP2's meaning:
- ``set_gradient_divide_factor(f)``: the unit's matrix gradients are the sum over ranks divided by
  ``f`` (``1.0``: the sum, as torchtitan sets it); by default they are the mean;
- ``set_requires_gradient_sync(flag)``: off, gradients accumulate locally with no communication
  (reductions and the HSDP all-reduce); ``set_requires_all_reduce(flag)``: HSDP accumulation with
  reductions but no all-reduce over the replicas;
- ``set_reshard_after_backward(flag)``: off, groups stay gathered after backward until a forward
  with ``reshard_after_forward`` (or an optimizer step, which reshards) frees them, so microbatches
  gather each group once; ``set_reshard_after_forward(flag)``;
- ``set_is_last_backward(flag)``: matrix reductions complete at the end of each synced backward
  whatever its value (the same gradients); ``False`` (pipelining, before each microbatch's
  backward) makes the model show each matrix's unsharded leaf until the next forward or
  backward end, so that zero-bubble schedules find the leaves forward used (see [Note:
  zero-bubble schedules] in ``pipelining.py``);
- ``unshard()`` / ``reshard()``: gather / free the unit's matrices (the gather is synchronous; an
  ``async_op=True`` call returns FSDP2's handle for the tail);
- ``set_post_optim_event(event)``: the next forward waits on ``event`` before its first gather;
- ``set_force_sum_reduction_for_comms(flag)``: accepted; matrices always reduce by sum and divide
  afterwards, what the flag asks of FSDP2;
- pipelining's end of step (``perform_reduce_grad``): it turns sync back on and calls the root
  state's ``_root_post_backward_final_callback()``, which now also reduces, lands and reshards the
  matrices that accumulated over the microbatches: one reduction per optimizer step.

``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` name FSDP2 units; the
matrices already prefetch the next group in the recorded forward order (and the previous one in
backward), so a call that involves a unit holding matrices raises ``NotImplementedError``.
A flag that the runtime keeps for the whole model (sync, reshard) set on a unit that covers only
some groups raises ``NotImplementedError`` naming the method: set it on the root.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from .pipelining import expose_leaves, hide_leaves

if TYPE_CHECKING:
    from .group import MatrixGroup
    from .state import MatrixFSDPState

__all__ = ["FSDP_METHODS", "install_fsdp_methods"]

logger = logging.getLogger(__name__)

# Every method of FSDPModule that acts on the matrices too.
FSDP_METHODS = (
    "set_gradient_divide_factor", "set_requires_gradient_sync", "set_requires_all_reduce",
    "set_is_last_backward", "set_reshard_after_backward", "set_reshard_after_forward",
    "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "unshard", "reshard",
    "set_post_optim_event", "set_force_sum_reduction_for_comms",
)


class _Methods:
    """The matrix side of each method, bound to one wrapped model."""

    def __init__(self, state: MatrixFSDPState) -> None:
        self.state = state
        root = state.root
        self.unit_of: dict[int, nn.Module] = {
            id(g): g.module if isinstance(g.module, FSDPModule) else root for g in state.groups
        }

    def groups_of(self, module: nn.Module, recurse: bool) -> list[MatrixGroup]:
        units = {id(m) for m in module.modules()} if recurse else {id(module)}
        return [g for g in self.state.groups if id(self.unit_of[id(g)]) in units]

    def _global(self, module: nn.Module, method: str, recurse: bool) -> bool:
        """True if the call covers every group (a whole-model flag); raise if only some."""
        mine = self.groups_of(module, recurse)
        if not mine:
            return False
        if len(mine) != len(self.state.groups):
            raise NotImplementedError(
                f"matrixfsdp: {method}() on {type(module).__name__} covers {len(mine)} of the "
                f"{len(self.state.groups)} matrix groups; the runtime keeps this flag for the whole "
                f"model: call {method}(...) on the wrapped root (recurse=True)"
            )
        return True

    # -- the methods (each after FSDP2's own) -----------------------------------------------------
    def set_gradient_divide_factor(self, module: nn.Module, factor: float) -> None:
        for group in self.groups_of(module, recurse=False):
            group.gradient_divide_factor = float(factor)

    def set_requires_gradient_sync(self, module: nn.Module, flag: bool, *, recurse: bool = True) -> None:
        if self._global(module, "set_requires_gradient_sync", recurse):
            self.state.requires_grad_sync = bool(flag)
            self.state.requires_all_reduce = bool(flag)

    def set_requires_all_reduce(self, module: nn.Module, flag: bool, *, recurse: bool = True) -> None:
        if self._global(module, "set_requires_all_reduce", recurse):
            self.state.requires_all_reduce = bool(flag)

    def set_is_last_backward(self, module: nn.Module, flag: bool) -> None:
        self.state.is_last_backward = bool(flag)
        # Pipelining's split backward reads submod.parameters() (see [Note: zero-bubble schedules])
        (hide_leaves if flag else expose_leaves)(self.state)

    def set_reshard_after_backward(self, module: nn.Module, flag: bool, *, recurse: bool = True) -> None:
        if self._global(module, "set_reshard_after_backward", recurse):
            self.state.reshard_after_backward = bool(flag)

    def set_reshard_after_forward(self, module: nn.Module, flag: bool, recurse: bool = True) -> None:
        if self._global(module, "set_reshard_after_forward", recurse):
            self.state.reshard_after_forward = bool(flag)

    def _prefetch_list(self, method: str, module: nn.Module, modules: Sequence[nn.Module]) -> None:
        involved = [m for m in (module, *modules) if self.groups_of(m, recurse=False)]
        if involved:
            raise NotImplementedError(
                f"matrixfsdp: {method}() names FSDP units that hold matrices "
                f"({', '.join(type(m).__name__ for m in involved)}); matrices prefetch the next "
                "group in forward order (the previous one in backward) by themselves: leave them "
                "out, or turn prefetching off with fully_shard_matrix's state (prefetch=False)"
            )

    def set_modules_to_forward_prefetch(self, module: nn.Module, modules: Sequence[nn.Module]) -> None:
        self._prefetch_list("set_modules_to_forward_prefetch", module, modules)

    def set_modules_to_backward_prefetch(self, module: nn.Module, modules: Sequence[nn.Module]) -> None:
        self._prefetch_list("set_modules_to_backward_prefetch", module, modules)

    def unshard(self, module: nn.Module, async_op: bool = False) -> None:
        for group in self.groups_of(module, recurse=False):
            self.state.hold_unsharded(group)

    def reshard(self, module: nn.Module) -> None:
        for group in self.groups_of(module, recurse=False):
            self.state._reshard(group)

    def set_post_optim_event(self, module: nn.Module, event: Any) -> None:
        self.state.post_optim_event = event

    def set_force_sum_reduction_for_comms(self, module: nn.Module, enable: bool) -> None:
        return None  # matrices always reduce by sum and divide afterwards


# Methods whose matrix side runs before FSDP2's (so a refused call changes nothing).
_CHECK_FIRST = {"set_requires_gradient_sync", "set_requires_all_reduce",
                "set_reshard_after_backward", "set_reshard_after_forward",
                "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"}


def _combined(name: str, matrices: _Methods, module: nn.Module) -> Callable[..., Any]:
    fsdp2 = getattr(type(module), name)
    ours = getattr(matrices, name)

    @functools.wraps(fsdp2)
    def method(*args: Any, **kwargs: Any) -> Any:
        if name in _CHECK_FIRST:
            ours(module, *args, **kwargs)
            return fsdp2(module, *args, **kwargs)
        out = fsdp2(module, *args, **kwargs)
        ours(module, *args, **kwargs)
        return out

    return method


def install_fsdp_methods(state: MatrixFSDPState) -> None:
    """Make every FSDP2 unit of the wrapped model that holds matrices drive them (see the Note)."""
    matrices = _Methods(state)
    units = {id(u): u for u in matrices.unit_of.values()}
    root = state.root
    if isinstance(root, FSDPModule):
        units[id(root)] = root
    for unit in units.values():
        for name in FSDP_METHODS:
            unit.__dict__[name] = _combined(name, matrices, unit)
    if isinstance(root, FSDPModule):
        _hook_final_callback(state, root)


def _hook_final_callback(state: MatrixFSDPState, root: nn.Module) -> None:
    """Pipelining's end of step calls the root FSDP2 state's final callback by hand."""
    fsdp_state = fully_shard.state(root)  # type: ignore[attr-defined]
    original = fsdp_state._root_post_backward_final_callback

    @functools.wraps(original)
    def final_callback(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        state.flush_reductions()
        return out

    fsdp_state._root_post_backward_final_callback = final_callback
