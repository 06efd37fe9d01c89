"""Name -> (config class, init_state_fn, step_fn) table of the functional optimizers.

Every entry follows one contract:

* ``init_state_fn(param, config) -> dict[str, Tensor]`` — state tensors only
  (no step counter; the caller keeps it).
* ``step_fn(param, grad, state, *, lr, weight_decay, step, initial_lr, config)``
  — updates ``param`` and ``state`` in place; ``step`` is 1-based and
  ``initial_lr`` is the learning rate at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from .config import EmaGramConfig, MuonConfig, OKLSConfig, ShampooConfig, SOAPConfig
from .emagram import emagram_init_state, emagram_step
from .muon import muon_init_state, muon_step
from .okls import okls_init_state, okls_step
from .shampoo import shampoo_init_state, shampoo_step
from .soap import soap_init_state, soap_step

__all__ = ["FUNCTIONAL_OPTIMIZERS", "InitStateFn", "StepFn", "get_functional_optimizer"]

InitStateFn = Callable[[Tensor, Any], dict[str, Tensor]]
StepFn = Callable[..., None]

FUNCTIONAL_OPTIMIZERS: dict[str, tuple[type, InitStateFn, StepFn]] = {
    "muon": (MuonConfig, muon_init_state, muon_step),
    "shampoo": (ShampooConfig, shampoo_init_state, shampoo_step),
    "soap": (SOAPConfig, soap_init_state, soap_step),
    "okls": (OKLSConfig, okls_init_state, okls_step),
    "emagram": (EmaGramConfig, emagram_init_state, emagram_step),
}


def get_functional_optimizer(name: str) -> tuple[type, InitStateFn, StepFn]:
    """Look up ``name`` in :data:`FUNCTIONAL_OPTIMIZERS`; ``KeyError`` lists the known names."""
    try:
        return FUNCTIONAL_OPTIMIZERS[name]
    except KeyError:
        known = ", ".join(sorted(FUNCTIONAL_OPTIMIZERS))
        raise KeyError(f"unknown functional optimizer {name!r}; known: {known}") from None
