"""Muon: momentum orthogonalised by a quintic Newton–Schulz iteration.

Per matrix (``step`` t, gradient G, momentum mu, Newton–Schulz map NS)::

    B <- mu B + (1 - mu) G            (buf.lerp_(G, 1 - mu))
    D  = G + mu (B - G) = lerp(G, B, mu)   if nesterov else B
    O  = NS(D)
    W <- W (1 - lr wd) - lr s O

with ``s = sqrt(max(1, m/n))`` ("original", default) or ``0.2 sqrt(max(m, n))``
("match_rms_adamw"). For a 2-D parameter this replays ``torch.optim.Muon``'s
operation sequence, so in bf16 the result is bitwise identical. Batched
``(*, m, n)`` input runs the same iteration with ``baddbmm`` per slice. Each iterate is
computed in place a block of columns at a time where the matrix splits into two blocks or more
(``_ns_columns``; [Note: owner step transients] in ``matrixfsdp.optim.owner_step``).
One intentional difference: torch normalises the Newton–Schulz input in place,
which for a bf16 parameter with ``nesterov=False`` also rescales the momentum
buffer (``buf.bfloat16()`` is ``buf`` itself); here the buffer is never
touched by the orthogonalisation.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from ._linalg import batched_addmm, dtype_from_name
from .config import MuonConfig

__all__ = [
    "muon_adjusted_lr", "muon_init_state", "muon_step", "newton_schulz_input",
    "zeropower_via_newton_schulz",
]

# Bytes of gradient rows per chunk when the Newton–Schulz input is built in another dtype, and
# the least bytes of a column block of the in-place Newton–Schulz iterate.
_CHUNK_BYTES = 1 << 20
# The least columns of a block of the in-place iterate.
_MIN_COLUMNS = 256


def zeropower_via_newton_schulz(
    x: Tensor,
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximate orthogonal polar factor ``U V^T`` of ``x`` (*, m, n) by Newton–Schulz.

    ``X = x / max(||x||_F, eps)`` in ``dtype`` (per matrix), transposed when
    ``m > n`` so ``X X^T`` is the small Gram; then ``steps`` times
    ``A = X X^T``, ``B = b A + c A A``, ``X = a X + B X``. The result is in
    ``dtype`` with the shape of ``x``; ``x`` is not modified.
    """
    return _newton_schulz_(x.to(dtype, copy=True), coefficients, steps, eps)


def _newton_schulz_(
    X: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """:func:`zeropower_via_newton_schulz` of a fresh ``X`` that it may overwrite.

    Transients (see [Note: owner step transients]): ``X`` is normalised in place, and each
    iteration frees the Gram ``A`` before ``B X`` is formed. ``X <- a X + B X`` is then computed
    in place a block of columns at a time (:func:`_ns_columns`; column block ``j`` of ``B X``
    reads only column block ``j`` of ``X``), so ``X``, ``A`` and ``B`` (while ``B`` is formed),
    or ``X``, ``B`` and one block are alive: ``|X| + max(2 k², k² + k c)`` elements of
    ``dtype`` (``k = min(m, n)``, ``c`` the block's columns), against ``2 |X| + k²`` for a new
    iterate. Matrices too small or too square to split (``c`` would not leave two blocks) take
    the new iterate, as before. The operations and operands are those of ``torch.optim.Muon``
    (the same ``addmm``, on column blocks); on the CPUs measured (BENCHMARKS §20) the blocked
    product is bit for bit the whole one.
    """
    a, b, c = coefficients
    shape = X.shape
    if X.dim() > 3:
        X = X.flatten(0, -3)  # a view: X is fresh, its leading dims contiguous
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    if X.dim() == 2:
        X.div_(X.norm().clamp(min=eps))
    else:
        X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps))
    columns = _ns_columns(X)
    for _ in range(steps):
        gram = X @ X.mT
        update = batched_addmm(gram, gram, gram, beta=b, alpha=c)
        del gram
        if columns is None or not _same_bits_in_place(X):
            X = batched_addmm(X, update, X, beta=a, alpha=1.0)
        else:
            _iterate_in_place(X, update, a, columns)
        del update
    return (X.mT if tall else X).reshape(shape)


def _ns_columns(X: Tensor) -> int | None:
    """Columns per block of the in-place iterate of ``X`` (*, k, n), ``k <= n``; ``None``: whole.

    A block holds as many bytes as ``B`` (``k`` columns), at least ``_CHUNK_BYTES`` over the
    batch and ``_MIN_COLUMNS`` columns (so each product stays a GEMM as efficient as the whole
    one), rounded up to a multiple of 64. Whole when that leaves fewer than two blocks.
    """
    k, n = X.size(-2), X.size(-1)
    per_column = X.numel() // n * X.element_size()
    columns = max(k, _MIN_COLUMNS, -(-_CHUNK_BYTES // per_column))
    columns = -(-columns // 64) * 64
    return None if 2 * columns > n else columns


def _same_bits_in_place(X: Tensor) -> bool:
    """Whether ``X`` is iterated in place: fp32/fp64 always; bf16/fp16 only with contiguous rows.

    A new iterate is row-major. In bf16, iterating a column-major ``X`` (the transpose of a tall
    matrix) in place keeps it column-major, and CPU bf16 GEMMs round that layout differently
    (measured, BENCHMARKS §20), which would lose ``torch.optim.Muon``'s bits; so a tall bf16
    matrix makes its first iterate anew (peak ``2|X| + k²`` there) and iterates in place after.
    """
    return X.dtype in (torch.float32, torch.float64) or X.stride(-1) == 1


def _iterate_in_place(X: Tensor, update: Tensor, a: float, columns: int) -> None:
    """``X <- a X + update @ X`` in place, ``columns`` columns of ``X`` at a time."""
    for start in range(0, X.size(-1), columns):
        block = X.narrow(-1, start, min(columns, X.size(-1) - start))
        if X.dim() == 2:
            block.addmm_(update, block.clone(), beta=a)
        else:
            block.baddbmm_(update, block.clone(), beta=a)


def _chunk_rows(t: Tensor, limit: int) -> int:
    """Rows per chunk of ``t`` (*, m, n) along dim -2: about ``limit`` bytes of its dtype, a
    multiple of 64 (so elementwise kernels vectorize the chunks as they do the whole matrix)."""
    rows = limit // max(1, t.size(-1) * t.element_size()) // 64 * 64
    return max(64, rows)


def newton_schulz_input(
    grad: Tensor, buf: Tensor, momentum: float, nesterov: bool, dtype: torch.dtype
) -> Tensor:
    """The Newton–Schulz input as a fresh tensor of ``dtype``: ``grad.lerp(buf, mu).to(dtype)``
    with Nesterov (``grad``'s layout), else ``buf.to(dtype)``.

    In ``grad``'s own dtype that is one fresh tensor. In another (bf16 Newton–Schulz of an
    fp32 gradient) it is filled one matrix and a chunk of rows at a time (``_CHUNK_BYTES``, or
    a sixteenth of the matrix if more: at most 16 chunks, i.e. 32 kernels, per matrix), so the
    full-size ``grad``-dtype direction is never materialised.
    """
    if not nesterov:
        return buf.to(dtype, copy=True)
    if dtype == grad.dtype:
        return grad.lerp(buf, momentum)
    out = torch.empty_like(grad, dtype=dtype)
    m = grad.size(-2)
    step = _chunk_rows(grad, max(_CHUNK_BYTES, m * grad.size(-1) * grad.element_size() // 16))
    for index in itertools.product(*(range(s) for s in grad.shape[:-2])):
        g, bf, o = grad[index], buf[index], out[index]
        for start in range(0, m, step):
            rows = min(step, m - start)
            o.narrow(0, start, rows).copy_(
                g.narrow(0, start, rows).lerp(bf.narrow(0, start, rows), momentum))
    return out


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, m: int, n: int) -> float:
    """Shape-adjusted learning rate, as ``torch.optim.Muon``'s ``_adjust_lr``."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


def muon_init_state(param: Tensor, config: MuonConfig) -> dict[str, Tensor]:
    """State: ``momentum_buffer`` zeros with the parameter's shape and dtype."""
    del config
    return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.contiguous_format)}


@torch.no_grad()
def muon_step(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    weight_decay: float,
    step: int,
    initial_lr: float,
    config: MuonConfig,
) -> None:
    """One Muon step on ``param`` (*, m, n), in place (see module docstring)."""
    del step, initial_lr
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - config.momentum)
    dtype = dtype_from_name(config.ns_dtype)
    ortho = _newton_schulz_(
        newton_schulz_input(grad, buf, config.momentum, config.nesterov, dtype),
        config.ns_coefficients, config.ns_steps, config.eps,
    )
    m, n = param.shape[-2], param.shape[-1]
    adjusted_lr = muon_adjusted_lr(lr, config.adjust_lr_fn, m, n)
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-adjusted_lr)  # in place, casting bf16 elements as it reads them
