"""The owner step's transient bytes, and the batched step's speed: ``python -m benchmarks.step_memory``.

Part 1 (memory): for each matrix shape and Newton–Schulz dtype, one Muon ``step_owned`` call on
``B`` same-shape owned matrices under a ``LiveBytesTracker``; the transient is the call's peak
live bytes above the live bytes before it (parameters, gradients and momentum excluded), shown
beside the fp32 matrix's bytes. ``B > 1`` goes through ``batch_owned`` with the given
``StepBatching`` (uncapped: ``max_bytes`` = everything; capped: the default).

Part 1 also steps four torchtitan-style fused ``wqkv`` matrices split q | k | v by a row layout,
one block at a time: what is held once every block is listed, and the peak.

Part 2 (speed): the whole owner step (``batch_owned`` + ``step_owned``, bf16 Newton–Schulz) over
``COUNT`` small same-shape matrices (``--small SHAPE:COUNT``), batched uncapped (the batching
before the cap), batched with the default cap, and unbatched, taking turns step by step; median
of ``--repeats`` after two warm-up steps, one thread.

Part 3 (speed): one owner step of one large matrix (``--large``), fp32 and bf16 Newton–Schulz,
iterating in place a block of columns at a time (the default) against a new iterate each
iteration (the step before), taking turns step by step; median of ``--repeats`` of the
thread's CPU time.

See [Note: owner step transients] in ``matrixfsdp.optim.owner_step`` and BENCHMARKS §20.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from matrixfsdp.memory import LiveBytesTracker
from matrixfsdp.optim import matrix_optimizer
from matrixfsdp.optim.functional import MuonConfig, muon
from matrixfsdp.optim.layouts import MatrixLayout
from matrixfsdp.optim.owner_step import (
    OwnedMatrix,
    StepBatching,
    batch_owned,
    init_owned_state,
    owned_blocks,
    step_owned,
)
from matrixfsdp.optim.registry import get_matrix_optimizer

__all__ = ["main", "owner_step_transient", "owner_step_transients", "time_in_place",
           "time_owner_steps", "whole_iterates"]

logger = logging.getLogger(__name__)
_UNCAPPED = StepBatching(True, max_bytes=1 << 62)


@contextlib.contextmanager
def owner_step_transients(tracker: LiveBytesTracker) -> Iterator[list[dict[str, Any]]]:
    """While active, every ``step_owned`` call of ``MatrixOptimizer.step`` appends
    ``{"transient": bytes, "batch": B, "shape": [...], "param_bytes": one item's bytes}``:
    its peak live bytes above its start (the tracker must be active around the step)."""
    original = matrix_optimizer.step_owned
    calls: list[dict[str, Any]] = []

    def recording(spec: Any, batch: Any, hyper: Any) -> None:
        name = f"owner_step#{len(calls)}"
        with tracker.phase(name):
            original(spec, batch, hyper)
        phase = tracker.phases.pop(name)
        p = batch[0].param
        calls.append({"transient": phase.peak - phase.start, "batch": len(batch),
                      "shape": list(p.shape), "param_bytes": p.numel() * p.element_size()})

    matrix_optimizer.step_owned = recording  # type: ignore[assignment]
    try:
        yield calls
    finally:
        matrix_optimizer.step_owned = original  # type: ignore[assignment]


def _items(shape: tuple[int, ...], count: int, seed: int = 0) -> list[OwnedMatrix]:
    gen = torch.Generator().manual_seed(seed)
    return [OwnedMatrix(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen),
                        {"momentum_buffer": torch.randn(shape, generator=gen)}, 3)
            for _ in range(count)]


def _step(items: list[OwnedMatrix], batching: StepBatching, config: MuonConfig) -> None:
    spec = get_matrix_optimizer("muon")
    hyper = {"lr": 0.02, "weight_decay": 0.01, "initial_lr": 0.02, "config": config}
    for batch in batch_owned(items, batching):
        step_owned(spec, batch, hyper)


def owner_step_transient(shape: tuple[int, ...], count: int, batching: StepBatching,
                         ns_dtype: str) -> int:
    """Peak live bytes of one owner step over ``count`` matrices above the bytes before it."""
    items = _items(shape, count)
    tracker = LiveBytesTracker().track([t for it in items
                                        for t in (it.param, it.grad, *it.state.values())])
    start = tracker.current
    with tracker:
        _step(items, batching, MuonConfig(ns_dtype=ns_dtype))
    return tracker.peak - start


def time_owner_steps(shape: tuple[int, ...], count: int, policies: dict[str, StepBatching],
                     ns_dtype: str, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of one owner step over ``count`` same-shape matrices per policy; the
    policies take turns step by step, so machine load hits them alike."""
    config = MuonConfig(ns_dtype=ns_dtype)
    items = {name: _items(shape, count) for name in policies}
    times: dict[str, list[float]] = {name: [] for name in policies}
    for index in range(warmup + repeats):
        for name, batching in policies.items():
            start = time.perf_counter()
            _step(items[name], batching, config)
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@contextlib.contextmanager
def whole_iterates() -> Iterator[None]:
    """While active, Newton–Schulz makes a new iterate each iteration (the step before the
    in-place iterate; see ``matrixfsdp.optim.functional.muon._ns_columns``)."""
    original = muon._ns_columns
    muon._ns_columns = lambda X: None  # type: ignore[assignment]
    try:
        yield
    finally:
        muon._ns_columns = original  # type: ignore[assignment]


def time_in_place(shape: tuple[int, ...], ns_dtype: str, repeats: int,
                  warmup: int = 2) -> dict[str, float]:
    """Median CPU seconds (this thread's: steadier than wall time on a shared machine) of one
    owner step of one ``shape`` matrix, in place and with whole iterates, taking turns."""
    config = MuonConfig(ns_dtype=ns_dtype)
    items = {name: _items(shape, 1) for name in ("in_place", "whole")}
    times: dict[str, list[float]] = {name: [] for name in items}
    for index in range(warmup + repeats):
        for name in items:
            with whole_iterates() if name == "whole" else contextlib.nullcontext():
                start = time.thread_time()
                _step(items[name], StepBatching(False), config)
                seconds = time.thread_time() - start
            if index >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def row_layout_transient(count: int = 4, head_dim: int = 64, kv_groups: int = 2,
                         q_per_kv: int = 4, dim: int = 512) -> dict[str, int]:
    """``count`` torchtitan-style fused ``wqkv`` matrices (rows interleaved per KV group: the
    group's q heads, one k head, one v head) split into q | k | v by a row layout, stepped one
    block at a time: bytes held once every block is listed (before the first step) and the
    peak above the start."""
    per_group = [("q", q_per_kv * head_dim), ("k", head_dim), ("v", head_dim)]
    blocks: dict[str, list[int]] = {"q": [], "k": [], "v": []}
    row = 0
    for _ in range(kv_groups):
        for name, size in per_group:
            blocks[name] += range(row, row + size)
            row += size
    layout = MatrixLayout(rows=tuple(tuple(b) for b in blocks.values()))
    spec, config = get_matrix_optimizer("muon"), MuonConfig()
    params, states = [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(count):
        p = torch.randn(row, dim, generator=gen)
        p.grad = torch.randn(row, dim, generator=gen)
        params.append(p)
        states.append(init_owned_state(p, spec, config, layout))
    tracker = LiveBytesTracker().track([t for p in params for t in (p, p.grad)],
                                       [t for s in states for t in s.values()])
    start = tracker.current
    with tracker:
        items = [it for p, s in zip(params, states, strict=True)
                 for it in owned_blocks(p, s, layout)]
        listed = tracker.current - start
        _step([it._replace(step=1) for it in items], StepBatching(False), config)
    return {"matrix_bytes": row * dim * 4, "shape": [row, dim], "count": count,
            "listed": listed, "peak": tracker.peak - start}


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("x"))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", default=["768x1536", "1536x768", "1024x1024"],
                   help="part 1 shapes (none: skip part 1)")
    p.add_argument("--batch", type=int, default=4, help="same-shape matrices in part 1")
    p.add_argument("--small", nargs="*", default=["64x64:48", "128x512:24", "256x256:24",
                                                  "512x512:8"],
                   help="SHAPE:COUNT same-shape matrices per part 2 case")
    p.add_argument("--large", nargs="*", default=["512x2048", "2048x512", "768x1536"],
                   help="part 3 shapes (none: skip part 3)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    torch.set_num_threads(1)
    memory, speed = [], []
    for text in args.shapes:
        shape = _shape(text)
        matrix = 4 * shape[0] * shape[1]
        for dtype in ("float32", "bfloat16"):
            row = {"shape": text, "ns_dtype": dtype, "matrix_bytes": matrix,
                   "single": owner_step_transient(shape, 1, StepBatching(), dtype),
                   "batched_uncapped": owner_step_transient(shape, args.batch, _UNCAPPED, dtype),
                   "batched_capped": owner_step_transient(shape, args.batch,
                                                          StepBatching(True), dtype)}
            memory.append(row)
            logger.info("%s", row)
    policies = {"uncapped": _UNCAPPED, "capped": StepBatching(True),
                "unbatched": StepBatching(False)}
    for text in args.small:
        shape, count = _shape(text.split(":")[0]), int(text.split(":")[1])
        row = {"shape": text.split(":")[0], "count": count,
               "batches": [len(b) for b in batch_owned(_items(shape, count), policies["capped"])],
               **time_owner_steps(shape, count, policies, "bfloat16", args.repeats)}
        speed.append(row)
        logger.info("%s", row)
    rows = row_layout_transient() if args.shapes else None
    in_place = []
    for text in args.large:
        for dtype in ("float32", "bfloat16"):
            row = {"shape": text, "ns_dtype": dtype,
                   **time_in_place(_shape(text), dtype, args.repeats)}
            in_place.append(row)
            logger.info("%s", row)
    return {"memory": memory, "speed": speed, "rows": rows, "in_place": in_place,
            "args": vars(args),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def render(results: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = ["| shape | NS dtype | fp32 matrix | one matrix | batch of B, uncapped | "
             "batch of B, default cap |", "|---|---|---|---|---|---|"]
    for r in results["memory"]:
        m = r["matrix_bytes"]
        cells = [f"{r[k] / mib:.2f} MiB ({r[k] / m:.2f}×)"
                 for k in ("single", "batched_uncapped", "batched_capped")]
        lines.append(f"| {r['shape']} | {r['ns_dtype']} | {m / mib:.2f} MiB | " + " | ".join(cells)
                     + " |")
    if results.get("rows"):
        r = results["rows"]
        m = r["matrix_bytes"]
        lines += ["", f"Row layout (q | k | v of {r['count']} fused wqkv, "
                  f"{r['shape'][0]}×{r['shape'][1]}, {m / mib:.2f} MiB each): held once listed "
                  f"{r['listed'] / mib:.2f} MiB ({r['listed'] / m:.2f}×), step peak "
                  f"{r['peak'] / mib:.2f} MiB ({r['peak'] / m:.2f}×)"]
    lines += ["", "| small shape × count | default cap's batches | batched, uncapped ms | "
              "batched, default cap ms | capped ÷ uncapped | unbatched ms |",
              "|---|---|---|---|---|---|"]
    for r in results["speed"]:
        lines.append(f"| {r['shape']} × {r['count']} | {r['batches']} | "
                     f"{1e3 * r['uncapped']:.2f} | {1e3 * r['capped']:.2f} | "
                     f"{r['capped'] / r['uncapped']:.3f} | {1e3 * r['unbatched']:.2f} |")
    lines += ["", "| large shape | NS dtype | in place ms | whole iterates ms | in place ÷ whole |",
              "|---|---|---|---|---|"]
    for r in results.get("in_place", []):
        lines.append(f"| {r['shape']} | {r['ns_dtype']} | {1e3 * r['in_place']:.1f} | "
                     f"{1e3 * r['whole']:.1f} | {r['in_place'] / r['whole']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    results = run(argv)
    sys.stdout.write((json.dumps(results, indent=1) if results["args"]["json"]
                      else render(results)) + "\n")


if __name__ == "__main__":
    main()
