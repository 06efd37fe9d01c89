"""``OwnerComm`` over ``torch.distributed`` (gloo on CPU, NCCL on CUDA), with the same code."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager
from torch.profiler import record_function

from .base import CommCounter, OwnerComm, Pending, ReplicateComm, _UnpackOnWait

__all__ = ["COALESCE_ENV", "PADDED_MAX_BYTES", "TorchOwnerComm", "TorchReplicateComm", "gather_form", "reduce_form"]

GatherImpl = Literal["auto", "alltoall", "broadcast", "allgather"]
ReduceImpl = Literal["auto", "alltoall", "rounds", "reduce", "allreduce", "scatter"]

# [Note: one call per group]
# On gloo every collective pays a fixed latency (about 0.2 ms on loopback, see BENCHMARKS §2),
# so a group of small matrices is latency-bound: a broadcast per matrix and a reduction in rounds
# cost more calls than FSDP2's one all-gather and one reduction. ``"allgather"`` makes the gather
# one call: it pads every owner segment to the group's longest and runs one all-gather into a
# buffer of ``N * width`` elements, then copies each peer's segment into its matrices. The
# reduction's one call is the in-place all-reduce of the packed buffer (``"allreduce"``: no
# buffer beyond it, twice a reduce-scatter's bytes, FSDP2's own reduction on gloo);
# ``"scatter"`` (one padded reduce-scatter) is there to be chosen by hand. Padding and the
# all-reduce cost bytes and the gather buffer memory, so ``"auto"`` takes these forms on gloo only
# while the padded group is at most ``PADDED_MAX_BYTES`` (the latency-bound regime: groups of
# small matrices, where the buffer is small too); larger groups keep the buffer-free forms.
PADDED_MAX_BYTES = 1 << 20

# [Note: one launch per group]
# On a backend that coalesces (NCCL), the per-matrix broadcasts of a gather and the per-segment
# reduces of a reduction are issued inside one coalescing block (torch's
# ``_coalescing_manager`` with the tensors' device), so a group's gather or reduction is one
# ``ncclGroupStart``/``ncclGroupEnd``: one launch per group and direction, as FSDP2's one
# all-gather and one reduce-scatter. Every op inside the block is issued ``async_op=True`` (the
# last op decides whether the block returns a work) and the ops' own works are dropped: they
# record no event while coalescing, so only the block's one work ("nccl:coalesced") is waited.
# The exchange forms need nothing more: ``batch_isend_irecv`` coalesces on NCCL by itself.
# gloo cannot coalesce (it refuses ``startCoalescing``); its one-call forms are the padded ones
# of [Note: one call per group]. ``MATRIXFSDP_COALESCE=0`` (or ``coalesce=False``) issues the
# ops one by one, for a backend whose coalescing misbehaves.
COALESCE_ENV = "MATRIXFSDP_COALESCE"


class TorchOwnerComm(OwnerComm):
    """Owner-segment collectives on a ``ProcessGroup`` (see [Note: owner segments]).

    No form holds a buffer it could avoid. Gathers read the owner's matrices where they live and
    write each peer's straight into the storage it was given (``all_gather_into``):
    ``gather_impl="alltoall"`` is one *exchange* per group (every owner sends each of its
    matrices to every peer, every peer receives each into its storage: one
    ``batch_isend_irecv``, the traffic of an uneven all-to-all without its packed send and
    receive buffers); ``"broadcast"`` issues one broadcast per matrix from its owner.
    Reductions work on the packed gradient buffer: ``reduce_impl="reduce"`` issues one
    ``reduce(dst=owner)`` per non-empty segment and ``"allreduce"`` one ``all_reduce`` of the
    whole buffer, both in place (nothing more held); ``"alltoall"`` exchanges (each rank sends
    segment ``r`` to rank ``r``; the owner receives its ``N − 1`` peers' copies into as many
    buffers and sums them into its segment on ``wait()``); ``"rounds"`` (gloo only) sends the
    same way but receives the peers' copies one after another into one buffer (peer
    ``rank − 1`` first, then ``rank − 2``, ...), summing each as it lands: the first receive is
    posted with the sends, the others on ``wait()``. Every form but ``"rounds"`` works on gloo
    and NCCL (uneven sizes; empty segments are skipped). See [Note: rounds need gloo].

    ``"auto"`` (the default for both) decides per call from the segment sizes, which come from
    the plan and so agree on every rank, and from the backend that carries the tensors:
    - gathers: on NCCL (or another backend), the exchange while a group's ``k`` non-empty
      segments number at least ``(N − 1) / 2``, else broadcast: the exchange makes each owner
      send its segment ``N − 1`` times, about ``(N − 1) / k`` times the bytes of a pipelined
      broadcast per segment. On gloo always broadcast: gloo runs collectives on its own worker
      threads but point-to-point sends on the caller's, so the exchange's socket writes would
      land on the training thread (its broadcast is a binomial tree: no more bytes per owner).
    - reductions: never the exchange (it holds ``N − 1`` received segments). On NCCL one
      ``reduce`` per segment (NCCL pipelines each; per rank about the bytes of a
      reduce-scatter). On gloo the rounds: the bytes of a reduce-scatter and one receive buffer
      of the owner's segment, where gloo's ``reduce`` (a ring reduce-scatter plus a gather per
      segment) and an in-place ``all_reduce`` (twice the bytes) both take longer. ``"auto"``
      picks the rounds only where gloo carries the tensors.

    ``coalesce`` (default: on unless ``MATRIXFSDP_COALESCE=0``): on a backend that coalesces
    (NCCL), a group's broadcasts or reduces launch as one (see [Note: one launch per group]).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        gather_impl: GatherImpl = "auto",
        reduce_impl: ReduceImpl = "auto",
        counter: CommCounter | None = None,
        dim: str = "shard",
        coalesce: bool | None = None,
    ) -> None:
        if gather_impl not in ("auto", "alltoall", "broadcast", "allgather"):
            raise ValueError(
                "gather_impl must be 'auto', 'alltoall', 'broadcast' or 'allgather', got "
                f"{gather_impl!r}"
            )
        if reduce_impl not in ("auto", "alltoall", "rounds", "reduce", "allreduce", "scatter"):
            raise ValueError(
                "reduce_impl must be 'auto', 'alltoall', 'rounds', 'reduce', 'allreduce' or "
                f"'scatter', got {reduce_impl!r}"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group)).lower()
        if reduce_impl == "rounds" and "gloo" not in self._backend:
            reduce_form("rounds", gloo=False, backend=self._backend)  # raises: gloo only
        self.gather_impl = gather_impl
        self.reduce_impl = reduce_impl
        self.counter = counter if counter is not None else CommCounter()
        self.dim = dim  # the mesh dim this group spans, for the counter
        if coalesce is None:
            coalesce = os.environ.get(COALESCE_ENV, "1").strip().lower() not in ("0", "false", "no")
        self.coalesce = coalesce  # see [Note: one launch per group]
        self._coalesces_on: dict[str, bool] = {}  # device type -> the backend coalesces
        self._global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r
            for r in range(self.world_size)
        ]

    # -- all-gather-v -----------------------------------------------------------------------------
    def all_gather_v(
        self, own: torch.Tensor, numels: Sequence[int], *, async_op: bool = False
    ) -> tuple[list[torch.Tensor], Pending]:
        if own.numel() != numels[self.rank]:
            raise ValueError(f"own segment has {own.numel()} elements, plan says {numels[self.rank]}")
        segments = [own if r == self.rank else own.new_empty(n) for r, n in enumerate(numels)]
        pending = self.all_gather_into([[s] for s in segments], async_op=async_op)
        return segments, pending

    def all_gather_into(
        self, parts: Sequence[Sequence[torch.Tensor]], *, async_op: bool = False
    ) -> Pending:
        if len(parts) != self.world_size:
            raise ValueError(f"{len(parts)} parts for a group of {self.world_size} ranks")
        like = next((t for part in parts for t in part), None)
        if self.world_size == 1 or like is None:
            return Pending()
        numels = [sum(t.numel() for t in part) for part in parts]
        form = gather_form(self.gather_impl, numels, self.world_size, gloo=self._on_gloo(like),
                           itemsize=like.element_size())
        if form == "broadcast":
            return self._gather_broadcast(parts, async_op)
        if form == "allgather":
            return self._gather_padded(parts, numels, async_op)
        return self._gather_exchange(parts, numels, async_op)

    def _gather_padded(
        self, parts: Sequence[Sequence[torch.Tensor]], numels: Sequence[int], async_op: bool
    ) -> Pending:
        """One padded all-gather (see [Note: one call per group])."""
        me, width = self.rank, max(numels)
        like = next(t for part in parts for t in part)
        send = like.new_empty(width)
        if parts[me]:
            torch.cat([t.reshape(-1) for t in parts[me]], out=send[: numels[me]])
        received = like.new_empty(width * self.world_size)
        with record_function("matrixfsdp::all_gather_v"):
            work = _all_gather_flat(received, send, self.group, async_op)
        itemsize = like.element_size()
        self.counter.record("all_gather_v", width * itemsize * (self.world_size - 1),
                            width * itemsize * (self.world_size - 1), dim=self.dim)
        segments = [received[r * width : r * width + n] for r, n in enumerate(numels)]
        unpack = _UnpackOnWait(_issued([work], async_op, keepalive=(send, received)),
                               segments, parts, me)
        if not async_op:
            unpack.wait()
        return unpack

    def _gather_exchange(
        self, parts: Sequence[Sequence[torch.Tensor]], numels: Sequence[int], async_op: bool
    ) -> Pending:
        me = self.rank
        peers = [r for r in range(self.world_size) if r != me]
        # Per pair and direction, sends and receives follow plan order on both sides.
        sends = [(r, t) for r in peers for t in parts[me]]
        recvs = [(r, t) for r in peers for t in parts[r]]
        with record_function("matrixfsdp::all_gather_v"):
            works = self._exchange(sends, recvs)
        itemsize = _itemsize(parts)
        self.counter.record("all_gather_v", numels[me] * itemsize * len(peers),
                            (sum(numels) - numels[me]) * itemsize, dim=self.dim)
        return _issued(works, async_op, keepalive=[t for part in parts for t in part])

    def _gather_broadcast(self, parts: Sequence[Sequence[torch.Tensor]], async_op: bool) -> Pending:
        sends = [(r, t) for r, part in enumerate(parts) for t in part if t.numel()]
        coalesce = bool(sends) and self._coalesces(sends[0][1])
        device = sends[0][1].device if coalesce else None
        with record_function("matrixfsdp::all_gather_v"), self._launch(device) as works:
            for r, t in sends:
                works.append(dist.broadcast(t, src=self._global_ranks[r], group=self.group,
                                            async_op=async_op or coalesce))
                mine = r == self.rank
                self.counter.record("all_gather_v", _nbytes(t) * (self.world_size - 1) if mine
                                    else 0, 0 if mine else _nbytes(t), dim=self.dim)
        return _issued(works, async_op, keepalive=[t for part in parts for t in part])

    # -- reduce-to-owners -------------------------------------------------------------------------
    def reduce_to_owners(
        self, flat: torch.Tensor, numels: Sequence[int], *, async_op: bool = False
    ) -> tuple[torch.Tensor, Pending]:
        if flat.numel() != sum(numels):
            raise ValueError(f"buffer has {flat.numel()} elements, segments sum to {sum(numels)}")
        segments = torch.split(flat, list(numels))
        own = segments[self.rank]
        if self.world_size == 1:
            return own, Pending()
        form = reduce_form(self.reduce_impl, gloo=self._on_gloo(flat),
                           backend=self._backend_of(flat),
                           padded_bytes=max(numels) * self.world_size * flat.element_size())
        if form == "scatter":
            return self._reduce_padded(flat, numels, async_op)
        if form == "allreduce":
            return own, self._reduce_all(flat, async_op)
        if form == "reduce":
            return own, self._reduce_p2p(flat, segments, async_op)
        if form == "rounds":
            return own, self._reduce_rounds(flat, segments, async_op)
        return self._reduce_exchange(flat, segments, async_op)

    def _reduce_exchange(
        self, flat: torch.Tensor, segments: Sequence[torch.Tensor], async_op: bool
    ) -> tuple[torch.Tensor, Pending]:
        me = self.rank
        own = segments[me]
        peers = [r for r in range(self.world_size) if r != me]
        sends = [(r, segments[r]) for r in peers]
        recvs = [(r, flat.new_empty(own.numel())) for r in peers] if own.numel() else []
        with record_function("matrixfsdp::reduce_to_owners"):
            works = self._exchange(sends, recvs)
        self.counter.record("reduce_to_owners", _nbytes(flat) - _nbytes(own),
                            _nbytes(own) * len(peers), dim=self.dim)
        pending = _SumOnWait(own, [buf for _, buf in recvs], works, keepalive=(flat,))
        if not async_op:
            pending.wait()
        return own, pending

    def _reduce_rounds(
        self, flat: torch.Tensor, segments: Sequence[torch.Tensor], async_op: bool
    ) -> Pending:
        """Gloo only (``reduce_form`` refuses it elsewhere; see [Note: rounds need gloo])."""
        me, n = self.rank, self.world_size
        own = segments[me]
        # Peer me + k receives its segment in round k; this rank hears from me - k in round k,
        # so every round's send was posted before its receive is (no rank waits on a later one).
        sends = [((me + k) % n, segments[(me + k) % n]) for k in range(1, n)]
        sources = [(me - k) % n for k in range(1, n)] if own.numel() else []
        buf = flat.new_empty(own.numel()) if sources else None
        with record_function("matrixfsdp::reduce_to_owners"):
            works = self._exchange(sends, [(sources[0], buf)] if sources else [])
        self.counter.record("reduce_to_owners", _nbytes(flat) - _nbytes(own),
                            _nbytes(own) * len(sources), dim=self.dim)
        pending = _RoundsOnWait(self, own, buf, sources, works, keepalive=(flat,))
        if not async_op:
            pending.wait()
        return pending

    def _reduce_padded(
        self, flat: torch.Tensor, numels: Sequence[int], async_op: bool
    ) -> tuple[torch.Tensor, Pending]:
        """One padded reduce-scatter (see [Note: one call per group]); the owner's summed
        segment is a fresh tensor, ``flat`` is not written."""
        width = max(numels)
        padded = flat.new_zeros(width * self.world_size)
        start = 0
        for r, n in enumerate(numels):
            padded[r * width : r * width + n] = flat[start : start + n]
            start += n
        out = flat.new_empty(width)
        with record_function("matrixfsdp::reduce_to_owners"):
            work = _reduce_scatter_flat(out, padded, self.group, async_op)
        nbytes = width * flat.element_size() * (self.world_size - 1)
        self.counter.record("reduce_to_owners", nbytes, nbytes, dim=self.dim)
        return out[: numels[self.rank]], _issued([work], async_op, keepalive=(padded, out))

    def _reduce_p2p(
        self, flat: torch.Tensor, segments: Sequence[torch.Tensor], async_op: bool
    ) -> Pending:
        owned = [(r, segment) for r, segment in enumerate(segments) if segment.numel()]
        coalesce = bool(owned) and self._coalesces(flat)
        with record_function("matrixfsdp::reduce_to_owners"), \
                self._launch(flat.device if coalesce else None) as works:
            for r, segment in owned:
                works.append(dist.reduce(segment, dst=self._global_ranks[r], group=self.group,
                                         async_op=async_op or coalesce))
                received = _nbytes(segment) * (self.world_size - 1) if r == self.rank else 0
                self.counter.record("reduce_to_owners", _nbytes(segment), received, dim=self.dim)
        return _issued(works, async_op, keepalive=(flat,))

    def _reduce_all(self, flat: torch.Tensor, async_op: bool) -> Pending:
        with record_function("matrixfsdp::reduce_to_owners"):
            work = dist.all_reduce(flat, group=self.group, async_op=async_op)
        # The all-reduce convention of ``CommCounter``: the payload, sent and received.
        self.counter.record("reduce_to_owners", _nbytes(flat), _nbytes(flat), dim=self.dim)
        return _issued([work], async_op, keepalive=(flat,))

    def _backend_of(self, t: torch.Tensor) -> str:
        """The backend serving ``t``'s device in this group (``"cpu:gloo,cuda:nccl"``-style
        backends map each device type to one; ``""`` where none does)."""
        backend = self._backend
        if ":" in backend:
            backend = dict(kv.split(":", 1) for kv in backend.split(",")).get(t.device.type, "")
        return backend

    def _on_gloo(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s device is served by gloo in this group."""
        return self._backend_of(t) == "gloo"

    # -- coalescing (see [Note: one launch per group]) -----------------------------------------
    def _coalesces(self, like: torch.Tensor) -> bool:
        """Whether this group's ops on ``like``'s device are issued as one coalesced launch."""
        if not self.coalesce or self._on_gloo(like):
            return False
        kind = like.device.type
        if kind not in self._coalesces_on:
            self._coalesces_on[kind] = backend_coalesces(self.group, like.device)
        return self._coalesces_on[kind]

    @contextlib.contextmanager
    def _launch(self, coalesce_on: torch.device | None) -> Iterator[list[object]]:
        """Collect the works of the ops issued in the block; with ``coalesce_on`` (a device) the
        block is one coalesced launch there and, on exit, its one work replaces the ops' own."""
        works: list[object] = []
        if coalesce_on is None:
            yield works
            return
        with _coalescing_manager(self.group, coalesce_on, async_ops=True) as launch:
            yield works
        works[:] = launch.works

    # -- point-to-point ---------------------------------------------------------------------------
    def _exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                  recvs: Sequence[tuple[int, torch.Tensor]]) -> list[object]:
        """Post every send and receive (group ranks, non-empty tensors) as one batch."""
        ops = [dist.P2POp(dist.isend, t, self._global_ranks[r], group=self.group)
               for r, t in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, self._global_ranks[r], group=self.group)
                for r, t in recvs if t.numel()]
        return list(dist.batch_isend_irecv(ops)) if ops else []

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


def backend_coalesces(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` coalesces ops into one launch (NCCL does;
    gloo does not). See [Note: one launch per group]."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = pg._get_backend(device)
    except (RuntimeError, AttributeError):  # no backend for this device type
        return False
    return bool(getattr(backend, "supports_coalescing", False))


def gather_form(impl: str, numels: Sequence[int], world_size: int, *, gloo: bool,
                itemsize: int = 4) -> Literal["alltoall", "broadcast", "allgather"]:
    """The gather form ``TorchOwnerComm`` uses for ``impl`` (``"auto"``: see its rule);
    ``gloo``: the tensors travel on gloo (else NCCL, or another backend)."""
    if impl in ("broadcast", "p2p"):
        return "broadcast"
    if impl == "allgather":
        return "allgather"
    if impl != "auto":
        return "alltoall"
    if gloo:
        padded = max(numels) * world_size * itemsize
        return "allgather" if padded <= PADDED_MAX_BYTES else "broadcast"
    owners = sum(1 for n in numels if n)
    return "broadcast" if owners < (world_size - 1) / 2 else "alltoall"


# [Note: rounds need gloo]
# A reduction in rounds posts all of a rank's sends at once but only its first receive; each
# later receive is posted after the previous one landed. That completes only if an unmatched
# send holds nothing else up until its receive is posted. gloo progresses each send and receive
# on its own, so every later receive, once posted, meets a send posted before it. NCCL does
# not: a send completes only as the peer's receive takes its data (beyond what fits in the
# connection's buffers), and a communicator's operations run in order on one stream, so the
# batch holding the sends cannot finish before the peers' later receives, which are queued
# behind the peers' own batches of sends: a cycle once a segment outgrows those buffers. Until
# the form is proven on NCCL it runs on gloo only: ``reduce_form`` refuses it elsewhere, and
# ``"auto"`` picks it only where gloo carries the tensors (else one in-place ``reduce`` per
# segment).
def reduce_form(
    impl: str, *, gloo: bool, backend: str | None = None, padded_bytes: int | None = None,
) -> Literal["alltoall", "rounds", "reduce", "allreduce", "scatter"]:
    """The reduction form ``TorchOwnerComm`` uses for ``impl`` (``"auto"``: see its rule).

    ``gloo``: gloo carries the tensors; ``backend`` names the backend that does (for the error
    raised when ``impl="rounds"`` and it is not gloo; see [Note: rounds need gloo]);
    ``padded_bytes``: the padded form's buffer (see [Note: one call per group]).
    """
    if impl == "p2p":
        return "reduce"
    if impl == "rounds" and not gloo:
        raise ValueError(
            f"reduce_impl='rounds' runs on gloo only, but these gradients travel on "
            f"{backend or 'a backend other than gloo'!r}, where posting every send with only "
            "the first receive can deadlock (see [Note: rounds need gloo] in "
            "matrixfsdp/collectives/torch_backend.py); use reduce_impl='reduce' (one in-place "
            "reduce per owner segment), 'alltoall' (one exchange: the owner receives its peers' "
            "copies at once) or 'auto'"
        )
    if impl in ("alltoall", "rounds", "reduce", "allreduce", "scatter"):
        return impl  # type: ignore[return-value]
    if gloo and padded_bytes is not None and padded_bytes <= PADDED_MAX_BYTES:
        return "allreduce"
    return "rounds" if gloo else "reduce"


def _all_gather_flat(out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None,
                     async_op: bool) -> object:
    """``all_gather_single`` where torch has it (2.13+), else ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, send, group=group, async_op=async_op)


def _reduce_scatter_flat(out: torch.Tensor, send: torch.Tensor,
                         group: dist.ProcessGroup | None, async_op: bool) -> object:
    """``reduce_scatter_single`` where torch has it (2.13+), else ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, send, group=group, async_op=async_op)


def _issued(works: Sequence[object], async_op: bool, keepalive: Sequence[object]) -> Pending:
    pending = Pending([w for w in works if w is not None], keepalive=keepalive)  # sync: None
    if not async_op:
        pending.wait()
    return pending


class _SumOnWait(Pending):
    """A reduction exchange: on ``wait()`` the peers' received copies are summed into ``own``."""

    def __init__(self, own: torch.Tensor, received: list[torch.Tensor], works: Sequence[object],
                 keepalive: Sequence[object]) -> None:
        super().__init__(works, keepalive=keepalive)
        self._own, self._received = own, received

    def wait(self) -> None:
        super().wait()
        for copy in self._received:  # rank order: the same sum on every run
            self._own.add_(copy)
        self._received = []


class _RoundsOnWait(Pending):
    """A reduction in rounds: the sends and the first receive are in flight; ``wait()`` sums
    each received copy into ``own`` and posts the next receive into the same buffer."""

    def __init__(self, comm: TorchOwnerComm, own: torch.Tensor, buf: torch.Tensor | None,
                 sources: list[int], works: list[object], keepalive: Sequence[object]) -> None:
        super().__init__(keepalive=keepalive)
        self._comm, self._own, self._buf, self._sources = comm, own, buf, sources
        self._works = works  # the sends, then the first receive (when this rank receives)

    def wait(self) -> None:
        if self._comm is None:
            return
        sends = self._works[:-1] if self._sources else self._works
        receive = self._works[-1] if self._sources else None
        for i, _ in enumerate(self._sources):
            if i:
                with record_function("matrixfsdp::reduce_to_owners"):
                    (receive,) = self._comm._exchange([], [(self._sources[i], self._buf)])
            receive.wait()  # type: ignore[union-attr]
            self._own.add_(self._buf)  # the same order on every run
        for work in sends:
            work.wait()  # type: ignore[attr-defined]
        self._comm, self._buf, self._works, self._sources = None, None, [], []
        self._keepalive.clear()


def _itemsize(parts: Sequence[Sequence[torch.Tensor]]) -> int:
    return next((t.element_size() for part in parts for t in part), 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
