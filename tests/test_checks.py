"""The comparison helpers themselves: bounds taken from a float64 rerun accept a reordered fp32
computation and reject a real error (see [Note: tolerances from float64] in ``checks.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

from .checks import ROUNDING_FLOOR, ROUNDING_SAFETY, assert_close_dicts, float64_rtols
from .models import TinyTransformer, global_batch, lm_loss, local_batch


def _pair() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TinyTransformer(), global_batch(0)


def test_float64_bounds_accept_a_reordered_sum_and_reject_an_error() -> None:
    ref, tokens = _pair()
    lm_loss(ref, tokens).backward()
    rtols = float64_rtols(ref, lambda m: lm_loss(m, tokens).backward())
    assert rtols.keys() == {f for f, p in ref.named_parameters() if p.grad is not None}
    assert min(rtols.values()) >= ROUNDING_SAFETY * ROUNDING_FLOOR
    assert max(rtols.values()) < 1e-4  # an fp32 network's rounding level, far from an error
    # The same mean over 4 slices of the batch, summed in another order: within the bounds.
    parts = copy.deepcopy(ref)
    parts.zero_grad(set_to_none=True)
    for rank in reversed(range(4)):
        (lm_loss(parts, local_batch(tokens, rank, 4)) / 4).backward()
    got = {f: p.grad for f, p in parts.named_parameters()}
    want = {f: p.grad for f, p in ref.named_parameters()}
    assert_close_dicts(got, want, rtols, "reordered")
    # One gradient off by 10x its bound: rejected, naming it.
    fqn = next(iter(rtols))
    bad = dict(got)
    bad[fqn] = want[fqn] * (1 + 10 * rtols[fqn])
    with pytest.raises(AssertionError, match=fqn.replace(".", r"\.")):
        assert_close_dicts(bad, want, rtols, "perturbed")


def test_float64_bounds_only_rerun_gradients() -> None:
    ref, tokens = _pair()
    with pytest.raises(ValueError, match="only gradients"):
        float64_rtols(ref, lambda m: lm_loss(m, tokens).backward(), attr="data")
