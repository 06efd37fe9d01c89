"""Small shared linear-algebra helpers (batched over leading dims)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

__all__ = ["batched_addmm", "dtype_from_name", "inverse_root_eigh", "robust_eigh"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def dtype_from_name(name: str) -> torch.dtype:
    """Map a config dtype name ("float32", ...) to a ``torch.dtype``."""
    return _DTYPES[name]


def batched_addmm(c: Tensor, a: Tensor, b: Tensor, *, beta: float, alpha: float) -> Tensor:
    """``beta * c + alpha * a @ b`` for (m, k) or (*, m, k) operands.

    2-D operands go through ``torch.addmm``; batched ones are flattened to one
    batch dim and go through ``torch.baddbmm``.
    """
    if a.dim() == 2:
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)
    lead = a.shape[:-2]
    out = torch.baddbmm(
        c.reshape(-1, *c.shape[-2:]),
        a.reshape(-1, *a.shape[-2:]),
        b.reshape(-1, *b.shape[-2:]),
        beta=beta,
        alpha=alpha,
    )
    return out.reshape(*lead, *out.shape[-2:])


def robust_eigh(X: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of symmetric ``X`` that does not give up on ill-conditioning.

    An eigensolver that fails to converge raises ``LinAlgError`` on the owner alone, which would
    leave its peers waiting (see [Note: step agreement] in ``matrixfsdp.optim.agreement``).
    Retried in float64 with a diagonal shift of ``1e-12 * (|tr X| / d + 1)``, removed from the
    eigenvalues afterwards; returned in ``X.dtype``. NaN/inf input still raises.
    """
    try:
        return torch.linalg.eigh(X)
    except torch.linalg.LinAlgError:
        d = X.shape[-1]
        X64 = X.to(torch.float64)
        shift = 1e-12 * (X64.diagonal(dim1=-2, dim2=-1).sum(-1).abs() / d + 1.0)
        eye = torch.eye(d, dtype=torch.float64, device=X.device)
        evals, evecs = torch.linalg.eigh(X64 + shift[..., None, None] * eye)
        logger.warning("matrixfsdp: eigh of a %s factor did not converge in %s; solved in "
                       "float64 with a 1e-12 relative shift", tuple(X.shape), X.dtype)
        return (evals - shift[..., None]).to(X.dtype), evecs.to(X.dtype)


def inverse_root_eigh(
    A: Tensor,
    root: float,
    *,
    eps: float,
    relative_to: str | None = "max",
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``(A + r I)^{-1/root}`` of symmetric PSD ``A`` (*, d, d) by ``torch.linalg.eigh``.

    The regularizer is ``r = eps * lambda_max(A)`` (``relative_to="max"``),
    ``r = eps * tr(A) / d`` (``"mean"``) or ``r = eps`` (``None``: absolute, as
    Distributed Shampoo's epsilon). The relative forms make the root
    scale-equivariant: ``(cA)^{-1/root} = c^{-1/root} A^{-1/root}``. Negative
    (round-off) eigenvalues are clamped to 0. ``A`` is normalised by
    ``c = tr(A)/d`` (at least ``eps`` in the absolute form, so a zero ``A``
    gives ``eps^{-1/root} I``) before the eigensolve and the scale is restored
    afterwards. Computed in ``dtype``; returned in fp32. In the relative forms an all-zero ``A``
    (a factor that has seen only zero gradients, e.g. torch's zero-gradient, lr=0 init step)
    has no scale to be relative to: its root is the identity (no preconditioning), not the
    ``tiny^{-1/root}`` that overflowed to inf in fp64 and made the update NaN.
    """
    d = A.shape[-1]
    X = A.to(dtype)
    X = (X + X.mT) * 0.5
    tiny = torch.finfo(dtype).tiny
    c = (X.diagonal(dim1=-2, dim2=-1).sum(-1) / d).clamp_min(tiny)
    if relative_to is None:
        c = c.clamp_min(eps)
    evals, evecs = robust_eigh(X / c[..., None, None])
    evals = evals.clamp_min(0.0)
    if relative_to == "max":
        reg = eps * evals[..., -1:]
    elif relative_to == "mean":
        reg = torch.full_like(evals[..., -1:], eps)
    elif relative_to is None:
        reg = eps / c[..., None]
    else:
        raise ValueError(f"relative_to must be 'max', 'mean' or None, got {relative_to!r}")
    powered = (evals + reg.clamp_min(tiny)).pow(-1.0 / root)
    out = (evecs * powered.unsqueeze(-2)) @ evecs.mT
    out = out.mul_(c.pow(-1.0 / root)[..., None, None])
    if relative_to is not None:
        zero = (X == 0).flatten(-2).all(-1)[..., None, None]
        out = torch.where(zero, torch.eye(d, dtype=out.dtype, device=out.device), out)
    return out.to(torch.float32)
