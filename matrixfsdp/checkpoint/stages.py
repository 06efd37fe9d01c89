"""Checkpoints of pipeline stages, loaded into a model cut another way (or not cut at all).

[Note: stage checkpoints]
Under pipeline parallelism each stage module is wrapped on its own data-parallel mesh and saved
with ``save(path_of_stage, stage_module, its_optimizer)``, collectively over that mesh. A stage
cut from the whole model as torchtitan cuts it (copy the model, delete what the stage does not
own) keeps the whole model's FQNs, so its checkpoint holds a disjoint part of the model's entries
and optimizer state, keyed as in the whole model:
- the same cut at another dp size (or HSDP shape) loads each stage's checkpoint with ``load``;
- another cut, or the whole model without pipelining, loads every stage's checkpoint with
  ``load_stages``: each checkpoint fills the entries and optimizer state it holds, the others
  are left for the next one, and together they must cover the model (``strict``).
No stage prefix needs naming: the FQNs are the model's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..api import get_state
from ..runtime import MatrixFSDPState
from . import _statedict as sd
from ._compat import _role_problems, names
from ._dist import agree, dcp_errors
from .core import open_checkpoint
from .errors import CheckpointMismatchError
from .layout import CheckpointLayout, decode_hyperparams
from .storage import SafeFileSystemReader

__all__ = ["load_stages"]

logger = logging.getLogger(__name__)


def load_stages(
    paths: Sequence[str | os.PathLike[str]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    weights_only: bool = False,
    strict: bool = True,
) -> dict[str, Any]:
    """Load the checkpoints of several pipeline stages into one wrapped model (see the Note).

    Collective over the model's mesh. Every check runs before any tensor is written: the stages
    must hold disjoint entries of the model, with its shapes and matrix set, and (``strict``)
    together all of them; an optimizer must be the one they were saved with, each stage's
    parameters among its groups'. Optimizer hyperparameters come from the first checkpoint;
    RNG states are not restored (the ranks differ). Returns the first stage's
    ``{"step": ..., "extra": ...}``; every stage must have been saved at the same step.
    """
    paths = [Path(p) for p in paths]
    runtime = get_state(model)
    group = sd.mesh_group(runtime)
    plans: list[tuple[Path, CheckpointLayout, Any, list[str]]] = []
    error = None
    try:
        plans = _check(paths, model, runtime, optimizer, weights_only=weights_only, strict=strict)
    except Exception as exc:  # forwarded so that no rank waits alone in dcp.load
        error = exc
    agree(error, group, f"checking the stage checkpoints {[str(p) for p in paths]}")
    use_optimizer = optimizer is not None and not weights_only
    for path, _, metadata, fqns in plans:
        targets = sd.model_targets(model, runtime, fqns)
        routes: dict[int, dict[str, str]] = {}
        if use_optimizer:
            optim_targets, routes = sd.optimizer_targets(model, runtime, optimizer, metadata)
            targets.update(optim_targets)
        with torch.no_grad(), dcp_errors(f"reading {path}"):
            dcp.load(targets, storage_reader=SafeFileSystemReader(str(path)), process_group=group)
        if use_optimizer:
            _install(optimizer, targets, routes)
    first = plans[0][1]
    if use_optimizer:
        _restore_hyperparams(optimizer, [p[1] for p in plans])
    logger.info("matrixfsdp.checkpoint: loaded step %d from %d stage checkpoints into %d "
                "entries", first.step, len(plans), sum(len(p[3]) for p in plans))
    return {"step": first.step, "extra": first.extra}


def _restore_hyperparams(optimizer: torch.optim.Optimizer,
                         layouts: list[CheckpointLayout]) -> None:
    """Each group's hyperparameters from the first stage whose optimizer had that group with
    parameters (matched by kind: a stage without matrices has an empty matrix group)."""
    for group in optimizer.param_groups:
        for layout in layouts:
            saved = next((g for g in layout.optimizer.groups
                          if g.kind == group.get("kind") and g.params), None)
            if saved is not None:
                decode_hyperparams(saved.hyperparams, group)
                break


def _install(optimizer: torch.optim.Optimizer, targets: dict[str, torch.Tensor],
             routes: dict[int, dict[str, str]]) -> None:
    """One stage's optimizer state: the parameters it holds; the others keep theirs."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            route = routes.get(id(p))
            if route:
                optimizer.state[p] = {name: sd._local_for(p, targets[key])
                                      for name, key in route.items()}


def _check(paths: list[Path], model: nn.Module, runtime: MatrixFSDPState,
           optimizer: torch.optim.Optimizer | None, *, weights_only: bool,
           strict: bool) -> list[tuple[Path, CheckpointLayout, Any, list[str]]]:
    """Every stage checkpoint against the model (local: the same answer on every rank)."""
    if not paths:
        raise ValueError("load_stages needs at least one checkpoint path")
    runtime.quiesce()  # nothing in flight may read a parameter this load writes
    now = {e.fqn: e for e in sd.model_entries(model, runtime)}
    seen: dict[str, Path] = {}
    problems: list[str] = []
    out = []
    for path in paths:
        layout, metadata = open_checkpoint(path)
        saved = layout.entries()
        unknown = sorted(set(saved) - set(now))
        if unknown:
            problems.append(f"{path} holds {len(unknown)} entries the model lacks: "
                            f"{names(unknown)} (cut the stages from this model, FQNs unchanged)")
        twice = sorted(f for f in saved if f in seen)
        if twice:
            problems.append(f"{path} and {seen[twice[0]]} both hold {names(twice)}")
        common = [f for f in saved if f in now]
        differ = [f for f in common if saved[f].shape != now[f].shape]
        if differ:
            problems.append(f"{path}: shape mismatch: " + "; ".join(
                f"{f!r}: checkpoint {list(saved[f].shape)}, model {list(now[f].shape)}"
                for f in differ))
        if not weights_only:
            problems += [f"{path}: {p}" for p in _role_problems(saved, now, common)]
            if optimizer is not None:
                problems += _optimizer_problems(path, layout, optimizer, model)
        if layout.step != (out[0][1].step if out else layout.step):
            problems.append(f"{path} was saved at step {layout.step}, {out[0][0]} at step "
                            f"{out[0][1].step}")
        seen.update({f: path for f in saved})
        out.append((path, layout, metadata, common))
    missing = sorted(set(now) - set(seen))
    if missing and strict:
        problems.append(f"no stage holds {len(missing)} entries of the model: {names(missing)} "
                        "(strict=False leaves them as they are)")
    if problems:
        raise CheckpointMismatchError("cannot load the stage checkpoints into this model:\n - "
                                      + "\n - ".join(problems))
    return out


def _optimizer_problems(path: Path, layout: CheckpointLayout, optimizer: torch.optim.Optimizer,
                        model: nn.Module) -> list[str]:
    saved = layout.optimizer
    if saved is None:
        return [f"{path} holds no optimizer state; pass optimizer=None or weights_only=True"]
    cls = type(optimizer)
    problems = []
    if saved.cls != f"{cls.__module__}.{cls.__qualname__}":
        problems.append(f"{path}: optimizer class {saved.cls}, now "
                        f"{cls.__module__}.{cls.__qualname__}")
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    groups = {g.get("kind"): g for g in optimizer.param_groups}
    for old in saved.groups:
        group = groups.get(old.kind)
        fqns = set() if group is None else {fqn_of.get(id(p)) for p in group["params"]}
        name = None if group is None else group.get("optimizer")
        name = name if isinstance(name, str) else None
        if old.params and old.optimizer != name:
            problems.append(f"{path}: group {old.kind!r} was stepped by {old.optimizer!r}, "
                            f"this optimizer's by {name!r}")
        outside = sorted(set(old.params) - fqns)
        if outside:
            problems.append(f"{path}: group {old.kind!r} of the checkpoint holds "
                            f"{names(outside)}, which this optimizer's group does not")
    return problems
