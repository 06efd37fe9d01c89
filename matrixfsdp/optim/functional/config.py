"""Frozen hyperparameter dataclasses for the functional matrix optimizers.

Each optimizer takes one config object. Every config validates itself in
``__post_init__`` and raises ``ValueError`` whose message starts with
``"<ConfigName>.<field>"`` so a bad value in a YAML file is easy to locate.
The learning rate and weight decay are not part of a config: the caller passes
them to every ``step_fn`` call because schedulers change them over time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "EmaGramConfig",
    "MuonConfig",
    "OKLSConfig",
    "SOAPConfig",
    "ShampooConfig",
]

_NS_DTYPES = ("bfloat16", "float32", "float64")
_ROOT_DTYPES = ("float32", "float64")
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_SHAPE_SCALES = ("none", "original", "match_rms_adamw")
_EPS_MODES = ("relative", "absolute")


def _fail(cls: object, field: str, rule: str, value: object) -> None:
    raise ValueError(f"{type(cls).__name__}.{field} must be {rule}, got {value!r}")


def _check_unit_interval(cls: object, field: str, value: float, *, closed: bool = False) -> None:
    """Require 0 <= value < 1 (or <= 1 when ``closed``) and a finite number."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0
    ok = ok and (value <= 1.0 if closed else value < 1.0)
    if not ok:
        _fail(cls, field, "in [0, 1]" if closed else "in [0, 1)", value)


def _check_nonneg(cls: object, field: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
        _fail(cls, field, ">= 0", value)


def _check_pos_int(cls: object, field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(cls, field, "an integer >= 1", value)


def _check_bool(cls: object, field: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(cls, field, "a bool", value)


def _check_choice(cls: object, field: str, value: object, choices: tuple) -> None:
    if value not in choices:
        _fail(cls, field, f"one of {choices}", value)


def _check_betas(cls: object, betas: tuple[float, float], *, beta2_closed: bool) -> None:
    """Validate ``betas`` and store it as a tuple of floats (YAML gives lists)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        _fail(cls, "betas", "a pair (beta1, beta2)", betas)
    _check_unit_interval(cls, "betas[0]", betas[0])
    _check_unit_interval(cls, "betas[1]", betas[1], closed=beta2_closed)
    object.__setattr__(cls, "betas", (float(betas[0]), float(betas[1])))


@dataclass(frozen=True)
class MuonConfig:
    """Muon; names and defaults follow ``torch.optim.Muon`` (torch >= 2.9).

    ``ns_dtype`` selects the Newton–Schulz compute dtype ("bfloat16" is torch's
    behaviour; "float32"/"float64" are for accuracy studies).
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    ns_steps: int = 5
    eps: float = 1e-7
    adjust_lr_fn: str | None = None
    ns_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _check_unit_interval(self, "momentum", self.momentum)
        if not isinstance(self.nesterov, bool):
            _fail(self, "nesterov", "a bool", self.nesterov)
        coeffs = self.ns_coefficients
        if not isinstance(coeffs, (tuple, list)) or len(coeffs) != 3:
            _fail(self, "ns_coefficients", "a tuple of 3 floats", coeffs)
        if not all(isinstance(c, (int, float)) and math.isfinite(c) for c in coeffs):
            _fail(self, "ns_coefficients", "finite numbers", coeffs)
        object.__setattr__(self, "ns_coefficients", tuple(float(c) for c in coeffs))
        _check_pos_int(self, "ns_steps", self.ns_steps)
        if self.ns_steps >= 100:
            _fail(self, "ns_steps", "< 100", self.ns_steps)
        _check_nonneg(self, "eps", self.eps)
        _check_choice(self, "adjust_lr_fn", self.adjust_lr_fn, _ADJUST_LR_FNS)
        _check_choice(self, "ns_dtype", self.ns_dtype, _NS_DTYPES)


@dataclass(frozen=True)
class ShampooConfig:
    """Shampoo with EMA Kronecker factors, eigh inverse 4th roots and Adam grafting.

    ``betas = (beta1, beta2)``: beta1 is the momentum EMA; beta2 is the EMA of
    the Kronecker factors and of the grafting second moment (beta2 = 1 gives
    plain sum accumulation and AdaGrad grafting). ``grafting`` is "adam" or
    "none".

    Conventions shared with Distributed Shampoo (facebookresearch/optimizers):

    * ``bias_correction`` (its ``use_bias_correction``): the momentum is divided
      by ``1 - beta1^t`` and, when beta2 < 1, each factor by ``1 - beta2^t``
      before its root (with or without grafting).
    * ``eps_mode``: "relative" (default) adds ``eps * lambda_max`` of the
      (bias-corrected) factor to its eigenvalues, which makes the roots
      scale-invariant and keeps fp32 eigensolves of rank-deficient factors
      stable; "absolute" adds ``eps * I`` to the bias-corrected factor, as
      Distributed Shampoo's ``epsilon`` (whose default is 1e-12).
    * ``start_preconditioning_step`` (``-1`` means ``precondition_frequency``,
      as in Distributed Shampoo): steps ``t < start`` use the grafting direction
      alone (the momentum itself when ``grafting="none"``: the roots start as
      identities); roots are recomputed at ``t = start`` and at every
      ``t > start`` with ``t % precondition_frequency == 0``. Unlike
      Distributed Shampoo a start below ``precondition_frequency`` is allowed
      (``start_preconditioning_step=1``: precondition from step 1, refresh at
      1, k, 2k, ...). The defaults (frequency 1, start -1) refresh every step.
    """

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    precondition_frequency: int = 1
    root_dtype: str = "float32"
    grafting: str = "adam"
    grafting_eps: float = 1e-8
    bias_correction: bool = True
    eps_mode: Literal["relative", "absolute"] = "relative"
    start_preconditioning_step: int = -1

    def __post_init__(self) -> None:
        _check_betas(self, self.betas, beta2_closed=True)
        if self.betas[1] == 0.0:
            _fail(self, "betas[1]", "in (0, 1]", self.betas[1])
        _check_nonneg(self, "eps", self.eps)
        _check_pos_int(self, "precondition_frequency", self.precondition_frequency)
        _check_choice(self, "root_dtype", self.root_dtype, _ROOT_DTYPES)
        _check_choice(self, "grafting", self.grafting, ("adam", "none"))
        _check_nonneg(self, "grafting_eps", self.grafting_eps)
        _check_bool(self, "bias_correction", self.bias_correction)
        _check_choice(self, "eps_mode", self.eps_mode, _EPS_MODES)
        start = self.start_preconditioning_step
        if isinstance(start, bool) or not isinstance(start, int) or (start < 1 and start != -1):
            _fail(self, "start_preconditioning_step", "-1 or an integer >= 1", start)

    @property
    def first_preconditioned_step(self) -> int:
        """``start_preconditioning_step`` with -1 resolved to ``precondition_frequency``."""
        start = self.start_preconditioning_step
        return self.precondition_frequency if start == -1 else start


@dataclass(frozen=True)
class SOAPConfig:
    """SOAP (Vyas et al., 2024): Adam in the eigenbasis of Shampoo's factors.

    Names and defaults follow the reference implementation (nikhilvyas/SOAP).
    ``shampoo_beta`` is the factor EMA coefficient; ``None`` means "use
    betas[1]" as there. ``eps`` is Adam's absolute epsilon added to the
    square root of the rotated second moment, as there; the factors'
    eigendecompositions take no regularizer, so there is no ``eps_mode``.
    """

    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float | None = None
    eps: float = 1e-8
    precondition_frequency: int = 10
    correct_bias: bool = True

    def __post_init__(self) -> None:
        _check_betas(self, self.betas, beta2_closed=False)
        if self.shampoo_beta is not None:
            _check_unit_interval(self, "shampoo_beta", self.shampoo_beta)
        _check_nonneg(self, "eps", self.eps)
        _check_pos_int(self, "precondition_frequency", self.precondition_frequency)
        if not isinstance(self.correct_bias, bool):
            _fail(self, "correct_bias", "a bool", self.correct_bias)


@dataclass(frozen=True)
class OKLSConfig:
    """Online KL Shampoo; names and defaults follow the public release
    (tilde-research/online-kl-shampoo-release, ``OnlineKLShampoo``: beta1=0.9684,
    beta2=0.9482, eps=1e-9; its lr=0.09434 and weight_decay=0.0303 are passed to
    the step function, not stored here).

    ``root_method`` is "cans" (Scaled CANS, the published method) or "eigh"
    (float64 eigendecomposition, for debugging). ``fp16_scaled`` selects the
    fp16-GEMM CANS path: None means "on CUDA only".
    """

    beta1: float = 0.9684
    beta2: float = 0.9482
    eps: float = 1e-9
    root_method: str = "cans"
    fp16_scaled: bool | None = None

    def __post_init__(self) -> None:
        _check_unit_interval(self, "beta1", self.beta1)
        _check_unit_interval(self, "beta2", self.beta2)
        _check_nonneg(self, "eps", self.eps)
        _check_choice(self, "root_method", self.root_method, ("cans", "eigh"))
        if self.fp16_scaled is not None and not isinstance(self.fp16_scaled, bool):
            _fail(self, "fp16_scaled", "None or a bool", self.fp16_scaled)


@dataclass(frozen=True)
class EmaGramConfig:
    """EMA-Gram quarter-power preconditioning.

    ``eps_mode="relative"`` (default) adds ``eps`` to the eigenvalues of each
    (bias-corrected) Gram after it is normalized by its mean eigenvalue
    (trace / d), i.e. ``eps`` is relative to the mean eigenvalue;
    ``"absolute"`` adds ``eps * I`` to the bias-corrected Gram, as Distributed
    Shampoo does. ``shape_scale`` multiplies the update like Muon's
    ``adjust_lr_fn``: "none", "original" (sqrt(max(1, m/n))) or
    "match_rms_adamw" (0.2 * sqrt(max(m, n))). ``root_dtype`` is the eigh compute dtype
    ("float32" or "float64"; the roots are stored in fp32).
    """

    betas: tuple[float, float] = (0.95, 0.95)
    eps: float = 1e-6
    precondition_frequency: int = 1
    bias_correction: bool = True
    shape_scale: str = "none"
    eps_mode: Literal["relative", "absolute"] = "relative"
    root_dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_betas(self, self.betas, beta2_closed=False)
        _check_nonneg(self, "eps", self.eps)
        _check_pos_int(self, "precondition_frequency", self.precondition_frequency)
        _check_bool(self, "bias_correction", self.bias_correction)
        _check_choice(self, "shape_scale", self.shape_scale, _SHAPE_SCALES)
        _check_choice(self, "eps_mode", self.eps_mode, _EPS_MODES)
        _check_choice(self, "root_dtype", self.root_dtype, _ROOT_DTYPES)
