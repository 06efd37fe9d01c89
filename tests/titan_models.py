"""torchtitan 0.3.0's own model classes, built on CPU, and a one-process Muon reference.

Test modules import this after ``pytest.importorskip("torchtitan")``. torchtitan's language
models default to flex attention (no CPU backward) or varlen (no CPU kernel); ``cpu_attention``
swaps each layer's inner attention for torchtitan's own ``ScaledDotProductAttention`` (causal,
the same forward as the block-causal mask on one unpacked document per row).
"""

from __future__ import annotations

import re
import types
from functools import partial

import torch
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims as parallel_dims_module
import torchtitan.distributed.utils as titan_dist_utils
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.config import ParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import FusedQKVLinear, ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock, model_registry

from matrixfsdp.optim import get_matrix_optimizer

from .dist_utils import test_device

__all__ = [
    "LR",
    "MATRIX_NAMES",
    "MUON",
    "TAIL",
    "TAIL_LR",
    "WD",
    "MuonReference",
    "batch",
    "build_llama3",
    "cpu_attention",
    "cpu_parallel_dims",
    "expected_matrices",
    "shard",
    "sharded_config",
    "tiny_llama3_config",
    "token_loss",
]

MUON = {"ns_dtype": "float32"}  # fp32 Newton–Schulz: bf16 would amplify reduction-order noise
LR, TAIL_LR, WD = 0.02, 1e-3, 0.1
TAIL = {"eps": 1e-8}
# Every 2-D weight inside torchtitan's Llama3 blocks.
MATRIX_NAMES = re.compile(r"layers\.\d+\.(attention\.(qkv_linear\.wqkv|wo)|feed_forward\.w[123])"
                          r"\.weight")


def cpu_attention(model: nn.Module) -> nn.Module:
    """Each block's inner attention becomes torchtitan's ``ScaledDotProductAttention``, with the
    old one's sharding declaration (TP's local map over the heads)."""
    for block in model.layers.values():
        old = block.attention.inner_attention
        block.attention.inner_attention = ScaledDotProductAttention.Config(
            sharding_config=old._sharding_config).build()
    return model


def tiny_llama3_config(*, n_layers: int = 2, dim: int = 64, n_heads: int = 4,
                       n_kv_heads: int = 2, vocab: int = 256) -> Llama3Model.Config:
    """Llama3's classes at toy size, with GQA (two KV groups) so ``wqkv`` interleaves groups."""
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}
    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=256, theta=500000, scaling="llama")
    layer = Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        attention=make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  wqkv_param_init=init, wo_param_init=init,
                                  inner_attention=ScaledDotProductAttention.Config(),
                                  fuse_qkv=True, rope=rope),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=2 * dim, w1_param_init=init,
                                     w2w3_param_init=init),
    )
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=init),
        layers=[layer] * n_layers,
    )


def cpu_parallel_dims(world: int, *, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1,
                      ep: int = 1) -> tuple[ParallelismConfig, ParallelDims]:
    """torchtitan's ParallelismConfig and built ParallelDims (``partial_dtensor``) on CPU ranks.

    torchtitan builds its meshes on ``torchtitan.tools.utils.device_type``, which falls back to
    ``"cuda"`` without an accelerator; a CPU rank points it at ``"cpu"`` (gloo). The SPMD
    backend is set process-wide, as torchtitan's trainer does before building the model (the
    MoE token dispatcher reads it).
    """
    parallel_dims_module.device_type = "cpu"
    titan_dist_utils.set_spmd_backend("partial_dtensor")
    config = ParallelismConfig(data_parallel_replicate_degree=dp_replicate,
                               data_parallel_shard_degree=dp_shard, tensor_parallel_degree=tp,
                               expert_parallel_degree=ep, spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(config, world)
    dims.build_mesh()
    return config, dims


def sharded_config(config: Llama3Model.Config, parallelism: ParallelismConfig
                   ) -> Llama3Model.Config:
    """``config`` with torchtitan's sharding declarations for ``parallelism`` (what the trainer's
    ``update_from_config`` does before building)."""
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config


def build_llama3(flavor: str = "debugmodel", seed: int = 0,
                 config: Llama3Model.Config | None = None) -> nn.Module:
    """torchtitan's Llama3 (its registry's ``flavor``, or ``config``), initialized by its own
    ``init_states`` from ``seed``, with CPU-trainable attention, on the test device."""
    config = model_registry(flavor).model if config is None else config
    torch.manual_seed(seed)
    with torch.device(test_device()):
        model = config.build()
        model.init_states(buffer_device=test_device())
    return cpu_attention(model)


def expected_matrices(model: nn.Module) -> set[str]:
    return {fqn for fqn, _ in model.named_parameters() if MATRIX_NAMES.fullmatch(fqn)}


def batch(step: int, vocab: int, rows: int = 4, seq: int = 17) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, vocab, (rows, seq), generator=g).to(test_device())


def shard(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tokens.shape[0] // world
    return tokens[rank * per:(rank + 1) * per]


def token_loss(model: nn.Module, tokens: torch.Tensor, global_tokens: int | None = None
               ) -> torch.Tensor:
    """Next-token cross entropy: the mean over ``tokens``, or (torchtitan's rescaling) the sum
    over them divided by ``global_tokens``, the token count of the whole data-parallel batch."""
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):  # TP's lm_head: vocab-sharded
        logits = logits.full_tensor()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           tokens[:, 1:].reshape(-1), reduction="sum")
    return loss / (tokens[:, 1:].numel() if global_tokens is None else global_tokens)


class MuonReference:
    """One process: functional Muon on each named matrix, torch AdamW on every other parameter."""

    def __init__(self, model: nn.Module, matrices: set[str], qkv: bool = False) -> None:
        """``qkv``: each fused ``wqkv`` steps as the ``wq``/``wk``/``wv`` that torchtitan's
        ``FusedQKVLinear`` state-dict hook splits it into (and merges back with its load hook)."""
        self.model = model
        self.fused = {f"{name}.wqkv.weight": m for name, m in model.named_modules()
                      if isinstance(m, FusedQKVLinear)} if qkv else {}
        self.spec = get_matrix_optimizer("muon")
        self.config = self.spec.make_config(MUON)
        named = dict(model.named_parameters())
        self.matrices = {f: named[f] for f in sorted(matrices)}
        self.states = {(f, i): self.spec.init_state_fn(block, self.config)
                       for f, p in self.matrices.items()
                       for i, block in enumerate(self._blocks(f, p.detach()))}
        self.tail = torch.optim.AdamW([p for f, p in named.items() if f not in matrices],
                                      lr=TAIL_LR, weight_decay=WD, **TAIL)
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for fqn, p in self.matrices.items():
            ws, gs = self._blocks(fqn, p.detach()), self._blocks(fqn, p.grad)
            for i, (w, g) in enumerate(zip(ws, gs, strict=True)):
                self.spec.step_fn(w, g, self.states[fqn, i], lr=LR, weight_decay=WD,
                                  step=self.steps, initial_lr=LR, config=self.config)
            p.copy_(self._merge(fqn, ws))
        self.tail.step()
        self.model.zero_grad()

    def _blocks(self, fqn: str, t: torch.Tensor) -> list[torch.Tensor]:
        """The matrices ``t`` steps as, fresh tensors: itself, or torchtitan's wq/wk/wv."""
        module = self.fused.get(fqn)
        if module is None:
            return [t.detach().clone()]
        sd = {"wqkv.weight": t.detach().clone()}
        FusedQKVLinear._split_qkv_on_save(module, sd, "", None)
        return [sd[f"{name}.weight"].clone() for name in ("wq", "wk", "wv")]

    def _merge(self, fqn: str, blocks: list[torch.Tensor]) -> torch.Tensor:
        module = self.fused.get(fqn)
        if module is None:
            return blocks[0]
        sd = {f"{name}.weight": b for name, b in zip(("wq", "wk", "wv"), blocks, strict=True)}
        FusedQKVLinear._merge_qkv_on_load(module, sd, "")
        return sd["wqkv.weight"]
