"""The ``matrixfsdp`` command line, end to end (real torchrun launches on 2 ranks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import matrixfsdp as mf

from .dist_utils import run_world

TINY = [
    "--set", "corpus_bytes=100000", "--set", "model.dim=32", "--set", "model.hidden=64",
    "--set", "model.layers=2", "--set", "model.heads=2", "--set", "model.seq_len=32",
    "--set", "warmup_steps=2", "--set", "global_batch=8", "--set", "eval_batches=1",
]


def _cli(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "matrixfsdp", *args], capture_output=True,
                          text=True, env=full_env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"matrixfsdp {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _train(out: Path, steps: int, *extra: str, env: dict | None = None, check: bool = True):
    return _cli("train", "--nproc", "2", "--steps", str(steps), "--out", str(out),
                "--set", "checkpoint_every=3", "--set", "eval_every=4", *TINY, *extra,
                env=env, check=check)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _train(out, 8)
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        for key in ("loss", "lr", "time_forward", "time_backward", "time_optimizer",
                    "tokens_per_s", "matrix_comm_bytes_sent", "peak_rss_mib"):
            assert key in r, key
        assert r["matrix_comm_bytes_sent"]["optimizer"] <= 4  # only the clip-norm scalar
        assert r["matrix_comm_bytes_sent"]["forward"] > 0
    assert "val_loss" in records[3] and "val_loss" in records[7]
    assert records[-1]["loss"] < records[0]["loss"]
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "final train loss" in (out / "summary.txt").read_text()
    assert "unigram baseline" in proc.stdout
    latest = mf.checkpoint.latest(out / "checkpoints")
    assert latest is not None and latest.name == "step_00000008"
    layout = mf.checkpoint.read_layout(latest)
    assert layout.step == 8 and layout.world_size == 2 and layout.plan.matrices
    text = _cli("inspect", str(latest)).stdout
    assert "step 8" in text and "world size 2" in text
    lrs = re.findall(r", lr (\S+)", text)  # learning rates rounded to 4 significant digits
    assert len(lrs) == 2 and all(v == f"{float(v):.4g}" for v in lrs), lrs


def test_kill_and_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    killed = _train(tmp_path / "a", 8, env={"MATRIXFSDP_FAIL_AT_STEP": "5"}, check=False)
    assert killed.returncode != 0 and "--resume" in killed.stderr
    assert mf.checkpoint.latest(tmp_path / "a" / "checkpoints").name == "step_00000003"
    _train(tmp_path / "a", 8, "--resume")
    _train(tmp_path / "b", 8)
    resumed, straight = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert resumed[-1]["loss"] == straight[-1]["loss"]
    assert resumed[-1]["val_loss"] == straight[-1]["val_loss"]


def test_bad_config_fails_before_launch(tmp_path: Path) -> None:
    proc = _cli("train", "--out", str(tmp_path), "--set", "lr=-1", check=False)
    assert proc.returncode == 2 and "lr" in proc.stderr and "greater than 0" in proc.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  dim: 30\n  heads: 4\n")
    proc = _cli("train", "--config", str(cfg), check=False)
    assert proc.returncode == 2 and "model.dim" in proc.stderr
    cfg.write_text("learning_rate: 0.1\n")
    proc = _cli("train", "--config", str(cfg), check=False)
    assert proc.returncode == 2 and "learning_rate" in proc.stderr
    cfg.write_text("model: [1, 2\n  dim: 3\n")  # malformed YAML: one line naming the file
    proc = _cli("train", "--config", str(cfg), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and str(cfg) in proc.stderr, proc.stderr
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(("name", "text"), [("bad.yaml", "lr: [0.1\n  x: 1\n"),
                                            ("bad.json", '{"lr": 0.1,,}'),
                                            ("bytes.json", "\udcff")])
def test_malformed_config_file_is_one_config_error(tmp_path: Path, name: str, text: str) -> None:
    from matrixfsdp.launch.config import ConfigError, load_config

    path = tmp_path / name
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match="^" + re.escape(f"config file '{path}' is not valid")) as info:
        load_config(path)
    assert "\n" not in str(info.value)


def _every_optimizer(rank: int, world: int, out: str) -> None:
    from matrixfsdp.launch.config import load_config
    from matrixfsdp.launch.train import train

    for name in ("muon", "shampoo", "soap", "okls", "emagram", "adamw"):
        overrides = {a.split("=")[0]: json.loads(a.split("=")[1]) for a in TINY[1::2]}
        cfg = load_config(None, optimizer=name, steps=4, out=f"{out}/{name}", eval_every=4,
                          checkpoint_every=4, **overrides)
        metrics = train(cfg)
        if rank == 0:
            assert len(metrics) == 4 and metrics[-1]["loss"] < metrics[0]["loss"], (name, metrics)


def test_every_optimizer_trains(tmp_path: Path) -> None:
    run_world(2, _every_optimizer, str(tmp_path))
    for name in ("muon", "okls", "adamw"):
        assert mf.checkpoint.latest(tmp_path / name / "checkpoints") is not None


@pytest.mark.parametrize("args", [["plan", "--world-size", "0"], ["inspect", "/nonexistent"]])
def test_cli_errors_are_clean(args: list[str]) -> None:
    proc = _cli(*args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_plan_with_tensor_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --tp``: the dp ranks of one tp group plan the global shapes (as the runtime does)."""
    from matrixfsdp.launch.cli import main
    from matrixfsdp.launch.plan_cmd import plan_for_model

    assert main(["plan", "--world-size", "64", "--tp", "8", "--model", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "8 dp ranks x 8 tp ranks" in out and "1/8 of the bytes" in out
    with_tp = plan_for_model("llama3-8b", 64, tp=8)
    assert with_tp.plan_hash() == plan_for_model("llama3-8b", 8).plan_hash()
    assert main(["plan", "--world-size", "64", "--tp", "3"]) == 2
    assert "--tp 3 must be a positive divisor" in capsys.readouterr().err


def test_tp_config_must_split_heads_and_hidden() -> None:
    from matrixfsdp.launch.config import ConfigError, load_config

    assert load_config(None, tp=2).tp == 2
    with pytest.raises(ConfigError, match=r"model\.heads \(4\) must be divisible by tp \(3\)"):
        load_config(None, tp=3)


def _train_tp(rank: int, world: int, out: str) -> None:
    from matrixfsdp.launch.config import load_config
    from matrixfsdp.launch.train import train

    overrides = {a.split("=")[0]: json.loads(a.split("=")[1]) for a in TINY[1::2]}
    losses = {}
    for tp in (1, 2):
        cfg = load_config(None, tp=tp, steps=4, out=f"{out}/tp{tp}", eval_every=4,
                          checkpoint_every=4, **overrides)
        losses[tp] = [r["loss"] for r in train(cfg)]
    if rank == 0:  # the same math: TP splits the blocks, the step sees whole matrices
        for a, b in zip(losses[1], losses[2], strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (losses[1], losses[2])


def test_train_with_tensor_parallelism(tmp_path: Path) -> None:
    """``train --tp 2`` (the default GPT parallelized) follows the ``--tp 1`` run's losses and
    checkpoints a layout that records the TP split."""
    run_world(2, _train_tp, str(tmp_path))
    latest = mf.checkpoint.latest(tmp_path / "tp2" / "checkpoints")
    assert latest is not None
    layout = mf.checkpoint.read_layout(latest)
    assert layout.tp_size == 2 and layout.world_size == 1
