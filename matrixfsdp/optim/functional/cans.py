"""Inverse square roots of SPD matrices: Scaled CANS coupled Newton–Schulz and references.

Scaled CANS (the Online KL Shampoo release, tilde-research/online-kl-shampoo-release)
computes ``S^{-1/2}`` with GEMMs only:

* ``L = 1.01 * min(Wolkowicz–Styan, Minc)`` is an O(d^2) upper bound on
  ``lambda_max(S)``, so ``Y0 = S / L`` has its spectrum in (0, 1].
* Coupled iteration, ``Z0 = I``: ``P = Z Y``, ``Q = a_k I + b_k P``,
  ``Y <- Y Q``, ``Z <- Q Z`` for the 10 CANS coefficient pairs ``(a_k, b_k)``.
  ``Y_k = Y0 Z_k`` holds throughout, so on an eigenvalue ``lam`` of ``Y0`` the
  iteration is the scalar odd polynomial ``x <- x (a_k + b_k x^2)`` on
  ``x = sqrt(lam) z``, driven towards 1; hence ``Z_10 ~ Y0^{-1/2}``.
* Result ``W = sym(Z_10) / sqrt(L)``. Cost: 1 + 3*8 + 2 = 27 GEMMs (28 on the
  fp16 path, see below).

fp16 path: every matrix fed to a GEMM is cast to fp16 after being multiplied
by a per-step scale ``s = M / bound`` (ceiling ``M = 16384``), where ``bound``
is the largest ``|z_k|``, ``|y_k|`` or ``|p_k|`` the scalar recursion reaches
for any ``lam`` in (0, 1] (for a symmetric matrix no entry exceeds the
spectral norm, so the scaled entries stay below ``M``, 4x under the fp16
maximum). The bounds are derived here by sweeping the scalar recursion in
float64 (:func:`cans_scalar_bounds`); the scales are folded into the
``alpha``/``beta`` of ``baddbmm``. Accumulation and the persistent ``Y``,
``Z`` stay fp32. On CUDA the GEMMs run as fp16 x fp16 -> fp32
(``baddbmm(..., out_dtype=torch.float32)``); elsewhere the same arithmetic is
emulated with fp16-rounded inputs multiplied in fp32. One deviation from the
published schedule: step 0's ``Y_0^2`` uses an fp16 hi/lo split of ``Y_0``
(one extra GEMM), which removes the cancellation in ``a_0 Y_0 + b_0 Y_0^2``
that otherwise costs ~3e-2 residual for well-conditioned ``S``.
Measured residuals ``||W S W - I||_F / sqrt(d)``: fp32 path ~3.5e-5 for
condition numbers 1..1e3; fp16 path 2e-3..2e-2 (fp16 has a 2^-11 unit
roundoff, so this is the TF32-class accuracy the method targets).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from ._linalg import robust_eigh

__all__ = [
    "CANS_COEFFICIENTS",
    "cans_scalar_bounds",
    "inverse_sqrt_cans",
    "inverse_sqrt_eigh",
    "inverse_sqrt_newton_schulz",
    "lambda_max_upper_bound",
    "sqrt_residual",
]

CANS_COEFFICIENTS: tuple[tuple[float, float], ...] = (
    (5.182503604966906, -5.178098480082684),
    (2.586120737395915, -0.6479542005271643),
    (2.567364126726186, -0.6454968804392178),
    (2.520560084348265, -0.6393528082067044),
    (2.410759275435182, -0.6248683598710716),
    (2.1883348130094173, -0.5952022073798908),
    (1.8595760874873613, -0.5504490972723968),
    (1.589020160467417, -0.5126569802066718),
    (1.5051653981684994, -0.5007377068751799),
    (1.5, -0.5),
)

_FP16_CEILING = 16384.0
_BOUND_SAFETY = 1.01  # rounds each derived scalar bound up by 1 %
_LO_SCALE = 2048.0  # 2^11: lifts the fp16 rounding residual of Yh_0 back into range


def lambda_max_upper_bound(S: Tensor) -> Tensor:
    """Upper bound on the largest eigenvalue of symmetric PSD ``S`` (*, d, d), O(d^2).

    ``min(WS, Minc)`` with Wolkowicz–Styan ``WS = mu + s sqrt(d - 1)``
    (``mu = tr(S)/d``, ``s^2 = ||S - mu I||_F^2 / d``, which equals
    ``||S||_F^2/d - mu^2`` without the cancellation) and Minc's bound
    ``max_i (|S| r)_i / r_i`` with ``r`` the row sums of ``|S|``. The matrix is
    first divided by its largest diagonal entry (which bounds every entry of a
    PSD matrix) so squares cannot overflow. Returns shape ``(*,)``.
    """
    d = S.shape[-1]
    diag = S.diagonal(dim1=-2, dim2=-1)
    c = diag.amax(dim=-1).clamp_min(torch.finfo(S.dtype).tiny)
    A = S / c[..., None, None]
    mu = A.diagonal(dim1=-2, dim2=-1).mean(dim=-1)
    centered = A - mu[..., None, None] * torch.eye(d, dtype=A.dtype, device=A.device)
    s = torch.linalg.matrix_norm(centered) / math.sqrt(d)
    ws = mu + s * math.sqrt(d - 1)
    absA = A.abs()
    r = absA.sum(dim=-1).clamp_min(torch.finfo(S.dtype).tiny)
    minc = ((absA @ r.unsqueeze(-1)).squeeze(-1) / r).amax(dim=-1)
    return c * torch.minimum(ws, minc)


@lru_cache(maxsize=8)
def cans_scalar_bounds(
    coefficients: tuple[tuple[float, float], ...] = CANS_COEFFICIENTS,
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Largest ``|z_k|``, ``|y_k|`` (k = 0..K) and ``|p_k|`` (k = 0..K-1) of the scalar recursion.

    ``y_0 = lam``, ``z_0 = 1``, ``p_k = z_k y_k``, ``q_k = a_k + b_k p_k``,
    ``y_{k+1} = y_k q_k``, ``z_{k+1} = q_k z_k``, maximised over a dense
    float64 grid of ``lam`` in [1e-16, 1] (log and linear spacing). These are
    the spectral-norm bounds of ``Z_k``, ``Y_k`` and ``P_k`` for ``S/L`` with
    spectrum in (0, 1]; the ``z`` maxima are reached as ``lam -> 0`` where
    ``z_k -> prod_{j<k} a_j``.
    """
    lam = torch.cat(
        [
            torch.logspace(-16.0, 0.0, 20001, dtype=torch.float64),
            torch.linspace(0.0, 1.0, 20001, dtype=torch.float64),
        ]
    )
    y, z = lam.clone(), torch.ones_like(lam)
    zb, yb, pb = [1.0], [1.0], []
    for a, b in coefficients:
        p = z * y
        pb.append(p.abs().max().item())
        q = a + b * p
        y, z = y * q, q * z
        zb.append(z.abs().max().item())
        yb.append(y.abs().max().item())
    return tuple(zb), tuple(yb), tuple(pb)


@lru_cache(maxsize=8)
def _fp16_scales(
    coefficients: tuple[tuple[float, float], ...],
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per-step scales ``s = M / (1.01 * bound)`` for Z, Y and P."""
    zb, yb, pb = cans_scalar_bounds(coefficients)

    def scale(bounds: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(_FP16_CEILING / (_BOUND_SAFETY * v) for v in bounds)

    return scale(zb), scale(yb), scale(pb)


_NATIVE_FP16_OUT_FP32: dict[str, bool] = {}


def _gemm16(c: Tensor, a16: Tensor, b16: Tensor, alpha: float, beta: float) -> Tensor:
    """fp32 ``beta * c + alpha * a16 @ b16`` from fp16 inputs (native on CUDA when supported)."""
    kind = a16.device.type
    if kind == "cuda" and _NATIVE_FP16_OUT_FP32.get(kind, True):
        try:
            return torch.baddbmm(c, a16, b16, torch.float32, beta=beta, alpha=alpha)
        except (RuntimeError, TypeError):
            _NATIVE_FP16_OUT_FP32[kind] = False
    return torch.baddbmm(c, a16.float(), b16.float(), beta=beta, alpha=alpha)


def _gemm16_half_out(a16: Tensor, b16: Tensor, alpha: float) -> Tensor:
    """fp16 ``alpha * a16 @ b16`` (fp32 accumulation, one rounding to fp16)."""
    if a16.device.type == "cuda":
        return torch.baddbmm(a16, a16, b16, beta=0.0, alpha=alpha)
    return torch.bmm(a16.float(), b16.float()).mul_(alpha).half()


def _cans_plain(Y: Tensor, coefficients: tuple[tuple[float, float], ...]) -> Tensor:
    """Unscaled coupled CANS iteration on ``Y = S / L`` (B, d, d); returns ``Z_K``."""
    a, b = coefficients[0]
    Z = Y * b
    Z.diagonal(dim1=-2, dim2=-1).add_(a)  # Z_1 = a I + b Y_0 (Z_0 = I)
    Y = torch.baddbmm(Y, Y, Y, beta=a, alpha=b)  # Y_1 = a Y_0 + b Y_0^2
    for a, b in coefficients[1:-1]:
        P = torch.bmm(Z, Y)
        Y, Z = (
            torch.baddbmm(Y, Y, P, beta=a, alpha=b),
            torch.baddbmm(Z, P, Z, beta=a, alpha=b),
        )
    a, b = coefficients[-1]
    return torch.baddbmm(Z, torch.bmm(Z, Y), Z, beta=a, alpha=b)  # last step: Z only


def _cans_fp16_scaled(Y: Tensor, coefficients: tuple[tuple[float, float], ...]) -> Tensor:
    """Coupled CANS with fp16 GEMM inputs; ``Y = S / L`` in fp32 (B, d, d); returns ``Z_K``.

    Stored ``Yh_k = sy_k Y_k`` and ``Zh_k = sz_k Z_k`` (fp32), ``Ph_k = sp_k P_k``
    (fp16). Substituting into the recursion gives, for step k >= 1,
    ``Ph = sp/(sz sy) Zh Yh``,
    ``Yh' = a sy'/sy Yh + b sy'/(sy sp) Yh Ph`` and
    ``Zh' = a sz'/sz Zh + b sz'/(sz sp) Ph Zh``; the last step uses ``sz' = 1``
    so it returns ``Z_K`` unscaled. Step 0 (``Z_0 = I``) needs no GEMM for Z;
    its ``Y_0^2`` is computed from an fp16 hi/lo split of ``Yh_0`` (one extra
    GEMM) because ``a_0 Y_0 + b_0 Y_0^2`` cancels badly for eigenvalues near 1.
    """
    sz, sy, sp = _fp16_scales(coefficients)
    K = len(coefficients)
    Yh = Y * sy[0]
    a, b = coefficients[0]
    Zh = Yh * (b * sz[1] / sy[0])
    Zh.diagonal(dim1=-2, dim2=-1).add_(a * sz[1])
    hi = Yh.half()
    lo = (Yh - hi.float()).mul_(_LO_SCALE).half()  # |Yh - hi| <= 2^-11 |Yh|
    alpha0 = b * sy[1] / sy[0] ** 2
    cross = _gemm16(Yh, hi, lo, alpha=alpha0 / _LO_SCALE, beta=0.0)
    Yh = _gemm16(Yh, hi, hi, alpha=alpha0, beta=a * sy[1] / sy[0]).add_(cross).add_(cross.mT)
    for k in range(1, K):
        a, b = coefficients[k]
        y16, z16 = Yh.half(), Zh.half()
        p16 = _gemm16_half_out(z16, y16, alpha=sp[k] / (sz[k] * sy[k]))
        sz_next = 1.0 if k == K - 1 else sz[k + 1]
        Zh_new = _gemm16(
            Zh, p16, z16, alpha=b * sz_next / (sz[k] * sp[k]), beta=a * sz_next / sz[k]
        )
        if k < K - 1:
            Yh = _gemm16(
                Yh, y16, p16, alpha=b * sy[k + 1] / (sy[k] * sp[k]), beta=a * sy[k + 1] / sy[k]
            )
        Zh = Zh_new
    return Zh


def inverse_sqrt_cans(
    S: Tensor,
    *,
    fp16_scaled: bool | None = None,
    coefficients: tuple[tuple[float, float], ...] = CANS_COEFFICIENTS,
) -> Tensor:
    """``S^{-1/2}`` of symmetric positive-definite ``S`` (*, d, d) by Scaled CANS.

    ``fp16_scaled=None`` means fp16 GEMM inputs on CUDA and plain GEMMs in the
    working dtype elsewhere. The working dtype is fp32 (fp64 if ``S`` is fp64
    and the fp16 path is off). Accuracy target: ``||W S W - I||_F / sqrt(d)``
    of a few 1e-5 for ``lambda_min / L`` down to ~1e-6. Returns ``S.dtype``.
    """
    if S.shape[-1] != S.shape[-2]:
        raise ValueError(f"inverse_sqrt_cans expects (*, d, d), got {tuple(S.shape)}")
    if len(coefficients) < 2:
        raise ValueError("inverse_sqrt_cans needs at least 2 coefficient pairs")
    if fp16_scaled is None:
        fp16_scaled = S.device.type == "cuda"
    d = S.shape[-1]
    work = torch.float64 if (S.dtype == torch.float64 and not fp16_scaled) else torch.float32
    X = S.reshape(-1, d, d).to(work)
    X = (X + X.mT) * 0.5
    L = lambda_max_upper_bound(X).mul_(1.01).clamp_min_(torch.finfo(work).tiny)
    Y = X / L[:, None, None]
    Z = _cans_fp16_scaled(Y, coefficients) if fp16_scaled else _cans_plain(Y, coefficients)
    W = (Z + Z.mT).mul_(0.5).mul_(L.rsqrt()[:, None, None])
    return W.reshape(S.shape).to(S.dtype)


def inverse_sqrt_newton_schulz(S: Tensor, *, steps: int = 21) -> Tensor:
    """``S^{-1/2}`` by the classical coupled Newton–Schulz iteration (a, b) = (1.5, -0.5).

    Same normalisation and GEMM structure as :func:`inverse_sqrt_cans` with
    constant coefficients; about 21 steps reach the accuracy of 10 CANS steps.
    """
    return inverse_sqrt_cans(S, fp16_scaled=False, coefficients=((1.5, -0.5),) * steps)


def inverse_sqrt_eigh(S: Tensor, eps: float = 0.0, *, dtype: torch.dtype | None = None) -> Tensor:
    """``(S + eps I)^{-1/2}`` by eigendecomposition (negative eigenvalues clamped to 0).

    ``dtype`` is the eigh compute dtype (default float64). Returns ``S.dtype``.
    """
    work = torch.float64 if dtype is None else dtype
    S_ = S.to(work)
    evals, evecs = robust_eigh((S_ + S_.mT) * 0.5)
    scale = (evals.clamp_min(0.0) + eps).rsqrt()
    return ((evecs * scale.unsqueeze(-2)) @ evecs.mT).to(S.dtype)


def sqrt_residual(S: Tensor, W: Tensor) -> Tensor:
    """``||W S W - I||_F / sqrt(d)`` per matrix (shape ``(*,)``), computed in float64."""
    d = S.shape[-1]
    S64, W64 = S.double(), W.double()
    eye = torch.eye(d, dtype=torch.float64, device=S.device)
    return torch.linalg.matrix_norm(W64 @ S64 @ W64 - eye) / math.sqrt(d)
