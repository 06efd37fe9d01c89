"""``OwnerComm`` over ``torch.distributed`` (gloo on CPU, NCCL on CUDA), with the same code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .base import CommCounter, OwnerComm, Pending, ReplicateComm

__all__ = ["TorchOwnerComm", "TorchReplicateComm", "uses_p2p"]

GatherImpl = Literal["auto", "alltoall", "broadcast"]
ReduceImpl = Literal["auto", "alltoall", "reduce"]


class TorchOwnerComm(OwnerComm):
    """Owner-segment collectives on a ``ProcessGroup`` (see [Note: owner segments]).

    ``gather_impl``: ``"alltoall"`` issues one uneven ``all_to_all_single`` per group (each rank
    sends its segment to every peer, no padding); ``"broadcast"`` issues one broadcast per
    non-empty segment. ``reduce_impl``: ``"alltoall"`` sends each owner its segment in one uneven
    all-to-all and sums locally; ``"reduce"`` issues one ``reduce(dst=owner)`` per non-empty
    segment. All four work on gloo and NCCL.

    ``"auto"`` (the default for both) decides per call from the segment sizes, which come from
    the plan and so agree on every rank: with ``k`` non-empty segments among ``N`` ranks, the
    all-to-all makes each owner send its segment ``N − 1`` times, about ``(N − 1) / k`` times
    the bytes of a pipelined broadcast (or reduce) per segment. One all-to-all wins while
    ``k ≥ (N − 1) / 2`` (small worlds, or groups spread over most ranks); past that, the
    broadcast/reduce form does (many ranks per group, e.g. 64 ranks and 7 matrices per block).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        gather_impl: GatherImpl = "auto",
        reduce_impl: ReduceImpl = "auto",
        counter: CommCounter | None = None,
        dim: str = "shard",
    ) -> None:
        if gather_impl not in ("auto", "alltoall", "broadcast"):
            raise ValueError(
                f"gather_impl must be 'auto', 'alltoall' or 'broadcast', got {gather_impl!r}"
            )
        if reduce_impl not in ("auto", "alltoall", "reduce"):
            raise ValueError(
                f"reduce_impl must be 'auto', 'alltoall' or 'reduce', got {reduce_impl!r}"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.gather_impl = gather_impl
        self.reduce_impl = reduce_impl
        self.counter = counter if counter is not None else CommCounter()
        self.dim = dim  # the mesh dim this group spans, for the counter
        self._global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r
            for r in range(self.world_size)
        ]

    def _use_p2p(self, impl: str, numels: Sequence[int]) -> bool:
        return uses_p2p(impl, numels, self.world_size)

    # -- all-gather-v -----------------------------------------------------------------------------
    def all_gather_v(
        self, own: torch.Tensor, numels: Sequence[int], *, async_op: bool = False
    ) -> tuple[list[torch.Tensor], Pending]:
        if own.numel() != numels[self.rank]:
            raise ValueError(f"own segment has {own.numel()} elements, plan says {numels[self.rank]}")
        if self.world_size == 1:
            return [own], Pending()
        if self._use_p2p(self.gather_impl, numels):
            return self._gather_broadcast(own, numels, async_op)
        return self._gather_alltoall(own, numels, async_op)

    def _gather_alltoall(
        self, own: torch.Tensor, numels: Sequence[int], async_op: bool
    ) -> tuple[list[torch.Tensor], Pending]:
        me, n = self.rank, self.world_size
        in_splits = [0 if r == me else numels[me] for r in range(n)]
        out_splits = [0 if r == me else numels[r] for r in range(n)]
        send = own.repeat(n - 1) if numels[me] else own.new_empty(0)
        recv = own.new_empty(sum(out_splits))
        with record_function("matrixfsdp::all_gather_v"):
            work = dist.all_to_all_single(
                recv, send, out_splits, in_splits, group=self.group, async_op=async_op
            )
        self.counter.record("all_gather_v", _nbytes(send), _nbytes(recv), dim=self.dim)
        segments = list(torch.split(recv, out_splits))
        segments[me] = own
        return segments, Pending([work] if async_op else [], keepalive=(send, recv))

    def _gather_broadcast(
        self, own: torch.Tensor, numels: Sequence[int], async_op: bool
    ) -> tuple[list[torch.Tensor], Pending]:
        segments, works = [], []
        with record_function("matrixfsdp::all_gather_v"):
            for r, numel in enumerate(numels):
                buf = own if r == self.rank else own.new_empty(numel)
                segments.append(buf)
                if numel == 0:
                    continue
                work = dist.broadcast(
                    buf, src=self._global_ranks[r], group=self.group, async_op=async_op
                )
                works.append(work)
                sent = _nbytes(buf) * (self.world_size - 1) if r == self.rank else 0
                self.counter.record("all_gather_v", sent, 0 if r == self.rank else _nbytes(buf),
                                    dim=self.dim)
        return segments, Pending(works if async_op else [], keepalive=segments)

    # -- reduce-to-owners -------------------------------------------------------------------------
    def reduce_to_owners(
        self, flat: torch.Tensor, numels: Sequence[int], *, async_op: bool = False
    ) -> tuple[torch.Tensor, Pending]:
        if flat.numel() != sum(numels):
            raise ValueError(f"buffer has {flat.numel()} elements, segments sum to {sum(numels)}")
        me = self.rank
        offset = sum(numels[:me])
        own = flat[offset : offset + numels[me]]
        if self.world_size == 1:
            return own, Pending()
        if self._use_p2p(self.reduce_impl, numels):
            return self._reduce_p2p(flat, numels, async_op)
        return self._reduce_alltoall(flat, own, numels, async_op)

    def _reduce_alltoall(
        self, flat: torch.Tensor, own: torch.Tensor, numels: Sequence[int], async_op: bool
    ) -> tuple[torch.Tensor, Pending]:
        # The own segment travels to itself (a local copy of one segment) so the send buffer is
        # ``flat`` as is: cutting it out would copy every other rank's segments instead.
        n = self.world_size
        out_splits = [numels[self.rank]] * n
        recv = flat.new_empty(sum(out_splits))
        with record_function("matrixfsdp::reduce_to_owners"):
            work = dist.all_to_all_single(
                recv, flat, out_splits, list(numels), group=self.group, async_op=async_op
            )
        sent = _nbytes(flat) - _nbytes(own)
        self.counter.record("reduce_to_owners", sent, _nbytes(recv) - _nbytes(own), dim=self.dim)
        return _SumOnWait.result(own, recv, n, work if async_op else None, flat)

    def _reduce_p2p(
        self, flat: torch.Tensor, numels: Sequence[int], async_op: bool
    ) -> tuple[torch.Tensor, Pending]:
        works, offset, own = [], 0, flat[:0]
        with record_function("matrixfsdp::reduce_to_owners"):
            for r, numel in enumerate(numels):
                segment = flat[offset : offset + numel]
                offset += numel
                if r == self.rank:
                    own = segment
                if numel == 0:
                    continue
                work = dist.reduce(
                    segment, dst=self._global_ranks[r], group=self.group, async_op=async_op
                )
                works.append(work)
                received = _nbytes(segment) * (self.world_size - 1) if r == self.rank else 0
                self.counter.record("reduce_to_owners", _nbytes(segment), received, dim=self.dim)
        return own, Pending(works if async_op else [], keepalive=(flat,))

    # -- scalars ----------------------------------------------------------------------------------
    def all_reduce_scalar(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        if self.world_size > 1:
            with record_function("matrixfsdp::all_reduce_scalar"):
                dist.all_reduce(value, op=ops[op], group=self.group)
            self.counter.record("all_reduce_scalar", _nbytes(value), _nbytes(value), dim=self.dim)
        return value


class TorchReplicateComm(ReplicateComm):
    """All-reduce (sum) over an HSDP replicate group, counted under mesh dim ``"replicate"``."""

    def __init__(self, group: dist.ProcessGroup, *, counter: CommCounter | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.counter = counter if counter is not None else CommCounter()

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Pending:
        if self.world_size == 1 or tensor.numel() == 0:
            return Pending()
        with record_function("matrixfsdp::all_reduce_replicas"):
            work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
        self.counter.record("all_reduce_replicas", _nbytes(tensor), _nbytes(tensor),
                            dim="replicate")
        return Pending([work] if async_op else [], keepalive=(tensor,))


def uses_p2p(impl: str, numels: Sequence[int], world_size: int) -> bool:
    """Whether a group moves by one broadcast/reduce per segment instead of one all-to-all."""
    if impl != "auto":
        return impl in ("broadcast", "reduce", "p2p")
    owners = sum(1 for n in numels if n)
    return owners < (world_size - 1) / 2


class _SumOnWait(Pending):
    """Pending all-to-all whose ``peers`` received segments are summed into ``own`` on wait()."""

    def __init__(
        self, own: torch.Tensor, recv: torch.Tensor, peers: int, work: object, send: torch.Tensor
    ) -> None:
        super().__init__([work] if work is not None else [], keepalive=(send,))
        self._own, self._recv, self._peers = own, recv, peers

    def wait(self) -> None:
        super().wait()
        if self._recv is not None and self._own.numel():
            # Every rank's copy of our segment, ours included: sum straight into place.
            torch.sum(self._recv.view(self._peers, -1), dim=0, out=self._own)
        self._recv = None

    @classmethod
    def result(
        cls, own: torch.Tensor, recv: torch.Tensor, peers: int, work: object, send: torch.Tensor
    ) -> tuple[torch.Tensor, Pending]:
        pending = cls(own, recv, peers, work, send)
        if work is None:
            pending.wait()
        return own, pending


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
