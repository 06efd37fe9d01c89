"""Deterministic owner assignment: longest-processing-time-first (LPT) over a cost model."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .costs import COST_MODELS, matrix_cost
from .plan import ParamPlacement, ParamSpec, Plan

__all__ = ["LPTPlanner", "make_plan"]


@dataclass(frozen=True)
class LPTPlanner:
    """Assign each matrix to the least-loaded rank, largest first (ties: FQN, then lowest rank).

    ``cost`` picks what is balanced: ``"bytes"`` (resident bytes, the default) or an optimizer's
    step FLOPs (``"muon"``, ``"shampoo"``, ``"soap"``, ``"okls"``, ``"emagram"``).
    ``memory_cap_bytes`` bounds the matrix bytes any rank may own. A matrix that fits on no rank
    under the cap (larger than the cap itself, e.g. a 128k-vocabulary head routed to the matrix
    optimizer, or too many whole matrices for too few ranks) is handled by ``oversized``:
    ``"tail"`` (default) demotes it to the FSDP2 ``Shard(0)`` tail, where the tail optimizer
    steps it, and records why in ``Plan.notes``; ``"error"`` raises ``ValueError`` naming it.

    ``stacks`` decides 3-D expert stacks ``(E, m, n)``: ``"whole"`` gives each stack one owner;
    ``"slices"`` keeps it in FSDP2 ``Shard(0)`` so every rank owns whole experts of it (see
    [Note: plan vocabulary]); ``"auto"`` (default) slices a stack with at least as many experts
    as ranks and keeps smaller stacks whole.
    """

    cost: Literal["bytes", "muon", "shampoo", "soap", "okls", "emagram"] = "bytes"
    memory_cap_bytes: int | None = None
    oversized: Literal["tail", "error"] = "tail"
    stacks: Literal["auto", "whole", "slices"] = "auto"

    def __post_init__(self) -> None:
        if self.cost not in COST_MODELS:
            raise ValueError(
                f"LPTPlanner.cost must be one of {sorted(COST_MODELS)}, got {self.cost!r}"
            )
        if self.oversized not in ("tail", "error"):
            raise ValueError(f"LPTPlanner.oversized must be 'tail' or 'error', got {self.oversized!r}")
        if self.stacks not in ("auto", "whole", "slices"):
            raise ValueError(
                f"LPTPlanner.stacks must be 'auto', 'whole' or 'slices', got {self.stacks!r}"
            )
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise ValueError(
                f"LPTPlanner.memory_cap_bytes must be positive, got {self.memory_cap_bytes}"
            )

    @property
    def name(self) -> str:
        return f"lpt-{self.cost}"

    def item_cost(self, spec: ParamSpec) -> float:
        if self.cost == "bytes":
            return float(spec.nbytes)
        return matrix_cost(spec.matrix_shape, self.cost)  # the (out, in) orientation

    def __call__(self, specs: Sequence[ParamSpec], world_size: int,
                 expert_grid: Sequence[int] | None = None) -> Plan:
        """Plan ``specs`` over ``world_size`` shard ranks; ``expert_grid`` (each shard rank's
        expert-mesh index) places expert rows too (see [Note: plan vocabulary])."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        sliced = {s.fqn for s in specs if s.role == "matrix" and s.mesh == "dense"
                  and self._slices(s, world_size)}
        matrices = [s for s in specs if s.role == "matrix" and s.fqn not in sliced]
        costs = [self.item_cost(s) for s in matrices]
        # Largest first; ties broken by FQN (two stable sorts beat one tuple-keyed sort).
        order = sorted(range(len(matrices)), key=lambda i: matrices[i].fqn)
        order.sort(key=costs.__getitem__, reverse=True)
        if any(s.mesh == "expert" for s in matrices):
            owner_of = self._assign_joint(matrices, costs, order, world_size, expert_grid)
        else:
            owner_of = self._assign(matrices, costs, order, world_size)
        placed = {s.fqn: (owner_of[i], costs[i]) for i, s in enumerate(matrices)}
        notes = {
            s.fqn: f"oversized: {s.nbytes} bytes fit on no rank under memory_cap_bytes="
                   f"{self.memory_cap_bytes}; demoted to the FSDP2 tail (stepped by the tail optimizer)"
            for s in matrices if placed[s.fqn][0] is None
        }
        rows = []
        for s in specs:
            if s.fqn in placed:
                owner, cost = placed[s.fqn]
                rows.append(ParamPlacement.of(s, owner, cost) if owner is not None
                            else ParamPlacement.of(s, role="tail"))
            elif s.fqn in sliced:
                rows.append(ParamPlacement.of(s, None, self.item_cost(s), role="sharded_stack"))
            else:
                rows.append(ParamPlacement.of(s))
        grid = tuple(expert_grid) if expert_grid is not None else None
        return Plan.trusted(world_size=world_size, planner=self.name, params=tuple(rows),
                            notes=notes, expert_grid=grid)

    def _slices(self, spec: ParamSpec, world_size: int) -> bool:
        if (len(spec.shape) != 3 or spec.orientation == "flatten" or world_size == 1
                or self.stacks == "whole"):
            return False
        return self.stacks == "slices" or spec.shape[0] >= world_size

    def _assign_joint(
        self, matrices: Sequence[ParamSpec], costs: Sequence[float], order: Sequence[int],
        world_size: int, expert_grid: Sequence[int] | None,
    ) -> list[int | None]:
        """LPT over dense and expert rows at once: a dense matrix goes to the least-loaded shard
        rank, an expert stack to the expert-mesh index whose ranks' highest load is least (it
        lands on all of them, one per ep rank). Loads are compared over the dense shard ranks."""
        if expert_grid is None:
            raise ValueError("expert rows need an expert_grid (expert parallelism)")
        if self.memory_cap_bytes is not None:
            raise NotImplementedError(
                "LPTPlanner.memory_cap_bytes is not supported with expert parallelism yet; "
                "leave it None"
            )
        load = [0.0] * world_size
        ranks_of: dict[int, list[int]] = {}
        for rank, index in enumerate(expert_grid):
            ranks_of.setdefault(index, []).append(rank)
        owner_of: list[int | None] = [0] * len(matrices)
        for i in order:
            if matrices[i].mesh == "expert":
                index = min(ranks_of, key=lambda f: (max(load[r] for r in ranks_of[f]), f))
                for rank in ranks_of[index]:
                    load[rank] += costs[i]
                owner_of[i] = index
            else:
                rank = min(range(world_size), key=lambda r: (load[r], r))
                load[rank] += costs[i]
                owner_of[i] = rank
        return owner_of

    def _assign(
        self, matrices: Sequence[ParamSpec], costs: Sequence[float], order: Sequence[int],
        world_size: int,
    ) -> list[int | None]:
        owner_of: list[int | None] = [0] * len(matrices)
        heap = [(0.0, rank) for rank in range(world_size)]
        if self.memory_cap_bytes is None:
            for i in order:
                load, rank = heap[0]
                owner_of[i] = rank
                heapq.heapreplace(heap, (load + costs[i], rank))
            return owner_of
        owned_bytes = [0] * world_size
        cap = self.memory_cap_bytes
        for i in order:
            nbytes = matrices[i].nbytes
            skipped = []
            while heap and owned_bytes[heap[0][1]] + nbytes > cap:
                skipped.append(heapq.heappop(heap))
            if not heap:
                heap = skipped
                heapq.heapify(heap)
                if self.oversized == "error":
                    spec = matrices[i]
                    raise ValueError(
                        f"matrix {spec.fqn!r} (shape {spec.shape}, {nbytes} bytes) fits on no "
                        f"rank under memory_cap_bytes={cap}; raise the cap, add ranks, or use "
                        "oversized='tail' to keep it in the FSDP2 tail"
                    )
                owner_of[i] = None
                continue
            load, rank = heap[0]
            owner_of[i] = rank
            owned_bytes[rank] += nbytes
            heapq.heapreplace(heap, (load + costs[i], rank))
            for item in skipped:
                heapq.heappush(heap, item)
        return owner_of


def make_plan(specs: Sequence[ParamSpec], world_size: int, planner: object = None,
              expert_grid: Sequence[int] | None = None) -> Plan:
    """Run ``planner`` (an ``LPTPlanner``, a cost-model name, a callable, or None for bytes);
    ``expert_grid`` places expert rows (expert parallelism: ``LPTPlanner`` only)."""
    if planner is None:
        planner = LPTPlanner()
    elif isinstance(planner, str):
        planner = LPTPlanner(cost=planner)  # type: ignore[arg-type]
    if not callable(planner):
        raise ValueError(
            f"planner must be an LPTPlanner, a cost-model name or a callable "
            f"(specs, world_size) -> Plan; got {type(planner).__name__}"
        )
    if expert_grid is not None:
        if not isinstance(planner, LPTPlanner):
            raise NotImplementedError(
                f"planner {type(planner).__name__} cannot place expert stacks (expert "
                "parallelism); use planner=None, a cost-model name or an LPTPlanner"
            )
        return planner(specs, world_size, expert_grid)
    plan = planner(specs, world_size)
    if not isinstance(plan, Plan):
        raise ValueError(f"planner returned {type(plan).__name__}, expected matrixfsdp Plan")
    if [p.fqn for p in plan.params] != [s.fqn for s in specs]:
        raise ValueError("planner must return one placement per spec, in the same order")
    return plan
