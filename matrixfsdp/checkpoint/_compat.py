"""Does a checkpoint fit this model and optimizer? Checked on every rank before any data is read.

Every check is a pure function of the layout and the model's structure, both identical on all
ranks, so every rank raises the same error without a collective and nothing is overwritten.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..planner import Plan
from .errors import CheckpointMismatchError
from .layout import CheckpointLayout, TensorEntry

__all__ = ["check_model", "check_optimizer", "names"]

logger = logging.getLogger(__name__)


def names(fqns: Iterable[str], limit: int = 12) -> str:
    """A readable, bounded list of FQNs for error messages."""
    items = sorted(fqns)
    shown = ", ".join(repr(f) for f in items[:limit])
    more = len(items) - limit
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def _role_problems(saved: dict[str, TensorEntry], now: dict[str, TensorEntry],
                   common: list[str]) -> list[str]:
    # Whole-owned matrices and sharded stacks are both stepped by the matrix optimizer; which one
    # a stack is depends on the world size, so a change between them is a reshard, not a mismatch.
    stepped = ("matrix", "sharded_stack")
    became_matrix = [f for f in common if now[f].role in stepped and saved[f].role not in stepped]
    became_tail = [f for f in common if saved[f].role in stepped and now[f].role not in stepped]
    if not (became_matrix or became_tail):
        return []
    parts = []
    if became_matrix:
        parts.append(f"matrices in this model but tail in the checkpoint: {names(became_matrix)}")
    if became_tail:
        parts.append(f"matrices in the checkpoint but tail in this model: {names(became_tail)}")
    return [
        "the matrix set differs from the checkpoint's (was the model wrapped with another "
        "matrix_filter?); " + "; ".join(parts)
        + ". Wrap with the same matrix_filter, or pass weights_only=True to load the weights alone"
    ]


def _shape(entry: TensorEntry) -> str:
    """``shape [..]``, with the TP split a TP matrix had (the shape is the global one)."""
    if entry.tp is None:
        return f"shape {list(entry.shape)}"
    return (f"shape {list(entry.shape)} (TP Shard({entry.tp.shard_dim}) over {entry.tp.tp_size}: "
            f"{list(entry.tp.local_sizes)})")


def _tp_hint(entries: list[TensorEntry]) -> str:
    """What to do when a TP matrix's global shape differs (the tp split itself never does)."""
    if not any(e.tp is not None for e in entries):
        return ""
    return (" (TP matrices are stored and compared as whole matrices: any tp size and shard dim "
            "load, but the global shape must match; build the model with the checkpoint's "
            "global shapes, or load weights_only from a resized full state dict with "
            "load_full_state_dict)")


def check_model(
    path: Path, layout: CheckpointLayout, current: list[TensorEntry], *,
    weights_only: bool, strict: bool,
) -> list[str]:
    """The FQNs to load; raises ``CheckpointMismatchError`` listing every problem found."""
    saved = layout.entries()
    now = {e.fqn: e for e in current}
    missing = sorted(set(now) - set(saved))
    unexpected = sorted(set(saved) - set(now))
    common = [f for f in now if f in saved]
    problems = []
    if missing and strict:
        problems.append(f"the checkpoint lacks {len(missing)} entries of the model: {names(missing)}")
    if unexpected and strict:
        problems.append(
            f"the checkpoint holds {len(unexpected)} entries the model lacks: {names(unexpected)}"
        )
    differ = [f for f in common if saved[f].shape != now[f].shape]
    if differ:
        problems.append("shape mismatch: " + "; ".join(
            f"{f!r}: checkpoint {_shape(saved[f])}, model {_shape(now[f])}" for f in differ
        ) + _tp_hint([saved[f] for f in differ] + [now[f] for f in differ]))
    if not weights_only:
        problems += _role_problems(saved, now, common)
    if problems:
        raise CheckpointMismatchError(
            f"cannot load {path} into this model:\n - " + "\n - ".join(problems)
            + ("\n(strict=False skips missing and unexpected entries)" if missing or unexpected
               else "")
        )
    for f in common:
        if saved[f].dtype != now[f].dtype:
            logger.warning("matrixfsdp.checkpoint: %s saved as %s is loaded into %s (cast)",
                           f, saved[f].dtype, now[f].dtype)
    return common


def _orientation_problems(layout: CheckpointLayout, plan: Plan) -> list[str]:
    """Matrix optimizer state is stored in the (out, in) orientation of the plan that saved it."""
    saved = {p.fqn: p.orientation for p in layout.plan.params if p.role != "tail"}
    turned = [f"{p.fqn!r} ({saved[p.fqn]} -> {p.orientation})" for p in plan.params
              if p.role != "tail" and p.fqn in saved and saved[p.fqn] != p.orientation]
    if not turned:
        return []
    return [f"matrix orientation changed since the save: {', '.join(turned)}; their optimizer "
            "state is stored in the saved orientation"]


def check_optimizer(
    path: Path, layout: CheckpointLayout, optimizer: torch.optim.Optimizer, model: nn.Module,
    plan: Plan | None = None,
) -> None:
    """Raise ``CheckpointMismatchError`` unless the optimizer matches the saved one."""
    saved = layout.optimizer
    if saved is None:
        raise CheckpointMismatchError(
            f"{path} holds no optimizer state; pass optimizer=None or weights_only=True"
        )
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    problems = []
    cls = type(optimizer)
    current_cls = f"{cls.__module__}.{cls.__qualname__}"
    if saved.cls != current_cls:
        problems.append(f"optimizer class: checkpoint {saved.cls}, now {current_cls}")
    if len(saved.groups) != len(optimizer.param_groups):
        problems.append(f"{len(saved.groups)} param groups in the checkpoint, "
                        f"{len(optimizer.param_groups)} now")
    for index, (old, group) in enumerate(zip(saved.groups, optimizer.param_groups, strict=False)):
        fqns = [fqn_of.get(id(p), "<not a model parameter>") for p in group["params"]]
        label = f"group {index} ({old.kind or 'unnamed'})"
        current_name = group.get("optimizer")
        current_name = current_name if isinstance(current_name, str) else None
        if old.optimizer != current_name:
            problems.append(
                f"{label}: the checkpoint's optimizer is {old.optimizer!r}, this one is "
                f"{current_name!r}, for parameters {names(fqns)}"
            )
        saved_split, split = old.hyperparams.get("split") or {}, group.get("split") or {}
        if old.kind == "matrix" and saved_split != split:
            from ..optim.layouts import split_differences  # lazily: the optimizer imports more
            problems.append(
                f"{label}: the checkpoint's per-block state was stepped with another split= "
                f"({split_differences(saved_split, split)}); pass MatrixOptimizer the "
                "checkpoint's split (the same RowLayout, block sizes or count)")
        only_saved, only_now = set(old.params) - set(fqns), set(fqns) - set(old.params)
        if only_saved or only_now:
            problems.append(
                f"{label}: parameters only in the checkpoint {names(only_saved)}, only in this "
                f"optimizer {names(only_now)}"
            )
    if plan is not None and any(g.kind == "matrix" for g in saved.groups):
        problems += _orientation_problems(layout, plan)
    if problems:
        raise CheckpointMismatchError(
            f"cannot load the optimizer state of {path}:\n - " + "\n - ".join(problems)
            + "\nBuild the same optimizer, or pass weights_only=True to load the weights alone"
        )
