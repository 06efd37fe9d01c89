"""A Hugging Face MoE no one here wrote (Qwen3-MoE) trained under expert parallelism.

Its fused expert stacks (``gate_up_proj``, ``down_proj``) are distributed ``Shard(0)`` over
``ep`` and an all-to-all dispatch is put around the model's own experts
(``tests/ep_models.hf_expert_parallel``); wrapped with the default groups at world 4 as
efsdp 2 x ep 2, its gradients, global norm and 3 Muon steps equal one process on the same batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import matrixfsdp as mf

from .checks import FREE_RUNNING_KWARGS, assert_close_dicts, full_values, reference_values
from .dist_utils import run_world
from .ep_models import hf_expert_parallel
from .models import global_batch, local_batch
from .test_ep import ep_meshes
from .test_optim_dist import ReferenceStepper

transformers = pytest.importorskip("transformers")

VOCAB = 23


def _qwen3_moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=12,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=32,
        norm_topk_prob=True, tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(rank: int, world: int) -> None:
    dense, experts, ep = ep_meshes("efsdp2_ep2")
    ref = _qwen3_moe()
    model = hf_expert_parallel(copy.deepcopy(ref), ep)
    mf.fully_shard_matrix(model, dense, expert_mesh=experts)
    plan = mf.get_plan(model)
    stacks = {p.fqn for p in plan.matrices if p.mesh == "expert"}
    assert stacks == {f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                      for w in ("gate_up_proj", "down_proj")}, stacks
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, weight_decay=0.1, tail_lr=1e-2,
                             tail_weight_decay=0.1, **FREE_RUNNING_KWARGS["muon"])
    stepper = ReferenceStepper(ref, {p.fqn for p in plan.matrices}, "muon", 0.02,
                               FREE_RUNNING_KWARGS["muon"])
    for step in range(3):
        tokens = global_batch(step)
        (sum(_loss(ref, local_batch(tokens, r, world)) for r in range(world)) / world).backward()
        _loss(model, local_batch(tokens, rank, world)).backward()
        # Step 0: the same parameters; later steps after fp32 updates of both (1.1e-6 measured).
        assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"),
                           1e-6 if step == 0 else 1e-5, f"step {step} grad")
        want = sum(p.grad.double().pow(2).sum().item() for p in ref.parameters()
                   if p.grad is not None) ** 0.5
        got = mf.global_grad_norm(model).item()
        assert abs(got - want) <= 1e-5 * want, f"global norm {got} != {want}"
        opt.step()
        stepper.step()
        opt.zero_grad()
        stepper.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, "3 Muon steps")


def test_hf_qwen3_moe_under_ep() -> None:
    run_world(4, _train)
