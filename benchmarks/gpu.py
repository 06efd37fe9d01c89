"""One-GPU benchmark and smoke test of matrixfsdp: one table, well under 8 minutes on one GPU.

Usage::

    python benchmarks/gpu.py                       # needs CUDA; exits 0 with a message without it
    python benchmarks/gpu.py --out benchmarks/results/gpu.md
    python benchmarks/gpu.py --device cpu --tiny   # every section's code on CPU at toy sizes
    pip install --target /tmp/site nvshmem4py-cu13 && PYTHONPATH=/tmp/site python benchmarks/gpu.py

Sections (rows of the one table; each is guarded, so a failure shows as a FAILED row):
1. Muon's Newton–Schulz (5 steps, bf16) at 4096² and 8192²: median ms and TFLOP/s from 30 n³ FLOPs
   (per step three n×n GEMMs of 2 n³: X Xᵀ, A·A, B·X); accuracy ‖O Oᵀ − I‖_F/√n.
2. Inverse square roots S^{-1/2} of 4 SPD 8192² matrices (condition ~1e3, a Kronecker-factor EMA
   step): Scaled CANS with fp16 GEMMs and per-step scaling (28 GEMMs of 2d³), Scaled CANS fp32
   (27), one warm-started QR refresh (~7.3 d³) and fp32 ``eigh`` (~11 d³); residual
   ‖W S W − I‖_F/√d in fp64.
3. The runtime at world size 1 on NCCL (gloo on CPU): the default ``matrixfsdp train`` model
   (``launch.ModelConfig()``) trained 20 Muon steps, saved, reloaded into a fresh model and
   optimizer (bitwise equal parameters and state), one more step on both.
4. ``collectives="nvshmem"`` at one PE: a put-with-signal loopback through the symmetric heap
   (bytes equal, GB/s) and 20 steps wrapped with ``collectives="nvshmem"`` equal to NCCL. Without
   nvshmem4py (or CUDA) the row reports the probe's reason and is not a failure.
5. OKLS steps on four 4096² matrices with on-device state and with ``offload_state="cpu"``
   (both one matrix at a time): median step ms, the ratio, and whether both give bitwise the
   same parameters.
6. One launch per group: a group's per-matrix broadcasts and per-segment reduces (64 matrices
   of 4096 elements) on the one-rank NCCL group, coalesced and one by one: the profiler's count
   of ``nccl:coalesced`` launches per call, the values kept, and median ms of each.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/gpu.py``: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn

from matrixfsdp.optim.functional import (
    inverse_sqrt_cans,
    inverse_sqrt_eigh,
    sqrt_residual,
    zeropower_via_newton_schulz,
)

__all__ = ["SIZES", "Sizes", "main"]

NS_FLOPS_PER_N3 = 30.0  # 5 Newton–Schulz steps x 3 GEMMs x 2 n^3 (square input)


@dataclass(frozen=True)
class Sizes:
    ns: tuple[int, ...]
    root_d: int
    root_batch: int
    okls_d: int
    okls_count: int
    okls_steps: int
    model: dict[str, int]
    train_steps: int
    global_batch: int
    corpus_bytes: int
    loopback_bytes: int
    launch_count: int = 64
    launch_numel: int = 4096


SIZES = {
    "full": Sizes(ns=(4096, 8192), root_d=8192, root_batch=4, okls_d=4096, okls_count=4,
                  okls_steps=5, model={}, train_steps=20, global_batch=16,
                  corpus_bytes=400_000, loopback_bytes=256 << 20),
    "tiny": Sizes(ns=(64, 96), root_d=48, root_batch=2, okls_d=48, okls_count=3, okls_steps=2,
                  model={"dim": 32, "layers": 2, "heads": 2, "hidden": 64, "seq_len": 16},
                  train_steps=2, global_batch=4, corpus_bytes=20_000, loopback_bytes=1 << 16,
                  launch_count=6, launch_numel=64),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, warmup: int = 1,
          repeats: int = 3) -> tuple[float, Any]:
    """Median wall seconds of ``fn()`` (synchronized) and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out


def _row(section: str, case: str, shape: str, ms: float | None = None,
         rate: str = "", check: str = "", ok: bool = True) -> dict[str, Any]:
    return {"section": section, "case": case, "shape": shape, "ms": ms, "rate": rate,
            "check": check, "ok": ok}


# -- 1. Newton–Schulz -------------------------------------------------------------------------------
def bench_newton_schulz(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for n in sizes.ns:
        gen = torch.Generator(device=device).manual_seed(n)
        G = torch.randn(n, n, device=device, generator=gen, dtype=torch.bfloat16)
        seconds, ortho = _time(lambda G=G: zeropower_via_newton_schulz(G, dtype=torch.bfloat16),
                               device, warmup=2, repeats=5)
        o = ortho.float()
        err = torch.linalg.matrix_norm(o @ o.mT - torch.eye(n, device=device)) / math.sqrt(n)
        rows.append(_row("Newton–Schulz, 5 steps, bf16", "Muon orthogonalization", f"{n}²",
                         seconds * 1e3, f"{NS_FLOPS_PER_N3 * n**3 / seconds / 1e12:.3g} TFLOP/s",
                         f"‖OOᵀ−I‖/√n = {err.item():.2e}"))
    return rows


# -- 2. inverse square roots ------------------------------------------------------------------------
def _spd_pair(d: int, batch: int, device: torch.device, cond: float = 1e3,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, Q_prev)``: S = 0.95 S_prev + 0.05 G Gᵀ/d², S_prev = Q_prev diag(λ) Q_prevᵀ."""
    gen = torch.Generator(device=device).manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(batch, d, d, device=device, generator=gen)).Q
    lam = torch.logspace(0.0, -math.log10(cond), d, device=device)
    S_prev = (Q * lam) @ Q.mT
    G = torch.randn(batch, d, d, device=device, generator=gen)
    S = 0.95 * S_prev + 0.05 * (G @ G.mT) / (d * d)
    return (S + S.mT) * 0.5, Q


def _qr_refresh(S: torch.Tensor, Q_prev: torch.Tensor) -> torch.Tensor:
    Q = torch.linalg.qr(S @ Q_prev).Q
    lam = torch.einsum("bij,bik,bkj->bj", Q, S, Q).clamp_min(1e-30)
    return (Q * lam.rsqrt().unsqueeze(-2)) @ Q.mT


def bench_inverse_roots(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    d, batch = sizes.root_d, sizes.root_batch
    S, Q_prev = _spd_pair(d, batch, device)
    gemm = 2.0 * d**3
    cases: list[tuple[str, Callable[[], torch.Tensor], float, int]] = [
        ("Scaled CANS, fp16 GEMMs + scaling", lambda: inverse_sqrt_cans(S, fp16_scaled=True),
         28 * gemm, 3),
        ("Scaled CANS, fp32", lambda: inverse_sqrt_cans(S, fp16_scaled=False), 27 * gemm, 3),
        ("QR refresh (warm start)", lambda: _qr_refresh(S, Q_prev), (2 + 4 / 3 + 2 + 2) * d**3, 3),
        ("eigh, fp32", lambda: inverse_sqrt_eigh(S, dtype=torch.float32), 11.0 * d**3, 1),
    ]
    rows, eigh_ms = [], None
    for name, fn, flops, repeats in cases:
        seconds, W = _time(fn, device, warmup=1, repeats=repeats)
        residual = sqrt_residual(S, W).max().item()
        rows.append(_row("inverse square root", name, f"{batch} × {d}²", seconds * 1e3,
                         f"{batch * flops / seconds / 1e12:.3g} TFLOP/s",
                         f"‖WSW−I‖/√d = {residual:.2e}", ok=math.isfinite(residual)))
        del W
        if name.startswith("eigh"):
            eigh_ms = seconds * 1e3
    if eigh_ms:
        rows[0]["check"] += f"; eigh / CANS fp16 = {eigh_ms / rows[0]['ms']:.1f}×"
    return rows


# -- 3. runtime smoke (world 1) ---------------------------------------------------------------------
def _default_model(sizes: Sizes, device: torch.device) -> nn.Module:
    from matrixfsdp.launch.config import ModelConfig
    from matrixfsdp.launch.model import GPT

    torch.manual_seed(0)
    return GPT(ModelConfig(**sizes.model)).to(device)


def _wrapped(sizes: Sizes, device: torch.device, optimizer: str = "muon",
             **wrap: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    import matrixfsdp as mf

    model = _default_model(sizes, device)
    mf.fully_shard_matrix(model, planner=optimizer, **wrap)
    kwargs = {"ns_dtype": "float32"} if optimizer == "muon" and device.type == "cpu" else {}
    opt = mf.MatrixOptimizer(model, optimizer=optimizer, lr=0.02, tail_lr=3e-3, **kwargs)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, corpus: Any, sizes: Sizes,
           steps: range, device: torch.device) -> list[float]:
    losses, seq = [], model.cfg.seq_len
    for step in steps:
        batch = corpus.batch("train", step, sizes.global_batch, seq, 0).to(device)
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _identical(a: tuple[nn.Module, torch.optim.Optimizer],
               b: tuple[nn.Module, torch.optim.Optimizer]) -> bool:
    (model_a, opt_a), (model_b, opt_b) = a, b
    params_b = dict(model_b.named_parameters())
    for fqn, p in model_a.named_parameters():
        q = params_b[fqn]
        if not torch.equal(_local(p.detach()), _local(q.detach())):
            return False
        state_a, state_b = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        if state_a.keys() != state_b.keys() or not all(
                torch.equal(_local(v).cpu(), _local(state_b[k]).cpu()) for k, v in state_a.items()):
            return False
    return True


def _max_param_diff(a: nn.Module, b: nn.Module) -> float:
    params_b = dict(b.named_parameters())
    return max((_local(p.detach()).float() - _local(params_b[f].detach()).float()).abs().max().item()
               for f, p in a.named_parameters())


def runtime_smoke(sizes: Sizes, device: torch.device, corpus: Any) -> list[dict[str, Any]]:
    import matrixfsdp as mf

    backend = dist.get_backend()
    model, opt = _wrapped(sizes, device)
    start = time.perf_counter()
    losses = _train(model, opt, corpus, sizes, range(sizes.train_steps), device)
    _sync(device)
    ms = (time.perf_counter() - start) / sizes.train_steps * 1e3
    rows = [_row(f"runtime, world 1, {backend}", f"train {sizes.train_steps} Muon steps",
                 "default model", ms, "per step", f"loss {losses[0]:.3f} → {losses[-1]:.3f}",
                 ok=losses[-1] < losses[0] and all(map(math.isfinite, losses)))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        mf.checkpoint.save(path, model, opt, step=sizes.train_steps)
        fresh = _wrapped(sizes, device)
        mf.checkpoint.load(path, *fresh)
    exact = _identical((model, opt), fresh)
    after = range(sizes.train_steps, sizes.train_steps + 1)
    _train(model, opt, corpus, sizes, after, device)
    _train(*fresh, corpus, sizes, after, device)
    diff = _max_param_diff(model, fresh[0])
    rows.append(_row(f"runtime, world 1, {backend}", "checkpoint save + load + 1 step",
                     "default model", None, "",
                     f"reload bitwise: {'yes' if exact else 'NO'}; next step Δ = {diff:.1e}",
                     ok=exact and diff < 1e-5))
    return rows


# -- 4. NVSHMEM at one PE ---------------------------------------------------------------------------
def _loopback(transport: Any, nbytes: int, device: torch.device, stream: Any) -> tuple[float, bool]:
    """Put-with-signal from this PE to itself through the heap: (seconds, bytes equal)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    _sync(device)
    start = time.perf_counter()
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        transport.put_signal(0, src, transport.rank, 0, stream)
        transport.wait_until(0, 1, stream)
        equal = torch.equal(transport.heap[:nbytes], src)
    _sync(device)
    return time.perf_counter() - start, equal


def nvshmem_one_pe(sizes: Sizes, device: torch.device, corpus: Any) -> list[dict[str, Any]]:
    import matrixfsdp as mf
    from matrixfsdp.collectives.nvshmem_backend import Nvshmem4pyTransport, NvshmemOwnerComm
    from matrixfsdp.collectives.nvshmem_probe import ProbeReason, probe
    from matrixfsdp.collectives.nvshmem_schedule import HeapLayout
    from matrixfsdp.collectives.nvshmem_sim import ThreadedWorld

    section = "collectives='nvshmem', 1 PE"
    # The wrapped model's communicator first: the loopback heap below is a second user of the
    # same NVSHMEM initialisation, which is finalized after the last user closes.
    nv = _wrapped(sizes, device, collectives="nvshmem")
    comm = mf.get_state(nv[0]).comm
    layout = HeapLayout(1, sizes.loopback_bytes)
    reason, detail = probe(None, device.type, layout.total_bytes)
    if reason is ProbeReason.OK:
        transport: Any = Nvshmem4pyTransport(None, device, layout)
        stream = torch.cuda.Stream(device)
        where = "nvshmem4py"
    else:  # the same loopback code on the CPU stand-in, so this path is exercised everywhere
        transport, stream = ThreadedWorld(layout).transport(0), None
        where = f"CPU stand-in ({reason.describe()})"
    try:
        seconds, equal = _loopback(transport, sizes.loopback_bytes, device, stream)
    finally:
        transport.close()
    rows = [_row(section, f"put_signal loopback via {where}", f"{sizes.loopback_bytes >> 10} KiB",
                 seconds * 1e3, f"{sizes.loopback_bytes / seconds / 1e9:.3g} GB/s",
                 f"bytes equal: {'yes' if equal else 'NO'}", ok=equal)]
    used = "NVSHMEM" if isinstance(comm, NvshmemOwnerComm) else "fallback to torch.distributed"
    ref = _wrapped(sizes, device)
    steps = range(min(sizes.train_steps, 5))
    _train(*nv, corpus, sizes, steps, device)
    _train(*ref, corpus, sizes, steps, device)
    same = _identical(nv, ref)
    if isinstance(comm, NvshmemOwnerComm):
        comm.close()
    rows.append(_row(section, f"train {len(steps)} steps ({used})", "default model", None, "",
                     f"equal to NCCL path: {'yes' if same else 'NO'}"
                     + ("" if reason is ProbeReason.OK else f"; {detail}"), ok=same))
    return rows


# -- 5. OKLS with and without offload ---------------------------------------------------------------
class _Stack(nn.Module):
    def __init__(self, d: int, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def okls_offload(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    import matrixfsdp as mf

    d, count = sizes.okls_d, sizes.okls_count
    runs = {}
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = _Stack(d, count).to(device)
        mf.fully_shard_matrix(model, planner="okls")
        # One matrix at a time in both (CUDA's default batches same-shape on-device matrices,
        # which rounds differently): the same math, so the results compare bit for bit.
        opt = mf.MatrixOptimizer(model, optimizer="okls", lr=0.01, offload_state=offload,
                                 batch_same_shape=False)
        runs[offload] = (model, opt)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, d, device=device, generator=gen) / math.sqrt(d)
    times: dict[Any, list[float]] = {None: [], "cpu": []}
    for step in range(sizes.okls_steps + 1):
        for offload, (model, opt) in runs.items():  # interleaved, side by side
            model(x).square().mean().backward()
            _sync(device)
            start = time.perf_counter()
            opt.step()
            _sync(device)
            if step:  # step 0 builds state: not timed
                times[offload].append(time.perf_counter() - start)
            opt.zero_grad(set_to_none=True)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    same = _identical(runs[None], runs["cpu"])
    shape = f"{count} × {d}²"
    return [_row("OKLS step", "state on device", shape, med[None]),
            _row("OKLS step", "offload_state='cpu'", shape, med["cpu"],
                 f"{med['cpu'] / med[None]:.2f}× on-device",
                 f"bitwise equal to on-device: {'yes' if same else 'NO'}", ok=same)]


# -- 6. One launch per group -------------------------------------------------------------------------
def _launches(fn: Callable[[], None], device: torch.device) -> dict[str, int]:
    """Profiler event counts of one call of ``fn``: coalesced launches and per-op collectives."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    names = [e.name for e in prof.events()]
    return {"coalesced": names.count("nccl:coalesced"),
            "ops": sum(n in ("nccl:broadcast", "nccl:reduce") for n in names)}


def _wait(issue: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    issue(*args, **kwargs).wait()


def one_launch_per_group(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    """The runtime skips collectives at world 1, so the forms are called on the group directly."""
    from matrixfsdp.collectives.torch_backend import TorchOwnerComm, backend_coalesces

    section = "one launch per group"
    if not backend_coalesces(None, device):
        return [_row(section, "skipped", "", None, "",
                     f"{dist.get_backend()} does not coalesce (NCCL does)")]
    shape = f"{sizes.launch_count} × {sizes.launch_numel}"
    tensors = [torch.full((sizes.launch_numel,), float(i), device=device)
               for i in range(sizes.launch_count)]
    flat = torch.cat(tensors)
    before = [t.clone() for t in tensors], flat.clone()
    rows = []
    for coalesce in (True, False):
        comm = TorchOwnerComm(coalesce=coalesce)
        gather = functools.partial(_wait, comm._gather_broadcast, [tensors], async_op=True)
        reduce = functools.partial(_wait, comm._reduce_p2p, flat, [flat], async_op=True)
        for name, fn, ops in (("gather", gather, sizes.launch_count), ("reduce", reduce, 1)):
            counts = _launches(fn, device)
            ms, _ = _time(fn, device, warmup=3, repeats=21)
            kept = (all(torch.equal(a, b) for a, b in zip(before[0], tensors, strict=True))
                    and torch.equal(before[1], flat))
            want = {"coalesced": 1 if coalesce else 0, "ops": ops}
            rows.append(_row(section, f"{name}, {'coalesced' if coalesce else 'one by one'}",
                             shape, ms * 1e3, f"{counts['coalesced']} coalesced launch(es)",
                             f"{counts['ops']} ops; values kept: {'yes' if kept else 'NO'}",
                             ok=kept and counts == want))
    return rows


# -- driver -----------------------------------------------------------------------------------------
def _guarded(name: str, fn: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    start = time.perf_counter()
    try:
        rows = fn()
    except Exception as exc:  # one broken section must not hide the others' figures
        rows = [_row(name, "FAILED", "", None, "", f"{type(exc).__name__}: {exc}"[:200], ok=False)]
    print(f"benchmarks.gpu: {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return rows


def _with_world_one(device: torch.device, fn: Callable[[], list[dict[str, Any]]]
                    ) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            return fn()
        finally:
            dist.destroy_process_group()


def run(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    from matrixfsdp.launch.data import ByteCorpus

    rows = _guarded("newton_schulz", lambda: bench_newton_schulz(sizes, device))
    rows += _guarded("inverse_roots", lambda: bench_inverse_roots(sizes, device))
    corpus = ByteCorpus(sizes.corpus_bytes, 0.05)

    def distributed() -> list[dict[str, Any]]:
        out = _guarded("runtime_smoke", lambda: runtime_smoke(sizes, device, corpus))
        out += _guarded("nvshmem", lambda: nvshmem_one_pe(sizes, device, corpus))
        out += _guarded("okls_offload", lambda: okls_offload(sizes, device))
        return out + _guarded("one_launch", lambda: one_launch_per_group(sizes, device))

    return rows + _with_world_one(device, distributed)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# matrixfsdp GPU benchmark", "",
             f"Command: `{meta['command']}`; {meta['date']}; device {meta['device']}; "
             f"torch {meta['torch']}; {meta['seconds']:.0f} s in all.", "",
             "| section | case | shape | ms | rate | check | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = "" if r["ms"] is None else f"{r['ms']:.1f}"
        lines.append(f"| {r['section']} | {r['case']} | {r['shape']} | {ms} | {r['rate']} | "
                     f"{r['check']} | {'ok' if r['ok'] else 'FAILED'} |")
    lines += ["", "FLOP counts: Newton–Schulz 30 n³; Scaled CANS 28 (fp16) / 27 (fp32) GEMMs of "
              "2d³; QR refresh ~7.3 d³; eigh ~11 d³. Medians of interleaved repeats."]
    return "\n".join(lines) + "\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.md"))
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto/cuda: the first CUDA device (exit 0 without one); cpu: run on CPU")
    p.add_argument("--tiny", action="store_true", help="toy sizes (for checking the code paths)")
    p.add_argument("--allow-cpu", action="store_true", help="same as --device cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    want_cpu = args.device == "cpu" or args.allow_cpu
    if not want_cpu and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device (torch.cuda.is_available() is False); skipping. "
              "Pass --device cpu --tiny to run every section's code on CPU.")
        return 0
    device = torch.device("cpu") if want_cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    rows = run(SIZES["tiny" if args.tiny else "full"], device)
    meta = {"command": " ".join(["python benchmarks/gpu.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__, "seconds": time.time() - start}
    text = markdown(meta, rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
