"""``MatrixOptimizer.state``: lookups of a matrix this rank does not own show the owner's names.

[Note: flat optimizer state]
- torch's ``set_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=
  True))`` rebuilds each parameter's entry from the flat keys ``state.<fqn>.<name>``, taking the
  names from this rank's own ``optimizer.state[param]``. A matrix's state lives on its owner
  only, so on every other rank torch would rebuild an empty entry and drop the rank's chunks of
  the owner's matrix DTensors, and the owner alone would enter the gathers of the load.
- So ``MatrixOptimizer.state`` is a ``defaultdict`` (``MatrixState``) whose lookup of a plain
  matrix without an entry on a non-owner returns the names the owner's state has, each mapped to
  ``None``, *without storing it*: this rank still holds no state, ``in``/``get``/``len``/
  iteration are unchanged. The names are those ``init_owned_state`` gives the matrix's layout in
  its group (computed on a meta tensor, no memory), which every registered optimizer keeps for
  the life of its state. torch then rebuilds the same entry on every rank and the load gathers
  each matrix DTensor to its owner, exactly as the nested (default) state dict does.
- Where the names cannot be known this way (a ``torch.optim`` class steps the matrices; a TP
  matrix, whose state lives on one tp rank; a step function that cannot run on a meta tensor),
  the lookup behaves as a plain ``defaultdict`` and the load raises the same ``ValueError`` on
  every rank before any gather (see ``_agree_on_names`` in ``runtime/optim_state_view.py``).
- torch's ``Optimizer.load_state_dict`` replaces ``state`` with a plain ``defaultdict``;
  ``MatrixOptimizer.__setstate__`` wraps it again.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["MatrixState", "owner_state_names"]

logger = logging.getLogger(__name__)

NamesOf = Callable[[Any], "list[str] | None"]


class MatrixState(defaultdict):
    """``defaultdict(dict)`` of optimizer state whose missing non-owned matrices show the owner's
    state names (see [Note: flat optimizer state]). Copies and pickles are plain defaultdicts."""

    def __init__(self, entries: Iterable[Any] | dict[Any, Any] = (),
                 names_of: NamesOf | None = None) -> None:
        super().__init__(dict, entries)
        self._names_of = names_of

    def __missing__(self, key: Any) -> Any:
        names = self._names_of(key) if self._names_of is not None else None
        if names is None:
            return super().__missing__(key)
        return dict.fromkeys(names)  # not stored: this rank keeps no state for the matrix

    def copy(self) -> defaultdict:
        return defaultdict(dict, self)

    def __reduce__(self) -> Any:
        return (defaultdict, (dict,), None, None, iter(self.items()))


def owner_state_names(optimizer: Any, param: Any) -> list[str] | None:
    """The names of the state the owner of ``param`` keeps, where ``param`` is a plain matrix this
    rank does not own and the names follow from its group (``None`` otherwise)."""
    fqn = optimizer._fqn_of.get(id(param)) if isinstance(param, torch.Tensor) else None
    mp = optimizer._runtime.params.get(fqn) if fqn is not None else None
    spec = optimizer._spec
    if mp is None or mp.is_owner or mp.tp is not None or mp.ep is not None or spec is None:
        return None
    group = next((g for g in optimizer.param_groups if g.get("kind") == "matrix"
                  and any(p is param for p in g["params"])), None)
    if group is None:
        return None
    from .owner_step import init_owned_state

    try:
        config = spec.make_config(group["matrix_kwargs"])
        layout = optimizer._layouts(group)[id(param)]
        probe = torch.empty(tuple(mp.shape), dtype=param.dtype, device="meta")
        return list(init_owned_state(probe, spec, config, layout))
    except Exception as exc:  # a step function that cannot run on a meta tensor
        logger.debug("matrixfsdp: no state names for %r from a meta tensor: %s", fqn, exc)
        return None
