"""torchtitan ``--module`` configs that train with matrixfsdp, and the trainer they build.

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module matrixfsdp.integrations.torchtitan_configs --config llama3_debugmodel

``llama3_debugmodel`` is torchtitan 0.3.0's own ``llama3_debugmodel`` config with three changes:
the model spec's ``parallelize_fn`` is ``matrixfsdp.integrations.torchtitan.parallelize_fn``,
the optimizer is ``MatrixOptimizersContainer`` (Muon on the blocks' matrices, AdamW with
torchtitan's settings on the rest), and the TP backend is ``partial_dtensor`` (see [Note:
torchtitan integration]); CUDA graphs are off (matrixfsdp's hooks are not graph-capturable).

``MatrixTrainer`` is torchtitan's ``Trainer`` with one substitution: inside ``train_step`` the
gradient clipping it calls (``torchtitan.distributed.utils.clip_grad_norm_``) is
``matrixfsdp.clip_grad_norm_`` on the model part (torchtitan's sums norms of same-layout
tensors; a matrix's gradient is a whole tensor on its owner and empty elsewhere). The swap is
scoped to the call and undone after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torchtitan.distributed.utils as titan_dist_utils
from torch import nn
from torchtitan.models.llama3 import config_registry as llama3_registry
from torchtitan.trainer import Trainer

from ..api import clip_grad_norm_
from .torchtitan import MatrixOptimizersContainer, parallelize_fn

__all__ = ["MatrixTrainer", "llama3_debugmodel", "matrix_clip_grad_norm", "with_matrixfsdp"]


def matrix_clip_grad_norm(model_parts: list[nn.Module]) -> Callable[..., torch.Tensor]:
    """A stand-in for torchtitan's ``clip_grad_norm_`` (same signature) over wrapped parts."""

    def clip(parameters: Any, max_norm: float, norm_type: float = 2.0,
             error_if_nonfinite: bool = False, foreach: bool | None = None,
             pp_mesh: Any = None, ep_enabled: bool = False) -> torch.Tensor:
        del parameters, foreach, ep_enabled  # the parts' own parameters; EP: the runtime's
        if pp_mesh is not None or len(model_parts) != 1:
            raise NotImplementedError(
                f"gradient clipping over {len(model_parts)} pipeline model parts is not "
                "supported by matrixfsdp's torchtitan trainer; set "
                "parallelism.pipeline_parallel_degree=1")
        return clip_grad_norm_(model_parts[0], max_norm, norm_type, error_if_nonfinite)

    return clip


@contextlib.contextmanager
def _matrix_clipping(model_parts: list[nn.Module]) -> Iterator[None]:
    original = titan_dist_utils.clip_grad_norm_
    titan_dist_utils.clip_grad_norm_ = matrix_clip_grad_norm(model_parts)
    try:
        yield
    finally:
        titan_dist_utils.clip_grad_norm_ = original


class MatrixTrainer(Trainer):
    """torchtitan's ``Trainer`` clipping gradients with ``matrixfsdp.clip_grad_norm_``."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def train_step(self, data_iterator: Any) -> Any:
        with _matrix_clipping(self.model_parts):
            return super().train_step(data_iterator)


def with_matrixfsdp(config: Trainer.Config,
                    optimizer: MatrixOptimizersContainer.Config | None = None
                    ) -> MatrixTrainer.Config:
    """Any torchtitan trainer config, trained through matrixfsdp (see the module docstring)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    out = MatrixTrainer.Config(**fields)
    out.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=parallelize_fn)
    out.optimizer = optimizer if optimizer is not None else MatrixOptimizersContainer.Config()
    out.parallelism.spmd_backend = "partial_dtensor"
    out.training.disable_cuda_graphs = True
    return out


def llama3_debugmodel() -> MatrixTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` with Muon (lr 0.02, weight decay 0.1) on the blocks'
    matrices and its own AdamW (lr 8e-4, betas (0.9, 0.95), weight decay 0.1) on the rest."""
    return with_matrixfsdp(llama3_registry.llama3_debugmodel(),
                           MatrixOptimizersContainer.Config(lr=0.02, weight_decay=0.1,
                                                            tail_lr=8e-4, tail_weight_decay=0.1))
