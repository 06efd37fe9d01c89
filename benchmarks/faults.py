"""Faults end to end: random SIGKILLs under torchrun, a 4 -> 3 resume, and a hung rank.

    python -m benchmarks.faults [--steps 120] [--every 20] [--seed 0] [--skip-elastic]

1. *Restarts.* ``matrixfsdp train --nproc 2 --max-restarts 2`` runs ``--steps`` steps with a
   checkpoint every ``--every``; this script SIGKILLs a random worker rank at two random steps
   (from outside, like a preemption). An uninterrupted run with the same flags is the
   reference. Checked: exit status, final weights bitwise equal to the reference's, every metric
   row present once, no checkpoint directory ever written twice (polled inodes), and the steps
   redone per kill (kill step - resume step, at most one interval).
2. *Elastic.* 4 ranks die at step 30 of 40; ``--nproc 3 --resume`` finishes; compared with an
   uninterrupted 4-rank run (losses and final weights; only fp32 reduction order differs).
3. *No hangs.* 3 ranks, ``collective_timeout_s=10``; one worker is frozen (SIGSTOP) mid-run; the
   time until both survivors exited is measured.

Prints a markdown report and writes ``benchmarks/results/faults.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import matrixfsdp as mf

MODEL = ["--set", "corpus_bytes=300000", "--set", "model.dim=64", "--set", "model.hidden=192",
         "--set", "model.layers=2", "--set", "model.heads=4", "--set", "model.seq_len=64",
         "--set", "global_batch=12", "--set", "warmup_steps=10", "--set", "eval_every=1000",
         "--set", "eval_batches=1"]
RESULTS = Path(__file__).parent / "results" / "faults.json"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _worker_ranks(cli_pid: int) -> dict[int, int]:
    """rank -> pid of the live training workers started by the ``matrixfsdp train`` process."""
    ranks = {}
    for pid in _children(cli_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _launch(out: Path, nproc: int, steps: int, every: int, *extra: str,
            env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "matrixfsdp", "train", "--nproc", str(nproc), "--steps",
           str(steps), "--out", str(out), "--set", f"checkpoint_every={every}", *MODEL, *extra]
    log = (out.parent / f"{out.name}.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _wait(proc: subprocess.Popen, timeout: float = 3600) -> int:
    return proc.wait(timeout=timeout)


def _weights(run: Path, step: int, scratch: Path) -> dict[str, torch.Tensor]:
    ckpt = mf.checkpoint.step_dir(run / "checkpoints", step)
    return torch.load(mf.checkpoint.export_full(ckpt, scratch / f"{run.name}.pt"), weights_only=True)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def restarts(tmp: Path, steps: int, every: int, rng: random.Random) -> dict:
    ref, run = tmp / "reference", tmp / "killed"
    t0 = time.perf_counter()
    assert _wait(_launch(ref, 2, steps, every)) == 0, (tmp / "reference.log").read_text()[-3000:]
    ref_s = time.perf_counter() - t0
    kill_at = sorted(rng.sample(range(every + 2, steps - 2), 2))
    kills, inodes, rewritten = [], {}, []
    t0 = time.perf_counter()
    proc = _launch(run, 2, steps, every, "--max-restarts", "2")
    while proc.poll() is None:
        for child in (run / "checkpoints").glob("step_*"):
            try:
                ino = child.stat().st_ino
            except FileNotFoundError:
                continue
            if inodes.setdefault(child.name, ino) != ino and child.name not in rewritten:
                rewritten.append(child.name)
        step = _last_step(run)
        if kill_at and step >= kill_at[0]:
            workers = _worker_ranks(proc.pid)
            if len(workers) == 2:
                rank = rng.randrange(2)
                os.kill(workers[rank], signal.SIGKILL)
                kills.append({"rank": rank, "after_step": step})
                kill_at.pop(0)
        time.sleep(0.02)
    run_s = time.perf_counter() - t0
    log = (tmp / "killed.log").read_text(errors="replace")
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", log)]
    for kill, resume in zip(kills, resumed, strict=False):
        kill["resumed_at"], kill["redone_steps"] = resume, kill["after_step"] - resume
    rows = [r["step"] for r in _metrics(run)]
    got, want = _weights(run, steps, tmp), _weights(ref, steps, tmp)
    return {
        "exit_code": proc.returncode, "kills": kills, "restarts": len(resumed),
        "bitwise_equal_weights": all(torch.equal(got[k], want[k]) for k in want),
        "tensors": len(want), "metric_rows_once": rows == list(range(1, steps + 1)),
        "losses_equal": [r["loss"] for r in _metrics(run)] == [r["loss"] for r in _metrics(ref)],
        "checkpoints_seen": sorted(inodes), "rewritten": rewritten,
        "max_redone_steps": max((k.get("redone_steps", steps) for k in kills), default=None),
        "wall_s": {"reference": round(ref_s, 1), "with_kills": round(run_s, 1)},
    }


def elastic(tmp: Path, steps: int = 40, every: int = 20, die: int = 30) -> dict:
    ref, run = tmp / "ref4", tmp / "elastic"
    assert _wait(_launch(ref, 4, steps, every)) == 0
    _wait(_launch(run, 4, steps, every, env={"MATRIXFSDP_FAIL_AT_STEP": str(die)}))
    assert _wait(_launch(run, 3, steps, every, "--resume")) == 0
    got, want = _metrics(run), _metrics(ref)
    wg, ww = _weights(run, steps, tmp), _weights(ref, steps, tmp)
    rel = max(((wg[k] - ww[k]).norm() / ww[k].norm()).item() for k in ww)
    return {
        "worlds": "4 -> 3", "resumed_at": every * (die // every),
        "metric_rows_once": [r["step"] for r in got] == list(range(1, steps + 1)),
        "max_loss_rel_diff": max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, want, strict=True)),
        "final_weights_rel_err": rel,
        "saved_world_sizes": [mf.checkpoint.read_layout(p).world_size
                              for p in sorted((run / "checkpoints").glob("step_*"))],
    }


def hang(tmp: Path, timeout_s: float = 10) -> dict:
    run = tmp / "hang"
    proc = _launch(run, 3, 1000, 1000, "--set", f"collective_timeout_s={timeout_s:g}")
    while _last_step(run) < 5:
        assert proc.poll() is None, (tmp / "hang.log").read_text()[-3000:]
        time.sleep(0.05)
    workers = _worker_ranks(proc.pid)
    os.kill(workers[2], signal.SIGSTOP)
    start = time.perf_counter()
    survivors = {workers[0], workers[1]}
    while survivors & set(_children(proc.pid)) and time.perf_counter() - start < timeout_s + 120:
        time.sleep(0.05)
    exited = time.perf_counter() - start
    os.kill(workers[2], signal.SIGKILL)
    _wait(proc)
    log = (tmp / "hang.log").read_text(errors="replace")
    return {"collective_timeout_s": timeout_s, "survivors_exit_s": round(exited, 1),
            "clear_error_logged": log.count("lost its peers") == 2}


def _report(res: dict, cmd: str) -> str:
    r = res["restarts"]
    lines = [f"Command: `{cmd}`  ", f"Machine: {res['machine']}", "",
             "| check | result |", "|---|---|",
             f"| exit status after {len(r['kills'])} SIGKILLs, --max-restarts 2 | {r['exit_code']} |",
             "| kills (rank, after step -> resumed at) | "
             + ", ".join(f"rank {k['rank']}: {k['after_step']} -> {k.get('resumed_at')}" for k in r["kills"])
             + " |",
             f"| final weights bitwise equal to the uninterrupted run ({r['tensors']} tensors) | "
             f"{r['bitwise_equal_weights']} |",
             f"| every loss bitwise equal | {r['losses_equal']} |",
             f"| metric rows 1..N each once | {r['metric_rows_once']} |",
             f"| checkpoints written twice | {r['rewritten'] or 'none'} |",
             f"| most steps redone per kill (interval {res['every']}) | {r['max_redone_steps']} |",
             f"| wall time: uninterrupted / with kills (loaded machine) | "
             f"{r['wall_s']['reference']} s / {r['wall_s']['with_kills']} s |"]
    if "elastic" in res:
        e = res["elastic"]
        lines += [f"| elastic {e['worlds']}: resumed at step {e['resumed_at']}, max loss rel. diff "
                  f"vs 4 ranks | {e['max_loss_rel_diff']:.1e} |",
                  f"| elastic: final weights rel. error vs 4 ranks | {e['final_weights_rel_err']:.1e} |"]
    h = res["hang"]
    lines.append(f"| frozen rank: survivors exited after (timeout {h['collective_timeout_s']:g} s) | "
                 f"{h['survivors_exit_s']} s (clear error: {h['clear_error_logged']}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-elastic", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="matrixfsdp-faults-"))
    res: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                 "steps": args.steps, "every": args.every, "seed": args.seed}
    try:
        res["restarts"] = restarts(tmp, args.steps, args.every, rng)
        if not args.skip_elastic:
            res["elastic"] = elastic(tmp)
        res["hang"] = hang(tmp)
    finally:
        print(f"logs: {tmp}", file=sys.stderr)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(_report(res, "python -m benchmarks.faults " + " ".join(sys.argv[1:])))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
