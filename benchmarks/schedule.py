"""Which collectives each strategy issues per step, and what it keeps resident, from a plan alone.

The same functions describe the measured small runs (checked against the profiler's counts) and
the projected 7B-class run (fed to the α–β model in ``costmodel``). Per-rank byte conventions are
those of :mod:`benchmarks.measure` ([Note: what a collective "costs" in the tables]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.planner import ParamPlacement, Plan

__all__ = ["Dtypes", "Op", "Setup", "owners_all", "per_rank_recv", "resident_model", "schedule"]


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: gathered (compute) parameters, reduced gradients, master params, state."""

    gather: int = 4
    grad: int = 4
    param: int = 4
    state: int = 4


@dataclass(frozen=True)
class Setup:
    """A plan plus what the schedule needs besides it."""

    plan: Plan
    optimizer: str
    dtypes: Dtypes = field(default_factory=Dtypes)
    gloo: bool = True  # gloo runs FSDP2's reduce-scatter as an all-reduce of the whole buffer

    @property
    def world(self) -> int:
        return self.plan.world_size

    def units(self) -> list[str]:
        """FSDP2 units in forward order: blocks (groups other than the root), then the root."""
        groups = list(dict.fromkeys(p.group for p in self.plan.params if p.group))
        return [*groups, ""]

    def params_of(self, unit: str, role: str | None = None) -> list[ParamPlacement]:
        return [p for p in self.plan.params if p.group == unit and (role is None or p.role == role)]

    def state_numels(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        return _state_shapes(self.optimizer, tuple(shape))


@lru_cache(maxsize=256)
def _state_shapes(optimizer: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes of the optimizer-state tensors of one matrix (from its init function, on meta)."""
    spec = get_matrix_optimizer(optimizer)
    state = spec.init_state_fn(torch.empty(shape, device="meta"), spec.make_config({}))
    return [tuple(t.shape) for t in state.values()]


@dataclass(frozen=True)
class Op:
    """One collective: ``kind`` with logical ``size`` bytes; ``root`` for broadcast/reduce;
    ``traffic[src][dst]`` bytes for an all-to-all."""

    phase: str
    kind: str
    size: int
    root: int | None = None
    traffic: tuple[tuple[int, ...], ...] | None = None


def padded(shape: tuple[int, ...], world: int) -> int:
    """Elements of a ``Shard(0)`` tensor padded to equal chunks (FSDP2, DTensor all-gather)."""
    rest = math.prod(shape[1:])
    return -(-shape[0] // world) * world * rest


def rows(shape: tuple[int, ...], world: int, rank: int) -> int:
    """Elements of rank ``rank``'s ``torch.chunk`` rows of a tensor of ``shape``."""
    chunk = -(-shape[0] // world)
    return max(0, min(chunk, shape[0] - rank * chunk)) * math.prod(shape[1:])


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# -- building blocks ----------------------------------------------------------------------------
def _fsdp(setup: Setup, role: str | None, resharded: bool = True) -> list[Op]:
    """FSDP2 forward gathers, backward re-gathers (blocks) and reduce-scatters, per unit."""
    n, d = setup.world, setup.dtypes
    ops: list[Op] = []
    for phase in ("forward", "backward"):
        for unit in setup.units():
            elems = sum(padded(p.shape, n) for p in setup.params_of(unit, role))
            if not elems:
                continue
            if phase == "forward" or (unit and resharded):
                ops.append(Op(phase, "all_gather", elems * d.gather))
    for unit in setup.units():
        elems = sum(padded(p.shape, n) for p in setup.params_of(unit, role))
        if elems:
            ops.append(Op("backward", "all_reduce" if setup.gloo else "reduce_scatter",
                          elems * d.grad))
    return ops


def _a2a(phase: str, world: int, pairs: dict[tuple[int, int], int], self_copy: bool = False) -> Op:
    """An all-to-all; ``self_copy``: each rank's segment to itself is in the buffers (a local
    copy that the profiler's output size includes), as in matrixfsdp's gradient reduction."""
    grid = [[0] * world for _ in range(world)]
    for (src, dst), nbytes in pairs.items():
        if src != dst or self_copy:
            grid[src][dst] += nbytes
    size = max(max(sum(row) for row in grid), max(sum(col) for col in zip(*grid, strict=True)))
    return Op(phase, "all_to_all", size, traffic=tuple(tuple(r) for r in grid))


def _owner_segments(setup: Setup, unit: str) -> dict[int, tuple[int, int]]:
    """owner -> (elements, matrix count) of the unit's matrices it owns."""
    seg: dict[int, tuple[int, int]] = {}
    for p in setup.params_of(unit, "matrix"):
        e, c = seg.get(int(p.owner_rank), (0, 0))  # type: ignore[arg-type]
        seg[int(p.owner_rank)] = (e + numel(p.shape), c + 1)  # type: ignore[arg-type]
    return seg


def _matrixfsdp(setup: Setup, impl: str) -> list[Op]:
    """``impl``: "alltoall", "p2p", or "auto" (the library default: per group, one all-to-all
    while the group's owners number at least (N − 1) / 2, else broadcast / reduce)."""
    n, d = setup.world, setup.dtypes
    ops = _fsdp(setup, "tail")
    for phase, kinds in (("forward", ("gather",)), ("backward", ("gather", "reduce"))):
        for unit in setup.units():
            seg = _owner_segments(setup, unit)
            if not seg:
                continue
            unit_impl = impl
            if impl == "auto":
                unit_impl = "alltoall" if len(seg) >= (n - 1) / 2 else "p2p"
            for kind in kinds:
                if kind == "gather" and unit_impl == "alltoall":
                    pairs = {(o, r): e * d.gather for o, (e, _) in seg.items() for r in range(n)}
                    ops.append(_a2a(phase, n, pairs))
                elif kind == "gather":
                    ops += [Op(phase, "broadcast", e * d.gather, root=o) for o, (e, _) in seg.items()]
                elif unit_impl == "alltoall":
                    pairs = {(r, o): (e + c) * d.grad for o, (e, c) in seg.items() for r in range(n)}
                    ops.append(_a2a(phase, n, pairs, self_copy=True))
                else:
                    ops += [Op(phase, "reduce", (e + c) * d.grad, root=o)
                            for o, (e, c) in seg.items()]
    return ops


def _ddp_buckets(setup: Setup) -> list[Op]:
    """DDP's bucketing: reverse parameter order, first bucket 1 MiB, then 25 MiB."""
    ops, current, limit = [], 0, 1 << 20
    for p in reversed(setup.plan.params):
        current += numel(p.shape) * setup.dtypes.grad
        if current >= limit:
            ops.append(Op("backward", "all_reduce", current))
            current, limit = 0, 25 << 20
    if current:
        ops.append(Op("backward", "all_reduce", current))
    return ops


def _tail_owners(setup: Setup) -> dict[str, int]:
    loads = [0] * setup.world
    owners = {}
    for p in sorted(setup.plan.tail, key=lambda p: (-numel(p.shape), p.fqn)):
        r = min(range(setup.world), key=lambda r: (loads[r], r))
        owners[p.fqn] = r
        loads[r] += numel(p.shape)
    return owners


def owners_all(setup: Setup) -> dict[str, int]:
    out = {p.fqn: int(p.owner_rank) for p in setup.plan.matrices}  # type: ignore[arg-type]
    out.update(_tail_owners(setup))
    return out


def _zero1(setup: Setup) -> list[Op]:
    owners = owners_all(setup)
    per = [0] * setup.world
    for p in setup.plan.params:
        per[owners[p.fqn]] += numel(p.shape)
    ops = [Op("backward", "reduce", e * setup.dtypes.grad, root=r) for r, e in enumerate(per) if e]
    ops += [Op("optimizer", "broadcast", e * setup.dtypes.param, root=r)
            for r, e in enumerate(per) if e]
    return ops


def _recon(setup: Setup) -> list[Op]:
    n, ops = setup.world, []
    for p in setup.plan.matrices:
        ops.append(Op("optimizer", "all_gather", padded(p.shape, n) * setup.dtypes.grad))
        ops += [Op("optimizer", "all_gather", padded(s, n) * setup.dtypes.state)
                for s in setup.state_numels(p.shape)]
    return ops


def _gather_once(setup: Setup) -> list[Op]:
    n, d = setup.world, setup.dtypes
    fwd: dict[tuple[int, int], int] = {}
    back: dict[tuple[int, int], int] = {}
    for p in setup.plan.matrices:
        o = int(p.owner_rank)  # type: ignore[arg-type]
        for r in range(n):
            fwd[(r, o)] = fwd.get((r, o), 0) + rows(p.shape, n, r) * d.grad
            back[(o, r)] = back.get((o, r), 0) + rows(p.shape, n, r) * d.param
    return [_a2a("optimizer", n, fwd), _a2a("optimizer", n, back)]


def schedule(setup: Setup, strategy: str) -> list[Op]:
    """Every collective ``strategy`` issues in one training step."""
    if strategy == "ddp":
        return _ddp_buckets(setup)
    if strategy == "fsdp2_adamw":
        return _fsdp(setup, None)
    if strategy == "fsdp2_recon":
        return _fsdp(setup, None) + _recon(setup)
    if strategy == "gather_once":
        return _fsdp(setup, None) + _gather_once(setup)
    if strategy == "zero1_owner":
        return _zero1(setup)
    if strategy == "matrixfsdp":
        return _matrixfsdp(setup, "auto")
    if strategy == "matrixfsdp_p2p":
        return _matrixfsdp(setup, "p2p")
    raise ValueError(f"no schedule for strategy {strategy!r}")


def per_rank_recv(op: Op, world: int) -> list[int]:
    """Bytes each rank receives from peers in ``op`` (see benchmarks.measure)."""
    if op.kind == "all_to_all":
        assert op.traffic is not None
        return [sum(col) for col in zip(*op.traffic, strict=True)]
    if op.kind == "all_gather":
        return [op.size * (world - 1) // world] * world
    if op.kind == "all_reduce":
        return [2 * (world - 1) * op.size // world] * world
    if op.kind == "reduce_scatter":
        return [(world - 1) * op.size // world] * world
    if op.kind == "broadcast":
        return [0 if r == op.root else op.size for r in range(world)]
    if op.kind == "reduce":
        return [(world - 1) * op.size if r == op.root else 0 for r in range(world)]
    raise ValueError(f"unknown collective kind {op.kind!r}")


def resident_model(setup: Setup, strategy: str) -> list[dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state each rank keeps between steps.

    Modeled like the strategies hold them: FSDP2 shards padded to equal chunks, AdamW two moments,
    the matrix optimizer's own state shapes; scalar step counters are ignored.
    """
    n, d = setup.world, setup.dtypes
    owners = owners_all(setup)
    out = []
    for r in range(n):
        params = grads = state = 0
        for p in setup.plan.params:
            full, shard = numel(p.shape), padded(p.shape, n) // n
            is_matrix = p.role == "matrix" and strategy != "fsdp2_adamw"
            own = owners[p.fqn] == r
            opt_full = (sum(numel(s) for s in setup.state_numels(p.shape)) if is_matrix
                        else 2 * full)
            if strategy == "ddp":
                params, grads, state = params + full, grads + full, state + opt_full
            elif strategy == "zero1_owner":
                params += full
                grads += full if own else 0
                state += opt_full if own else 0
            elif strategy.startswith("matrixfsdp") and p.role == "matrix":
                params += full if own else 0
                grads += full if own else 0
                state += opt_full if own else 0
            else:  # FSDP2 shards; the matrix state is sharded (recon) or whole on owners
                params, grads = params + shard, grads + shard
                if is_matrix and strategy == "gather_once":
                    state += opt_full if own else 0
                elif is_matrix:
                    state += sum(padded(s, n) // n for s in setup.state_numels(p.shape))
                else:
                    state += 2 * shard
        out.append({"params": params * d.param, "grads": grads * d.grad, "state": state * d.state})
    return out
