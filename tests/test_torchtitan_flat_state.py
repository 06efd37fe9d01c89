"""``MatrixOptimizersContainer.load_state_dict`` of a flat dict that does not fit (see [Note:
flat optimizer state of the torchtitan container]), at world 2: saved with another ``qkv_split``,
without a parameter's state, or different on one rank only, it raises one ``ValueError`` on every
rank, naming the FQN, what was saved against what is expected and the fix (it was a bare
``KeyError``, and a rank whose dict was complete entered the load's collectives alone).
"""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from .dist_utils import run_subtests, run_world

pytest.importorskip("torchtitan")
from torchtitan.config import CompileConfig, TrainingConfig

from matrixfsdp.integrations.torchtitan import parallelize_fn

from .test_torchtitan_integration import container_config
from .titan_models import (
    batch,
    build_llama3,
    cpu_parallel_dims,
    shard,
    tiny_llama3_config,
    token_loss,
)

VOCAB = 256
WQKV = "layers.0.attention.qkv_linear.wqkv.weight"


def _container(rank: int, world: int, qkv_split: str = "none"):
    parallelism, dims = cpu_parallel_dims(world)
    model = build_llama3(config=tiny_llama3_config(), seed=0)
    parallelize_fn(model, parallel_dims=dims, parallelism=parallelism,
                   training=TrainingConfig(mixed_precision_param="float32"),
                   compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    optimizers = container_config(qkv_split=qkv_split).build(model_parts=[model])
    tokens = batch(0, VOCAB)
    token_loss(model, shard(tokens, rank, world), tokens[:, 1:].numel()).backward()
    optimizers.step()
    optimizers.zero_grad()
    return optimizers


def _other_split(rank: int, world: int) -> None:
    saved = _container(rank, world, qkv_split="qkv").state_dict()
    target = _container(rank, world)
    with pytest.raises(ValueError, match=rf"another split=.*'{WQKV}': checkpoint row layout of 3 "
                       r"blocks.*now whole \(no split\).*qkv_split="):
        target.load_state_dict(saved)
    whole = target.state_dict()  # and the other way round: per-block state is not expected
    with pytest.raises(ValueError, match=rf"'{WQKV}': checkpoint whole \(no split\), now row "
                       "layout of 3 blocks"):
        _container(rank, world, qkv_split="qkv").load_state_dict(whole)


def _missing_state(rank: int, world: int) -> None:
    target = _container(rank, world)
    flat = dict(target.state_dict())
    del flat[f"state.{WQKV}.momentum_buffer"]
    with pytest.raises(ValueError, match=rf"no state \['momentum_buffer'\] of '{WQKV}': it saved "
                       r"\['step'\], this optimizer expects \{'momentum_buffer': \[\d+, \d+\], "
                       r"'step': \[\]\}.*model parts"):
        target.load_state_dict(flat)


def _one_rank_differs(rank: int, world: int) -> None:
    """Only rank 1's dict lacks a key: rank 0 raises the same error instead of hanging."""
    target = _container(rank, world)
    flat = dict(target.state_dict())
    if rank == 1:
        del flat["param_groups.tok_embeddings.weight.lr"]
    with pytest.raises(ValueError, match=r"no param_groups\.tok_embeddings\.weight\.lr"):
        target.load_state_dict(flat)
    dist.barrier()


def _world(rank: int, world: int) -> None:
    at = functools.partial
    run_subtests(rank, {
        "other_split": at(_other_split, rank, world),
        "missing_state": at(_missing_state, rank, world),
        "one_rank_differs": at(_one_rank_differs, rank, world),
    })


def test_flat_state_errors_world2() -> None:
    run_world(2, _world, timeout=300.0)
