"""Shampoo with EMA Kronecker factors, eigh inverse 4th roots and Adam grafting.

Per matrix, with ``betas = (b1, b2)``, step t (1-based), gradient G (m x n),
``bc1 = 1 - b1^t`` and ``bc2 = 1 - b2^t`` (both 1 when ``bias_correction`` is
off; ``bc2 = 1`` when b2 = 1), start s = ``first_preconditioned_step`` and
refresh period k = ``precondition_frequency``::

    L <- b2 L + (1 - b2) G G^T        R <- b2 R + (1 - b2) G^T G
    (b2 = 1: L <- L + G G^T, R <- R + G^T G)
    M <- b1 M + (1 - b1) G;           M_hat = M / bc1
    if t == s or (t > s and t % k == 0):
        L_root = (L / bc2 + r_L I)^{-1/4},  R_root likewise
        r = eps lambda_max(L / bc2) ("relative") or eps ("absolute")
    D_sh = L_root M_hat R_root        (roots start as identities)

Grafting "adam" uses the Adam direction built from the same gradients::

    V <- b2 V + (1 - b2) G*G           (b2 = 1: V <- V + G*G, no bias correction)
    D_adam = M_hat / (sqrt(V / (1 - b2^t)) + grafting_eps)
    D = D_adam                          for t < s
    D = D_sh ||D_adam||_F / ||D_sh||_F  for t >= s

and grafting "none" uses ``D = D_sh`` throughout (``D = M_hat`` before the
first refresh). Update: ``W <- W (1 - lr wd) - lr D``. This is Distributed
Shampoo's algorithm (facebookresearch/optimizers: ``use_bias_correction``,
``epsilon``, ``start_preconditioning_step``, ``AdamPreconditionerConfig``
grafting) for one unblocked matrix; see :class:`ShampooConfig`. Roots are
computed by ``torch.linalg.eigh`` in ``root_dtype`` and stored (fp32) in the
state. All state is fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import batched_addmm, dtype_from_name, inverse_root_eigh
from .config import ShampooConfig

__all__ = ["shampoo_direction", "shampoo_init_state", "shampoo_refreshes", "shampoo_step"]


def shampoo_init_state(param: Tensor, config: ShampooConfig) -> dict[str, Tensor]:
    """fp32 state: factors ``L`` (*, m, m), ``R`` (*, n, n), their roots (identity), ``exp_avg``,
    ``exp_avg_sq`` (Adam grafting only)."""
    *lead, m, n = param.shape
    kw = {"dtype": torch.float32, "device": param.device}
    state = {
        "L": torch.zeros(*lead, m, m, **kw),
        "R": torch.zeros(*lead, n, n, **kw),
        "L_root": torch.eye(m, **kw).expand(*lead, m, m).clone(),
        "R_root": torch.eye(n, **kw).expand(*lead, n, n).clone(),
        "exp_avg": torch.zeros(*lead, m, n, **kw),
    }
    if config.grafting == "adam":
        state["exp_avg_sq"] = torch.zeros(*lead, m, n, **kw)
    return state


def shampoo_refreshes(step: int, config: ShampooConfig) -> bool:
    """Whether step ``step`` (1-based) recomputes the roots (Distributed Shampoo's schedule)."""
    start = config.first_preconditioned_step
    return step == start or (step > start and step % config.precondition_frequency == 0)


def _accumulate_factors(g: Tensor, state: dict[str, Tensor], beta2: float) -> None:
    """EMA (or sum, for beta2 = 1) of ``G G^T`` and ``G^T G`` into ``L`` and ``R``."""
    alpha = 1.0 if beta2 == 1.0 else 1.0 - beta2
    state["L"].copy_(batched_addmm(state["L"], g, g.mT, beta=beta2, alpha=alpha))
    state["R"].copy_(batched_addmm(state["R"], g.mT, g, beta=beta2, alpha=alpha))


def _refresh_roots(state: dict[str, Tensor], step: int, config: ShampooConfig) -> None:
    beta2 = config.betas[1]
    bc2 = 1.0 - beta2**step if config.bias_correction and beta2 < 1.0 else 1.0
    dtype = dtype_from_name(config.root_dtype)
    relative_to = "max" if config.eps_mode == "relative" else None
    for name in ("L", "R"):
        factor = state[name] if bc2 == 1.0 else state[name] / bc2
        root = inverse_root_eigh(factor, 4, eps=config.eps, relative_to=relative_to, dtype=dtype)
        state[f"{name}_root"].copy_(root)


def _adam_direction(
    g: Tensor, m_hat: Tensor, state: dict[str, Tensor], step: int, config: ShampooConfig
) -> Tensor:
    """Update ``exp_avg_sq``; return ``m_hat / (sqrt(bias-corrected V) + grafting_eps)``."""
    beta2 = config.betas[1]
    v = state["exp_avg_sq"]
    if beta2 == 1.0:
        v.addcmul_(g, g)
        denom = v.sqrt()
    else:
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v / (1.0 - beta2**step)).sqrt_()
    return m_hat / denom.add_(config.grafting_eps)


def shampoo_direction(
    g: Tensor, state: dict[str, Tensor], step: int, config: ShampooConfig
) -> Tensor:
    """Update all Shampoo state with fp32 gradient ``g`` and return the (grafted) direction."""
    beta1, beta2 = config.betas
    _accumulate_factors(g, state, beta2)
    state["exp_avg"].lerp_(g, 1.0 - beta1)
    m_hat = state["exp_avg"]
    if config.bias_correction and beta1 > 0.0:
        m_hat = m_hat / (1.0 - beta1**step)
    if shampoo_refreshes(step, config):
        _refresh_roots(state, step, config)
    adam = _adam_direction(g, m_hat, state, step, config) if config.grafting == "adam" else None
    if adam is not None and step < config.first_preconditioned_step:
        return adam  # grafting-only steps
    direction = state["L_root"] @ m_hat @ state["R_root"]
    if adam is None:
        return direction
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
