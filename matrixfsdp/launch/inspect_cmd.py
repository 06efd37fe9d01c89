"""``matrixfsdp inspect CHECKPOINT``: the saved layout, step, world size and sizes."""

from __future__ import annotations

from pathlib import Path

__all__ = ["inspect_checkpoint"]


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def inspect_checkpoint(path: str | Path) -> str:
    """A human-readable summary; raises the checkpoint layer's errors for bad paths."""
    from ..checkpoint import open_checkpoint

    path = Path(path)
    layout, _ = open_checkpoint(path)
    plan = layout.plan
    files = [f for f in path.iterdir() if f.is_file()]
    lines = [
        f"checkpoint {path}",
        f"  step {layout.step}   saved at world size {layout.world_size}   mesh (replicate, "
        f"shard) {layout.saved_mesh_shape}   format v"
        f"{layout.format_version}   matrixfsdp {layout.matrixfsdp_version}   torch "
        f"{layout.torch_version}",
        f"  plan {layout.plan_hash[:16]} ({plan.planner}): {len(plan.matrices)} matrices, "
        f"{len(plan.tail)} tail tensors, {_human(sum(p.nbytes for p in plan.params))} of "
        f"parameters; max/mean bytes {plan.imbalance('bytes'):.3f}",
        f"  on disk: {len(files)} files, {_human(sum(f.stat().st_size for f in files))}",
        "",
        f"  {'rank':>4} {'matrices':>9} {'matrix bytes':>13}",
    ]
    for load in plan.rank_loads():
        lines.append(f"  {load.rank:>4} {load.num_matrices:>9} {_human(load.nbytes):>13}")
    if layout.optimizer is not None:
        lines += ["", f"  optimizer {layout.optimizer.cls}"]
        for group in layout.optimizer.groups:
            lr = group.hyperparams.get("lr")
            lr_text = f"{lr:.4g}" if isinstance(lr, (int, float)) else str(lr)
            lines.append(f"    group {group.kind or '-'}: {group.optimizer or '-'}, "
                         f"{len(group.params)} params, lr {lr_text}")
    for fqn, note in plan.notes.items():
        lines.append(f"  note {fqn}: {note}")
    if isinstance(layout.extra, dict):
        lines += ["", f"  extra keys: {sorted(layout.extra)}"]
    return "\n".join(lines)
