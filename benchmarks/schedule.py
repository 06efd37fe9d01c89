"""Which collectives each strategy issues per step, and what it keeps resident, from a plan alone.

The same functions describe the measured small runs (checked against the profiler's counts) and
the projected 7B-class run (fed to the α–β model in ``costmodel``). Per-rank byte conventions are
those of :mod:`benchmarks.measure` ([Note: what a collective "costs" in the tables]).

HSDP strategies (names ending ``_hsdp``) run on a ``(replicate, shard)`` mesh: their ``Setup``
holds the plan over the shard size and ``replicate``; global rank ``g`` sits at replica
``g // shard``, shard coordinate ``g % shard`` (``init_device_mesh``'s row-major order). Each op
names the group it runs on: ``"world"`` (all ranks; a flat strategy's one group), ``"shard"``
(every shard group at once, the same op in each) or ``"replicate"`` (the replicate group of
shard coordinate ``member`` only, or of every coordinate when ``member`` is None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from matrixfsdp.collectives.torch_backend import PADDED_MAX_BYTES
from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.planner import ParamPlacement, Plan
from matrixfsdp.runtime.tail import tail_has_unit

__all__ = [
    "Dtypes",
    "Op",
    "Setup",
    "inter_node_recv",
    "is_hsdp",
    "owners_all",
    "per_rank_calls",
    "per_rank_recv",
    "resident_model",
    "schedule",
]


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
    replicate: int = 1  # HSDP replicas; the plan is over the shard size

    @property
    def shard(self) -> int:
        return self.plan.world_size

    @property
    def world(self) -> int:
        return self.plan.world_size * self.replicate

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.replicate, self.shard)

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
    root: int | None = None  # index in the op's group
    traffic: tuple[tuple[int, ...], ...] | None = None
    group: str = "world"  # "world", "shard" or "replicate" (see the module docstring)
    member: int | None = None  # "replicate" ops: the shard coordinate whose group issues it


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
def _unit_params(setup: Setup, role: str | None, fold: bool) -> dict[str, list[ParamPlacement]]:
    """Each FSDP2 unit's parameters; with ``fold`` a group's tail joins the root's unit unless
    ``tail_has_unit`` gives it its own (matrixfsdp's default, see [Note: tail units])."""
    units = {unit: setup.params_of(unit, role) for unit in setup.units()}
    if fold:
        for unit in [u for u in units if u]:
            nbytes = sum(numel(p.shape) * setup.dtypes.param for p in units[unit])
            if not tail_has_unit("auto", nbytes):
                units[""] = units[""] + units.pop(unit)
    return units


def _fsdp(setup: Setup, role: str | None, resharded: bool = True,
          fold: bool = False) -> list[Op]:
    """FSDP2 forward gathers, backward re-gathers (blocks) and reduce-scatters, per unit; under
    HSDP inside the shard group, then one all-reduce of the reduced shard over the replicas."""
    n, d = setup.shard, setup.dtypes
    group = "shard" if setup.replicate > 1 else "world"
    ops: list[Op] = []
    units = _unit_params(setup, role, fold)
    for phase in ("forward", "backward"):
        for unit, params in units.items():
            elems = sum(padded(p.shape, n) for p in params)
            if not elems:
                continue
            if n > 1 and (phase == "forward" or (unit and resharded)):  # FSDP2 skips 1 rank
                ops.append(Op(phase, "all_gather", elems * d.gather, group=group))
    for params in units.values():
        elems = sum(padded(p.shape, n) for p in params)
        if elems and n > 1:
            ops.append(Op("backward", "all_reduce" if setup.gloo else "reduce_scatter",
                          elems * d.grad, group=group))
        if elems and setup.replicate > 1:
            ops.append(Op("backward", "all_reduce", elems // n * d.grad, group="replicate"))
    return ops


def _a2a(phase: str, world: int, pairs: dict[tuple[int, int], int], self_copy: bool = False,
         group: str = "world") -> Op:
    """An all-to-all (or matrixfsdp's exchange of point-to-point sends, the same traffic);
    ``self_copy``: each rank's segment to itself is in the buffers (a local copy that the
    profiler's output size includes), as in the DistMuon baseline's ``all_to_all_single``."""
    grid = [[0] * world for _ in range(world)]
    for (src, dst), nbytes in pairs.items():
        if src != dst or self_copy:
            grid[src][dst] += nbytes
    size = max(max(sum(row) for row in grid), max(sum(col) for col in zip(*grid, strict=True)))
    return Op(phase, "all_to_all", size, traffic=tuple(tuple(r) for r in grid), group=group)


def _owner_segments(setup: Setup, unit: str) -> dict[int, tuple[int, int]]:
    """owner -> (elements, matrix count) of the unit's matrices it owns."""
    seg: dict[int, tuple[int, int]] = {}
    for p in setup.params_of(unit, "matrix"):
        e, c = seg.get(int(p.owner_rank), (0, 0))  # type: ignore[arg-type]
        seg[int(p.owner_rank)] = (e + numel(p.shape), c + 1)  # type: ignore[arg-type]
    return seg


def _forms(impl: str, owners: int, n: int, gloo: bool, gather_padded: int = 0,
           reduce_padded: int = 0) -> tuple[str, str]:
    """(gather, reduce) forms of one group, by ``TorchOwnerComm``'s rule (its docstring):
    "p2p" is broadcast per matrix / reduce per segment, "alltoall" the exchange; "auto" on gloo
    gathers with one padded all-gather and reduces with one all-reduce while the padded group
    (``*_padded`` bytes) fits ``PADDED_MAX_BYTES``, else broadcasts and reduces in rounds; on
    NCCL it exchanges gathers while owners >= (N - 1) / 2 and reduces per segment."""
    if impl == "p2p":
        return "broadcast", "reduce"
    if impl == "alltoall":
        return "alltoall", "alltoall"
    if impl == "xreduce":
        return "broadcast", "alltoall"
    if impl == "bcast_rounds":
        return "broadcast", "rounds"
    if gloo:
        return (("allgather" if gather_padded <= PADDED_MAX_BYTES else "broadcast"),
                ("allreduce" if reduce_padded <= PADDED_MAX_BYTES else "rounds"))
    return ("alltoall" if owners >= (n - 1) / 2 else "broadcast"), "reduce"


def _matrixfsdp(setup: Setup, impl: str, replicate_flags: bool = True,
                fold_tails: bool = True) -> list[Op]:
    """``impl``: "alltoall" (one exchange of point-to-point sends per group, the traffic of an
    uneven all-to-all), "p2p" (one broadcast per matrix, one reduce per owner segment), or
    "auto" (the library default, ``_forms``). Under HSDP inside the shard group, and each
    owner's summed segment is then all-reduced over its replicate group (one call per group and
    owner: values and presence flags, or the values only with ``replicate_flags=False``)."""
    n, d = setup.shard, setup.dtypes
    g = "shard" if setup.replicate > 1 else "world"
    ops = _fsdp(setup, "tail", fold=fold_tails)
    for phase, kinds in (("forward", ("gather",)), ("backward", ("gather", "reduce"))):
        for unit in setup.units():
            seg = _owner_segments(setup, unit)
            if not seg:
                continue
            width = max(e for e, _ in seg.values())
            red_width = max(e + c for e, c in seg.values())
            gather, reduce = _forms(impl, len(seg), n, setup.gloo, width * n * d.gather,
                                    red_width * n * d.grad)
            for kind in kinds:
                if n == 1:  # one rank per shard group: nothing moves inside it
                    continue
                if kind == "gather" and gather == "allgather":
                    ops.append(Op(phase, "all_gather", width * n * d.gather, group=g))
                elif kind == "gather" and gather == "alltoall":
                    pairs = {(o, r): e * d.gather for o, (e, _) in seg.items() for r in range(n)}
                    ops.append(_a2a(phase, n, pairs, group=g))
                elif kind == "gather":
                    ops += [Op(phase, "broadcast", numel(p.shape) * d.gather,
                               root=int(p.owner_rank), group=g)  # type: ignore[arg-type]
                            for p in setup.params_of(unit, "matrix")]
                elif reduce in ("alltoall", "rounds"):  # the rounds: the exchange's traffic
                    pairs = {(r, o): (e + c) * d.grad for o, (e, c) in seg.items() for r in range(n)}
                    ops.append(_a2a(phase, n, pairs, group=g))
                elif reduce == "allreduce":
                    flat = sum(e + c for e, c in seg.values()) * d.grad
                    ops.append(Op(phase, "all_reduce", flat, group=g))
                else:
                    ops += [Op(phase, "reduce", (e + c) * d.grad, root=o, group=g)
                            for o, (e, c) in seg.items()]
            if setup.replicate > 1 and phase == "backward":
                ops += [Op(phase, "all_reduce", (e + c * replicate_flags) * d.grad,
                           group="replicate", member=o) for o, (e, c) in sorted(seg.items())]
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
    loads = [0] * setup.shard
    owners = {}
    for p in sorted(setup.plan.tail, key=lambda p: (-numel(p.shape), p.fqn)):
        r = min(range(setup.shard), key=lambda r: (loads[r], r))
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
    n, ops = setup.shard, []
    g = "shard" if setup.replicate > 1 else "world"
    for p in setup.plan.matrices:
        ops.append(Op("optimizer", "all_gather", padded(p.shape, n) * setup.dtypes.grad, group=g))
        ops += [Op("optimizer", "all_gather", padded(s, n) * setup.dtypes.state, group=g)
                for s in setup.state_numels(p.shape)]
    return ops


def _distmuon(setup: Setup) -> list[Op]:
    """Owner all-to-all Muon (benchmarks.strategies.hsdp): per FSDP2 unit, one packed
    all-to-all of direction rows to the owners and one of update rows back, inside the shard
    group; rows travel in the gather dtype (torchtitan sends bf16), self rows included."""
    n, g = setup.shard, ("shard" if setup.replicate > 1 else "world")
    size = setup.dtypes.gather
    ops: list[Op] = []
    for unit in setup.units():
        mats = setup.params_of(unit, "matrix")
        if not mats:
            continue
        to_owner: dict[tuple[int, int], int] = {}
        for p in mats:
            o = int(p.owner_rank)  # type: ignore[arg-type]
            for r in range(n):
                to_owner[(r, o)] = to_owner.get((r, o), 0) + rows(p.shape, n, r) * size
        back = {(o, r): b for (r, o), b in to_owner.items()}
        ops += [_a2a("optimizer", n, to_owner, self_copy=True, group=g),
                _a2a("optimizer", n, back, self_copy=True, group=g)]
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


def is_hsdp(strategy: str) -> bool:
    return strategy.endswith("_hsdp")


def schedule(setup: Setup, strategy: str) -> list[Op]:
    """Every collective ``strategy`` issues in one training step (an HSDP strategy needs a setup
    with ``replicate`` > 1, a flat one a setup with ``replicate`` == 1)."""
    if is_hsdp(strategy) != (setup.replicate > 1):
        raise ValueError(f"strategy {strategy!r} on a setup with replicate={setup.replicate}")
    strategy = strategy.removesuffix("_hsdp")
    if strategy == "distmuon":
        return _fsdp(setup, None) + _distmuon(setup)
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
    if strategy == "matrixfsdp_noflags":  # replicate_presence_flags=False
        return _matrixfsdp(setup, "auto", replicate_flags=False)
    if strategy == "matrixfsdp_p2p":
        return _matrixfsdp(setup, "p2p")
    if strategy == "matrixfsdp_xreduce":
        return _matrixfsdp(setup, "xreduce")
    if strategy == "matrixfsdp_bcast":
        return _matrixfsdp(setup, "bcast_rounds")
    if strategy == "matrixfsdp_unit_tails":
        return _matrixfsdp(setup, "bcast_rounds", fold_tails=False)
    raise ValueError(f"no schedule for strategy {strategy!r}")


def _position(op: Op, rank: int, shape: tuple[int, int]) -> tuple[int, int] | None:
    """(group size, index in the op's group) of global ``rank``; None if it takes no part."""
    replicate, shard = shape
    replica, coord = divmod(rank, shard)
    if op.group == "shard":
        return shard, coord
    if op.group == "replicate":
        if op.member is not None and coord != op.member:
            return None
        return replicate, replica
    return replicate * shard, rank


def _recv_in_group(op: Op, n: int, i: int) -> int:
    """Bytes member ``i`` of an ``n``-rank group receives from peers in ``op``."""
    if op.kind == "all_to_all":
        assert op.traffic is not None
        return sum(row[i] for row in op.traffic)
    if op.kind == "all_gather":
        return op.size * (n - 1) // n
    if op.kind == "all_reduce":
        return 2 * (n - 1) * op.size // n
    if op.kind == "reduce_scatter":
        return (n - 1) * op.size // n
    if op.kind == "broadcast":
        return 0 if i == op.root else op.size
    if op.kind == "reduce":
        return (n - 1) * op.size if i == op.root else 0
    raise ValueError(f"unknown collective kind {op.kind!r}")


def per_rank_recv(op: Op, world: int, shape: tuple[int, int] | None = None) -> list[int]:
    """Bytes each of the ``world`` ranks receives from peers in ``op`` (see benchmarks.measure);
    ``shape``: the (replicate, shard) mesh of an HSDP setup."""
    shape = shape or (1, world)
    out = []
    for rank in range(world):
        pos = _position(op, rank, shape)
        out.append(0 if pos is None else _recv_in_group(op, *pos))
    return out


def per_rank_calls(ops: list[Op], world: int, shape: tuple[int, int] | None = None) -> list[int]:
    """How many of ``ops`` each rank takes part in."""
    shape = shape or (1, world)
    return [sum(_position(op, r, shape) is not None for op in ops) for r in range(world)]


def inter_node_recv(op: Op, world: int, shape: tuple[int, int], gpus_per_node: int) -> list[int]:
    """Bytes each rank receives from ranks on *other nodes* in ``op`` (direct exchange; nodes
    hold consecutive global ranks; a shard group of at most a node's GPUs stays inside it)."""
    shard = shape[1]
    node = [r // gpus_per_node for r in range(world)]
    out = []
    for rank in range(world):
        pos = _position(op, rank, shape)
        if pos is None:
            out.append(0)
            continue
        n, i = pos
        if op.group == "shard":
            members = [rank - i + j for j in range(n)]
        elif op.group == "replicate":
            members = [j * shard + rank % shard for j in range(n)]
        else:
            members = list(range(n))
        remote = [j for j, m in enumerate(members) if node[m] != node[rank]]
        if op.kind == "all_to_all":
            assert op.traffic is not None
            out.append(sum(op.traffic[j][i] for j in remote))
        elif op.kind in ("all_gather", "reduce_scatter"):
            out.append(op.size * len(remote) // n)
        elif op.kind == "all_reduce":
            out.append(2 * op.size * len(remote) // n)
        elif op.kind == "broadcast":
            out.append(op.size if op.root in remote else 0)
        else:  # reduce: the root receives one buffer from each peer
            out.append(op.size * len(remote) if i == op.root else 0)
    return out


def resident_model(setup: Setup, strategy: str) -> list[dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state each rank keeps between steps.

    Modeled like the strategies hold them: FSDP2 shards padded to equal chunks, AdamW two moments,
    the matrix optimizer's own state shapes; scalar step counters are ignored.
    """
    n, d = setup.shard, setup.dtypes  # every replica holds the same (HSDP)
    owners = owners_all(setup)
    strategy = strategy.removesuffix("_hsdp")
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
