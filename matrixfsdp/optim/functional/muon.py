"""Muon: momentum orthogonalised by a quintic Newton–Schulz iteration.

Per matrix (``step`` t, gradient G, momentum mu, Newton–Schulz map NS)::

    B <- mu B + (1 - mu) G            (buf.lerp_(G, 1 - mu))
    D  = G + mu (B - G) = lerp(G, B, mu)   if nesterov else B
    O  = NS(D)
    W <- W (1 - lr wd) - lr s O

with ``s = sqrt(max(1, m/n))`` ("original", default) or ``0.2 sqrt(max(m, n))``
("match_rms_adamw"). For a 2-D parameter this replays ``torch.optim.Muon``'s
operation sequence, so in bf16 the result is bitwise identical. Batched
``(*, m, n)`` input runs the same iteration with ``baddbmm`` per slice.
One intentional difference: torch normalises the Newton–Schulz input in place,
which for a bf16 parameter with ``nesterov=False`` also rescales the momentum
buffer (``buf.bfloat16()`` is ``buf`` itself); here the buffer is never
touched by the orthogonalisation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._linalg import batched_addmm, dtype_from_name
from .config import MuonConfig

__all__ = ["muon_adjusted_lr", "muon_init_state", "muon_step", "zeropower_via_newton_schulz"]


def zeropower_via_newton_schulz(
    x: Tensor,
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximate orthogonal polar factor ``U V^T`` of ``x`` (*, m, n) by Newton–Schulz.

    ``X = x / max(||x||_F, eps)`` in ``dtype`` (per matrix), transposed when
    ``m > n`` so ``X X^T`` is the small Gram; then ``steps`` times
    ``A = X X^T``, ``B = b A + c A A``, ``X = a X + B X``. The result is in
    ``dtype`` with the shape of ``x``.
    """
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    X = x.to(dtype)
    if tall:
        X = X.mT
    if X.dim() == 2:
        X = X / X.norm().clamp(min=eps)
    else:
        X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = X @ X.mT
        update = batched_addmm(gram, gram, gram, beta=b, alpha=c)
        X = batched_addmm(X, update, X, beta=a, alpha=1.0)
    return X.mT if tall else X


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, m: int, n: int) -> float:
    """Shape-adjusted learning rate, as ``torch.optim.Muon``'s ``_adjust_lr``."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


def muon_init_state(param: Tensor, config: MuonConfig) -> dict[str, Tensor]:
    """State: ``momentum_buffer`` zeros with the parameter's shape and dtype."""
    del config
    return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.contiguous_format)}


@torch.no_grad()
def muon_step(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    weight_decay: float,
    step: int,
    initial_lr: float,
    config: MuonConfig,
) -> None:
    """One Muon step on ``param`` (*, m, n), in place (see module docstring)."""
    del step, initial_lr
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - config.momentum)
    direction = grad.lerp(buf, config.momentum) if config.nesterov else buf
    ortho = zeropower_via_newton_schulz(
        direction,
        config.ns_coefficients,
        config.ns_steps,
        config.eps,
        dtype_from_name(config.ns_dtype),
    )
    m, n = param.shape[-2], param.shape[-1]
    adjusted_lr = muon_adjusted_lr(lr, config.adjust_lr_fn, m, n)
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-adjusted_lr)
