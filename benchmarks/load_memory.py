"""Peak memory per rank of building a wrapped model and loading full weights into it.

    python -m benchmarks.load_memory [--world 4] [--dim 768] [--layers 12] [--repeats 3]

The parent writes the weights of a GPT (default about 390 MB in fp32) as a Hugging Face sharded
safetensors directory (``model.safetensors.index.json`` + shards). Then, per variant, a fresh
gloo world (``MALLOC_MMAP_THRESHOLD_=65536`` plus ``mallopt``, so freed tensors leave the RSS)
builds the model, wraps it, loads the weights, and reports per rank:

- ``peak``: the RSS high-water mark from before the model is built to the end of the load
  (``VmHWM`` after ``echo 5 > /proc/self/clear_refs``), over the RSS at that start;
- ``load extra``: the high-water mark of the load alone over the RSS just before it;
- ``params``: live parameter storage after the load (owned matrices + FSDP2 shards, padding
  included), the tensors the rank keeps.

Variants: init ``eager`` (every rank builds the whole model, then wraps) or ``meta`` (build on
the meta device, wrap, ``to_empty``: each rank allocates only what it keeps); load ``stream``
(``load_full_state_dict(model, directory)``: lazy per-rank reads), ``load_file`` (a dict of
``safetensors.torch.load_file`` of every shard, then ``load_full_state_dict(model, dict)``: the
pre-streaming way) or ``in_memory`` (every shard read into memory first). Variants run
interleaved, ``--repeats`` times each; figures are medians over repeats of the busiest rank, as
ratios of the full model's bytes. Every variant's loss on a fixed batch must agree exactly.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import matrixfsdp as mf

from .config import ModelConfig
from .launch import run_world
from .measure import peak_rss_bytes, reset_peak_rss, rss_bytes, track_live_memory
from .model import build_gpt, lm_loss

INITS = ("eager", "meta")
LOADS = ("stream", "load_file", "in_memory")
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
MiB = 2**20


def write_hf_dir(cfg: ModelConfig, path: Path, shards: int) -> int:
    """Save a seeded GPT as an HF sharded safetensors directory; returns the model's bytes."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in build_gpt(cfg).state_dict().items()}
    total = sum(v.nbytes for v in state.values())
    keys, weight_map, budget = list(state), {}, total / shards
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        if size >= budget * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(key)
        size += state[key].nbytes
    for i, names in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k] for k in names}, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def _build(cfg: ModelConfig, init: str) -> torch.nn.Module:
    if init == "eager":
        model = build_gpt(cfg)
        mf.fully_shard_matrix(model)
        return model
    with torch.device("meta"):
        model = build_gpt(cfg)
    mf.fully_shard_matrix(model)
    model.to_empty(device="cpu")
    return model


def _source(load: str, path: Path) -> Any:
    if load == "stream":
        return path
    import safetensors.torch as st

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        out.update(st.load_file(str(shard)) if load == "load_file"
                   else st.load(shard.read_bytes()))
    return out


def _param_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct parameter storages this rank holds (FSDP2 padding included)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


TINY = ModelConfig(dim=32, layers=1, heads=1, mlp_hidden=64, vocab=64, seq_len=8)


def _warm_up(path: Path, init: str) -> int:
    """Build, wrap and load a tiny model the same way once: one-time library initialization
    (lazy imports of FSDP2/DTensor internals, safetensors) is then not counted; returns its RSS
    growth."""
    before = rss_bytes()
    try:
        model = _build(TINY, init)
    except ValueError:  # meta init unsupported: reported by the measured build
        model = _build(TINY, "eager")
    mf.checkpoint.load_full_state_dict(model, path)
    del model
    gc.collect()
    return rss_bytes() - before


def _worker(rank: int, world: int, cfg: ModelConfig, init: str, load: str, path: str
            ) -> dict[str, Any]:
    track_live_memory()
    warm_up = _warm_up(Path(path) / "tiny", init)
    gc.collect()
    dist.barrier()
    start = rss_bytes()
    reset_peak_rss()
    try:
        model = _build(cfg, init)
    except ValueError as exc:  # meta-device wrap not supported by this matrixfsdp
        return {"pending": str(exc).splitlines()[0]}
    wrap_peak = peak_rss_bytes() - start
    before_load = rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    mf.checkpoint.load_full_state_dict(model, _source(load, Path(path)))
    gc.collect()
    seconds = time.perf_counter() - t0
    load_peak = peak_rss_bytes()
    out = {"peak": max(wrap_peak, load_peak - start), "load_extra": load_peak - before_load,
           "params": _param_bytes(model), "seconds": seconds, "warm_up": warm_up}
    tokens = torch.arange(2 * 17).view(2, 17) % cfg.vocab
    with torch.no_grad():
        out["loss"] = float(lm_loss(model, tokens))
    return out


def _summary(runs: list[list[dict[str, Any]]], total: int) -> dict[str, Any]:
    if any("pending" in r for run in runs for r in run):
        return {"pending": next(r["pending"] for run in runs for r in run if "pending" in r)}
    busiest = {k: [max(r[k] for r in run) for run in runs]
               for k in ("peak", "load_extra", "params", "seconds", "warm_up")}
    med = {k: statistics.median(v) for k, v in busiest.items()}
    return {**med, **{f"{k}_ratio": med[k] / total for k in ("peak", "load_extra", "params")},
            "spread": max(busiest["peak"]) - min(busiest["peak"]),
            "loss": {r["loss"] for run in runs for r in run}}


def _table(results: dict[str, dict[str, Any]], total: int) -> list[str]:
    lines = ["| init | load | peak / rank | x full model | load extra / rank | x full | "
             "params / rank | spread | load s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        init, load = name.split("+")
        if "pending" in r:
            lines.append(f"| {init} | {load} | pending: {r['pending']} | | | | | | |")
            continue
        lines.append(
            f"| {init} | {load} | {r['peak'] / MiB:.0f} MiB | {r['peak_ratio']:.3f} | "
            f"{r['load_extra'] / MiB:.0f} MiB | {r['load_extra_ratio']:.3f} | "
            f"{r['params'] / MiB:.0f} MiB | {r['spread'] / MiB:.1f} MiB | {r['seconds']:.2f} |")
    return lines


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS)
    parser.add_argument("--loads", nargs="+", default=list(LOADS), choices=LOADS)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    cfg = ModelConfig(dim=args.dim, layers=args.layers, heads=max(1, args.dim // 64),
                      mlp_hidden=4 * args.dim, vocab=args.vocab, seq_len=128)
    variants = [f"{i}+{lo}" for i in args.inits for lo in args.loads]
    tmp = Path(tempfile.mkdtemp(prefix="matrixfsdp_load_"))
    try:
        total = write_hf_dir(cfg, tmp, args.shards)
        (tmp / "tiny").mkdir()
        write_hf_dir(TINY, tmp / "tiny", 1)
        runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
        for repeat in range(args.repeats):
            shift = repeat % len(variants)
            for name in variants[shift:] + variants[:shift]:  # rotate the order every round
                init, load = name.split("+")
                runs[name].append(run_world(args.world, _worker, cfg, init, load, str(tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {name: _summary(r, total) for name, r in runs.items()}
    losses = set().union(*(r["loss"] for r in results.values() if "loss" in r))
    if len(losses) > 1:
        raise RuntimeError(f"variants loaded different weights: losses {sorted(losses)}")
    _print(args, argv, cfg, results, total)
    if args.json is not None:
        args.json.write_text(json.dumps({"total_bytes": total, "results": {
            k: {kk: vv for kk, vv in v.items() if kk != "loss"} for k, v in results.items()}},
            indent=1))
    return {"total_bytes": total, "results": results}


def _print(args: argparse.Namespace, argv: list[str] | None, cfg: ModelConfig,
           results: dict[str, dict[str, Any]], total: int) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    command = " ".join(["python -m benchmarks.load_memory", *(argv if argv is not None
                                                                else sys.argv[1:])])
    print(f"Command: `{command}`; {stamp} UTC; {platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; torch {torch.__version__}; world {args.world}\n")
    print(f"Model: GPT dim {cfg.dim}, {cfg.layers} layers, MLP {cfg.mlp_hidden}, vocab "
          f"{cfg.vocab}: {total / MiB:.0f} MiB in fp32, {args.shards} safetensors shards; "
          f"busiest rank, median of {args.repeats}. Not counted: one-time library "
          f"initialization in each process (a warm-up wrap + load of a tiny model, "
          f"{_warm(results) / MiB:.0f} MiB)\n")
    print("\n".join(_table(results, total)))


def _warm(results: dict[str, dict[str, Any]]) -> float:
    return max((r["warm_up"] for r in results.values() if "warm_up" in r), default=0.0)


def main(argv: list[str] | None = None) -> None:
    if any(os.environ.get(k) != v for k, v in MMAP_ENV.items()):  # glibc reads them at start-up
        env = {**os.environ, **MMAP_ENV}
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.load_memory",
                                   *(argv if argv is not None else sys.argv[1:])], env)
    run(argv)


if __name__ == "__main__":
    main()
