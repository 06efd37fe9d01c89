"""Pure, process-group-free step functions for the matrix optimizers.

Every function works on whole local tensors of shape ``(m, n)`` or
``(*, m, n)`` (a batch of independent matrices, e.g. stacked experts). See
:mod:`.registry` for the ``init_state_fn`` / ``step_fn`` contract; each
optimizer's module docstring states its math and the reference
implementation whose conventions it follows.
"""

from __future__ import annotations

from .cans import (
    CANS_COEFFICIENTS,
    cans_scalar_bounds,
    inverse_sqrt_cans,
    inverse_sqrt_eigh,
    inverse_sqrt_newton_schulz,
    lambda_max_upper_bound,
    sqrt_residual,
)
from .config import EmaGramConfig, MuonConfig, OKLSConfig, ShampooConfig, SOAPConfig
from .emagram import emagram_direction, emagram_init_state, emagram_shape_scale, emagram_step
from .muon import muon_adjusted_lr, muon_init_state, muon_step, zeropower_via_newton_schulz
from .okls import okls_direction, okls_init_state, okls_scales, okls_step
from .packing import pack_sym, packed_dim, packed_size, unpack_sym
from .registry import FUNCTIONAL_OPTIMIZERS, InitStateFn, StepFn, get_functional_optimizer
from .shampoo import shampoo_direction, shampoo_init_state, shampoo_refreshes, shampoo_step
from .soap import soap_direction, soap_init_state, soap_step

__all__ = [
    "CANS_COEFFICIENTS",
    "FUNCTIONAL_OPTIMIZERS",
    "EmaGramConfig",
    "InitStateFn",
    "MuonConfig",
    "OKLSConfig",
    "SOAPConfig",
    "ShampooConfig",
    "StepFn",
    "cans_scalar_bounds",
    "emagram_direction",
    "emagram_init_state",
    "emagram_shape_scale",
    "emagram_step",
    "get_functional_optimizer",
    "inverse_sqrt_cans",
    "inverse_sqrt_eigh",
    "inverse_sqrt_newton_schulz",
    "lambda_max_upper_bound",
    "muon_adjusted_lr",
    "muon_init_state",
    "muon_step",
    "okls_direction",
    "okls_init_state",
    "okls_scales",
    "okls_step",
    "pack_sym",
    "packed_dim",
    "packed_size",
    "shampoo_direction",
    "shampoo_init_state",
    "shampoo_refreshes",
    "shampoo_step",
    "soap_direction",
    "soap_init_state",
    "soap_step",
    "sqrt_residual",
    "unpack_sym",
    "zeropower_via_newton_schulz",
]
