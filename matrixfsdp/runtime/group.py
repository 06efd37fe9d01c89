"""A communication group of matrices: one gather to unshard, one reduction for its gradients."""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..collectives import OwnerComm, Pending, ReplicateComm
from .matrix_param import MatrixParam
from .streams import InFlight, RuntimeStreams

__all__ = ["GradHandoff", "GroupState", "MatrixGroup"]

logger = logging.getLogger(__name__)


class GroupState(enum.Enum):
    SHARDED = "sharded"  # non-owners hold no storage
    GATHERING = "gathering"  # storage allocated, gather in flight
    UNSHARDED = "unsharded"  # every rank holds every matrix of the group


class GradHandoff(NamedTuple):
    """Owners' averaged gradients, computed on a side stream, not yet in ``.grad``.

    ``flags[i]`` is positive when some rank had a gradient for ``params[i]`` (a device tensor:
    the host reads every group's flags at once when gradients land, see [Note: streams]).
    """

    params: list[MatrixParam]
    grads: list[torch.Tensor]
    flags: torch.Tensor


# [Note: presence flags]
# A gradient reduction carries, after each owner segment's values, one *presence flag* element
# per trainable matrix of the segment (1 if this rank has a gradient for it), summed with the
# values. A matrix that got no gradient on any rank keeps ``.grad = None``, as in single-device
# training; one used on only some ranks gets the exact global-batch average (absent ranks add
# zeros, the divisor is every rank).
# Under HSDP (see [Note: HSDP mesh]) the owner's summed segment is then all-reduced over the
# replicate group, by default flags included (``replicate_presence_flags=True``): a flag then
# counts the ranks of every replica. With ``replicate_presence_flags=False`` only the values
# cross replicas (the bytes of FSDP2's HSDP all-reduce) and each owner knows its own replica's
# count; presence elsewhere travels in the sign of a zero instead (the *signed-zero mark*):
# before the all-reduce each owner writes element 0 of every matrix its replica had no
# gradient for as -0.0 (all of that matrix's values are +0.0 then), and turns a -0.0 there into
# +0.0 where its replica had one (the same number). IEEE addition (round to nearest) gives -0.0
# only when every term is -0.0: any +0.0 or nonzero term, including terms that cancel, gives
# +0.0 or a nonzero. So after the all-reduce a matrix absent from this replica is present
# somewhere exactly when its element 0 is not -0.0; every replica reads the same sum, lands the
# same ``.grad`` (``None`` where no rank of any replica had a gradient), and no byte is added.


# [Note: accumulation in reduce_dtype]
# With gradient sync off (``set_requires_gradient_sync(False)``) gradients wait for a synced
# backward to reduce them. Left in the unsharded leaf, autograd would sum the micro-batches in
# the compute dtype: a bf16 running sum under ``MixedPrecisionPolicy(param_dtype=bf16)``, whose
# rounding grows with the micro-batch count. As FSDP2 does for its parameters
# (``FSDPParam.to_accumulated_grad_if_needed``), each no-sync backward of a group moves its
# gradients into one accumulator per matrix in the reduction dtype (``reduce_dtype``, else the
# parameter's own dtype: matrixfsdp reduces in it where FSDP2 would reduce in ``param_dtype``),
# later backwards add theirs into it, and the synced backward reduces accumulator + its own
# gradient (FSDP2's ``accumulate_unsharded_grad_if_needed``). A gradient already in the
# reduction dtype accumulates in the leaf as before (no copy). Clearing: ``discard_accumulated``.


class MatrixGroup:
    """The matrices gathered by one module's forward (a block, or the root).

    Segments follow the plan order of ``params`` (see [Note: owner segments]); a reduction's
    segment holds its matrices' values, then their presence flags (see [Note: presence flags]).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: Sequence[MatrixParam],
        comm: OwnerComm,
        *,
        reduce_dtype: torch.dtype | None = None,
        replicate: ReplicateComm | None = None,
        streams: RuntimeStreams | None = None,
        replicate_presence_flags: bool = True,
        data_parallel_world: int | None = None,
    ) -> None:
        self.name = name
        # Ranks whose mean the gradient is (None: this group's ranks; expert groups: the whole
        # data-parallel world, see [Note: expert parallelism] in ``runtime/experts.py``).
        self.data_parallel_world = data_parallel_world
        # FSDP2's set_gradient_divide_factor on the unit holding this group (None: the mean).
        self.gradient_divide_factor: float | None = None
        self.module = module
        self.params = list(params)
        self.comm = comm
        self.replicate = replicate
        self.replicate_presence_flags = replicate_presence_flags
        self.reduce_dtype = reduce_dtype
        self._streams = streams if streams is not None else RuntimeStreams()
        # Owners' summed segments kept while the replicate all-reduce is off (accumulation).
        self._unreduced: torch.Tensor | None = None
        world = comm.world_size
        self.owned_by = [[p for p in self.params if p.owner_rank == r] for r in range(world)]
        self.gather_numels = [sum(p.numel for p in owned) for owned in self.owned_by]
        self._set_trainable(tuple(p.requires_grad for p in self.params))
        self.state = GroupState.SHARDED
        self._gather: InFlight[None] | None = None
        # See [Note: backward completion] in ``state.py``.
        self.calls_pending = 0  # forward calls whose backward through the group has not run
        self.needs_reduce = False  # gradients may have accumulated since the last reduction
        self.backward_running = False  # a pre-backward ran, its post-backward not yet

    @property
    def streams(self) -> RuntimeStreams:
        """The model's side streams, bound to this group's device (see [Note: streams])."""
        return self._streams.bind(self._device())

    def end_backward(self, *, accumulating: bool) -> None:
        """Forget this backward's forward calls; while ``accumulating`` (gradient sync off) the
        local gradients stay to be reduced later (see [Note: backward completion] in
        ``state.py``)."""
        self.calls_pending = 0
        self.backward_running = False
        if not accumulating:
            self.needs_reduce = False

    # -- requires_grad ----------------------------------------------------------------------------
    def refresh_trainable(self) -> bool:
        """Follow ``requires_grad`` of the sharded parameters (what users freeze); True if changed.

        Called outside forward/backward, before the group's next forward: a matrix frozen since
        the last forward is computed without gradient and left out of reductions, an unfrozen one
        trains again. The reduction layout changes with it, so a partial sum kept for the
        replicas (HSDP accumulation) is dropped, with a warning.
        """
        flags = tuple(p.sharded.requires_grad for p in self.params)
        if flags == self._trainable_flags:
            return False
        for p, flag in zip(self.params, flags, strict=True):
            p.requires_grad = flag
            p.unsharded.requires_grad_(flag)
            if not flag:
                p.unsharded.grad = p.accumulated_grad = None
        if self._unreduced is not None:
            logger.warning("matrixfsdp: group %r: requires_grad changed during HSDP accumulation; "
                           "the partial gradient sum kept for the replicas is dropped", self.name)
            self._unreduced = None
        self._set_trainable(flags)
        return True

    def _set_trainable(self, flags: tuple[bool, ...]) -> None:
        self._trainable_flags = flags
        self.trainable = [p for p, flag in zip(self.params, flags, strict=True) if flag]
        self.trainable_by = [[p for p in owned if p in self.trainable] for owned in self.owned_by]
        # Each owner segment of a reduction: its matrices' values, then one flag per matrix.
        self.value_numels = [sum(p.numel for p in owned) for owned in self.trainable_by]
        self.reduce_numels = [v + len(owned) for v, owned in zip(self.value_numels,
                                                                  self.trainable_by, strict=True)]

    def accumulate_grads(self) -> None:
        """Gradient sync off: move this backward's gradients into the reduction-dtype
        accumulators (see [Note: accumulation in reduce_dtype]); on the compute stream."""
        dtype = self._reduce_dtype()
        for p in self.trainable:
            grad = p.unsharded.grad
            if grad is None or (p.accumulated_grad is None and grad.dtype == dtype):
                continue
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(dtype)
            else:
                p.accumulated_grad.add_(grad)
            p.unsharded.grad = None

    def discard_accumulated(self) -> bool:
        """Drop the gradients held for a later reduction (sync off): the leaves' and the
        accumulators'. True if any existed. Local: no collective."""
        held = any(p.unsharded.grad is not None or p.accumulated_grad is not None
                   for p in self.params)
        for p in self.params:
            p.unsharded.grad = p.accumulated_grad = None
        return held

    def discard_unreduced(self) -> bool:
        """Drop the partial sum kept for the replicas (HSDP accumulation); True if one existed."""
        dropped, self._unreduced = self._unreduced is not None, None
        return dropped

    # -- unshard / reshard ------------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        """Allocate storage and start the owner-segment all-gather (idempotent).

        Storage is allocated on compute; copy-in, gather and (on CUDA) copy-out run on the
        gather stream (see [Note: streams]).
        """
        if self.state is not GroupState.SHARDED:
            return
        for p in self.params:
            p.alloc()
        streams = self.streams
        self._gather = streams.issue(streams.gather, self._start_gather)
        self.state = GroupState.GATHERING
        if not async_op:
            self.wait_unshard()

    def _start_gather(self) -> tuple[Pending, Callable[[], None]]:
        # Each segment as its matrices: the owner's are sent from where they live, the peers'
        # land straight in their (just allocated) storage; nothing is left to copy out.
        parts = [[p.own_values() if rank == self.comm.rank else p.gather_target() for p in owned]
                 for rank, owned in enumerate(self.owned_by)]
        return self.comm.all_gather_into(parts, async_op=True), _nothing

    @property
    def gather_event(self) -> object:
        """The in-flight gather's event after its copy-out (None on the host, or not issued)."""
        return self._gather.event if self._gather is not None else None

    def wait_unshard(self) -> None:
        """Finish an in-flight gather: its segments are in the matrices, compute waits for them."""
        if self.state is not GroupState.GATHERING:
            return
        assert self._gather is not None  # internal invariant of the state machine
        self._gather.finish()
        self._gather = None
        self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Free non-owned storage (owners keep their pinned matrices).

        A gather still in flight is waited and its output dropped (the collective must complete
        before the storage it writes into can go, and compute waits for it before that is freed).
        """
        if self.state is GroupState.GATHERING:
            assert self._gather is not None  # internal invariant of the state machine
            self._gather.discard()
            self._gather = None
        for p in self.params:
            p.free()
        self.state = GroupState.SHARDED

    def use_unsharded(self) -> None:
        for p in self.params:
            p.use_unsharded()

    def use_sharded(self) -> None:
        for p in self.params:
            p.use_sharded()

    # -- gradients --------------------------------------------------------------------------------
    def reduce_grads(self) -> InFlight[GradHandoff | torch.Tensor | None]:
        """Pack local gradients (+ presence flags) by owner and start the reduction.

        Its result, once complete: the owners' ``GradHandoff``, or under HSDP the owned summed
        segment (a copy) for the all-reduce; ``None`` on a rank that owns no trainable matrix.
        """
        streams = self.streams
        return streams.issue(streams.reduce, self._start_reduce)

    def _start_reduce(self) -> tuple[Pending, Callable[[], GradHandoff | torch.Tensor | None]]:
        flat = self._pack_grads()
        owned, pending = self.comm.reduce_to_owners(flat, self.reduce_numels, async_op=True)
        return pending, functools.partial(self._after_reduce, owned)

    def _pack_grads(self) -> torch.Tensor:
        """Copy-in, on the reduce stream; each gradient is released once that copy has run."""
        streams = self.streams
        dtype = self._reduce_dtype()
        flat = torch.empty(sum(self.reduce_numels), dtype=dtype, device=self._device())
        segment = 0
        for owned, values in zip(self.trainable_by, self.value_numels, strict=True):
            offset, flag = segment, segment + values
            for p in owned:
                slot = flat[offset : offset + p.numel]
                parts = [g for g in (p.accumulated_grad, p.unsharded.grad) if g is not None]
                if not parts:
                    slot.zero_()
                for i, grad in enumerate(parts):  # [Note: accumulation in reduce_dtype]
                    if i == 0:
                        slot.copy_(grad.reshape(-1))
                    else:
                        slot.add_(grad.reshape(-1))
                    streams.ops.keep_until_done(grad, streams.reduce)  # made on compute
                flat[flag] = 1.0 if parts else 0.0
                offset, flag = offset + p.numel, flag + 1
                p.unsharded.grad = p.accumulated_grad = None
            segment = flag
        return flat

    def _after_reduce(self, owned: torch.Tensor) -> GradHandoff | torch.Tensor | None:
        """The reduction's consume step (on the reduce stream)."""
        if not self.trainable_by[self.comm.rank]:
            return None
        if self.replicate is None:
            return self.average_owned(owned)
        # A copy: the reduction's output is a view of the group's full buffer, freed next.
        owned = owned.clone()
        if self._unreduced is not None:
            owned.add_(self._unreduced)
            self._unreduced = None
        return owned

    @property
    def grad_divisor(self) -> float:
        """Ranks whose gradients are averaged: the shard group times the replicas (HSDP)."""
        if self.gradient_divide_factor is not None:
            return self.gradient_divide_factor
        if self.data_parallel_world is not None:
            return self.data_parallel_world
        return self.comm.world_size * (self.replicate.world_size if self.replicate else 1)

    def finish_reduce(
        self, reduce: InFlight[GradHandoff | torch.Tensor | None], *, all_reduce: bool = True
    ) -> GradHandoff | InFlight[GradHandoff] | None:
        """Complete a reduction (compute does not wait for it, see [Note: streams]).

        Returns the owners' ``GradHandoff``, or under HSDP the all-reduce of the owned segment
        over the replicate group, started now on the all-reduce stream. With
        ``all_reduce=False`` (HSDP accumulation) the owned sum is kept, unreduced over the
        replicas, and added into the next reduction that all-reduces.
        """
        result = reduce.complete()
        if result is None or isinstance(result, GradHandoff):
            return result
        if not all_reduce:
            self._unreduced = result
            return None
        streams = self.streams
        streams.ops.keep_until_done(result, streams.all_reduce)  # allocated on the reduce stream
        return streams.issue(streams.all_reduce, functools.partial(self._start_all_reduce, result),
                             after=reduce.event)

    def _start_all_reduce(self, owned: torch.Tensor) -> tuple[Pending, Callable[[], GradHandoff]]:
        if self.replicate_presence_flags:
            crossing = owned
        else:  # only the values cross replicas, presence in a signed zero ([Note: presence flags])
            crossing = owned[: self.value_numels[self.comm.rank]]
            self._mark_absent(owned)
        pending = self.replicate.all_reduce(crossing, async_op=True)  # type: ignore[union-attr]
        return pending, functools.partial(self.average_owned, owned)

    def _first_elements(self) -> torch.Tensor:
        """Offsets of each owned trainable matrix's element 0 in the owned segment."""
        mine = self.trainable_by[self.comm.rank]
        offsets = [0]
        for p in mine[:-1]:
            offsets.append(offsets[-1] + p.numel)
        return torch.tensor(offsets, dtype=torch.long, device=self._device())

    def _mark_absent(self, owned: torch.Tensor) -> None:
        """The signed-zero mark (see [Note: presence flags]), without a host synchronisation."""
        firsts = self._first_elements()
        if not firsts.numel():
            return
        values = owned[: self.value_numels[self.comm.rank]]
        flags = owned[self.value_numels[self.comm.rank]:]
        first = values[firsts]
        minus_zero = torch.full_like(first, -0.0)
        values[firsts] = torch.where(flags > 0, first + 0.0, minus_zero)

    def _present_anywhere(self, owned: torch.Tensor) -> torch.Tensor:
        """Presence after a values-only all-reduce: this replica's flag, or the signed zero."""
        values = owned[: self.value_numels[self.comm.rank]]
        flags = owned[self.value_numels[self.comm.rank]:].to(torch.float32)
        first = values[self._first_elements()]
        absent_everywhere = (first == 0) & torch.signbit(first)
        return torch.where(flags > 0, flags, (~absent_everywhere).to(torch.float32))

    def average_owned(self, owned: torch.Tensor) -> GradHandoff:
        """Each owned matrix's averaged gradient from the summed segment, and its flag.

        No host synchronisation: whether a gradient exists is decided when it lands.
        """
        mine = self.trainable_by[self.comm.rank]
        divisor = self.grad_divisor
        grads, start = [], 0
        for p in mine:
            values = owned[start : start + p.numel].view(p.shape)
            # A standalone tensor: a view would keep the whole group buffer alive.
            grads.append(torch.div(values, divisor).to(p.dtype))
            start += p.numel
        if self.replicate is not None and not self.replicate_presence_flags:
            flags = self._present_anywhere(owned)
        else:  # a copy, as the gradients: the buffer can go
            flags = owned[start : start + len(mine)].to(torch.float32, copy=True)
        return GradHandoff(mine, grads, flags)

    # -- helpers ----------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return self.params[0].device

    def _reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.params[0].dtype

    def resident_bytes(self) -> int:
        return sum(p.resident_bytes() for p in self.params)

    def __repr__(self) -> str:
        return f"MatrixGroup({self.name!r}, {len(self.params)} matrices, {self.state.value})"


def land_grads(handoffs: Sequence[GradHandoff]) -> None:
    """Put averaged gradients into ``.grad`` (added to existing ones); matrices no rank had a
    gradient for keep theirs (``None`` stays ``None``, as on one device).

    One host synchronisation for all of ``handoffs`` (their flags read at once); the caller made
    compute wait for the streams that produced them.
    """
    if not handoffs:
        return
    flags = torch.cat([h.flags for h in handoffs]).tolist()
    i = 0
    for handoff in handoffs:
        for p, grad in zip(handoff.params, handoff.grads, strict=True):
            if flags[i] > 0:
                if p.sharded.grad is None:
                    p.sharded.grad = grad
                else:
                    p.sharded.grad.add_(grad)
            i += 1


def _nothing() -> None:
    """The consume step of a gather that received straight into the matrices."""
