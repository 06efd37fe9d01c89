"""``matrixfsdp plan``: print an owner plan without any process group."""

from __future__ import annotations

from ..planner import LPTPlanner, Plan

__all__ = ["format_plan", "plan_for_model"]

_COST_OF_OPTIMIZER = {
    "adamw": "bytes", "muon": "muon", "shampoo": "shampoo", "soap": "soap", "okls": "okls",
    "emagram": "emagram",
}


def plan_for_model(model: str, world_size: int, optimizer: str = "muon",
                   memory_cap_bytes: int | None = None, *, replicate: int = 1,
                   tp: int = 1) -> Plan:
    """The plan of ``model`` on ``world_size`` ranks; with ``replicate`` > 1 (HSDP) the plan of
    one replica's shard group of ``world_size / replicate`` ranks (see [Note: HSDP mesh]); with
    ``tp`` > 1 over ``world_size / (replicate x tp)`` dp ranks, from the global shapes, as the
    runtime plans TP matrices (see [Note: TP matrices])."""
    from .presets import PRESETS, preset_specs, specs_from_factory

    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"--tp {tp} must be a positive divisor of --world-size {world_size} (ranks = "
            f"replicate x shard x tp); divisors: "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    world_size //= tp
    if replicate < 1 or world_size % replicate:
        raise ValueError(
            f"--replicate {replicate} must be a positive divisor of --world-size {world_size} "
            f"(ranks = replicate x shard size); divisors: "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    specs = preset_specs(model) if model in PRESETS else specs_from_factory(model)
    if optimizer not in _COST_OF_OPTIMIZER:
        raise ValueError(f"--optimizer must be one of {sorted(_COST_OF_OPTIMIZER)}, got {optimizer!r}")
    cap = None if memory_cap_bytes is None else memory_cap_bytes * tp  # per GPU: 1/tp of a matrix
    planner = LPTPlanner(cost=_COST_OF_OPTIMIZER[optimizer], memory_cap_bytes=cap)
    shard = world_size // replicate
    return planner(specs, shard).with_mesh_shape(replicate, shard)


def format_plan(plan: Plan, *, title: str = "") -> str:
    """A per-rank table plus the imbalance beside its lower bound."""
    gib, gflop = 1024**3, 1e9
    loads = plan.rank_loads()
    lines = [title] if title else []
    lines.append(f"{'rank':>5} {'matrices':>9} {'GiB':>9} {'GFLOP/step':>12}")
    for load in loads:
        lines.append(f"{load.rank:>5} {load.num_matrices:>9} {load.nbytes / gib:>9.3f} "
                     f"{load.cost / gflop:>12.1f}")
    total_bytes = sum(p.nbytes for p in plan.params)
    lines += [
        "",
        f"matrices: {len(plan.matrices)}  tail tensors: {len(plan.tail)}  "
        f"model: {total_bytes / gib:.2f} GiB  world size: {plan.world_size}  planner: {plan.planner}"
        + (f"  mesh (replicate, shard): {tuple(plan.mesh_shape)}" if plan.mesh_shape else ""),
        f"imbalance max/mean by cost:  {plan.imbalance('cost'):.4f}  "
        f"(lower bound {plan.imbalance_bound('cost'):.4f})",
        f"imbalance max/mean by bytes: {plan.imbalance('bytes'):.4f}  "
        f"(lower bound {plan.imbalance_bound('bytes'):.4f})",
        f"plan hash: {plan.plan_hash()[:16]}",
    ]
    return "\n".join(lines)
