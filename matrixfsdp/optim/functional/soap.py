"""SOAP (Vyas et al., 2024): Adam in the eigenbasis of Shampoo's Kronecker factors.

Per matrix, ``betas = (b1, b2)``, factor EMA ``bs = shampoo_beta`` (``None``
means ``b2``), refresh period k = ``precondition_frequency``:

* Step 1 only initialises: ``L = (1 - bs) G G^T``, ``R = (1 - bs) G^T G`` and
  ``Q_L``, ``Q_R`` = eigenvectors by ``torch.linalg.eigh`` in descending
  eigenvalue order. The weights are not changed (as in the reference
  implementation, so the current gradient never defines its own basis).
* Step s >= 2, Adam step t = s - 1::

      G' = Q_L^T G Q_R
      M' <- b1 M' + (1 - b1) G'           (first moment, rotated space)
      V' <- b2 V' + (1 - b2) G' * G'      (second moment, rotated space)
      D  = Q_L (M' / (sqrt(V') + eps)) Q_R^T
      W <- W - lr sqrt(1 - b2^t) / (1 - b1^t) D   (bias correction on)
      W <- W (1 - lr wd)                           (decoupled decay, after the update)
      L <- bs L + (1 - bs) G G^T,  R <- bs R + (1 - bs) G^T G
      if t % k == 0: refresh the bases.

* Refresh (one power-iteration step + QR, per side): order the current
  columns by the estimated eigenvalues ``diag(Q^T L Q)`` (descending),
  permute ``V'`` along that side the same way, and set ``Q <- qr(L Q)``.
  ``M'`` is re-projected into the new bases,
  ``M' <- Q_L,new^T (Q_L,old M' Q_R,old^T) Q_R,new`` — exactly equivalent to
  keeping the first moment in the original space and projecting it every
  step (the EMA is linear), at 4 GEMMs per refresh instead of 2 per step.
  ``V'`` is only permuted, not rotated, as in SOAP.

``eps`` is Adam's absolute epsilon in the rotated space, as in the reference
implementation (nikhilvyas/SOAP), whose conventions this follows throughout,
including the order of the weight decay. All state is fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._linalg import batched_addmm, robust_eigh
from .config import SOAPConfig

__all__ = ["soap_direction", "soap_init_state", "soap_step"]


def soap_init_state(param: Tensor, config: SOAPConfig) -> dict[str, Tensor]:
    """fp32 state: ``L``, ``R``, bases ``Q_L``, ``Q_R``, rotated ``exp_avg``, ``exp_avg_sq``."""
    del config
    *lead, m, n = param.shape
    kw = {"dtype": torch.float32, "device": param.device}
    return {
        "L": torch.zeros(*lead, m, m, **kw),
        "R": torch.zeros(*lead, n, n, **kw),
        "Q_L": torch.zeros(*lead, m, m, **kw),
        "Q_R": torch.zeros(*lead, n, n, **kw),
        "exp_avg": torch.zeros(*lead, m, n, **kw),
        "exp_avg_sq": torch.zeros(*lead, m, n, **kw),
    }


def _factor_beta(config: SOAPConfig) -> float:
    return config.betas[1] if config.shampoo_beta is None else config.shampoo_beta


def _accumulate_factors(g: Tensor, state: dict[str, Tensor], beta: float) -> None:
    state["L"].copy_(batched_addmm(state["L"], g, g.mT, beta=beta, alpha=1.0 - beta))
    state["R"].copy_(batched_addmm(state["R"], g.mT, g, beta=beta, alpha=1.0 - beta))


def _eigenbasis_descending(A: Tensor) -> Tensor:
    """Eigenvectors of symmetric ``A`` as columns, largest eigenvalue first."""
    _, vecs = robust_eigh((A + A.mT) * 0.5)
    return vecs.flip(-1)


def _refresh_side(A: Tensor, Q: Tensor, v: Tensor, dim: int) -> Tensor:
    """Sort ``Q``'s columns by ``diag(Q^T A Q)`` (descending), permute ``v`` along ``dim``
    in place, and return ``qr(A Q_sorted).Q``."""
    AQ = A @ Q
    est = (Q * AQ).sum(dim=-2)  # diag(Q^T A Q), shape (*, d)
    order = torch.argsort(est, dim=-1, descending=True)
    AQ = AQ.gather(-1, order.unsqueeze(-2).expand_as(AQ))
    idx = order.unsqueeze(-1) if dim == -2 else order.unsqueeze(-2)
    v.copy_(v.gather(dim, idx.expand_as(v)))
    return torch.linalg.qr(AQ).Q


def _refresh_bases(state: dict[str, Tensor]) -> None:
    """QR refresh of both bases; re-project the rotated first moment."""
    q_l_old, q_r_old = state["Q_L"].clone(), state["Q_R"].clone()
    v = state["exp_avg_sq"]
    state["Q_L"].copy_(_refresh_side(state["L"], q_l_old, v, -2))
    state["Q_R"].copy_(_refresh_side(state["R"], q_r_old, v, -1))
    to_new_l = state["Q_L"].mT @ q_l_old
    to_new_r = q_r_old.mT @ state["Q_R"]
    state["exp_avg"].copy_(to_new_l @ state["exp_avg"] @ to_new_r)


def soap_direction(
    g: Tensor, state: dict[str, Tensor], step: int, config: SOAPConfig
) -> Tensor | None:
    """Advance SOAP state with fp32 gradient ``g``; return the bias-corrected direction.

    Returns ``None`` on step 1 (initialisation only). The returned direction
    already includes ``sqrt(1 - b2^t) / (1 - b1^t)``.
    """
    beta1, beta2 = config.betas
    if step == 1:
        _accumulate_factors(g, state, _factor_beta(config))
        state["Q_L"].copy_(_eigenbasis_descending(state["L"]))
        state["Q_R"].copy_(_eigenbasis_descending(state["R"]))
        return None
    t = step - 1
    q_l, q_r = state["Q_L"], state["Q_R"]
    g_rot = q_l.mT @ g @ q_r
    state["exp_avg"].lerp_(g_rot, 1.0 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g_rot, g_rot, value=1.0 - beta2)
    ratio = state["exp_avg"] / state["exp_avg_sq"].sqrt().add_(config.eps)
    direction = q_l @ ratio @ q_r.mT
    if config.correct_bias:
        direction.mul_((1.0 - beta2**t) ** 0.5 / (1.0 - beta1**t))
    _accumulate_factors(g, state, _factor_beta(config))
    if t % config.precondition_frequency == 0:
        _refresh_bases(state)
    return direction


@torch.no_grad()
def soap_step(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    weight_decay: float,
    step: int,
    initial_lr: float,
    config: SOAPConfig,
) -> None:
    """One SOAP step on ``param`` (*, m, n), in place (see module docstring)."""
    del initial_lr
    direction = soap_direction(grad.float(), state, step, config)
    if direction is None:
        return
    param.add_(direction, alpha=-lr)
    param.mul_(1 - lr * weight_decay)
