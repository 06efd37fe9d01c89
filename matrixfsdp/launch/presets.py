"""Parameter shapes of well-known models, as planner specs (pure Python: no torch needed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..planner import ParamSpec

__all__ = ["PRESETS", "DecoderShape", "preset_specs"]


@dataclass(frozen=True)
class DecoderShape:
    """A Llama-style decoder: attention (GQA) + SwiGLU MLP per layer, untied embedding/head."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    dtype: str = "bfloat16"

    def specs(self) -> list[ParamSpec]:
        head_dim = self.dim // self.heads
        kv = self.kv_heads * head_dim
        specs = [ParamSpec(fqn="tok_embeddings.weight", shape=(self.vocab, self.dim),
                           dtype=self.dtype, role="tail")]
        for i in range(self.layers):
            group = f"layers.{i}"
            matrices = {
                "attention.wq.weight": (self.dim, self.dim),
                "attention.wk.weight": (kv, self.dim),
                "attention.wv.weight": (kv, self.dim),
                "attention.wo.weight": (self.dim, self.dim),
                "feed_forward.w1.weight": (self.hidden, self.dim),
                "feed_forward.w2.weight": (self.dim, self.hidden),
                "feed_forward.w3.weight": (self.hidden, self.dim),
            }
            for name, shape in matrices.items():
                specs.append(ParamSpec(fqn=f"{group}.{name}", shape=shape, dtype=self.dtype,
                                       role="matrix", group=group))
            for norm in ("attention_norm.weight", "ffn_norm.weight"):
                specs.append(ParamSpec(fqn=f"{group}.{norm}", shape=(self.dim,),
                                       dtype=self.dtype, role="tail", group=group))
        specs.append(ParamSpec(fqn="norm.weight", shape=(self.dim,), dtype=self.dtype,
                               role="tail"))
        specs.append(ParamSpec(fqn="output.weight", shape=(self.vocab, self.dim),
                               dtype=self.dtype, role="tail"))
        return specs


PRESETS: dict[str, DecoderShape] = {
    "llama3-8b": DecoderShape(dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336,
                              vocab=128256),
    "llama3-70b": DecoderShape(dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672,
                               vocab=128256),
    "llama2-7b": DecoderShape(dim=4096, layers=32, heads=32, kv_heads=32, hidden=11008,
                              vocab=32000),
    "gpt-small": DecoderShape(dim=128, layers=4, heads=4, kv_heads=4, hidden=384, vocab=256,
                              dtype="float32"),
}


def preset_specs(name: str) -> list[ParamSpec]:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} or pass "
                         "a Python path 'package.module:factory'")
    return PRESETS[name].specs()


def specs_from_factory(path: str) -> list[ParamSpec]:
    """Build ``module:factory`` on the meta device and select matrices as fully_shard_matrix would."""
    import importlib

    import torch

    from ..runtime.selection import default_groups, param_specs, select_params

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {path!r}: expected a preset or 'package.module:factory'")
    factory: Callable = getattr(importlib.import_module(module_name), attr)
    with torch.device("meta"):
        model = factory()
    sites = select_params(model, default_groups(model), None, "meta")
    return param_specs(sites)
