"""Element-wise AdamW as a matrix step function (for ``optimizer="adamw"`` baselines).

Follows ``torch.optim.AdamW``'s default (non-amsgrad) update: decoupled decay ``W ← W(1 − lr·wd)``,
bias-corrected moments, ``W ← W − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AdamWConfig", "adamw_init_state", "adamw_step"]


@dataclass(frozen=True)
class AdamWConfig:
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"AdamWConfig.betas[{i}] must be in [0, 1), got {beta}")
        if self.eps < 0:
            raise ValueError(f"AdamWConfig.eps must be >= 0, got {self.eps}")


def adamw_init_state(param: Tensor, config: AdamWConfig) -> dict[str, Tensor]:
    return {
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


@torch.no_grad()
def adamw_step(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    weight_decay: float,
    step: int,
    initial_lr: float,
    config: AdamWConfig,
) -> None:
    beta1, beta2 = config.betas
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(config.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
