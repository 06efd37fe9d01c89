"""torchtitan's MoE at ep 2: forward+backward through matrixfsdp's ``parallelize_fn`` against
torchtitan's own ``parallelize_deepseekv3`` (FSDP2-EP), on CPU (gloo).

``python -m benchmarks.titan_moe_step --worlds 2 4 --reps 15`` (``--help``).

[Note: torchtitan MoE benchmark]
- Model: torchtitan 0.3.0's DeepSeek-V3 classes at toy size (``tests/titan_moe.py``:
  ``tiny_moe_config(dim=..., n_layers=...)``, 8 routed experts, top-3, the ``standard``
  ``AllToAllTokenDispatcher``), torchtitan's experts as written (bf16 grouped mm), its inner
  attention swapped for ``ScaledDotProductAttention`` (CPU), fp32 parameters.
- Both wrap a model built from one seed with torchtitan's EP sharding declarations, on the same
  ``ParallelDims`` (ep 2; efsdp = world / 2): (a) ``matrixfsdp.integrations.torchtitan.
  parallelize_fn`` with the defaults (expert stacks owned whole over efsdp); (b) torchtitan's
  ``parallelize_deepseekv3`` (FSDP2 over fsdp, the experts FSDP2-sharded over efsdp), with
  ``set_force_sum_reduction_for_comms(True)`` on its FSDP modules (gloo has no PREMUL_SUM; the
  divide factor is 1.0 on both).
- Timing: per repetition both in alternating order, the trainer's loss (local token sum over
  the global count) forward+backward between barriers, the slowest rank; medians over
  repetitions after ``--warmup``. Gradients are cleared outside the timed region.
- Agreement: the two losses of the first repetition (same parameters, same batch).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from .launch import run_world

__all__ = ["main", "measure"]

logger = logging.getLogger(__name__)


def _models(world: int, dim: int, layers: int) -> tuple[dict[str, torch.nn.Module], Any]:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3

    from matrixfsdp.integrations.torchtitan import parallelize_fn
    from tests.titan_models import cpu_parallel_dims, sharded_config
    from tests.titan_moe import build_moe, tiny_moe_config

    parallelism, dims = cpu_parallel_dims(world, ep=2)
    kwargs = dict(parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                  parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                  dump_folder="/tmp")
    models = {}
    for name, fn in (("matrixfsdp", parallelize_fn), ("fsdp2", parallelize_deepseekv3)):
        model = build_moe(sharded_config(tiny_moe_config(dim=dim, n_layers=layers), parallelism),
                          fp32=False)
        models[name] = fn(model, **kwargs)
    for module in models["fsdp2"].modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return models, dims


def _rank(rank: int, world: int, reps: int, warmup: int, dim: int, layers: int,
          rows: int, seq: int) -> dict[str, Any]:
    from tests.titan_models import batch, shard, token_loss

    models, dims = _models(world, dim, layers)
    data_rank = dims.get_mesh("batch").get_local_rank()
    times: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, float] = {}
    for rep in range(warmup + reps):
        tokens = batch(rep, 256, rows=rows, seq=seq)
        local = shard(tokens, data_rank, world)
        order = list(models) if rep % 2 == 0 else list(reversed(models))
        for name in order:
            model = models[name]
            dist.barrier()
            start = time.perf_counter()
            loss = token_loss(model, local, tokens[:, 1:].numel())
            loss.backward()
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep == 0:
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses[name] = total.item()
            if rep >= warmup:
                times[name].append(elapsed.item())
            model.zero_grad(set_to_none=True)
    return {"median_s": {n: statistics.median(t) for n, t in times.items()},
            "times_s": times, "loss": losses}


def measure(world: int, reps: int = 15, warmup: int = 2, dim: int = 128, layers: int = 3,
            rows: int = 8, seq: int = 65) -> dict[str, Any]:
    """Both paths' forward+backward medians at ``world`` (ep 2), from rank 0's view."""
    out = run_world(world, _rank, reps, warmup, dim, layers, rows, seq)[0]
    med = out["median_s"]
    out["ratio"] = med["matrixfsdp"] / med["fsdp2"]
    loss = out["loss"]
    out["loss_rel_diff"] = abs(loss["matrixfsdp"] - loss["fsdp2"]) / abs(loss["fsdp2"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="global batch rows")
    parser.add_argument("--seq", type=int, default=65, help="tokens per row (+1 for targets)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for world in args.worlds:
        out = measure(world, args.reps, args.warmup, args.dim, args.layers, args.rows, args.seq)
        med = out["median_s"]
        logger.info("world %d (efsdp %d x ep 2), dim %d, %d layers, %d x %d tokens: "
                    "forward+backward median matrixfsdp %.1f ms, torchtitan FSDP2-EP %.1f ms, "
                    "ratio %.2f; loss agreement %.1e", world, world // 2, args.dim, args.layers,
                    args.rows, args.seq - 1, 1e3 * med["matrixfsdp"], 1e3 * med["fsdp2"],
                    out["ratio"], out["loss_rel_diff"])


if __name__ == "__main__":
    main()
