"""Strategies that keep full parameters on every rank: DDP and ZeRO-1 owner placement."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import MatrixStepper, Strategy, StrategyContext

__all__ = ["DDPStrategy", "Zero1OwnerStrategy"]


class DDPStrategy(Strategy):
    """Stock DDP: all-reduced gradients; every rank steps every matrix and the AdamW tail.

    ``gradient_as_bucket_view=True`` so the gradients *are* DDP's buckets (no second copy).
    """

    name = "ddp"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        super().__init__(model, ctx)
        self.ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        params = dict(model.named_parameters())
        self.matrices = {f: params[f] for f in ctx.matrix_fqns}
        tail = [p for f, p in params.items() if f not in self.matrices]
        self.stepper = MatrixStepper(ctx.optim)
        self.tail_opt = torch.optim.AdamW(tail, lr=ctx.optim.tail_lr,
                                          weight_decay=ctx.optim.tail_weight_decay)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from ..model import lm_loss

        return lm_loss(self.ddp, tokens)

    @torch.no_grad()
    def step(self) -> None:
        for fqn, p in self.matrices.items():
            if p.grad is not None:
                self.stepper.step(fqn, p, p.grad)
        self.tail_opt.step()

    def zero_grad(self) -> None:
        # Keep DDP's bucket views alive (set_to_none would drop them and reallocate each step).
        self.tail_opt.zero_grad(set_to_none=False)
        for p in self.matrices.values():
            if p.grad is not None:
                p.grad.zero_()

    def state_tensors(self) -> list[Any]:
        return self.stepper.state_tensors() + _adamw_state(self.tail_opt)


class Zero1OwnerStrategy(Strategy):
    """ZeRO-1 owner placement: full parameters everywhere, whole tensors owned by one rank.

    Matrices follow the matrixfsdp plan; tail tensors are spread by greedy bytes. Backward ends
    with one ``reduce(dst=r)`` per owner rank r of the flat gradients it owns (non-owners then
    drop their gradients); the optimizer step runs on owners (matrix step function or AdamW)
    and ends with one ``broadcast(src=r)`` per owner of its updated tensors.
    """

    name = "zero1_owner"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        super().__init__(model, ctx)
        params = dict(model.named_parameters())
        owners = {f: ctx.owner(f) for f in ctx.matrix_fqns}
        owners.update(_greedy_owners({f: p for f, p in params.items() if f not in owners},
                                     ctx.world))
        # Ranks that own nothing take part in no reduce/broadcast (same decision on every rank).
        self.owned: dict[int, list[tuple[str, nn.Parameter]]] = {
            r: owned for r in range(ctx.world)
            if (owned := [(f, p) for f, p in params.items() if owners[f] == r])
        }
        mine = self.owned.get(ctx.rank, [])
        self.matrices = [(f, p) for f, p in mine if f in set(ctx.matrix_fqns)]
        tail = [p for f, p in mine if f not in set(ctx.matrix_fqns)]
        self.stepper = MatrixStepper(ctx.optim)
        self.tail_opt = (torch.optim.AdamW(tail, lr=ctx.optim.tail_lr,
                                           weight_decay=ctx.optim.tail_weight_decay)
                         if tail else None)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        with torch.no_grad():
            flats, works = {}, []
            for r, owned in self.owned.items():
                flats[r] = torch.cat([p.grad.reshape(-1) for _, p in owned])
                works.append(dist.reduce(flats[r], dst=r, async_op=True))
            for w in works:
                w.wait()
            for r, owned in self.owned.items():
                for (_, p), g in zip(owned, _split(flats[r], owned), strict=True):
                    p.grad = g.div(self.ctx.world) if r == self.ctx.rank else None

    @torch.no_grad()
    def step(self) -> None:
        for fqn, p in self.matrices:
            self.stepper.step(fqn, p, p.grad)
        if self.tail_opt is not None:
            self.tail_opt.step()
        flats, works = {}, []
        for r, owned in self.owned.items():
            flats[r] = torch.cat([p.reshape(-1) for _, p in owned])
            works.append(dist.broadcast(flats[r], src=r, async_op=True))
        for w in works:
            w.wait()
        for r, owned in self.owned.items():
            if r != self.ctx.rank:
                for (_, p), value in zip(owned, _split(flats[r], owned), strict=True):
                    p.copy_(value)

    def state_tensors(self) -> list[Any]:
        tail = _adamw_state(self.tail_opt) if self.tail_opt is not None else []
        return self.stepper.state_tensors() + tail


def _split(flat: torch.Tensor, owned: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    sizes = [p.numel() for _, p in owned]
    return [t.view(p.shape) for t, (_, p) in zip(flat.split(sizes), owned, strict=True)]


def _greedy_owners(params: dict[str, nn.Parameter], world: int) -> dict[str, int]:
    """Largest first to the rank with the fewest bytes (ties: FQN, lowest rank)."""
    loads = [0] * world
    owners: dict[str, int] = {}
    for fqn, p in sorted(params.items(), key=lambda kv: (-kv[1].numel(), kv[0])):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[fqn] = rank
        loads[rank] += p.numel() * p.element_size()
    return owners


def _adamw_state(opt: torch.optim.Optimizer) -> list[Any]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
