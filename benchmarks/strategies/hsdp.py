"""HSDP strategies and the strongest FSDP2 + Muon baseline (owner all-to-alls overlapped with NS).

[Note: the owner all-to-all Muon baseline]
``distmuon`` keeps stock FSDP2 ``Shard(0)`` storage and Muon's momentum sharded the same way (as
torchtitan's / Dion's distributed Muon and Canzona do). Per optimizer step, in *waves* (one
FSDP2 unit's matrices each, forward order):
1. every rank updates the momentum rows it holds and forms its rows of the Nesterov direction
   (element-wise, so exact on rows);
2. one packed uneven ``all_to_all_single`` sends each matrix's rows to its owner (the matrixfsdp
   plan over the shard group: the same balanced owners), who assembles whole matrices;
3. the owner orthogonalises them (Newton–Schulz) and one packed all-to-all sends every rank its
   rows of the update, which it applies with weight decay to its shard.
The gather of wave k+1 is issued before wave k's Newton–Schulz and the scatter of wave k is
waited only after wave k+1's compute, so communication overlaps compute (two waves in flight).
Under HSDP (``distmuon_hsdp``) FSDP2 HSDP has already averaged the gradients over all ranks; the
all-to-alls run inside each shard group and every replica repeats its shard group's step.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.optim.functional.muon import muon_adjusted_lr, zeropower_via_newton_schulz

from .base import Strategy, StrategyContext, chunk_sizes, owner_plan
from .replicated import _adamw_state
from .sharded import MatrixFSDPStrategy

__all__ = ["DistMuonHSDPStrategy", "DistMuonStrategy", "MatrixFSDPHSDPNoFlagsStrategy",
           "MatrixFSDPHSDPStrategy", "hsdp_mesh"]


def hsdp_mesh(ctx: StrategyContext) -> DeviceMesh:
    """The (replicate, shard) mesh of ``ctx.hsdp_replicate`` replicas (collective)."""
    replicas = ctx.hsdp_replicate
    if ctx.world % replicas:
        raise ValueError(f"hsdp_replicate={replicas} does not divide the world size {ctx.world}")
    return init_device_mesh("cpu", (replicas, ctx.world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def _group_ranks(mesh: DeviceMesh, dim: int) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(mesh.get_group(dim)))


class MatrixFSDPHSDPStrategy(MatrixFSDPStrategy):
    """``fully_shard_matrix`` on a 2-D (replicate, shard) mesh: owners inside each shard group,
    one all-reduce per group over the replicas (see matrixfsdp's [Note: HSDP mesh])."""

    name = "matrixfsdp_hsdp"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        self.mesh2d = hsdp_mesh(ctx)
        super().__init__(model, ctx, mesh=self.mesh2d)

    def mesh_dims(self) -> dict[tuple[int, ...], str]:
        return {_group_ranks(self.mesh2d, 1): "shard", _group_ranks(self.mesh2d, 0): "replicate"}


class MatrixFSDPHSDPNoFlagsStrategy(MatrixFSDPHSDPStrategy):
    """matrixfsdp HSDP with ``replicate_presence_flags=False``: the all-reduce over replicas
    carries the gradients only (every matrix of the benchmark model takes part in the loss)."""

    name = "matrixfsdp_noflags_hsdp"
    wrap_kwargs: ClassVar[dict[str, Any]] = {"replicate_presence_flags": False}


class DistMuonStrategy(Strategy):
    """Stock FSDP2 + Muon by owner all-to-alls overlapped with Newton–Schulz (see the Note)."""

    name = "distmuon"
    hsdp = False

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        if ctx.optim.name != "muon":
            raise ValueError(f"{self.name} implements Muon only, got optimizer {ctx.optim.name!r}")
        super().__init__(model, ctx)
        self.mesh = hsdp_mesh(ctx) if self.hsdp else ctx.mesh
        shard_dim = self.mesh.ndim - 1
        self.group = self.mesh.get_group(shard_dim)
        self.me, self.size = self.mesh.get_local_rank(shard_dim), self.mesh.size(shard_dim)
        plan = owner_plan(model, self.size, ctx.optim.name) if self.hsdp else ctx.plan
        for block in model.layers:  # type: ignore[union-attr]
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        params = dict(model.named_parameters())
        self.owner = {p.fqn: int(p.owner_rank) for p in plan.matrices}  # type: ignore[arg-type]
        self.waves = [[p.fqn for p in plan.matrices if p.group == g] for g in plan.groups()]
        self.matrices: dict[str, DTensor] = {f: params[f] for f in self.owner}
        self.tail_opt = torch.optim.AdamW([p for f, p in params.items() if f not in self.owner],
                                          lr=ctx.optim.tail_lr,
                                          weight_decay=ctx.optim.tail_weight_decay)
        self.config = get_matrix_optimizer("muon").make_config(ctx.optim.matrix_kwargs)
        self.momentum: dict[str, torch.Tensor] = {}

    def mesh_dims(self) -> dict[tuple[int, ...], str]:
        if not self.hsdp:
            return super().mesh_dims()
        return {_group_ranks(self.mesh, 1): "shard", _group_ranks(self.mesh, 0): "replicate"}

    # -- one wave ---------------------------------------------------------------------------------
    def _rows(self, fqn: str) -> list[int]:
        p = self.matrices[fqn]
        return [r * (p.numel() // p.shape[0]) for r in chunk_sizes(p.shape[0], self.size)]

    def _directions(self, wave: list[str]) -> dict[str, torch.Tensor]:
        """Momentum update and Nesterov direction on this rank's rows (element-wise, exact)."""
        out = {}
        mu = self.config.momentum
        for f in wave:
            grad = self.matrices[f].grad.to_local()
            buf = self.momentum.setdefault(f, torch.zeros_like(grad))
            buf.lerp_(grad, 1 - mu)
            out[f] = grad.lerp(buf, mu) if self.config.nesterov else buf
        return out

    def _exchange(self, send: list[torch.Tensor], send_splits: list[int],
                  recv_splits: list[int]) -> tuple[torch.Tensor, Any]:
        flat = torch.cat([t.reshape(-1) for t in send]) if send else torch.empty(0)
        recv = flat.new_empty(sum(recv_splits))
        with record_function("distmuon::all_to_all"):
            work = dist.all_to_all_single(recv, flat, recv_splits, send_splits, group=self.group,
                                          async_op=True)
        return recv, (work, flat)

    def _gather(self, wave: list[str]) -> tuple[torch.Tensor, Any]:
        """Start sending every matrix's direction rows to its owner (packed by destination)."""
        directions = self._directions(wave)
        send, send_splits = [], []
        for dst in range(self.size):
            mine = [directions[f] for f in wave if self.owner[f] == dst]
            send += mine
            send_splits.append(sum(t.numel() for t in mine))
        owned = [f for f in wave if self.owner[f] == self.me]
        recv_splits = [sum(self._rows(f)[src] for f in owned) for src in range(self.size)]
        return self._exchange(send, send_splits, recv_splits)

    def _orthogonalise(self, wave: list[str], recv: torch.Tensor) -> dict[str, torch.Tensor]:
        owned = [f for f in wave if self.owner[f] == self.me]
        pieces: dict[str, list[torch.Tensor]] = {f: [] for f in owned}
        offset = 0
        for src in range(self.size):
            for f in owned:
                n = self._rows(f)[src]
                pieces[f].append(recv[offset : offset + n])
                offset += n
        c = self.config
        out = {}
        for f in owned:
            shape = self.matrices[f].shape
            whole = torch.cat(pieces[f]).view(shape)
            out[f] = zeropower_via_newton_schulz(whole, c.ns_coefficients, c.ns_steps, c.eps,
                                                 getattr(torch, c.ns_dtype)).to(whole.dtype)
        return out

    def _scatter(self, wave: list[str], ortho: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Start sending every rank its rows of the updates this rank computed."""
        owned = [f for f in wave if self.owner[f] == self.me]
        send, send_splits = [], []
        for dst in range(self.size):
            rows = []
            for f in owned:
                sizes = chunk_sizes(self.matrices[f].shape[0], self.size)
                start = sum(sizes[:dst])
                rows.append(ortho[f][start : start + sizes[dst]])
            send += rows
            send_splits.append(sum(t.numel() for t in rows))
        recv_splits = [sum(self._rows(f)[self.me] for f in wave if self.owner[f] == src)
                       for src in range(self.size)]
        return self._exchange(send, send_splits, recv_splits)

    def _apply(self, wave: list[str], recv: torch.Tensor) -> None:
        lr, wd = self.ctx.optim.matrix_lr, self.ctx.optim.weight_decay
        offset = 0
        for src in range(self.size):
            for f in (f for f in wave if self.owner[f] == src):
                local = self.matrices[f].to_local()
                update = recv[offset : offset + local.numel()].view_as(local)
                offset += local.numel()
                m, n = self.matrices[f].shape
                local.mul_(1 - lr * wd)
                local.add_(update, alpha=-muon_adjusted_lr(lr, self.config.adjust_lr_fn, m, n))

    @torch.no_grad()
    def step(self) -> None:
        waves = [[f for f in w if self.matrices[f].grad is not None] for w in self.waves]
        waves = [w for w in waves if w]
        gathers = [self._gather(waves[0])] if waves else []
        scatters: list[tuple[list[str], tuple[torch.Tensor, Any]]] = []
        for k, wave in enumerate(waves):
            if k + 1 < len(waves):  # in flight while this wave computes
                gathers.append(self._gather(waves[k + 1]))
            recv, (work, _) = gathers[k]
            work.wait()
            scatters.append((wave, self._scatter(wave, self._orthogonalise(wave, recv))))
            if len(scatters) > 1:  # the previous wave's updates have had a compute to land
                self._finish(*scatters.pop(0))
        for item in scatters:
            self._finish(*item)
        self.tail_opt.step()

    def _finish(self, wave: list[str], pending: tuple[torch.Tensor, Any]) -> None:
        recv, (work, _) = pending
        work.wait()
        self._apply(wave, recv)

    def state_tensors(self) -> list[Any]:
        return list(self.momentum.values()) + _adamw_state(self.tail_opt)


class DistMuonHSDPStrategy(DistMuonStrategy):
    """The owner all-to-all Muon baseline on FSDP2 HSDP (all-to-alls inside each shard group)."""

    name = "distmuon_hsdp"
    hsdp = True
