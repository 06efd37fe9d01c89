"""A communication group of matrices: one gather to unshard, one reduction for its gradients."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..collectives import OwnerComm, Pending, ReplicateComm
from .matrix_param import MatrixParam

__all__ = ["GroupState", "MatrixGroup", "PendingAllReduce", "PendingReduce"]


class GroupState(enum.Enum):
    SHARDED = "sharded"  # non-owners hold no storage
    GATHERING = "gathering"  # storage allocated, gather in flight
    UNSHARDED = "unsharded"  # every rank holds every matrix of the group


@dataclass
class PendingReduce:
    """A gradient reduction in flight: ``owned`` is this rank's summed segment once waited."""

    group: MatrixGroup
    owned: torch.Tensor
    pending: Pending


@dataclass
class PendingAllReduce:
    """HSDP: an owner's summed segment being all-reduced over its replicate group."""

    group: MatrixGroup
    owned: torch.Tensor
    pending: Pending


class MatrixGroup:
    """The matrices gathered by one module's forward (a block, or the root).

    Segments follow the plan order of ``params`` (see [Note: owner segments]). For the gradient
    reduction every trainable matrix gets one extra *presence flag* element (1 if this rank has a
    gradient for it): the owner sums flags with the values, so a matrix that got no gradient on any
    rank keeps ``.grad = None`` exactly as in single-device training, while a matrix used on only
    some ranks still gets the exact global-batch average.

    Under HSDP (``replicate`` set, see [Note: HSDP mesh]) the owner's summed segment, flags
    included, is then summed over the replicate group: a flag counts the ranks of all replicas
    that had a gradient, and the divisor is every rank of the mesh (``R x S``), so the result is
    the exact global average, ``None`` only when no rank of any replica had a gradient.
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
    ) -> None:
        self.name = name
        self.module = module
        self.params = list(params)
        self.comm = comm
        self.replicate = replicate
        self.reduce_dtype = reduce_dtype
        # Owners' summed segments kept while the replicate all-reduce is off (accumulation).
        self._unreduced: torch.Tensor | None = None
        world = comm.world_size
        self.owned_by = [[p for p in self.params if p.owner_rank == r] for r in range(world)]
        self.gather_numels = [sum(p.numel for p in owned) for owned in self.owned_by]
        self.trainable = [p for p in self.params if p.requires_grad]
        self.trainable_by = [[p for p in owned if p.requires_grad] for owned in self.owned_by]
        self.reduce_numels = [sum(p.numel + 1 for p in owned) for owned in self.trainable_by]
        self.state = GroupState.SHARDED
        self._gather: Pending | None = None
        self.begin_iteration()

    def begin_iteration(self) -> None:
        """Reset this group's progress through one forward/backward (see the state's Note)."""
        self.backwards_pending = 0  # forward calls whose backward has not completed yet
        self.grads_reduced = False  # its reduction was issued this iteration

    # -- unshard / reshard ------------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        """Allocate storage and start the owner-segment all-gather (idempotent)."""
        if self.state is not GroupState.SHARDED:
            return
        for p in self.params:
            p.alloc()
        # Each segment as its matrices: the owner's are sent from where they live, the peers'
        # land straight in their (just allocated) storage.
        parts = [[p.own_values() if rank == self.comm.rank else p.gather_target() for p in owned]
                 for rank, owned in enumerate(self.owned_by)]
        self._gather = self.comm.all_gather_into(parts, async_op=async_op)
        self.state = GroupState.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish an in-flight gather (every peer's matrices are then in their storage)."""
        if self.state is not GroupState.GATHERING:
            return
        assert self._gather is not None  # internal invariant of the state machine
        self._gather.wait()
        self._gather = None
        self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Free non-owned storage (owners keep their pinned matrices).

        A gather still in flight is waited and its output dropped (the collective must complete
        before the storage it writes into can go).
        """
        if self.state is GroupState.GATHERING:
            assert self._gather is not None  # internal invariant of the state machine
            self._gather.wait()
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
    def reduce_grads(self) -> PendingReduce:
        """Pack local gradients (+ presence flags) by owner and start the reduction."""
        flat = self._pack_grads()
        owned, pending = self.comm.reduce_to_owners(flat, self.reduce_numels, async_op=True)
        return PendingReduce(self, owned, pending)

    def _pack_grads(self) -> torch.Tensor:
        dtype = self._reduce_dtype()
        flat = torch.empty(sum(self.reduce_numels), dtype=dtype, device=self._device())
        offset = 0
        for owned in self.trainable_by:
            for p in owned:
                grad = p.unsharded.grad
                slot = flat[offset : offset + p.numel]
                if grad is None:
                    slot.zero_()
                else:
                    slot.copy_(grad.reshape(-1))
                flat[offset + p.numel] = 0.0 if grad is None else 1.0
                offset += p.numel + 1
                p.unsharded.grad = None
        return flat

    @property
    def grad_divisor(self) -> int:
        """Ranks whose gradients are averaged: the shard group times the replicas (HSDP)."""
        return self.comm.world_size * (self.replicate.world_size if self.replicate else 1)

    def finish_reduce(self, reduce: PendingReduce, *,
                      all_reduce: bool = True) -> PendingAllReduce | None:
        """Wait; then average into the owned matrices' ``.grad``, or, under HSDP, start the
        all-reduce of the owned segment over the replicate group and return it.

        With ``all_reduce=False`` (HSDP accumulation) the owned sum is kept, unreduced over the
        replicas, and added to the next reduction that all-reduces.
        """
        reduce.pending.wait()
        if not self.trainable_by[self.comm.rank]:
            return None
        if self.replicate is None:
            self.accumulate_owned(reduce.owned)
            return None
        # A copy: the reduction's output is a view of the group's full buffer, freed right now.
        owned = reduce.owned.clone()
        if self._unreduced is not None:
            owned.add_(self._unreduced)
            self._unreduced = None
        if not all_reduce:
            self._unreduced = owned
            return None
        pending = self.replicate.all_reduce(owned, async_op=True)
        return PendingAllReduce(self, owned, pending)

    def finish_all_reduce(self, work: PendingAllReduce) -> None:
        work.pending.wait()
        self.accumulate_owned(work.owned)

    def accumulate_owned(self, owned: torch.Tensor) -> None:
        """Give each owned matrix its averaged gradient from the summed segment (or leave None)."""
        mine = self.trainable_by[self.comm.rank]
        starts = [0]
        for p in mine:
            starts.append(starts[-1] + p.numel + 1)
        flag_index = torch.tensor([s - 1 for s in starts[1:]], device=owned.device)
        present = owned.index_select(0, flag_index).tolist()  # one host sync per group
        divisor = self.grad_divisor
        for p, start, flag in zip(mine, starts, present, strict=False):
            if flag <= 0:
                continue  # no rank produced a gradient: stays None, as on one device
            values = owned[start : start + p.numel].view(p.shape)
            # A standalone tensor: a view would keep the whole group buffer alive.
            grad = torch.div(values, divisor).to(p.dtype)
            if p.sharded.grad is None:
                p.sharded.grad = grad
            else:
                p.sharded.grad.add_(grad)

    # -- helpers ----------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return self.params[0].device

    def _reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.params[0].dtype

    def resident_bytes(self) -> int:
        return sum(p.resident_bytes() for p in self.params)

    def __repr__(self) -> str:
        return f"MatrixGroup({self.name!r}, {len(self.params)} matrices, {self.state.value})"
