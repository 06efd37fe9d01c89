"""CPU micro-benchmark of the functional matrix optimizers and of inverse square roots.

Usage::

    python -m benchmarks.optim_cpu            # markdown tables on stdout
    python -m benchmarks.optim_cpu --json     # the same measurements as JSON

Part 1 times one ``step_fn`` call per optimizer (median of ``--repeats`` calls
after ``--warmup`` calls) for each matrix shape, once with
``torch.set_num_threads(1)`` and once with the default thread count. Part 2
compares Scaled CANS with ``torch.linalg.eigh`` (and classical coupled
Newton–Schulz) for ``S^{-1/2}`` of random SPD matrices (condition number 1e3),
reporting time and the residual ``||W S W - I||_F / sqrt(d)``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from matrixfsdp.optim.functional import (
    FUNCTIONAL_OPTIMIZERS,
    EmaGramConfig,
    MuonConfig,
    OKLSConfig,
    ShampooConfig,
    SOAPConfig,
    inverse_sqrt_cans,
    inverse_sqrt_eigh,
    inverse_sqrt_newton_schulz,
    sqrt_residual,
)

__all__ = ["bench_inverse_sqrt", "bench_optimizers", "main"]

# (row label, registry name, config): SOAP appears twice because its basis
# refresh (eigh at step 1, QR every k steps) is far costlier than a plain step.
OPTIMIZER_CASES: list[tuple[str, str, Any]] = [
    ("muon (bf16 NS)", "muon", MuonConfig()),
    ("shampoo (k=1)", "shampoo", ShampooConfig()),
    ("soap (k=10, step without refresh)", "soap", SOAPConfig()),
    ("soap (k=1, QR refresh every step)", "soap", SOAPConfig(precondition_frequency=1)),
    ("okls (Scaled CANS, fp32 on CPU)", "okls", OKLSConfig()),
    ("emagram (k=1)", "emagram", EmaGramConfig()),
]


def _log(row: dict[str, Any]) -> None:
    """One progress line on stderr (the tables/JSON go to stdout at the end)."""
    label = row.get("optimizer") or row.get("method")
    sys.stderr.write(
        f"[optim_cpu] {label} {row.get('shape') or row.get('d')} "
        f"threads={row['threads']} median={row['median_s']:.4f}s\n"
    )
    sys.stderr.flush()


def _median_seconds(fn: Callable[[], None], warmup: int, repeats: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def _time_optimizer(name: str, config: Any, shape: tuple[int, int], warmup: int, repeats: int):
    _, init_fn, step_fn = FUNCTIONAL_OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(*shape, generator=gen)
    grads = [torch.randn(*shape, generator=gen) for _ in range(2)]
    state = init_fn(param, config)
    counter = {"step": 0}
    # SOAP's step 1 only initialises (eigh); never time it as a regular step.
    if name == "soap":
        step_fn(
            param,
            grads[0],
            state,
            lr=1e-3,
            weight_decay=0.0,
            step=1,
            initial_lr=1e-3,
            config=config,
        )
        counter["step"] = 1

    def one_step() -> None:
        counter["step"] += 1
        t = counter["step"]
        step_fn(
            param,
            grads[t % 2],
            state,
            lr=1e-3,
            weight_decay=0.01,
            step=t,
            initial_lr=1e-3,
            config=config,
        )

    return _median_seconds(one_step, warmup, repeats)


def bench_optimizers(shapes, warmup: int, repeats: int, threads: int) -> list[dict[str, Any]]:
    """Median step time of every optimizer case for every shape at ``threads`` threads."""
    torch.set_num_threads(threads)
    rows = []
    for shape in shapes:
        for label, name, config in OPTIMIZER_CASES:
            med, times = _time_optimizer(name, config, shape, warmup, repeats)
            rows.append(
                {
                    "optimizer": label,
                    "shape": list(shape),
                    "threads": threads,
                    "median_s": med,
                    "times_s": times,
                }
            )
            _log(rows[-1])
    return rows


def _random_spd(d: int, cond: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    lam = torch.logspace(0.0, -math.log10(cond), d, dtype=torch.float64)
    return ((q * lam) @ q.T).float()


ROOT_METHODS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("Scaled CANS (fp32 GEMMs, 27)", lambda s: inverse_sqrt_cans(s, fp16_scaled=False)),
    ("Scaled CANS (fp16 inputs, emulated)", lambda s: inverse_sqrt_cans(s, fp16_scaled=True)),
    ("coupled Newton-Schulz (21 steps)", inverse_sqrt_newton_schulz),
    ("eigh fp32", lambda s: inverse_sqrt_eigh(s, dtype=torch.float32)),
    ("eigh fp64", lambda s: inverse_sqrt_eigh(s, dtype=torch.float64)),
]


def bench_inverse_sqrt(dims, warmup: int, repeats: int, threads: int, cond: float = 1e3):
    """Time and residual of each inverse-square-root method at each size."""
    torch.set_num_threads(threads)
    rows = []
    for d in dims:
        S = _random_spd(d, cond, seed=d)
        for label, fn in ROOT_METHODS:
            med, times = _median_seconds(lambda fn=fn, S=S: fn(S), warmup, repeats)
            residual = sqrt_residual(S, fn(S)).item()
            rows.append(
                {
                    "method": label,
                    "d": d,
                    "cond": cond,
                    "threads": threads,
                    "median_s": med,
                    "times_s": times,
                    "residual": residual,
                }
            )
            _log(rows[-1])
    return rows


def _markdown(results: dict[str, Any]) -> str:
    out = [f"Environment: {results['env']}", ""]
    out += ["| optimizer | shape | threads | median step (ms) |", "|---|---|---:|---:|"]
    for r in results["optimizers"]:
        shape = "x".join(map(str, r["shape"]))
        out.append(f"| {r['optimizer']} | {shape} | {r['threads']} | {1e3 * r['median_s']:.1f} |")
    out += ["", "| inverse sqrt method | d | threads | median (ms) | ||WSW-I||_F/sqrt(d) |"]
    out.append("|---|---:|---:|---:|---:|")
    for r in results["inverse_sqrt"]:
        out.append(
            f"| {r['method']} | {r['d']} | {r['threads']} | {1e3 * r['median_s']:.1f} "
            f"| {r['residual']:.2e} |"
        )
    return "\n".join(out)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (>= 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--shapes", default="1024x1024,1024x4096", help="comma list of MxN")
    p.add_argument("--cans-dims", default="512,1024,2048", help="comma list of d")
    p.add_argument(
        "--threads",
        default="1,default",
        help="comma list of thread counts to run; 'default' = torch's default count",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    dims = [int(d) for d in args.cans_dims.split(",") if d]
    default_threads = torch.get_num_threads()
    thread_settings = []
    for item in args.threads.split(","):
        count = default_threads if item.strip() == "default" else int(item)
        if count not in thread_settings:
            thread_settings.append(count)
    results: dict[str, Any] = {
        "env": f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"default threads {default_threads}, median of {args.repeats} after {args.warmup} warm-up",
        "optimizers": [],
        "inverse_sqrt": [],
    }
    for threads in thread_settings:
        results["inverse_sqrt"] += bench_inverse_sqrt(dims, args.warmup, args.repeats, threads)
        results["optimizers"] += bench_optimizers(shapes, args.warmup, args.repeats, threads)
    torch.set_num_threads(default_threads)
    sys.stdout.write((json.dumps(results, indent=2) if args.json else _markdown(results)) + "\n")
    return results


if __name__ == "__main__":
    main()
