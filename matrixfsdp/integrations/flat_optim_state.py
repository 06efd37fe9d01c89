"""torchtitan's flat, FQN-keyed optimizer state -> an optimizer's own state dict, or a clear error.

[Note: flat optimizer state of the torchtitan container]
- ``MatrixOptimizersContainer.state_dict()`` is torchtitan's flat ``state.{fqn}.{name}`` /
  ``param_groups.{fqn}.{key}`` dict (``param_names`` give the FQNs). ``unflatten`` rebuilds the
  state dict ``optimizer.load_state_dict`` takes, with the entries ``optimizer.state_dict()``
  shows (every matrix's state on every rank), so every rank enters every matrix's gathers.
- A flat dict saved by another container (another ``split`` / ``qkv_split``, another matrix
  optimizer, another set of parameters) lacks keys this optimizer needs. Before any load,
  ``unflatten`` checks it and raises one ``ValueError`` naming the FQN, what the checkpoint has
  against what is expected (a split's row layout, the state names and their shapes) and the fix.
  The problem is agreed over the model's shard group (one exchange of JSON), so every rank raises
  it, also where the dicts differ between ranks, instead of some ranks entering the load's
  collectives alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from ..optim.layouts import split_differences
from ..runtime.state_dict_view import exchange_json

__all__ = ["flat_state_problem", "unflatten"]

_FIX = ("build the container as the checkpoint was saved (the same matrix optimizer name, "
        "split= / qkv_split= and model parts), or load a checkpoint this container saved")


def unflatten(optim: Optimizer, flat: Mapping[str, Any]) -> dict[str, Any]:
    """``optim``'s own state dict from torchtitan's flat one (see the Note); collective."""
    template = optim.state_dict()
    problem = _agreed(optim, flat_state_problem(template, flat))
    if problem is not None:
        raise ValueError(f"MatrixOptimizersContainer.load_state_dict (torchtitan's flat state "
                         f"into a {type(optim).__name__}): {problem}")
    fqn_of = _fqns(template)
    state = {pid: {name: flat[f"state.{fqn_of[pid]}.{name}"] for name in entry}
             for pid, entry in template["state"].items()}
    groups = []
    for group in template["param_groups"]:
        names = group["param_names"]
        loaded = dict(group)
        if names:
            for key in group:
                if key not in ("params", "param_names"):
                    loaded[key] = flat[f"param_groups.{names[0]}.{key}"]
        groups.append(loaded)
    return {"state": state, "param_groups": groups}


def flat_state_problem(template: Mapping[str, Any], flat: Mapping[str, Any]) -> str | None:
    """What keeps ``flat`` from loading into the optimizer whose ``state_dict()`` is
    ``template`` (``None``: nothing), naming the FQN, saved against expected, and the fix."""
    for index, group in enumerate(template["param_groups"]):
        names = group["param_names"]
        if not names:
            continue
        if "split" in group and f"param_groups.{names[0]}.split" in flat:
            saved = flat[f"param_groups.{names[0]}.split"] or {}
            diff = split_differences(saved if isinstance(saved, Mapping) else {},
                                     group["split"] or {})
            if diff:
                return (f"param group {index}'s matrices were stepped with another split= "
                        f"({diff}); their per-block state does not fit this optimizer's blocks: "
                        f"{_FIX}")
        missing = [key for key in group if key not in ("params", "param_names")
                   and f"param_groups.{names[0]}.{key}" not in flat]
        if missing:
            return (f"the checkpoint has no param_groups.{names[0]}.{missing[0]} (param group "
                    f"{index}, {len(names)} parameters, missing {missing[:4]}): {_FIX}")
    fqn_of = _fqns(template)
    for pid, entry in template["state"].items():
        fqn = fqn_of[pid]
        missing = [name for name in entry if f"state.{fqn}.{name}" not in flat]
        if missing:
            return _missing_state(fqn, entry, missing, flat)
    return None


def _missing_state(fqn: str, entry: Mapping[str, Any], missing: list[str],
                   flat: Mapping[str, Any]) -> str:
    prefix = f"state.{fqn}."
    saved = sorted(key[len(prefix):] for key in flat if key.startswith(prefix))
    expected = {name: list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                for name, value in entry.items()}
    return (f"the checkpoint has no state {missing[:4]} of {fqn!r}: it saved "
            f"{saved[:8] or 'no state for it'}, this optimizer expects {expected} (names with "
            f"'@<block>' are per-block state of a split matrix): {_FIX}")


def _fqns(template: Mapping[str, Any]) -> dict[Any, str]:
    return {pid: fqn for group in template["param_groups"]
            for pid, fqn in zip(group["params"], group["param_names"], strict=True)}


def _agreed(optim: Optimizer, problem: str | None) -> str | None:
    """The first rank's problem, on every rank of the model's shard group (a MatrixOptimizer's;
    another optimizer's problem stays local)."""
    runtime = getattr(optim, "_runtime", None)
    if runtime is None:
        return problem
    problems = [p for p in exchange_json(runtime, problem) if p is not None]
    return problems[0] if problems else None
