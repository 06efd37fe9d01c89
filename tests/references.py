"""Float64 reference optimizers written from the published formulas, for the tests only.

Nothing here imports the library's step functions: each class restates one optimizer's math
(each library module's docstring, and the reference implementation it follows) in float64 with
plain tensors, so a test that compares the library against these checks the math, not the
sharding alone. One object steps one matrix ``(m, n)``; :class:`StackReference` steps an
``(E, m, n)`` stack as E independent matrices.

``step(W, G, lr=..., weight_decay=..., initial_lr=...)`` takes and returns float64 weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "REFERENCES",
    "EmaGramReference",
    "MuonReference",
    "OKLSReference",
    "SOAPReference",
    "ShampooReference",
    "StackReference",
    "check_eigenbasis",
    "make_reference",
    "sym_power",
]

F64 = torch.float64


def sym_power(A: Tensor, power: float, reg: float = 0.0) -> Tensor:
    """``V diag((max(lam, 0) + reg)^power) V^T`` of symmetric ``A`` (float64)."""
    lam, V = torch.linalg.eigh((A + A.T) / 2)
    lam = lam.clamp(min=0.0) + reg
    return V @ torch.diag(lam**power) @ V.T


def _lam_max(A: Tensor) -> float:
    return torch.linalg.eigvalsh((A + A.T) / 2)[-1].item()


class MuonReference:
    """Muon: momentum, optional Nesterov, quintic Newton–Schulz in float64, shape-adjusted lr."""

    def __init__(self, shape, *, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.7750,
                 2.0315), ns_steps=5, eps=1e-7, adjust_lr_fn=None, **_: Any) -> None:
        self.mu, self.nesterov, self.coeffs = momentum, nesterov, ns_coefficients
        self.ns_steps, self.eps, self.adjust = ns_steps, eps, adjust_lr_fn
        self.B = torch.zeros(shape, dtype=F64)

    def orthogonalize(self, D: Tensor) -> Tensor:
        a, b, c = self.coeffs
        tall = D.shape[0] > D.shape[1]
        X = D.T if tall else D
        X = X / max(torch.linalg.norm(X).item(), self.eps)
        for _ in range(self.ns_steps):
            A = X @ X.T
            X = a * X + (b * A + c * (A @ A)) @ X
        return X.T if tall else X

    def step(self, W: Tensor, G: Tensor, *, lr: float, weight_decay: float,
             initial_lr: float) -> Tensor:
        G = G.to(F64)
        m, n = G.shape
        self.B = self.mu * self.B + (1 - self.mu) * G
        D = (1 - self.mu) * G + self.mu * self.B if self.nesterov else self.B
        scale = 0.2 * math.sqrt(max(m, n)) if self.adjust == "match_rms_adamw" else math.sqrt(
            max(1.0, m / n))
        return W * (1 - lr * weight_decay) - lr * scale * self.orthogonalize(D)


class ShampooReference:
    """Distributed Shampoo's algorithm for one unblocked matrix (see ShampooConfig)."""

    def __init__(self, shape, *, betas=(0.9, 0.999), eps=1e-6, precondition_frequency=1,
                 grafting="adam", grafting_eps=1e-8, bias_correction=True, eps_mode="relative",
                 start_preconditioning_step=-1, **_: Any) -> None:
        m, n = shape
        self.b1, self.b2 = betas
        self.eps, self.eps_mode, self.k = eps, eps_mode, precondition_frequency
        self.start = precondition_frequency if start_preconditioning_step == -1 else (
            start_preconditioning_step)
        self.grafting, self.geps, self.bias_correction = grafting, grafting_eps, bias_correction
        self.L, self.R = torch.zeros(m, m, dtype=F64), torch.zeros(n, n, dtype=F64)
        self.L_root, self.R_root = torch.eye(m, dtype=F64), torch.eye(n, dtype=F64)
        self.M, self.V = torch.zeros(shape, dtype=F64), torch.zeros(shape, dtype=F64)
        self.t = 0

    def _root(self, X: Tensor) -> Tensor:
        reg = self.eps * _lam_max(X) if self.eps_mode == "relative" else self.eps
        return sym_power(X, -0.25, reg)

    def step(self, W: Tensor, G: Tensor, *, lr: float, weight_decay: float,
             initial_lr: float) -> Tensor:
        G, b1, b2 = G.to(F64), self.b1, self.b2
        self.t += 1
        t = self.t
        w = 1.0 if b2 == 1.0 else 1 - b2
        self.L, self.R = b2 * self.L + w * G @ G.T, b2 * self.R + w * G.T @ G
        self.M = b1 * self.M + (1 - b1) * G
        bc1 = 1 - b1**t if self.bias_correction else 1.0
        bc2 = 1 - b2**t if self.bias_correction and b2 < 1 else 1.0
        M_hat = self.M / bc1
        if t == self.start or (t > self.start and t % self.k == 0):
            self.L_root, self.R_root = self._root(self.L / bc2), self._root(self.R / bc2)
        D = self.L_root @ M_hat @ self.R_root
        if self.grafting == "adam":
            self.V = self.V + G * G if b2 == 1.0 else b2 * self.V + (1 - b2) * G * G
            v_hat = self.V if b2 == 1.0 else self.V / (1 - b2**t)
            adam = M_hat / (v_hat.sqrt() + self.geps)
            D = adam if t < self.start else D * torch.linalg.norm(adam) / torch.linalg.norm(D)
        return W * (1 - lr * weight_decay) - lr * D


class SOAPReference:
    """SOAP as nikhilvyas/SOAP, with the first moment kept in the ORIGINAL space and projected
    every step (equivalent to the library's re-projected rotated moment, as the EMA is linear).

    ``pick_basis(QL, QR, L, R, index=...)`` may replace the step-1 eigenbases (``index`` is the
    expert of a stack, else None): the eigenbasis of a rank-deficient factor is arbitrary inside
    its null space, so a test checks with :func:`check_eigenbasis` that the library's choice is
    a valid one and hands it over.
    """

    def __init__(self, shape, *, betas=(0.95, 0.95), shampoo_beta=None, eps=1e-8,
                 precondition_frequency=10, correct_bias=True,
                 pick_basis: Callable[..., tuple[Tensor, Tensor]] | None = None,
                 index: int | None = None, **_: Any) -> None:
        self.b1, self.b2 = betas
        self.bs = self.b2 if shampoo_beta is None else shampoo_beta
        self.eps, self.k, self.correct_bias = eps, precondition_frequency, correct_bias
        self.pick_basis, self.index = pick_basis, index
        self.M, self.V = torch.zeros(shape, dtype=F64), torch.zeros(shape, dtype=F64)
        self.calls = 0

    @staticmethod
    def _eigvecs_descending(A: Tensor) -> Tensor:
        return torch.linalg.eigh((A + A.T) / 2)[1].flip(-1)

    def step(self, W: Tensor, G: Tensor, *, lr: float, weight_decay: float,
             initial_lr: float) -> Tensor:
        G, b1, b2, bs = G.to(F64), self.b1, self.b2, self.bs
        self.calls += 1
        if self.calls == 1:  # initialisation only; the weights do not move
            self.L, self.R = (1 - bs) * G @ G.T, (1 - bs) * G.T @ G
            self.QL, self.QR = self._eigvecs_descending(self.L), self._eigvecs_descending(self.R)
            if self.pick_basis is not None:
                self.QL, self.QR = self.pick_basis(self.QL, self.QR, self.L, self.R,
                                                   index=self.index)
            return W.clone()
        t, QL, QR = self.calls - 1, self.QL, self.QR
        self.M = b1 * self.M + (1 - b1) * G
        Gr = QL.T @ G @ QR
        self.V = b2 * self.V + (1 - b2) * Gr**2
        D = QL @ ((QL.T @ self.M @ QR) / (self.V.sqrt() + self.eps)) @ QR.T
        scale = math.sqrt(1 - b2**t) / (1 - b1**t) if self.correct_bias else 1.0
        W = (W - lr * scale * D) * (1 - lr * weight_decay)
        self.L, self.R = bs * self.L + (1 - bs) * G @ G.T, bs * self.R + (1 - bs) * G.T @ G
        if t % self.k == 0:
            ol = torch.argsort(torch.diagonal(QL.T @ self.L @ QL), descending=True)
            orr = torch.argsort(torch.diagonal(QR.T @ self.R @ QR), descending=True)
            self.V = self.V[ol][:, orr]
            self.QL = torch.linalg.qr(self.L @ QL[:, ol]).Q
            self.QR = torch.linalg.qr(self.R @ QR[:, orr]).Q
        return W


class OKLSReference:
    """Online KL Shampoo as the release (tilde-research/online-kl-shampoo-release), exact roots."""

    def __init__(self, shape, *, beta1=0.9684, beta2=0.9482, eps=1e-9, **_: Any) -> None:
        self.b1, self.b2, self.eps = beta1, beta2, eps
        self.M = torch.zeros(shape, dtype=F64)
        self.t = 0

    def step(self, W: Tensor, G: Tensor, *, lr: float, weight_decay: float,
             initial_lr: float) -> Tensor:
        G, b1, b2, eps = G.to(F64), self.b1, self.b2, self.eps
        m, n = G.shape
        self.t += 1
        if self.t == 1:  # warm start from the first gradient
            f2 = (G**2).sum().item()
            Sa = math.sqrt(m / (n * f2 + eps)) * G @ G.T
            Sb = math.sqrt(n / (m * f2 + eps)) * G.T @ G
            self.Sa = Sa + (torch.linalg.norm(Sa).item() / math.sqrt(m) + eps) * torch.eye(m, dtype=F64)
            self.Sb = Sb + (torch.linalg.norm(Sb).item() / math.sqrt(n) + eps) * torch.eye(n, dtype=F64)
            self.Pa, self.Pb = sym_power(self.Sa, -0.5), sym_power(self.Sb, -0.5)
        self.M = b1 * self.M + (1 - b1) * G
        N = (1 - b1) * G + b1 * self.M
        GPb, PaG = G @ self.Pb, self.Pa @ G
        self.Sa = b2 * self.Sa + (1 - b2) / n * GPb @ GPb.T + eps * torch.eye(m, dtype=F64)
        self.Sb = b2 * self.Sb + (1 - b2) / m * PaG.T @ PaG + eps * torch.eye(n, dtype=F64)
        self.Pa, self.Pb = sym_power(self.Sa, -0.5), sym_power(self.Sb, -0.5)
        v = (1 - b1) / (1 + b1) * (1 + 2 * b1 - 2 * b1**3)
        scale = v**-0.5 * math.sqrt(m / n) / (math.sqrt(m) + math.sqrt(n))
        wd_t = weight_decay * lr * lr / initial_lr  # AdamC
        return W * (1 - wd_t) - lr * scale * (self.Pa @ N @ self.Pb)


class EmaGramReference:
    """EMA-Gram: bias-corrected EMA momentum and Grams, (Gram + eps I)^{-1/4} on both sides."""

    def __init__(self, shape, *, betas=(0.95, 0.95), eps=1e-6, precondition_frequency=1,
                 bias_correction=True, shape_scale="none", eps_mode="relative", **_: Any) -> None:
        m, n = shape
        self.b1, self.b2 = betas
        self.eps, self.eps_mode, self.k, self.bc = eps, eps_mode, precondition_frequency, (
            bias_correction)
        self.scale = {"none": 1.0, "original": math.sqrt(max(1.0, m / n)),
                      "match_rms_adamw": 0.2 * math.sqrt(max(m, n))}[shape_scale]
        self.M = torch.zeros(shape, dtype=F64)
        self.L, self.R = torch.zeros(m, m, dtype=F64), torch.zeros(n, n, dtype=F64)
        self.t = 0

    def _root(self, X: Tensor) -> Tensor:
        d = X.shape[0]
        reg = self.eps * torch.trace(X).item() / d if self.eps_mode == "relative" else self.eps
        return sym_power(X, -0.25, reg)

    def step(self, W: Tensor, G: Tensor, *, lr: float, weight_decay: float,
             initial_lr: float) -> Tensor:
        G, b1, b2 = G.to(F64), self.b1, self.b2
        self.t += 1
        t = self.t
        self.M = b1 * self.M + (1 - b1) * G
        self.L, self.R = b2 * self.L + (1 - b2) * G @ G.T, b2 * self.R + (1 - b2) * G.T @ G
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if self.bc else (1.0, 1.0)
        if (t - 1) % self.k == 0:
            self.L_root, self.R_root = self._root(self.L / bc2), self._root(self.R / bc2)
        D = self.L_root @ (self.M / bc1) @ self.R_root
        return W * (1 - lr * weight_decay) - lr * self.scale * D


REFERENCES: dict[str, type] = {
    "muon": MuonReference,
    "shampoo": ShampooReference,
    "soap": SOAPReference,
    "okls": OKLSReference,
    "emagram": EmaGramReference,
}


def check_eigenbasis(Q: Tensor, A: Tensor, rtol: float = 1e-5) -> Tensor:
    """Assert ``Q`` (any dtype) is an orthonormal eigenbasis of symmetric ``A`` with eigenvalues in
    descending order (within ``rtol`` of ``||A||``); return it in float64."""
    Q, A = Q.to(F64), A.to(F64)
    eye = torch.eye(Q.shape[0], dtype=F64)
    assert torch.linalg.norm(Q.T @ Q - eye) <= 10 * rtol, "basis is not orthonormal"
    rot = Q.T @ A @ Q
    off = rot - torch.diag(torch.diagonal(rot))
    scale = torch.linalg.norm(A)
    assert torch.linalg.norm(off) <= rtol * scale, "basis does not diagonalise the factor"
    lam = torch.diagonal(rot)
    assert bool((lam[:-1] >= lam[1:] - rtol * scale).all()), "eigenvalues not descending"
    return Q


class StackReference:
    """An ``(E, m, n)`` stack stepped as E independent matrices."""

    def __init__(self, name: str, shape, **hyper: Any) -> None:
        self.slices = [REFERENCES[name](tuple(shape[1:]), index=i, **hyper)
                       for i in range(shape[0])]

    def step(self, W: Tensor, G: Tensor, **kw: float) -> Tensor:
        return torch.stack([ref.step(W[i], G[i], **kw) for i, ref in enumerate(self.slices)])


def make_reference(name: str, shape, **hyper: Any):
    """A float64 reference for one parameter of ``shape`` (2-D, or 3-D as a stack)."""
    if len(shape) == 3:
        return StackReference(name, shape, **hyper)
    return REFERENCES[name](tuple(shape), **hyper)
