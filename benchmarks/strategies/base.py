"""What every strategy shares: the context, the matrix stepper, byte counting, row chunks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.planner import COST_MODELS, Plan, make_plan
from matrixfsdp.runtime.selection import default_groups, param_specs, select_params

from ..config import OptimConfig
from ..model import lm_loss

__all__ = [
    "MatrixStepper",
    "Strategy",
    "StrategyContext",
    "chunk_sizes",
    "local_rows",
    "owner_plan",
    "planner_for",
    "tensor_bytes",
]


def planner_for(optim_name: str) -> str:
    """Balance owners by the optimizer's step FLOPs when the library has a cost model for it."""
    return optim_name if optim_name in COST_MODELS else "bytes"


def owner_plan(model: nn.Module, world: int, optim_name: str) -> Plan:
    """The plan ``fully_shard_matrix(model, planner=planner_for(name))`` computes (same inputs)."""
    sites = select_params(model, default_groups(model), None, "cpu")
    return make_plan(param_specs(sites), world, planner_for(optim_name))


@dataclass(frozen=True)
class StrategyContext:
    """Everything a strategy needs besides its own model copy."""

    optim: OptimConfig
    rank: int
    world: int
    mesh: DeviceMesh
    plan: Plan
    hsdp_replicate: int = 2  # replicas of the HSDP strategies' (replicate, shard) mesh

    @property
    def matrix_fqns(self) -> tuple[str, ...]:
        return tuple(p.fqn for p in self.plan.matrices)

    def owner(self, fqn: str) -> int:
        return int(self.plan[fqn].owner_rank)  # type: ignore[arg-type]


class MatrixStepper:
    """The library's pure step function applied to whole matrices, with per-key state/step."""

    def __init__(self, optim: OptimConfig) -> None:
        self.spec = get_matrix_optimizer(optim.name)
        self.config = self.spec.make_config(optim.matrix_kwargs)
        self.lr = optim.matrix_lr
        self.weight_decay = optim.weight_decay
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.spec.init_state_fn(param, self.config)

    def step(self, key: str, param: torch.Tensor, grad: torch.Tensor,
             state: dict[str, torch.Tensor] | None = None, *,
             weight_decay: float | None = None) -> None:
        """One step of matrix ``key``; ``state`` overrides the stepper's own state dict."""
        if state is None:
            if key not in self.state:
                self.state[key] = self.init_state(param)
            state = self.state[key]
        self.steps[key] = self.steps.get(key, 0) + 1
        self.spec.step_fn(
            param, grad, state, lr=self.lr,
            weight_decay=self.weight_decay if weight_decay is None else weight_decay,
            step=self.steps[key], initial_lr=self.lr, config=self.config,
        )

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for st in self.state.values() for t in st.values()]


class Strategy:
    """One way of training the model; subclasses fill in the placement and the optimizer step.

    ``forward`` returns the local loss; ``backward`` ends with every gradient where the optimizer
    step expects it (gradient sync belongs to backward); ``step`` is the optimizer step with
    whatever communication it needs; ``resident_tensors`` lists what stays allocated between steps.
    """

    name = "base"

    def __init__(self, model: nn.Module, ctx: StrategyContext) -> None:
        self.model = model
        self.ctx = ctx

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, tokens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        raise NotImplementedError

    def mesh_dims(self) -> dict[tuple[int, ...], str]:
        """Global ranks of each process group the strategy uses -> its mesh dim name. A flat
        strategy's one group is its shard group (a flat mesh is HSDP with one replica)."""
        return {tuple(range(self.ctx.world)): "shard"}

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def resident_tensors(self) -> dict[str, list[Any]]:
        """``{"params": [...], "grads": [...], "state": [...]}`` of tensors held between steps."""
        params = list(self.model.parameters())
        return {
            "params": params,
            "grads": [p.grad for p in params],
            "state": self.state_tensors(),
        }

    def state_tensors(self) -> list[Any]:
        raise NotImplementedError

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of distinct storages per category (aliases counted once, in category order)."""
        seen: set[tuple[int, int]] = set()
        return {k: tensor_bytes(v, seen) for k, v in self.resident_tensors().items()}


def tensor_bytes(tensors: Iterable[Any], seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def chunk_sizes(rows: int, world: int) -> list[int]:
    """Rows per rank under ``torch.chunk`` semantics (what DTensor/FSDP2 ``Shard(0)`` uses)."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def local_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's ``Shard(0)`` rows of ``full`` (a view)."""
    sizes = chunk_sizes(full.shape[0], world)
    start = sum(sizes[:rank])
    return full[start : start + sizes[rank]]
