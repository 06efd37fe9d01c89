"""Faults: torchrun restarts resume exactly, elastic world size, no hangs, crash-safe checkpoints."""

from __future__ import annotations

import datetime
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import matrixfsdp as mf
from matrixfsdp.checkpoint.layout import COMPLETE_FILE, LAYOUT_FILE, CompleteMarker
from matrixfsdp.checkpoint.storage import METADATA_FILE, prepare_target, read_marker
from matrixfsdp.launch import cli
from matrixfsdp.launch.faults import RunExistsError, StartMode, move_aside, resolve_start

from .fault_utils import TINY_TRAIN, metric_steps, read_metrics, start_world, train_rank, wait_exit
from .models import TinyTransformer

STEPS = 12  # checkpoints every 4 steps (TINY_TRAIN)
NAN = {"MATRIXFSDP_NAN_GRAD": "1:2"}  # every run: rank 1's gradient of step 3 holds a NaN


def _logs(log_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("*.log")))


def _run_world(world: int, argv: list[str], log_dir: Path, codes: list[int] | None = None,
               env: dict[str, str] | None = None) -> None:
    procs = start_world(world, train_rank, argv, log_dir=log_dir, env=env)
    got = wait_exit(procs, timeout=240)
    assert got == (codes or [0] * world), f"exit codes {got}:\n{_logs(log_dir)[-5000:]}"


def _weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    file = mf.checkpoint.export_full(checkpoint, scratch / f"{checkpoint.parent.parent.name}.pt")
    return torch.load(file, weights_only=True)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 12-step run on 2 ranks; step 3 is skipped (a NaN gradient on rank 1)."""
    root = tmp_path_factory.mktemp("reference")
    _run_world(2, ["--out", str(root / "run"), "--steps", str(STEPS), *TINY_TRAIN], root / "logs",
               env=NAN)
    rows = read_metrics(root / "run")
    assert [r["skipped"] for r in rows] == [s == 3 for s in range(1, STEPS + 1)]
    assert [r["skipped_steps"] for r in rows] == [int(s >= 3) for s in range(1, STEPS + 1)]
    assert "skipped an optimizer step" in _logs(root / "logs")
    return root / "run"


# -- restarts under torchrun ------------------------------------------------------------------------
class _CheckpointWatcher:
    """Polls a checkpoint root; a directory that reappears with a new inode was rewritten.

    Directories present before the launch (the run that ``--overwrite`` moves aside) are ignored.
    """

    def __init__(self, root: Path) -> None:
        self.root, self.inodes, self.rewritten = root, {}, []
        self.before = set(self._scan())

    def _scan(self) -> list[tuple[str, int]]:
        found = []
        for child in self.root.glob("step_*") if self.root.is_dir() else ():
            try:
                found.append((child.name, child.stat().st_ino))
            except FileNotFoundError:
                continue
        return found

    def poll(self) -> None:
        for name, inode in self._scan():
            if (name, inode) in self.before:
                continue
            if self.inodes.setdefault(name, inode) != inode:
                self.rewritten.append(name)


def test_torchrun_restarts_resume_exactly(reference: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Two ranks SIGKILLed under --max-restarts 2: the run completes, bitwise as if never killed."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    argv = ["train", "--nproc", "2", "--steps", str(STEPS), "--out", str(run), *TINY_TRAIN]
    assert cli.main(argv) == 2  # checkpoints there, neither --resume nor --overwrite
    assert "--resume" in capsys.readouterr().err
    env = {**os.environ, **NAN, "OMP_NUM_THREADS": "1", "MATRIXFSDP_FAULTS": "0:1:6,1:0:10"}
    watcher = _CheckpointWatcher(run / "checkpoints")
    log = tmp_path / "torchrun.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "matrixfsdp", *argv, "--max-restarts", "2",
                                 "--overwrite"], env=env, stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            watcher.poll()
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, output[-6000:]
    assert output.count("fault injection: SIGKILL") == 2 and "lost its peers" in output
    # Each restart resumed from the newest checkpoint before its kill: no interval lost or redone
    # beyond the steps since that checkpoint, and no completed checkpoint written again.
    assert "step_00000004 at step 4" in output and "step_00000008 at step 8" in output, output
    assert watcher.rewritten == [] and sorted(watcher.inodes) == [
        f"step_{s:08d}" for s in (4, 8, 12)]
    assert metric_steps(run) == list(range(1, STEPS + 1))
    for key in ("loss", "skipped_steps"):  # the skipped-step count comes back from checkpoints
        assert [r[key] for r in read_metrics(run)] == [r[key] for r in read_metrics(reference)]
    (moved,) = tmp_path.glob("run.old-*")  # --overwrite moved the old run aside, intact
    assert metric_steps(moved) == list(range(1, STEPS + 1))
    final = f"checkpoints/step_{STEPS:08d}"
    got, want = _weights(run / final, tmp_path), _weights(reference / final, tmp_path)
    assert got.keys() == want.keys()
    for fqn in want:
        assert torch.equal(got[fqn], want[fqn]), f"{fqn} differs from the uninterrupted run"


_RDZV_WORKER = """
import os, signal, torch, torch.distributed as dist
from matrixfsdp.launch.faults import init_process_group, restart_count
init_process_group("gloo", 60)
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1 and restart_count() < 2:
    os.kill(os.getpid(), signal.SIGKILL)
print(f"rank {dist.get_rank()} attempt {restart_count()} sum {int(t.item())}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_sharing_its_store_restarts_cleanly(tmp_path: Path) -> None:
    """A plain ``torchrun`` (agent store shared with the workers): every restart rendezvouses.

    Without per-attempt keys, restarted gloo workers read the dead generation's addresses and
    fail with ``connectFullMesh ... Connection refused`` (seen in 3 of 3 trials).
    """
    script = tmp_path / "worker.py"
    script.write_text(_RDZV_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--max-restarts", "2", "--standalone", str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    # The two ranks share one pipe, so their lines may interleave: match records, not lines.
    seen = set(re.findall(r"rank (\d) attempt (\d) sum (\d)", proc.stdout))
    assert {("0", "2", "2"), ("1", "2", "2")} <= seen, proc.stdout
    assert all(total == "2" for *_, total in seen), proc.stdout
    assert ("1", "0", "2") not in seen and ("1", "1", "2") not in seen, proc.stdout  # killed
    assert "connectFullMesh" not in proc.stderr


# -- elastic world size -----------------------------------------------------------------------------
def test_resume_at_another_world_size(reference: Path, tmp_path: Path) -> None:
    """3 ranks die at step 10; 2 ranks resume from step 8 and track the 2-rank reference."""
    out = tmp_path / "run"
    argv = ["--out", str(out), "--steps", str(STEPS), *TINY_TRAIN]
    _run_world(3, argv, tmp_path / "w3", codes=[17] * 3, env={**NAN, "MATRIXFSDP_FAIL_AT_STEP": "10"})
    assert mf.checkpoint.read_layout(out / "checkpoints/step_00000008").world_size == 3
    _run_world(2, [*argv, "--resume"], tmp_path / "w2")
    assert "at step 8 (world size 2)" in _logs(tmp_path / "w2")
    assert mf.checkpoint.read_layout(out / f"checkpoints/step_{STEPS:08d}").world_size == 2
    assert metric_steps(out) == list(range(1, STEPS + 1))
    # The same global batches at any world size: only fp32 reduction order differs (measured:
    # losses within 1.3e-7 relative, weights 5.6e-6 after 12 steps).
    for got, want in zip(read_metrics(out), read_metrics(reference), strict=True):
        assert got["skipped_steps"] == want["skipped_steps"]
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"]), (got, want)
    final = f"checkpoints/step_{STEPS:08d}"
    got, want = _weights(out / final, tmp_path), _weights(reference / final, tmp_path)
    for fqn in want:
        assert _rel_err(got[fqn], want[fqn]) <= 1e-5, fqn  # measured 5.6e-6


# -- no hangs ---------------------------------------------------------------------------------------
def test_survivors_of_a_hung_rank_exit_within_the_timeout(tmp_path: Path) -> None:
    """A rank frozen mid-run (SIGSTOP: its sockets stay open) stops its peers after the timeout."""
    timeout = 10  # shorter ones can fire on a heavily loaded machine before the freeze
    out = tmp_path / "run"
    argv = ["--out", str(out), "--steps", "400", *TINY_TRAIN,
            "--set", f"collective_timeout_s={timeout}", "--set", "checkpoint_every=1000"]
    procs = start_world(3, train_rank, argv, log_dir=tmp_path / "logs")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (
                (out / "metrics.jsonl").is_file() and len(metric_steps(out)) >= 3):
            assert all(p.is_alive() for p in procs), _logs(tmp_path / "logs")
            time.sleep(0.05)
        os.kill(procs[2].pid, signal.SIGSTOP)
        start = time.monotonic()
        codes = wait_exit(procs[:2], timeout=timeout + 10)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.join()
    logs = _logs(tmp_path / "logs")
    assert codes == [1, 1] and elapsed <= timeout + 10, (codes, elapsed, logs[-3000:])
    assert logs.count("lost its peers") == 2 and f"collective_timeout_s={timeout} s" in logs


# -- start rules ------------------------------------------------------------------------------------
def _fake_checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / METADATA_FILE).write_bytes(b"")
    (path / LAYOUT_FILE).write_text("{}")
    (path / COMPLETE_FILE).write_text(CompleteMarker(step=step).model_dump_json())
    return path


def test_fresh_launch_into_a_run_needs_resume_or_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fake_checkpoint(out / "checkpoints" / "step_00000004", 4)
    with pytest.raises(RunExistsError, match=r"--resume .*--overwrite"):
        resolve_start(out, resume=False, overwrite=False, restarts=0)
    with pytest.raises(ValueError, match="exclude each other"):
        resolve_start(out, resume=True, overwrite=True, restarts=0)
    assert resolve_start(out, resume=True, overwrite=False, restarts=0) is StartMode.RESUME
    assert resolve_start(out, resume=False, overwrite=False, restarts=1) is StartMode.RESUME
    assert resolve_start(out, resume=False, overwrite=True, restarts=0) is StartMode.FRESH
    assert resolve_start(tmp_path / "new", resume=False, overwrite=False, restarts=0) is StartMode.FRESH
    moved = move_aside(out)
    assert moved is not None and not out.exists()
    assert (moved / "checkpoints" / "step_00000004" / COMPLETE_FILE).is_file()
    assert move_aside(out) is None


def test_latest_survives_an_interrupted_replace(tmp_path: Path) -> None:
    """A save killed between moving the old checkpoint aside and renaming the new one in."""
    root = tmp_path
    _fake_checkpoint(root / "step_00000001", 1)
    _fake_checkpoint(root / "same", 3)
    os.rename(root / "same", root / ".same.old")  # publish() died right after its first rename
    _fake_checkpoint(root / ".same.tmp", 5)
    assert mf.checkpoint.latest(root) == root / ".same.old"
    prepare_target(root / "same")  # the next save to the same path restores it first
    assert read_marker(root / "same").step == 3 and not (root / ".same.old").exists()
    assert mf.checkpoint.latest(root) == root / "same"
    _fake_checkpoint(root / ".same.old", 2)  # a leftover beside a present checkpoint: ignored
    assert mf.checkpoint.latest(root) == root / "same"
    mf.checkpoint.remove_checkpoint(root / "same")
    assert sorted(p.name for p in root.iterdir()) == [".same.old", ".same.tmp", "step_00000001"]


# -- crash-safe under repetition --------------------------------------------------------------------
def _saver(rank: int, world: int, root: str, ready: str, keep_saving: bool) -> None:
    """Load the latest checkpoint (checking its values), then save forever; SIGKILLed by the test."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    model = TinyTransformer()
    mf.fully_shard_matrix(model)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02)
    model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    opt.step()  # optimizer state exists from here on
    found = mf.checkpoint.latest(root)
    step = 0
    if found is not None:
        step = mf.checkpoint.load(found, model, opt)["step"]
        for fqn, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            assert torch.all(local == step), f"{found}: {fqn} holds other values than step {step}"
    if rank == 0:
        Path(ready).write_text(str(step))
    while keep_saving:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).fill_(step)
        # Odd steps replace one directory in place, even steps add a directory and prune.
        path = Path(root) / "same" if step % 2 else mf.checkpoint.step_dir(root, step)
        mf.checkpoint.save(path, model, opt, step=step)
        if rank == 0 and step % 2 == 0:
            for old in sorted(Path(root).glob("step_*"))[:-1]:
                mf.checkpoint.remove_checkpoint(old)
    dist.destroy_process_group()


def test_checkpoints_survive_repeated_kills_while_saving(tmp_path: Path) -> None:
    """A saving rank is SIGKILLed at random moments: latest() always loads, and never goes back."""
    kills, rng = 5, random.Random(14)
    root, newest = tmp_path / "ckpt", 0
    for attempt in range(kills + 1):
        ready, logs = tmp_path / f"ready{attempt}", tmp_path / f"logs{attempt}"
        last = attempt == kills
        procs = start_world(2, _saver, str(root), str(ready), not last, log_dir=logs)
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and all(
                p.is_alive() or p.exitcode == 0 for p in procs):
            time.sleep(0.02)
        if not ready.exists():
            wait_exit(procs, 0)
            pytest.fail(f"attempt {attempt}: loading the latest checkpoint failed:\n{_logs(logs)}")
        loaded = int(ready.read_text())
        assert loaded >= newest, f"attempt {attempt}: resumed at {loaded}, newest was {newest}"
        if last:
            assert wait_exit(procs, 60) == [0, 0], _logs(logs)
            break
        while _latest_step(root) <= loaded and time.monotonic() < deadline:
            time.sleep(0.02)  # let this world publish at least one checkpoint
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(procs[rng.randrange(2)].pid, signal.SIGKILL)
        wait_exit(procs, 30)
        found = mf.checkpoint.latest(root)
        assert found is not None or newest == 0
        if found is not None:
            mf.checkpoint.open_checkpoint(found)  # layout, DCP metadata and every data file
            newest = read_marker(found).step
    assert newest >= kills, f"a world published no checkpoint before its kill (newest {newest})"


def _latest_step(root: Path) -> int:
    found = mf.checkpoint.latest(root)
    marker = None if found is None else read_marker(found)
    return -1 if marker is None else marker.step
