"""Name → matrix optimizer (state initializer, step function, config) registry.

[Note: matrix step function contract]
- ``init_state_fn(param, config) -> dict[str, Tensor]`` builds all state for one matrix (or a
  ``(*, m, n)`` batch) on its owner; no ``"step"`` key (the caller counts steps).
- ``step_fn(param, grad, state, *, lr, weight_decay, step, initial_lr, config) -> None`` updates
  ``param`` and the state tensors in place; ``step`` is 1 on the first call; ``initial_lr`` is the
  learning rate at construction (OKLS's AdamC weight decay scales by ``lr / initial_lr``).
- ``config`` is ``config_cls(**optimizer_kwargs)`` (validated in its ``__post_init__``) or, when no
  config class was registered, a read-only mapping of the keyword arguments.
- Nothing here communicates: a step function sees one rank's whole tensors only.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = [
    "InitStateFn",
    "MatrixOptimizerSpec",
    "StepFn",
    "get_matrix_optimizer",
    "matrix_optimizer_names",
    "register_matrix_optimizer",
]

InitStateFn = Callable[[Tensor, Any], dict[str, Tensor]]
StepFn = Callable[..., None]


@dataclass(frozen=True)
class MatrixOptimizerSpec:
    name: str
    step_fn: StepFn
    init_state_fn: InitStateFn
    config_cls: type | None = None

    def make_config(self, kwargs: Mapping[str, Any]) -> Any:
        if self.config_cls is None:
            return types.MappingProxyType(dict(kwargs))
        try:
            return self.config_cls(**kwargs)
        except TypeError as exc:  # an unknown keyword: say which optimizer rejected it
            raise ValueError(
                f"optimizer {self.name!r} does not take {sorted(kwargs)}: {exc}"
            ) from exc


_REGISTRY: dict[str, MatrixOptimizerSpec] = {}


def register_matrix_optimizer(
    name: str,
    step_fn: StepFn,
    init_state_fn: InitStateFn,
    *,
    config_cls: type | None = None,
    overwrite: bool = False,
) -> None:
    """Make ``name`` usable as ``MatrixOptimizer(model, optimizer=name)``.

    See [Note: matrix step function contract] for the two functions' signatures.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_matrix_optimizer: name must be a non-empty str, got {name!r}")
    if not callable(step_fn) or not callable(init_state_fn):
        raise ValueError("register_matrix_optimizer: step_fn and init_state_fn must be callable")
    if name in _REGISTRY and not overwrite:
        raise ValueError(
            f"matrix optimizer {name!r} is already registered; pass overwrite=True to replace it"
        )
    _REGISTRY[name] = MatrixOptimizerSpec(name, step_fn, init_state_fn, config_cls)


def get_matrix_optimizer(name: str) -> MatrixOptimizerSpec:
    _register_builtins()
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown matrix optimizer {name!r}; choose one of {matrix_optimizer_names()} or "
            "register one with matrixfsdp.register_matrix_optimizer"
        )
    return _REGISTRY[name]


def matrix_optimizer_names() -> list[str]:
    _register_builtins()
    return sorted(_REGISTRY)


_builtins_done = False


def _register_builtins() -> None:
    global _builtins_done
    if _builtins_done:
        return
    _builtins_done = True
    from .adamw import AdamWConfig, adamw_init_state, adamw_step
    from .functional import FUNCTIONAL_OPTIMIZERS

    for name, (config_cls, init_fn, step_fn) in FUNCTIONAL_OPTIMIZERS.items():
        _REGISTRY.setdefault(name, MatrixOptimizerSpec(name, step_fn, init_fn, config_cls))
    _REGISTRY.setdefault("adamw", MatrixOptimizerSpec("adamw", adamw_step, adamw_init_state,
                                                      AdamWConfig))
