"""Strategies on ZeRO-3 sharding: FSDP2 + AdamW, FSDP2 + reconstruction, gather-once, matrixfsdp."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import matrixfsdp as mf

from .base import MatrixStepper, Strategy, StrategyContext, chunk_sizes, local_rows, planner_for
from .replicated import _adamw_state

__all__ = [
    "FSDP2AdamWStrategy",
    "FSDP2SGDMomentumStrategy",
    "GatherOnceStrategy",
    "MatrixFSDPBroadcastRoundsStrategy",
    "MatrixFSDPExchangeReduceStrategy",
    "MatrixFSDPP2PStrategy",
    "MatrixFSDPStrategy",
    "MatrixFSDPUnitTailsStrategy",
    "ReconstructionStrategy",
]


def _fully_shard(model: nn.Module, ctx: StrategyContext) -> None:
    """Stock FSDP2: one unit per block, then the root (the same units matrixfsdp uses)."""
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)


def _tail_adamw(params: list[nn.Parameter], ctx: StrategyContext) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=ctx.optim.tail_lr, weight_decay=ctx.optim.tail_weight_decay)


class FSDP2AdamWStrategy(Strategy):
    """The cost floor: stock FSDP2 and ``torch.optim.AdamW`` on every parameter."""

    name = "fsdp2_adamw"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        super().__init__(model, ctx)
        _fully_shard(model, ctx)
        self.opt = _tail_adamw(list(model.parameters()), ctx)

    def step(self) -> None:
        self.opt.step()

    def state_tensors(self) -> list[Any]:
        return _adamw_state(self.opt)


class FSDP2SGDMomentumStrategy(FSDP2AdamWStrategy):
    """Stock FSDP2 with the optimizer-state size of Muon: ``torch.optim.SGD`` with momentum (one
    buffer per matrix, like Muon's) on the matrices and AdamW on the tail. The memory baseline a
    matrix optimizer at ZeRO-3 memory should match (its update is not Muon's)."""

    name = "fsdp2_sgdm"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        Strategy.__init__(self, model, ctx)
        _fully_shard(model, ctx)
        params = dict(model.named_parameters())
        matrices = [params[f] for f in ctx.matrix_fqns]
        self.sgd = torch.optim.SGD(matrices, lr=ctx.optim.matrix_lr, momentum=0.95)
        self.opt = _tail_adamw([p for f, p in params.items() if f not in ctx.matrix_fqns], ctx)

    def step(self) -> None:
        self.sgd.step()
        self.opt.step()

    def state_tensors(self) -> list[Any]:
        return _adamw_state(self.sgd) + _adamw_state(self.opt)


class _ShardedMatrices(Strategy):
    """FSDP2 model whose matrices get a matrix optimizer and whose tail gets AdamW."""

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        super().__init__(model, ctx)
        _fully_shard(model, ctx)
        params = dict(model.named_parameters())
        self.matrices: dict[str, DTensor] = {f: params[f] for f in ctx.matrix_fqns}
        self.tail_opt = _tail_adamw([p for f, p in params.items() if f not in self.matrices], ctx)
        self.stepper = MatrixStepper(ctx.optim)


class ReconstructionStrategy(_ShardedMatrices):
    """Stock FSDP2 + a matrix optimizer by reconstruction ("stock FSDP2-Muon" in the MatrixFSDP
    paper, "MatrixFSDP: communication-free matrix optimizers under ZeRO-3 parameter sharding").

    Per matrix and step: ``full_tensor()`` all-gathers the gradient and every optimizer-state
    tensor (state is kept ``Shard(0)``, ZeRO-3 style); every rank runs the step function on the
    whole matrix (its own rows of the parameter are placed in a zero matrix: the update is
    row-local in the parameter, so no parameter gather is needed) and keeps its rows.
    """

    name = "fsdp2_recon"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        super().__init__(model, ctx)
        self.dstate: dict[str, dict[str, DTensor]] = {}

    def _state(self, fqn: str, p: DTensor) -> dict[str, DTensor]:
        if fqn not in self.dstate:
            full = self.stepper.init_state(torch.empty(p.shape, dtype=p.dtype))
            rank, world = self.ctx.rank, self.ctx.world
            self.dstate[fqn] = {
                k: DTensor.from_local(local_rows(t, rank, world).clone(), self.ctx.mesh,
                                      [Shard(0)], run_check=False, shape=t.shape,
                                      stride=t.stride())
                for k, t in full.items()
            }
        return self.dstate[fqn]

    @torch.no_grad()
    def step(self) -> None:
        rank, world = self.ctx.rank, self.ctx.world
        for fqn, p in self.matrices.items():
            if p.grad is None:
                continue
            grad = p.grad.full_tensor()
            sharded_state = self._state(fqn, p)
            state = {k: v.full_tensor() for k, v in sharded_state.items()}
            local = p.to_local()
            whole = torch.zeros(p.shape, dtype=p.dtype)
            mine = local_rows(whole, rank, world)
            mine.copy_(local)
            self.stepper.step(fqn, whole, grad, state)
            local.copy_(mine)
            for k, v in sharded_state.items():
                v.to_local().copy_(local_rows(state[k], rank, world))
        self.tail_opt.step()

    def state_tensors(self) -> list[Any]:
        return [v for st in self.dstate.values() for v in st.values()] + _adamw_state(self.tail_opt)


class GatherOnceStrategy(_ShardedMatrices):
    """FSDP2 + one all-to-all per step that hands whole gradients to owners (Dion / Distributed
    Shampoo style): owners (the matrixfsdp plan) keep whole optimizer state, compute the update
    ``Δ`` of each owned matrix (step function on a zero parameter) and a second all-to-all sends
    every rank its rows of ``Δ``. Exact only without matrix weight decay (checked)."""

    name = "gather_once"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        if ctx.optim.weight_decay:
            raise ValueError(
                "gather_once ships the update Δ computed on a zero parameter, which equals the "
                f"step only without weight decay; got weight_decay={ctx.optim.weight_decay}"
            )
        super().__init__(model, ctx)
        self.by_owner = [[f for f in ctx.matrix_fqns if ctx.owner(f) == r]
                         for r in range(ctx.world)]
        self.rows = {f: chunk_sizes(p.shape[0], ctx.world) for f, p in self.matrices.items()}
        self.cols = {f: p.numel() // p.shape[0] for f, p in self.matrices.items()}

    def _numel(self, fqns: list[str], rank: int) -> int:
        return sum(self.rows[f][rank] * self.cols[f] for f in fqns)

    def _exchange(self, send: list[list[torch.Tensor]], recv_numels: list[int]) -> list[torch.Tensor]:
        """One uneven all-to-all: ``send[d]`` goes to rank d; returns what each rank sent us."""
        me = self.ctx.rank
        flat = [t.reshape(-1) for d, parts in enumerate(send) if d != me for t in parts]
        in_splits = [0 if d == me else sum(t.numel() for t in parts) for d, parts in enumerate(send)]
        out_splits = [0 if s == me else n for s, n in enumerate(recv_numels)]
        out = torch.empty(sum(out_splits))
        dist.all_to_all_single(out, torch.cat(flat) if flat else torch.empty(0), out_splits,
                               in_splits)
        return list(out.split(out_splits))

    @torch.no_grad()
    def step(self) -> None:
        me, world = self.ctx.rank, self.ctx.world
        mine = self.by_owner[me]
        local = {f: p.to_local() for f, p in self.matrices.items()}
        grads = {f: p.grad.to_local() for f, p in self.matrices.items()}
        send = [[grads[f] for f in self.by_owner[d]] for d in range(world)]
        got = self._exchange(send, [self._numel(mine, s) for s in range(world)])
        pieces = [
            () if s == me else from_s.split([self.rows[f][s] * self.cols[f] for f in mine])
            for s, from_s in enumerate(got)
        ]
        deltas = {}
        for i, f in enumerate(mine):
            shape = self.matrices[f].shape
            rows = [grads[f] if s == me else pieces[s][i].view(-1, *shape[1:])
                    for s in range(world)]
            delta = torch.zeros(shape)
            self.stepper.step(f, delta, torch.cat(rows))
            deltas[f] = delta
        back = [[local_rows(deltas[f], d, world) for f in mine] for d in range(world)]
        got = self._exchange(back, [self._numel(self.by_owner[s], me) for s in range(world)])
        for f in mine:
            local[f].add_(local_rows(deltas[f], me, world))
        for s in range(world):
            if s != me and self.by_owner[s]:
                sizes = [self.rows[f][me] * self.cols[f] for f in self.by_owner[s]]
                for f, piece in zip(self.by_owner[s], got[s].split(sizes), strict=True):
                    local[f].add_(piece.view_as(local[f]))
        self.tail_opt.step()

    def state_tensors(self) -> list[Any]:
        return self.stepper.state_tensors() + _adamw_state(self.tail_opt)


class MatrixFSDPStrategy(Strategy):
    """``fully_shard_matrix`` (owners balanced by the optimizer's cost) + ``MatrixOptimizer``."""

    name = "matrixfsdp"
    wrap_kwargs: ClassVar[dict[str, Any]] = {}  # more keywords for fully_shard_matrix (variants)

    def __init__(self, model: nn.Module, ctx: StrategyContext, *, mesh: Any = None) -> None:
        super().__init__(model, ctx)
        mf.fully_shard_matrix(model, mesh, planner=planner_for(ctx.optim.name), **self.wrap_kwargs)
        self.runtime = mf.get_state(model)
        if mesh is None and self.runtime.plan.params != ctx.plan.params:
            raise RuntimeError("matrixfsdp's plan differs from the plan the baselines use")
        o = ctx.optim
        self.opt = mf.MatrixOptimizer(
            model, optimizer=o.name, lr=o.matrix_lr, weight_decay=o.weight_decay,
            tail_lr=o.tail_lr, tail_weight_decay=o.tail_weight_decay, **o.matrix_kwargs,
        )

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def resident_tensors(self) -> dict[str, list[Any]]:
        out = super().resident_tensors()
        out["params"] += [mp.unsharded for mp in self.runtime.params.values()]
        return out

    def state_tensors(self) -> list[Any]:
        return [v for st in self.opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]


class _MatrixFSDPFormsStrategy(MatrixFSDPStrategy):
    """matrixfsdp with its owner collectives forced to ``gather_impl`` / ``reduce_impl``
    (``TorchOwnerComm``'s forms) instead of the ones ``"auto"`` picks."""

    gather_impl: str
    reduce_impl: str

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        super().__init__(model, ctx)
        comm = self.runtime.comm
        comm.gather_impl = self.gather_impl  # type: ignore[attr-defined]
        comm.reduce_impl = self.reduce_impl  # type: ignore[attr-defined]


class MatrixFSDPP2PStrategy(_MatrixFSDPFormsStrategy):
    """matrixfsdp forced to its p2p collectives: one ``broadcast`` per owner segment to gather and
    one ``reduce(dst=owner)`` per segment for gradients (what ``fully_shard_matrix(...,
    collectives="p2p")`` selects; the default ``"auto"`` picks per group)."""

    name = "matrixfsdp_p2p"
    gather_impl, reduce_impl = "broadcast", "reduce"


class MatrixFSDPExchangeReduceStrategy(_MatrixFSDPFormsStrategy):
    """matrixfsdp with one broadcast per matrix to gather (as ``"auto"`` on gloo) and the
    exchange reduction (``reduce_impl="alltoall"``): each owner receives its segment from its
    N - 1 peers into as many buffers at once and sums them, where the default (``"auto"``'s
    rounds on gloo) receives them one after another into one buffer."""

    name = "matrixfsdp_xreduce"
    gather_impl, reduce_impl = "broadcast", "alltoall"


class MatrixFSDPBroadcastRoundsStrategy(_MatrixFSDPFormsStrategy):
    """matrixfsdp with the buffer-free gloo forms for every group: one broadcast per matrix and
    the reduction in rounds (what ``"auto"`` picks on gloo for groups past ``PADDED_MAX_BYTES``;
    for smaller ones it makes one padded all-gather and one all-reduce, see [Note: one call per
    group])."""

    name = "matrixfsdp_bcast"
    gather_impl, reduce_impl = "broadcast", "rounds"


class MatrixFSDPUnitTailsStrategy(MatrixFSDPBroadcastRoundsStrategy):
    """The layout before per-group overhead was cut: an FSDP2 unit for every block's tail
    (``tail_units="groups"``) and the buffer-free gloo forms for every group."""

    name = "matrixfsdp_unit_tails"
    wrap_kwargs: ClassVar[dict[str, Any]] = {"tail_units": "groups"}
