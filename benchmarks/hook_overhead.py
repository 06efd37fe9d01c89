"""CPU time of the runtime's hooks per step, beside stock FSDP2's: ``python -m benchmarks.hook_overhead``.

Usage::

    python -m benchmarks.hook_overhead --world 2 --steps 10 --dim 32 --layers 48

Each strategy trains forward+backward in its own gloo world. Every hook function of the runtime
(``MatrixFSDPState``'s forward/backward hooks and end-of-backward callback) and of FSDP2
(``FSDPState``'s pre/post-forward and pre-backward hooks, ``FSDPParamGroup.post_backward``, the root's
end-of-backward callback) is wrapped to add up the calling thread's CPU time (``time.thread_time``:
a blocking wait for a collective costs none; work the hook does to issue, pack or copy counts). A
matrixfsdp model also runs FSDP2's hooks for its tail (see [Note: tail units]); both are reported.
Prints, per strategy, each hook's calls and CPU milliseconds per step (rank 0) and the total per
block per step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import matrixfsdp as mf
from matrixfsdp.runtime.state import MatrixFSDPState

from .config import ModelConfig, add_model_flags, model_from_flags
from .launch import run_world
from .model import build_gpt, global_tokens, lm_loss, local_tokens

__all__ = ["main"]

RUNTIME_HOOKS = ("_root_pre_forward", "_root_post_forward", "_pre_forward", "_post_forward",
                 "_pre_backward", "_post_backward", "_final_callback")
FSDP2_STATE_HOOKS = ("_pre_forward", "_post_forward", "_pre_backward",
                     "_root_post_backward_final_callback")


def _fsdp2_classes() -> tuple[type, type]:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    return FSDPState, FSDPParamGroup


def _timed(totals: dict[str, list[float]], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = totals[label]
            entry[0] += 1
            entry[1] += time.thread_time() - start
    return wrapper


def _instrument(totals: dict[str, list[float]]) -> None:
    """Wrap the hook functions on their classes (before any model binds them)."""
    state_cls, group_cls = _fsdp2_classes()
    for name in FSDP2_STATE_HOOKS:
        setattr(state_cls, name, _timed(totals, f"FSDP2 {name}", getattr(state_cls, name)))
    group_cls.post_backward = _timed(totals, "FSDP2 post_backward", group_cls.post_backward)
    for name in RUNTIME_HOOKS:
        setattr(MatrixFSDPState, name,
                _timed(totals, f"matrixfsdp {name}", getattr(MatrixFSDPState, name)))


def hook_worker(rank: int, world: int, strategy: str, model_cfg: ModelConfig, steps: int
                ) -> dict[str, Any]:
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    _instrument(totals)
    torch.manual_seed(0)
    model = build_gpt(model_cfg)
    if strategy == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        mf.fully_shard_matrix(model)
    for step in range(steps + 2):
        if step == 2:
            totals.clear()
            dist.barrier()
            start = time.perf_counter()
        tokens = local_tokens(global_tokens(model_cfg, step, 8, 0), rank, world)
        lm_loss(model, tokens).backward()
        for p in model.parameters():
            p.grad = None
    wall = (time.perf_counter() - start) / steps
    return {"wall": wall, "hooks": {k: (v[0] / steps, v[1] / steps) for k, v in totals.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hook_overhead", description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    add_model_flags(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = model_from_flags(args)
    print(f"# hook CPU time per step (rank 0), world {args.world}, {args.steps} steps, {cfg}")
    for strategy in ("fsdp2", "matrixfsdp"):
        result = run_world(args.world, hook_worker, strategy, cfg, args.steps)[0]
        hooks = result["hooks"]
        total = sum(ms for _, ms in hooks.values())
        print(f"\n## {strategy}: wall {result['wall'] * 1e3:.1f} ms/step, hooks "
              f"{total * 1e3:.2f} ms/step = {total / cfg.layers * 1e3:.3f} ms per block")
        print("| hook | calls/step | CPU ms/step | µs/call |\n|---|---:|---:|---:|")
        for name, (calls, sec) in sorted(hooks.items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {calls:.0f} | {sec * 1e3:.2f} | {sec / max(calls, 1) * 1e6:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
