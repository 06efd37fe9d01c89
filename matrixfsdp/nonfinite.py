"""The global gradient norm shared between ``clip_grad_norm_`` and non-finite step skipping.

[Note: skipping non-finite steps]
- ``MatrixOptimizer(..., skip_nonfinite=True)`` skips a step when the *global* gradient norm (every
  owned matrix and every tail shard, over all ranks) is inf or NaN. The decision comes from one
  all-reduced value that every rank receives identically, so either every rank steps or none
  does. The norm is a sum of ``|g|^p`` terms: inf and NaN survive a sum in any reduction order
  (a max-reduction does not promise that for NaN), so only sum-based norms decide.
- ``clip_grad_norm_`` (order ``p < inf``) already all-reduces that norm: it records the value for
  the model and the next ``step()`` reuses it, so clipping + skipping cost one scalar
  all-reduce in total. Without a recorded norm the optimizer all-reduces one fp32 scalar itself,
  counted as ``all_reduce_scalar`` in the optimizer phase. The matrices' own step still issues
  no collective: this scalar is the only optimizer-phase communication ``skip_nonfinite`` adds.
- A record is used by one ``step()`` at most; ``step()``, ``zero_grad()`` and the end of every
  backward through the model drop it (another backward changes the gradients, so the next step
  all-reduces a fresh norm). Which norm a step uses depends only on the calls made (the same on
  every rank), never on local data, so ranks cannot disagree on whether to communicate. In-place
  edits of gradients after clipping are not re-checked; they are detected through the gradients'
  version counters and logged as a warning.
- The decision is read on the host (``bool(torch.isfinite(norm))``), once per step: the one
  host synchronisation ``skip_nonfinite`` adds to ``step()``, which otherwise has none (step
  counters are host tensors, as in torch.optim); see [Note: streams] for backward's one.
- A skipped step changes nothing: no parameter and no optimizer state (step counters, momenta,
  the tail's AdamW moments and step) moves. Gradients are set to ``None``, the optimizer counts
  the step in ``skipped_steps`` and logs it.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["GradNormRecord", "discard_global_norm", "record_global_norm", "take_global_norm"]

logger = logging.getLogger(__name__)


class GradNormRecord(NamedTuple):
    """A global gradient norm and a fingerprint of the local gradients it was computed from."""

    norm: torch.Tensor
    fingerprint: tuple[int, int]


_RECORDS: weakref.WeakKeyDictionary[object, GradNormRecord] = weakref.WeakKeyDictionary()


def _fingerprint(grads: Sequence[torch.Tensor]) -> tuple[int, int]:
    return len(grads), sum(g._version for g in grads)


def record_global_norm(owner: object, norm: torch.Tensor, norm_type: float,
                       grads: Sequence[torch.Tensor]) -> None:
    """Remember ``norm`` (all-reduced, of order ``norm_type``) for ``owner``'s next step."""
    if math.isinf(norm_type):
        _RECORDS.pop(owner, None)  # max-reduced: not a safe decision value (see the Note)
        return
    _RECORDS[owner] = GradNormRecord(norm.detach(), _fingerprint(grads))


def take_global_norm(owner: object, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Pop the norm recorded for ``owner`` (None if there is none)."""
    record = _RECORDS.pop(owner, None)
    if record is None:
        return None
    if record.fingerprint != _fingerprint(grads):
        logger.warning(
            "matrixfsdp: gradients changed after clip_grad_norm_ (another backward or an "
            "in-place edit); the non-finite check uses the norm computed when clipping"
        )
    return record.norm


def discard_global_norm(owner: object) -> None:
    """Forget any recorded norm of ``owner`` (gradients were cleared)."""
    _RECORDS.pop(owner, None)
