"""Shampoo with EMA Kronecker factors, eigh inverse 4th roots and Adam grafting.

Per matrix, with ``betas = (b1, b2)``, step t (1-based), gradient G (m x n)::

    L <- b2 L + (1 - b2) G G^T        R <- b2 R + (1 - b2) G^T G
    (b2 = 1: L <- L + G G^T, R <- R + G^T G)
    M <- b1 M + (1 - b1) G
    every k = precondition_frequency steps (t = 1, k+1, 2k+1, ...):
        L_root = (L + eps lambda_max(L) I)^{-1/4},  R_root likewise
    D_sh = L_root M R_root

Grafting "adam" rescales ``D_sh`` per matrix to the Frobenius norm of the Adam
direction built from the same gradients::

    V <- b2 V + (1 - b2) G*G           (b2 = 1: V <- V + G*G, no bias correction)
    D_adam = (M / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + grafting_eps)
    D = D_sh * ||D_adam||_F / ||D_sh||_F

and grafting "none" uses ``D = D_sh``. Update: ``W <- W (1 - lr wd) - lr D``.

``eps`` is relative to the largest eigenvalue, which makes the roots
scale-equivariant, so the factors need no bias correction (the grafted
update is invariant to it). Roots are computed by ``torch.linalg.eigh`` in
``root_dtype`` and stored (fp32) in the state. All state is fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import batched_addmm, dtype_from_name, inverse_root_eigh
from .config import ShampooConfig

__all__ = ["shampoo_direction", "shampoo_init_state", "shampoo_step"]


def shampoo_init_state(param: Tensor, config: ShampooConfig) -> dict[str, Tensor]:
    """fp32 state: factors ``L`` (*, m, m), ``R`` (*, n, n), their roots, ``exp_avg``, ``exp_avg_sq``."""
    *lead, m, n = param.shape
    kw = {"dtype": torch.float32, "device": param.device}
    state = {
        "L": torch.zeros(*lead, m, m, **kw),
        "R": torch.zeros(*lead, n, n, **kw),
        "L_root": torch.zeros(*lead, m, m, **kw),
        "R_root": torch.zeros(*lead, n, n, **kw),
        "exp_avg": torch.zeros(*lead, m, n, **kw),
    }
    if config.grafting == "adam":
        state["exp_avg_sq"] = torch.zeros(*lead, m, n, **kw)
    return state


def _accumulate_factors(g: Tensor, state: dict[str, Tensor], beta2: float) -> None:
    """EMA (or sum, for beta2 = 1) of ``G G^T`` and ``G^T G`` into ``L`` and ``R``."""
    alpha = 1.0 if beta2 == 1.0 else 1.0 - beta2
    state["L"].copy_(batched_addmm(state["L"], g, g.mT, beta=beta2, alpha=alpha))
    state["R"].copy_(batched_addmm(state["R"], g.mT, g, beta=beta2, alpha=alpha))


def _adam_direction(
    g: Tensor, state: dict[str, Tensor], step: int, config: ShampooConfig
) -> Tensor:
    """Update ``exp_avg_sq`` and return the bias-corrected Adam (or AdaGrad) direction."""
    beta1, beta2 = config.betas
    v = state["exp_avg_sq"]
    if beta2 == 1.0:
        v.addcmul_(g, g)
        denom = v.sqrt()
    else:
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v / (1.0 - beta2**step)).sqrt_()
    m_hat = state["exp_avg"] / (1.0 - beta1**step)
    return m_hat / denom.add_(config.grafting_eps)


def shampoo_direction(
    g: Tensor, state: dict[str, Tensor], step: int, config: ShampooConfig
) -> Tensor:
    """Update all Shampoo state with fp32 gradient ``g`` and return the (grafted) direction."""
    beta1, beta2 = config.betas
    _accumulate_factors(g, state, beta2)
    state["exp_avg"].lerp_(g, 1.0 - beta1)
    if (step - 1) % config.precondition_frequency == 0:
        dtype = dtype_from_name(config.root_dtype)
        for name in ("L", "R"):
            root = inverse_root_eigh(state[name], 4, eps=config.eps, relative_to="max", dtype=dtype)
            state[f"{name}_root"].copy_(root)
    direction = state["L_root"] @ state["exp_avg"] @ state["R_root"]
    if config.grafting == "none":
        return direction
    adam = _adam_direction(g, state, step, config)
    adam_norm = torch.linalg.vector_norm(adam, dim=(-2, -1), keepdim=True)
    sh_norm = torch.linalg.vector_norm(direction, dim=(-2, -1), keepdim=True)
    return direction.mul_(adam_norm / sh_norm.clamp_min(torch.finfo(torch.float32).tiny))


@torch.no_grad()
def shampoo_step(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    weight_decay: float,
    step: int,
    initial_lr: float,
    config: ShampooConfig,
) -> None:
    """One Shampoo step on ``param`` (*, m, n), in place (see module docstring)."""
    del initial_lr
    direction = shampoo_direction(grad.float(), state, step, config)
    param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-lr)
