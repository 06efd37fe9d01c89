"""``MatrixOptimizer``'s param groups: building the first ones and routing added ones.

The matrix group (``kind="matrix"``) holds matrices in plan order with the matrix optimizer's
name, keywords (validated by its config) and stored ``split`` (``layouts.resolve_split``); tail
groups (``kind="tail"``) belong to the tail optimizer, a ``torch.optim`` instance that shares the
``MatrixOptimizer``'s state and group dicts. ``add_param_group`` routes a user's group by whether
the runtime manages its parameters as matrices and validates it as the constructor validates its
arguments (the same forms of ``split``, the same errors).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .agreement import probe_torch_class
from .layouts import resolve_split
from .offload import StatePlacement, make_state_placement
from .registry import MatrixOptimizerSpec, get_matrix_optimizer

if TYPE_CHECKING:
    from ..runtime import MatrixFSDPState

__all__ = [
    "MatrixParamGroups",
    "build_matrix_group",
    "build_tail_optimizer",
    "check_rates",
    "check_torch_class",
    "matrix_params",
    "state_placement",
]

logger = logging.getLogger(__name__)


class MatrixParamGroups:
    """``add_param_group`` of ``MatrixOptimizer`` (a mixin before ``torch.optim.Optimizer``)."""

    param_groups: list[dict[str, Any]]
    _fqn_of: dict[int, str]
    _matrix_cls: type[torch.optim.Optimizer] | None
    _matrix_ids: frozenset[int]
    _runtime: MatrixFSDPState
    _spec: MatrixOptimizerSpec | None
    _tail_args: tuple[Any, float, float, dict[str, Any]]
    _tail_inner: torch.optim.Optimizer | None

    def _link_inner(self) -> None:  # pragma: no cover - MatrixOptimizer defines it
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; matrices step with the matrix optimizer, anything else with the tail's.

        The parameters are routed by whether the runtime manages them as matrices (a group must
        not mix the two). Unset hyperparameters come from the first group of the same kind; for
        a matrix group, keys other than ``lr``/``weight_decay``/``initial_lr``/``split`` are
        matrix optimizer keywords (e.g. ``momentum``).
        """
        if "kind" not in param_group:  # a user's group (our own groups arrive with their kind)
            param_group = self._route(param_group)
        super().add_param_group(param_group)
        if hasattr(self, "_config_cache"):  # not while torch's __init__ adds the first groups
            self._link_inner()

    def _route(self, param_group: dict[str, Any]) -> dict[str, Any]:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        ids = self._matrix_ids | {id(mp.sharded) for mp in self._runtime.params.values()}
        kinds = {id(p) in ids for p in params}
        if len(kinds) > 1:
            shapes = [tuple(p.shape) for p in params]
            raise ValueError(
                f"MatrixOptimizer.add_param_group: the group (parameter shapes {shapes}) mixes "
                "matrices managed by matrixfsdp with other tensors; add them as two groups"
            )
        group = {**param_group, "params": params}
        if kinds == {True}:
            return self._matrix_group_defaults(group)
        if self._tail_inner is None:
            cls_or_name, lr, wd, kwargs = self._tail_args
            self._tail_inner = build_tail_optimizer(cls_or_name, params, lr, wd, kwargs)
            assert self._tail_inner is not None  # params is not empty here
            self._tail_inner.param_groups.clear()
        return {**self._tail_inner.defaults, **group, "kind": "tail"}

    def _matrix_group_defaults(self, group: dict[str, Any]) -> dict[str, Any]:
        base = next(g for g in self.param_groups if g["kind"] == "matrix")
        own = {"params", "lr", "weight_decay", "initial_lr", "split"}
        kwargs = {**base["matrix_kwargs"], **{k: v for k, v in group.items() if k not in own}}
        if self._spec is not None:
            config = self._spec.make_config(kwargs)  # validates, naming the bad field
            if dataclasses.is_dataclass(config):
                kwargs = dataclasses.asdict(config)
        lr = group.get("lr", base["lr"])
        check_rates(lr=lr, weight_decay=group.get("weight_decay", base["weight_decay"]))
        out = {"params": group["params"], "kind": "matrix", "lr": lr,
               "initial_lr": group.get("initial_lr", lr),
               "weight_decay": group.get("weight_decay", base["weight_decay"]),
               "optimizer": base["optimizer"], "matrix_kwargs": kwargs}
        out["split"] = self._group_split(group, base)
        if self._matrix_cls is not None:  # its keywords, checked as the constructor does
            fqns = {self._fqn_of.get(id(p)) for p in group["params"]}
            probe_torch_class(self._matrix_cls, out, self._runtime.plan.params, fqns)
        return out

    def _group_split(self, group: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        """The new group's stored split: its ``split`` resolved as the constructor's (the same
        forms and errors, over the group's matrices), else the first matrix group's entries for
        them."""
        fqn_of = {**self._fqn_of, **{id(mp.sharded): f for f, mp in self._runtime.params.items()}}
        fqns = [fqn_of[id(p)] for p in group["params"]]
        if "split" not in group:
            return {f: v for f, v in (base.get("split") or {}).items() if f in fqns}
        shapes = [tuple(self._runtime.plan[f].matrix_shape) for f in fqns]
        try:
            split = resolve_split(group["split"], self._runtime.plan, fqns,
                                  scope=f"this param group ({len(fqns)} matrices)")
        except ValueError as exc:
            raise ValueError(f"MatrixOptimizer.add_param_group (matrices {fqns[:4]}, (out, in) "
                             f"shapes {shapes[:4]}): {exc}") from None
        if self._matrix_cls is not None:
            check_torch_class(self._matrix_cls, split, [])
        return split


def check_rates(**rates: float) -> None:
    """Raise ``ValueError`` naming the first learning rate or decay that is not a finite ``>= 0``."""
    for field, value in rates.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"MatrixOptimizer.{field} must be a finite number >= 0, got {value!r}")


def matrix_params(model: nn.Module, runtime: MatrixFSDPState) -> tuple[list[nn.Parameter], list[str]]:
    """The parameters the matrix optimizer steps and their FQNs: every planned matrix (its
    sharded parameter, empty on non-owners), then the sharded expert stacks."""
    named = dict(model.named_parameters())
    matrices = [mp.sharded for mp in runtime.params.values()]
    matrices += [named[p.fqn] for p in runtime.plan.sharded_stacks]
    fqns = [*runtime.params, *(p.fqn for p in runtime.plan.sharded_stacks)]
    return matrices, fqns


def build_matrix_group(
    optimizer: str | type[torch.optim.Optimizer],
    matrices: list[nn.Parameter],
    lr: float,
    weight_decay: float,
    kwargs: dict[str, Any],
) -> tuple[MatrixOptimizerSpec | None, type[torch.optim.Optimizer] | None, dict[str, Any]]:
    """The first matrix group (without its ``split``) and the registered spec or torch.optim
    class that steps it; a registered optimizer's keywords are validated by its config."""
    group: dict[str, Any] = {
        "params": matrices, "kind": "matrix", "lr": lr, "initial_lr": lr,
        "weight_decay": weight_decay,
    }
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        group["optimizer"] = f"{optimizer.__module__}.{optimizer.__qualname__}"
        group["matrix_kwargs"] = dict(kwargs)
        return None, optimizer, group
    if not isinstance(optimizer, str):
        raise ValueError(
            f"MatrixOptimizer.optimizer must be a registered name or a torch.optim.Optimizer "
            f"class, got {optimizer!r}"
        )
    spec = get_matrix_optimizer(optimizer)
    config = spec.make_config(kwargs)  # validates now, naming the bad field
    group["optimizer"] = optimizer
    group["matrix_kwargs"] = (
        dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(kwargs)
    )
    return spec, None, group


def check_torch_class(
    cls: type[torch.optim.Optimizer], split: Mapping[str, Any], stored: list[str]
) -> None:
    """A torch.optim class steps stored tensors as they are: no blocks, stored orientation."""
    if split:
        raise NotImplementedError(
            f"MatrixOptimizer(optimizer={cls.__name__}) cannot split {sorted(split)}: a "
            "torch.optim class steps whole stored tensors; use a registered optimizer name "
            "(e.g. 'muon') or drop split"
        )
    if stored:
        logger.warning(
            "matrixfsdp: %s steps %d matrices in their stored orientation, not (out, in): %s; "
            "its shape rules (e.g. Muon's learning-rate scale) see the transpose. Use "
            "optimizer='muon' (or another registered name) for the (out, in) orientation",
            cls.__name__, len(stored), stored[:8],
        )


def state_placement(
    offload_state: str | None,
    matrices: list[nn.Parameter],
    stacks: list[Any],
    matrix_cls: type | None,
    batch_same_shape: bool | None,
) -> StatePlacement:
    """Where owned matrices' state lives (``offload_state``), or the error naming what cannot
    be offloaded and the fix."""
    if offload_state not in (None, "cpu"):
        raise ValueError(f"MatrixOptimizer.offload_state must be None or 'cpu', got {offload_state!r}")
    if offload_state is not None:
        if matrix_cls is not None:
            raise NotImplementedError(
                f"offload_state={offload_state!r} needs a registered step function; a "
                f"torch.optim class ({matrix_cls.__name__}) keeps its own state on the device"
            )
        if stacks:
            raise NotImplementedError(
                f"offload_state={offload_state!r} does not cover the expert state of sharded "
                f"stacks {[p.fqn for p in stacks]}; wrap with planner=LPTPlanner(stacks='whole')"
            )
        if batch_same_shape:
            raise ValueError(
                f"offload_state={offload_state!r} stages one matrix at a time; pass "
                "batch_same_shape=False (or leave it None)"
            )
    device = matrices[0].device if matrices else torch.device("cpu")
    return make_state_placement(offload_state, device)


def build_tail_optimizer(
    tail_optimizer: str | type[torch.optim.Optimizer],
    params: list[nn.Parameter],
    lr: float,
    weight_decay: float,
    kwargs: Mapping[str, Any],
) -> torch.optim.Optimizer | None:
    """The tail's torch.optim instance over ``params`` (``None`` without any)."""
    if not params:
        return None
    if tail_optimizer == "adamw":
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    elif isinstance(tail_optimizer, type) and issubclass(tail_optimizer, torch.optim.Optimizer):
        cls = tail_optimizer
    else:
        raise ValueError(
            f"MatrixOptimizer.tail_optimizer must be 'adamw' or a torch.optim.Optimizer class, "
            f"got {tail_optimizer!r}"
        )
    return cls(params, lr=lr, weight_decay=weight_decay, **kwargs)
