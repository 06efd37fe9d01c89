"""EMA-Gram quarter-power preconditioning.

Per matrix, ``betas = (b1, b2)``, step t (1-based), gradient G (m x n)::

    M <- b1 M + (1 - b1) G
    L <- b2 L + (1 - b2) G G^T          R <- b2 R + (1 - b2) G^T G
    every k = precondition_frequency steps (t = 1, k+1, ...), per Gram X (d x d):
        Xc = X / (1 - b2^t)             (bias correction, if enabled)
        c  = tr(Xc) / d                 (normalisation: mean eigenvalue 1)
        Xc / c = V diag(lam) V^T        (torch.linalg.eigh in root_dtype)
        X_root = c^{-1/4} V diag((max(lam, 0) + eps)^{-1/4}) V^T
        (eps_mode "absolute": X_root = (Xc + eps I)^{-1/4} instead)
    D = L_root (M / (1 - b1^t)) R_root
    W <- W (1 - lr wd) - lr s D

The Gram is normalised by its trace before the eigensolve and the
normalisation is undone afterwards, so (in the default "relative" eps mode)
``eps`` acts relative to the mean eigenvalue and ``D`` does not depend on the
gradient scale (with a single
gradient and no regularizer, ``D = U V^T`` of that gradient, like Muon). ``s``
is the optional shape scale of :class:`EmaGramConfig` (1 by default). All
state is fp32; the roots are stored in the state between refreshes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._linalg import batched_addmm, dtype_from_name, inverse_root_eigh
from .config import EmaGramConfig

__all__ = ["emagram_direction", "emagram_init_state", "emagram_shape_scale", "emagram_step"]


def emagram_init_state(param: Tensor, config: EmaGramConfig) -> dict[str, Tensor]:
    """fp32 state: ``exp_avg`` (*, m, n), Grams ``L``, ``R`` and their roots."""
    del config
    *lead, m, n = param.shape
    kw = {"dtype": torch.float32, "device": param.device}
    return {
        "exp_avg": torch.zeros(*lead, m, n, **kw),
        "L": torch.zeros(*lead, m, m, **kw),
        "R": torch.zeros(*lead, n, n, **kw),
        "L_root": torch.zeros(*lead, m, m, **kw),
        "R_root": torch.zeros(*lead, n, n, **kw),
    }


def emagram_shape_scale(shape_scale: str, m: int, n: int) -> float:
    """1, ``sqrt(max(1, m/n))`` ("original") or ``0.2 sqrt(max(m, n))`` ("match_rms_adamw")."""
    if shape_scale == "none":
        return 1.0
    if shape_scale == "original":
        return math.sqrt(max(1.0, m / n))
    if shape_scale == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"unknown shape_scale {shape_scale!r}")


def emagram_direction(
    g: Tensor, state: dict[str, Tensor], step: int, config: EmaGramConfig
) -> Tensor:
    """Advance the EMA-Gram state with fp32 gradient ``g``; return ``L^{-1/4} M R^{-1/4}``."""
    beta1, beta2 = config.betas
    state["exp_avg"].lerp_(g, 1.0 - beta1)
    state["L"].copy_(batched_addmm(state["L"], g, g.mT, beta=beta2, alpha=1.0 - beta2))
    state["R"].copy_(batched_addmm(state["R"], g.mT, g, beta=beta2, alpha=1.0 - beta2))
    bc1 = 1.0 - beta1**step if config.bias_correction else 1.0
    bc2 = 1.0 - beta2**step if config.bias_correction else 1.0
    if (step - 1) % config.precondition_frequency == 0:
        relative_to = "mean" if config.eps_mode == "relative" else None
        for name in ("L", "R"):
            gram = state[name] / bc2
            root = inverse_root_eigh(gram, 4, eps=config.eps, relative_to=relative_to,
                                     dtype=dtype_from_name(config.root_dtype))
            state[f"{name}_root"].copy_(root)
    return state["L_root"] @ (state["exp_avg"] / bc1) @ state["R_root"]


@torch.no_grad()
def emagram_step(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    weight_decay: float,
    step: int,
    initial_lr: float,
    config: EmaGramConfig,
) -> None:
    """One EMA-Gram step on ``param`` (*, m, n), in place (see module docstring)."""
    del initial_lr
    m, n = param.shape[-2], param.shape[-1]
    direction = emagram_direction(grad.float(), state, step, config)
    scale = emagram_shape_scale(config.shape_scale, m, n)
    param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-lr * scale)
