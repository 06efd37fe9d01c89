"""Online KL Shampoo (OKLS; reference release tilde-research/online-kl-shampoo-release).

Per matrix G (m x n), beta1, beta2, eps, step t (1-based), current lr and the
initial lr ``lr0``:

* t = 1, warm start from the first gradient (``||.||`` = Frobenius)::

      S_a = sym(sqrt(m / (n ||G||^2 + eps)) G G^T) + (||S_a||/sqrt(m) + eps) I
      S_b = sym(sqrt(n / (m ||G||^2 + eps)) G^T G) + (||S_b||/sqrt(n) + eps) I
      P_a = S_a^{-1/2},  P_b = S_b^{-1/2}

  (``eps`` inside the square root guards a zero first gradient, as in the
  release), then the regular step below also runs on t = 1.
* Every step::

      M <- beta1 M + (1 - beta1) G;      N = lerp(G, M, beta1)
      S_a <- sym(beta2 S_a + (1 - beta2)/n (G P_b)(G P_b)^T) + eps I   (previous P_b)
      S_b <- sym(beta2 S_b + (1 - beta2)/m (P_a G)^T (P_a G)) + eps I  (previous P_a)
      P_a = S_a^{-1/2},  P_b = S_b^{-1/2}       (fresh, Scaled CANS)
      U = P_a N P_b
      c_mom = v^{-1/2},  v = (1 - beta1)/(1 + beta1) (1 + 2 beta1 - 2 beta1^3)
      s_shape = sqrt(m/n) / (sqrt(m) + sqrt(n))
      wd_t = wd lr (lr / lr0)                   (AdamC)
      W <- W (1 - wd_t) - lr c_mom s_shape U

State (fp32): ``momentum`` (*, m, n) and the symmetric ``S_a``, ``S_b``,
``P_a``, ``P_b`` packed as upper triangles, (*, d(d+1)/2).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .cans import inverse_sqrt_cans, inverse_sqrt_eigh
from .config import OKLSConfig
from .packing import pack_sym, packed_size, unpack_sym

__all__ = ["okls_direction", "okls_init_state", "okls_scales", "okls_step"]


def okls_init_state(param: Tensor, config: OKLSConfig) -> dict[str, Tensor]:
    """fp32 state: ``momentum`` (*, m, n); packed ``S_a``, ``P_a`` (*, m(m+1)/2), ``S_b``, ``P_b``."""
    del config
    *lead, m, n = param.shape
    kw = {"dtype": torch.float32, "device": param.device}
    return {
        "momentum": torch.zeros(*lead, m, n, **kw),
        "S_a": torch.zeros(*lead, packed_size(m), **kw),
        "S_b": torch.zeros(*lead, packed_size(n), **kw),
        "P_a": torch.zeros(*lead, packed_size(m), **kw),
        "P_b": torch.zeros(*lead, packed_size(n), **kw),
    }


def okls_scales(beta1: float, m: int, n: int) -> tuple[float, float]:
    """``(c_mom, s_shape)``: Nesterov variance correction and muP shape factor."""
    v = (1.0 - beta1) / (1.0 + beta1) * (1.0 + 2.0 * beta1 - 2.0 * beta1**3)
    return v**-0.5, math.sqrt(m / n) / (math.sqrt(m) + math.sqrt(n))


def _inverse_sqrt(S: Tensor, config: OKLSConfig) -> Tensor:
    if config.root_method == "eigh":
        return inverse_sqrt_eigh(S)
    return inverse_sqrt_cans(S, fp16_scaled=config.fp16_scaled)


def _sym_plus_diag(S: Tensor, diag: float) -> Tensor:
    """``(S + S^T)/2 + diag I`` (new tensor)."""
    out = (S + S.mT).mul_(0.5)
    out.diagonal(dim1=-2, dim2=-1).add_(diag)
    return out


def _warm_start(g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Initial ``S_a``, ``S_b`` from the first fp32 gradient ``g`` (*, m, n)."""
    m, n = g.shape[-2], g.shape[-1]
    frob_sq = g.square().sum(dim=(-2, -1))[..., None, None]
    S_a = (g @ g.mT).mul_(torch.sqrt(m / (n * frob_sq + eps)))
    S_b = (g.mT @ g).mul_(torch.sqrt(n / (m * frob_sq + eps)))
    S_a = _sym_plus_diag(S_a, 0.0)
    S_b = _sym_plus_diag(S_b, 0.0)
    S_a.diagonal(dim1=-2, dim2=-1).add_(
        (torch.linalg.matrix_norm(S_a) / math.sqrt(m) + eps).unsqueeze(-1)
    )
    S_b.diagonal(dim1=-2, dim2=-1).add_(
        (torch.linalg.matrix_norm(S_b) / math.sqrt(n) + eps).unsqueeze(-1)
    )
    return S_a, S_b


def okls_direction(g: Tensor, state: dict[str, Tensor], step: int, config: OKLSConfig) -> Tensor:
    """Advance the OKLS state with fp32 gradient ``g`` and return ``U = P_a N P_b``."""
    m, n = g.shape[-2], g.shape[-1]
    beta1, beta2, eps = config.beta1, config.beta2, config.eps
    if step == 1:
        S_a, S_b = _warm_start(g, eps)
        P_a, P_b = _inverse_sqrt(S_a, config), _inverse_sqrt(S_b, config)
    else:
        S_a, S_b = unpack_sym(state["S_a"], m), unpack_sym(state["S_b"], n)
        P_a, P_b = unpack_sym(state["P_a"], m), unpack_sym(state["P_b"], n)
    momentum = state["momentum"]
    momentum.lerp_(g, 1.0 - beta1)
    nesterov = torch.lerp(g, momentum, beta1)
    g_pb = g @ P_b
    pa_g = P_a @ g
    S_a = _sym_plus_diag(S_a.mul_(beta2).add_(g_pb @ g_pb.mT, alpha=(1.0 - beta2) / n), eps)
    S_b = _sym_plus_diag(S_b.mul_(beta2).add_(pa_g.mT @ pa_g, alpha=(1.0 - beta2) / m), eps)
    P_a, P_b = _inverse_sqrt(S_a, config), _inverse_sqrt(S_b, config)
    for name, value in (("S_a", S_a), ("S_b", S_b), ("P_a", P_a), ("P_b", P_b)):
        state[name].copy_(pack_sym(value))
    return P_a @ nesterov @ P_b


@torch.no_grad()
def okls_step(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    weight_decay: float,
    step: int,
    initial_lr: float,
    config: OKLSConfig,
) -> None:
    """One OKLS step on ``param`` (*, m, n), in place (see module docstring).

    fp32 parameters are updated with in-place ops; lower-precision ones are
    updated in fp32 and rounded once (``param.copy_``).
    """
    m, n = param.shape[-2], param.shape[-1]
    update = okls_direction(grad.float(), state, step, config)
    c_mom, s_shape = okls_scales(config.beta1, m, n)
    wd_t = weight_decay * lr * (lr / initial_lr) if initial_lr > 0 else 0.0
    if param.dtype == torch.float32:
        param.mul_(1.0 - wd_t).add_(update, alpha=-lr * c_mom * s_shape)
    else:
        param.copy_(param.float().mul_(1.0 - wd_t).add_(update, alpha=-lr * c_mom * s_shape))
