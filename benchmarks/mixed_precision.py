"""bf16 vs fp32 training step with matrixfsdp, interleaved in one world.

    python -m benchmarks.mixed_precision [--world 2] [--steps 8] [--dim 256]

Two copies of the same GPT are wrapped, one plain (fp32) and one with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (fp32 masters on owners,
bf16 gathers and compute); their steps alternate so machine noise hits both alike. Prints a
markdown table of medians (slowest rank per step) and the bf16 / fp32 ratio.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy

import matrixfsdp as mf
from matrixfsdp.launch.config import ModelConfig
from matrixfsdp.launch.model import GPT


def _step(model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    model.loss(tokens).backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t2 = time.perf_counter()
    times = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times[0]), float(times[1])


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = ModelConfig(dim=args.dim, layers=4, heads=4, hidden=2 * args.dim, seq_len=128)
    policies = {"fp32": None, "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32)}
    runs = {}
    for name, policy in policies.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        mf.fully_shard_matrix(model, mp_policy=policy)
        opt = mf.MatrixOptimizer(model, "muon", lr=0.02, tail_lr=3e-3, ns_dtype="float32")
        runs[name] = (model, opt, {"fwd_bwd": [], "opt": []})
    g = torch.Generator().manual_seed(0)
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 256, (args.batch, cfg.seq_len + 1), generator=g)
        local = tokens.chunk(world)[rank]
        order = list(runs) if step % 2 == 0 else list(reversed(runs))
        for name in order:
            model, opt, times = runs[name]
            fwd_bwd, opt_time = _step(model, opt, local)
            if step >= args.warmup:
                times["fwd_bwd"].append(fwd_bwd)
                times["opt"].append(opt_time)
    if rank == 0:
        for name, (_, _, times) in runs.items():
            out[name] = {k: statistics.median(v) for k, v in times.items()}
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(args.world, port, args, out), nprocs=args.world,
                       start_method="fork")
    load = os.getloadavg()[0]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    machine = platform.processor() or platform.machine()
    print(f"Command: `python -m benchmarks.mixed_precision --world {args.world} --steps "
          f"{args.steps} --dim {args.dim}`; {stamp} UTC; {machine}, {os.cpu_count()} cores, "
          f"load {load:.1f}; torch {torch.__version__}\n")
    print("| policy | fwd+bwd ms | optimizer ms | total ms |")
    print("|---|---|---|---|")
    for name in ("fp32", "bf16"):
        r = out[name]
        print(f"| {name} | {r['fwd_bwd'] * 1e3:.1f} | {r['opt'] * 1e3:.1f} | "
              f"{(r['fwd_bwd'] + r['opt']) * 1e3:.1f} |")
    total = {n: out[n]["fwd_bwd"] + out[n]["opt"] for n in ("fp32", "bf16")}
    fwd_ratio = out["bf16"]["fwd_bwd"] / out["fp32"]["fwd_bwd"]
    print(f"\nbf16 / fp32 total step: {total['bf16'] / total['fp32']:.2f}x "
          f"(fwd+bwd {fwd_ratio:.2f}x)")


if __name__ == "__main__":
    main()
