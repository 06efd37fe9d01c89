"""Recommended hyperparameters of every built-in matrix optimizer (one table, one truth).

[Note: recommended hyperparameters]
Each built-in optimizer's learning rate, weight decay and key hyperparameters default to the
values of its reference implementation or paper, checked on ``matrixfsdp train``'s default task
(the embedded byte-level GPT, 400 steps, 2 ranks) by a learning-rate sweep x{1/3, 1, 3}; where
the reference value trains badly on that task the table holds the sweep's best and says why
(``note``). The sweep and its command are in BENCHMARKS.md ("Per-optimizer defaults").

- ``lr``, ``weight_decay``: the matrices' learning rate and decoupled weight decay, as
  ``MatrixOptimizer(lr=..., weight_decay=...)`` takes them.
- ``optimizer_kwargs``: the optimizer's config fields (``MuonConfig``, ``OKLSConfig``, ...).
- ``tail_lr``, ``tail_weight_decay``: AdamW on the FSDP2 tail (embeddings, norms, head).
  ``None`` means "the same as ``lr`` / ``weight_decay``": the ``adamw`` baseline runs one AdamW
  over every parameter. Otherwise the tail keeps the AdamW baseline's learning rate, as Keller
  Jordan's Muon README and Distributed Shampoo's README advise (keep the AdamW you had for the
  parameters the matrix optimizer does not handle / graft from it).

``matrixfsdp train`` fills every field the user did not set from this table and records which
ones in ``TrainConfig.defaults_applied``; ``MatrixOptimizer`` itself keeps explicit keyword
defaults, so library callers pass ``**recommended_hyperparameters(name).matrix_optimizer_kwargs()``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["RecommendedHyperparameters", "recommended_hyperparameters", "recommended_optimizer_names"]


class RecommendedHyperparameters(NamedTuple):
    lr: float
    weight_decay: float
    optimizer_kwargs: Mapping[str, Any]
    tail_lr: float | None  # None: same as lr
    tail_weight_decay: float | None  # None: same as weight_decay
    source: str
    note: str = ""

    def resolved_tail(self, lr: float, weight_decay: float) -> tuple[float, float]:
        """``(tail_lr, tail_weight_decay)`` given the matrices' (possibly user-set) values."""
        return (lr if self.tail_lr is None else self.tail_lr,
                weight_decay if self.tail_weight_decay is None else self.tail_weight_decay)

    def matrix_optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``MatrixOptimizer(model, optimizer=name, **kwargs)``."""
        tail_lr, tail_wd = self.resolved_tail(self.lr, self.weight_decay)
        return {"lr": self.lr, "weight_decay": self.weight_decay, "tail_lr": tail_lr,
                "tail_weight_decay": tail_wd, **self.optimizer_kwargs}


_TAIL_LR = 3e-3  # the AdamW baseline's lr (see adamw below); tail sweep for Muon in BENCHMARKS


def _frozen(**kwargs: Any) -> Mapping[str, Any]:
    return types.MappingProxyType(kwargs)


_RECOMMENDED: dict[str, RecommendedHyperparameters] = {
    "muon": RecommendedHyperparameters(
        lr=0.02, weight_decay=0.01,
        optimizer_kwargs=_frozen(momentum=0.95, nesterov=True, ns_steps=5),
        tail_lr=_TAIL_LR, tail_weight_decay=0.0,
        source="Keller Jordan's Muon (KellerJordan/Muon README: lr 0.02, weight_decay 0.01, "
               "momentum 0.95, Nesterov, 5 Newton-Schulz steps)",
    ),
    "okls": RecommendedHyperparameters(
        lr=0.09434, weight_decay=0.0303,
        optimizer_kwargs=_frozen(beta1=0.9684, beta2=0.9482, eps=1e-9),
        tail_lr=_TAIL_LR, tail_weight_decay=0.0,
        source="the Online KL Shampoo release (tilde-research/online-kl-shampoo-release, "
               "OnlineKLShampoo defaults: lr 0.09434, weight_decay 0.0303 (AdamC), beta1 0.9684, "
               "beta2 0.9482, eps 1e-9)",
    ),
    "soap": RecommendedHyperparameters(
        lr=3e-3, weight_decay=0.01,
        optimizer_kwargs=_frozen(betas=(0.95, 0.95), eps=1e-8, precondition_frequency=10),
        tail_lr=_TAIL_LR, tail_weight_decay=0.0,
        source="the SOAP authors' implementation (nikhilvyas/SOAP README: lr 3e-3, betas "
               "(0.95, 0.95), weight_decay 0.01, precondition_frequency 10)",
    ),
    "shampoo": RecommendedHyperparameters(
        lr=3e-3, weight_decay=1e-5,
        optimizer_kwargs=_frozen(betas=(0.9, 0.999), grafting="adam", grafting_eps=1e-8,
                                 precondition_frequency=1),
        tail_lr=_TAIL_LR, tail_weight_decay=0.0,
        source="Distributed Shampoo's README, AdamW example with Adam grafting "
               "(facebookresearch/optimizers: lr 1e-3, betas (0.9, 0.999), epsilon 1e-12, "
               "weight_decay 1e-5 decoupled, precondition_frequency 100, grafting beta2 0.999 and "
               "epsilon 1e-8; bias correction on, its default and ours)",
        note="lr 3e-3, not the example's 1e-3: the README grafts from the AdamW it replaces and "
             "AdamW's best lr on the default task is 3e-3 (sweep: 1.581 at 3e-3 vs 1.680 at 1e-3); "
             "precondition_frequency 1, not the example's 100: with 100 (start_preconditioning_step "
             "-1 = 100, so grafted Adam alone for the first 100 of the 400 steps) the default task "
             "ends at 1.667, with 10 at 1.598, with 1 at 1.581; eps_mode 'relative' with eps 1e-6 "
             "(of each factor's largest eigenvalue), not the example's absolute 1e-12 "
             "(eps_mode='absolute', eps=1e-12: 1.593): a relative eps keeps the fp32 eigensolves "
             "of rank-deficient factors stable and the roots scale-invariant",
    ),
    "emagram": RecommendedHyperparameters(
        lr=0.06, weight_decay=0.01,
        optimizer_kwargs=_frozen(betas=(0.95, 0.95), eps=1e-6, precondition_frequency=1),
        tail_lr=_TAIL_LR, tail_weight_decay=0.0,
        source="the Marin EMA-Gram quarter-power writeup (EMA Grams, eigendecomposition, a small "
               "eigenvalue regularizer, -1/4 powers every step); it publishes no learning rate",
        note="weight decay as Muon's; lr 0.06 = 3x Muon's 0.02, the best of the sweep (0.02, "
             "0.06, 0.18 -> 1.763, 1.600, 1.732): with one gradient the EMA-Gram direction is "
             "Muon's U V^T, but the EMAs of noisy gradients give it singular values below 1",
    ),
    "adamw": RecommendedHyperparameters(
        lr=3e-3, weight_decay=0.01,
        optimizer_kwargs=_frozen(betas=(0.9, 0.999), eps=1e-8),
        tail_lr=None, tail_weight_decay=None,
        source="torch.optim.AdamW defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, "
               "weight_decay 0.01), one AdamW over every parameter",
        note="lr 3e-3, not torch's generic 1e-3: the sweep's best on the default task (1e-3, 3e-3, "
             "9e-3 -> 1.830, 1.766, 2.272); a 400-step run of a small model wants the larger step",
    ),
}


def recommended_optimizer_names() -> list[str]:
    """The optimizers that have recommended hyperparameters (every built-in one)."""
    return sorted(_RECOMMENDED)


def recommended_hyperparameters(name: str) -> RecommendedHyperparameters:
    """The recommended hyperparameters of built-in optimizer ``name``.

    See [Note: recommended hyperparameters]. Raises ``ValueError`` listing the valid names.
    """
    if name not in _RECOMMENDED:
        raise ValueError(f"no recommended hyperparameters for optimizer {name!r}; "
                         f"choose one of {', '.join(recommended_optimizer_names())}")
    return _RECOMMENDED[name]
