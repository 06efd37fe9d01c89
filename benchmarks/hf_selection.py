"""What the default selection makes of Hugging Face models: ``python -m benchmarks.hf_selection``.

Builds GPT-2, Llama, Qwen3-MoE, Mixtral and T5 from ``transformers`` config objects (tiny sizes,
or ``--layers``/``--hidden`` for bigger ones; nothing is downloaded), runs the wrapping-time
selection and the planner (no process group needed) and prints a markdown table: the model's
weights of 2+ dims inside blocks (and how many of them are embeddings, which the rule leaves to
the tail), how many the default rule selects (and how many of those are
3-D expert stacks), how many tensors stay in the tail, and what the previous rule (``nn.Linear``
weights only) selected. The tests build their models with ``build`` below.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["MODELS", "build", "lm_loss_fn", "selection_row"]

MODELS = ("gpt2", "llama", "qwen3_moe", "mixtral", "t5")


def _configs(layers: int, hidden: int, vocab: int) -> dict[str, tuple[Any, Any]]:
    import transformers as tf

    heads, inter = 2, hidden * 3 // 2
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=64,
                  intermediate_size=inter, attention_dropout=0.0)
    return {
        "gpt2": (tf.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=hidden, n_layer=layers,
                               n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=0, eos_token_id=0), tf.GPT2LMHeadModel),
        "llama": (tf.LlamaConfig(**common), tf.LlamaForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig(**common, head_dim=hidden // heads,
                                        moe_intermediate_size=hidden // 2, num_experts=4,
                                        num_experts_per_tok=2), tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
                    tf.MixtralForCausalLM),
        "t5": (tf.T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=inter,
                           num_layers=layers, num_heads=heads, dropout_rate=0.0,
                           decoder_start_token_id=0), tf.T5ForConditionalGeneration),
    }


def build(name: str, *, seed: int = 0, layers: int = 2, hidden: int = 16, vocab: int = 50) -> nn.Module:
    """A freshly initialised ``transformers`` model (fp32, CPU, training mode)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config, cls = _configs(layers, hidden, vocab)[name]
    torch.manual_seed(seed)
    model = cls(config)
    return model.train()


def lm_loss_fn(name: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """Next-token cross entropy (mean over the local batch) for ``build(name)``'s model."""
    def causal(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           tokens[:, 1:].reshape(-1))

    def seq2seq(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens, decoder_input_ids=tokens[:, :-1], use_cache=False).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           tokens[:, 1:].reshape(-1))

    return seq2seq if name == "t5" else causal


def selection_row(name: str, model: nn.Module) -> dict[str, Any]:
    """Counts for one model: block weights of 2+ dims, selected (stacks), tail, previous rule."""
    from matrixfsdp.planner import make_plan
    from matrixfsdp.runtime.selection import default_groups, param_specs, select_params

    sites = select_params(model, default_groups(model), None, "cpu")
    plan = make_plan(param_specs(sites), 1)
    selection = plan.selection()
    block_weights = [s for s in sites if s.group and s.param.ndim >= 2]
    embeddings = [s for s in block_weights if isinstance(s.module, nn.Embedding)]
    previous = [s for s in sites
                if s.group and isinstance(s.module, nn.Linear) and s.param.ndim == 2]
    return {
        "model": name,
        "block_weights": len(block_weights),
        "embeddings": len(embeddings),
        "selected": len(selection.matrices) + len(selection.stacks),
        "stacks": len(selection.stacks),
        "tail": len(selection.tail),
        "previous_rule": len(previous),
        "transposed": sum(p.orientation == "in_out" for p in plan.params if p.role != "tail"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=16)
    args = parser.parse_args(argv)
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{args.layers} layers, hidden {args.hidden}\n")
    print("| model | block weights (>= 2-D) | of which embeddings | selected | of which 3-D stacks "
          "| stored (in, out) | tail tensors | previous rule (nn.Linear only) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        row = selection_row(name, build(name, layers=args.layers, hidden=args.hidden))
        print(f"| {name} | {row['block_weights']} | {row['embeddings']} | {row['selected']} | "
              f"{row['stacks']} | "
              f"{row['transposed']} | {row['tail']} | {row['previous_rule']} |")


if __name__ == "__main__":
    main()
