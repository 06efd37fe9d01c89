"""torchtitan 0.3.0's DeepSeek-V3 MoE classes at toy size, on CPU, and a one-process reference.

Test modules import this after ``pytest.importorskip("torchtitan")``.

- The model is torchtitan's ``DeepSeekV3Model`` built from its own ``build_mla_moe_layers``
  (MLA attention, a dense first layer, then MoE layers: ``TokenChoiceTopKRouter``, shared
  experts, ``RoutedExperts`` = ``GroupedExperts`` stacks ``(E, F, D)`` / ``(E, D, F)`` and the
  ``standard`` ``AllToAllTokenDispatcher``), the debugmodel's choices (8 experts, top-3 softmax
  routing, 2 shared experts, YaRN RoPE, load-balancing bias) at smaller dims and fewer layers.
- Attention: each layer's inner attention becomes torchtitan's ``ScaledDotProductAttention``
  (``titan_models.cpu_attention``; flex attention has no CPU backward).
- [Note: fp32 experts] torchtitan 0.3.0's ``GroupedExperts.forward`` casts the tokens and the
  expert weights to bf16 before ``torch._grouped_mm`` (it has no fp32 option; the grouped mm
  itself runs on CPU, fp32 included). bf16 rounding of values that differ by fp32
  reduction-order noise makes an fp32-tight comparison meaningless, so ``fp32_experts`` runs
  torchtitan's own forward with those ``.bfloat16()`` calls made identities (a
  ``TorchFunctionMode`` active only inside the experts' forward); the dispatcher, router,
  grouped mm and everything else run as torchtitan wrote them. ``fp32_experts=False`` keeps
  torchtitan's bf16 experts.
- The load-balancing bias (``expert_bias_E``) is a buffer torchtitan updates in an optimizer
  step pre-hook (``register_moe_load_balancing_hook``: token counts summed over the ``loss``
  mesh, a sign step). Both sides register torchtitan's own hook: the distributed container with
  its ``ParallelDims``, the reference with a one-process stand-in (no mesh), so the bias and
  hence the routing follow the same trajectory on both (the counts are integers, the update is
  a sign: exact). DeepSeek-V3 in torchtitan has no auxiliary loss.
"""

from __future__ import annotations

import re
import types

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.deepseek_v3 import (
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    _NORM_INIT,
    _depth_experts_init,
    _depth_init,
    _output_linear_init,
    build_mla_moe_layers,
)
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

from matrixfsdp.optim import get_matrix_optimizer

from .dist_utils import test_device
from .titan_models import LR, MUON, TAIL, TAIL_LR, WD, cpu_attention

__all__ = [
    "EXPERT_NAMES",
    "MATRIX_NAMES",
    "MoEReference",
    "build_moe",
    "fp32_experts",
    "tiny_moe_config",
]

# Every 2-D weight inside the blocks (MLA projections, dense FFN, shared experts, router gate)
# and the routed-expert stacks.
EXPERT_NAMES = re.compile(r"layers\.\d+\.moe\.routed_experts\.inner_experts\.w[123]_E(FD|DF)")
MATRIX_NAMES = re.compile(
    r"layers\.\d+\.(attention\.(wq|wkv_a|wkv_b|wo)\.weight|feed_forward\.w[123]\.weight|"
    r"moe\.(shared_experts\.w[123]|router\.gate)\.weight|"
    r"moe\.routed_experts\.inner_experts\.w[123]_E(FD|DF))")


def tiny_moe_config(*, n_layers: int = 3, dim: int = 64, num_experts: int = 8,
                    vocab: int = 256) -> DeepSeekV3Model.Config:
    """DeepSeek-V3's debugmodel (torchtitan's classes and choices) at toy size."""
    rope = ComplexRoPE.Config(dim=8, max_seq_len=256, theta=10000.0, scaling="yarn",
                              rope_factor=40.0, beta_fast=32.0, beta_slow=1.0,
                              original_seq_len=64)
    layers = build_mla_moe_layers(
        n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.7,
        dense_hidden_dim=2 * dim, moe_hidden_dim=dim // 2, num_experts=num_experts,
        num_shared_experts=2, router_top_k=3, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        linear_init=_LINEAR_INIT, norm_init=_NORM_INIT, depth_init=_depth_init,
        depth_experts_init=_depth_experts_init, rope=rope)
    return DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_output_linear_init(dim)),
        layers=layers, mtp_layers=[])


class _NoBf16Casts(TorchFunctionMode):
    """``Tensor.bfloat16()`` is the identity (see [Note: fp32 experts])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0]
        return func(*args, **(kwargs or {}))


class Fp32GroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` forward, in the parameters' dtype."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
                ) -> torch.Tensor:
        with _NoBf16Casts():
            return super().forward(x_RD, num_tokens_per_expert_E)


def fp32_experts(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if type(module) is GroupedExperts:
            module.__class__ = Fp32GroupedExperts
    return model


def build_moe(config: DeepSeekV3Model.Config, seed: int = 0, *, fp32: bool = True
              ) -> nn.Module:
    """The model, initialized by torchtitan's ``init_states`` from ``seed``, CPU-trainable."""
    torch.manual_seed(seed)
    with torch.device(test_device()):
        model = config.build()
        model.init_states(buffer_device=test_device())
    cpu_attention(model)
    return fp32_experts(model) if fp32 else model


class MoEReference:
    """One process: torchtitan's load-balancing pre-hook, then functional Muon on each matrix
    (each expert of a stack its own matrix) and torch AdamW on every other parameter."""

    def __init__(self, model: nn.Module, matrices: set[str]) -> None:
        self.model = model
        self.spec = get_matrix_optimizer("muon")
        self.config = self.spec.make_config(MUON)
        named = dict(model.named_parameters())
        self.matrices = {f: named[f] for f in sorted(matrices)}
        self.states = {(f, i): self.spec.init_state_fn(w, self.config)
                       for f, p in self.matrices.items() for i, w in enumerate(_slices(p))}
        self.tail = torch.optim.AdamW([p for f, p in named.items() if f not in matrices],
                                      lr=TAIL_LR, weight_decay=WD, **TAIL)
        self.hooks: list = []
        one_process = types.SimpleNamespace(get_optional_mesh=lambda name: None,
                                            ep_enabled=False, tp=1)
        register_moe_load_balancing_hook(self, [model], one_process)
        self.steps = 0

    def register_step_pre_hook(self, hook) -> None:
        self.hooks.append(hook)

    @torch.no_grad()
    def step(self) -> None:
        for hook in self.hooks:
            hook(self, (), {})
        self.steps += 1
        for fqn, p in self.matrices.items():
            for i, (w, g) in enumerate(zip(_slices(p), _slices(p.grad), strict=True)):
                w = w.clone()
                self.spec.step_fn(w, g, self.states[fqn, i], lr=LR, weight_decay=WD,
                                  step=self.steps, initial_lr=LR, config=self.config)
                (p if p.dim() == 2 else p[i]).copy_(w)
        self.tail.step()
        self.model.zero_grad()


def _slices(t: torch.Tensor) -> list[torch.Tensor]:
    t = t.detach()
    return [t] if t.dim() == 2 else list(t.unbind(0))
