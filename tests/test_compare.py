"""Per-optimizer recommended defaults and ``matrixfsdp compare`` (resume, plot, table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrixfsdp.launch.compare import RunState, parse_optimizers, run_state
from matrixfsdp.launch.config import OPTIMIZER_NAMES, ConfigError, load_config
from matrixfsdp.optim.defaults import recommended_hyperparameters
from matrixfsdp.optim.registry import get_matrix_optimizer

from .dist_utils import run_world

TINY = {"corpus_bytes": 100_000, "model.dim": 32, "model.hidden": 64, "model.layers": 2,
        "model.heads": 2, "model.seq_len": 32, "warmup_steps": 2, "global_batch": 8}
TINY_FLAGS = [x for key, value in TINY.items() for x in ("--set", f"{key}={value}")]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "matrixfsdp", *args], capture_output=True,
                          text=True, env=full_env, timeout=300)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_recommended_defaults_are_valid_configs(name: str) -> None:
    rec = recommended_hyperparameters(name)
    get_matrix_optimizer(name).make_config(dict(rec.optimizer_kwargs))  # unknown keys raise
    assert rec.lr > 0 and rec.weight_decay >= 0 and rec.source
    cfg = load_config(None, optimizer=name)
    assert (cfg.lr, cfg.weight_decay) == (rec.lr, rec.weight_decay)
    assert (cfg.tail_lr, cfg.tail_weight_decay) == rec.resolved_tail(rec.lr, rec.weight_decay)
    assert {k for k in cfg.optimizer_kwargs} == set(rec.optimizer_kwargs)
    assert {"lr", "weight_decay", "tail_lr", "tail_weight_decay"} <= set(cfg.defaults_applied)


def test_config_records_defaults_and_user_values(tmp_path: Path) -> None:
    okls = load_config(None, optimizer="okls")
    assert (okls.lr, okls.weight_decay) == (0.09434, 0.0303)  # the release's, not OKLSConfig's
    assert okls.optimizer_kwargs == {"beta1": 0.9684, "beta2": 0.9482, "eps": 1e-9}
    # --set lr / optimizer_kwargs.KEY win and are not listed as defaults
    mine = load_config(None, optimizer="okls", lr=0.05, **{"optimizer_kwargs.beta1": 0.9})
    assert mine.lr == 0.05 and mine.optimizer_kwargs["beta1"] == 0.9
    assert mine.optimizer_kwargs["beta2"] == 0.9482
    assert "lr" not in mine.defaults_applied and "optimizer_kwargs.beta1" not in mine.defaults_applied
    assert "optimizer_kwargs.beta2" in mine.defaults_applied
    # AdamW everywhere: the tail follows the (user's) lr unless tail_lr is set
    adamw = load_config(None, optimizer="adamw", lr=0.004)
    assert adamw.tail_lr == 0.004 and "tail_lr" in adamw.defaults_applied
    assert load_config(None, optimizer="adamw", lr=0.004, tail_lr=0.001).tail_lr == 0.001
    # config.json round trip is stable; reloaded with another optimizer, defaults re-resolve
    saved = tmp_path / "config.json"
    saved.write_text(mine.model_dump_json())
    assert load_config(saved) == mine
    soap = load_config(saved, optimizer="soap", **{"optimizer_kwargs": {}})
    assert soap.lr == 0.05  # the user's lr stays
    assert soap.weight_decay == recommended_hyperparameters("soap").weight_decay
    assert soap.optimizer_kwargs == {"betas": [0.95, 0.95], "eps": 1e-8, "precondition_frequency": 10}
    # a file value overridden on the command line becomes the user's
    assert "weight_decay" not in load_config(saved, weight_decay=0.1).defaults_applied


def test_bad_optimizer_name_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="choose from muon, shampoo, soap, okls, emagram, adamw"):
        parse_optimizers("muon,sgd")
    with pytest.raises(ConfigError, match="more than once"):
        parse_optimizers("muon,muon")
    proc = _cli("compare", "--optimizers", "muon,Adam", "--out", str(tmp_path))
    assert proc.returncode == 2 and "'Adam'" in proc.stderr
    assert all(name in proc.stderr for name in OPTIMIZER_NAMES) and "Traceback" not in proc.stderr
    proc = _cli("train", "--set", "optimizer=lion", "--out", str(tmp_path))
    assert proc.returncode == 2 and all(f"'{name}'" in proc.stderr for name in OPTIMIZER_NAMES)
    assert not any(tmp_path.iterdir())  # nothing started


def test_run_state_refuses_another_configuration(tmp_path: Path) -> None:
    cfg = load_config(None, optimizer="muon", out=str(tmp_path / "muon"), steps=8, **TINY)
    assert run_state(cfg) == (RunState.NEW, 0)
    (tmp_path / "muon").mkdir()
    (tmp_path / "muon" / "config.json").write_text(cfg.model_dump_json())
    assert run_state(cfg) == (RunState.NEW, 0)
    other = load_config(None, optimizer="muon", out=str(tmp_path / "muon"), steps=9, lr=0.01, **TINY)
    with pytest.raises(ConfigError, match="lr, steps differ"):
        run_state(other)
    (tmp_path / "muon" / "metrics.jsonl").write_text(json.dumps({"step": 8}) + "\n")
    (tmp_path / "muon" / "summary.txt").write_text("done\n")
    assert run_state(cfg) == (RunState.FINISHED, 8)
    (tmp_path / "muon" / "metrics.jsonl").write_text(json.dumps({"step": 8})[:5])  # cut by a kill
    assert run_state(cfg) == (RunState.NEW, 0)
    (tmp_path / "muon" / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        run_state(cfg)


# A small GPT (2 layers, dim 64, MLP 256, 64 bytes of context; unigram baseline 3.16 nats/byte)
# trained 30 steps from ~5.9 nats/byte. Bound = the final validation loss each optimizer's
# defaults reached on the development machine (in brackets) + 0.04 of headroom. lr 0.02 for
# Shampoo / AdamW, the single lr every optimizer got before per-optimizer defaults, misses the
# bound by 0.05 / 0.16 (measured 2.891 / 3.111), so a bad default fails this test. So does
# Shampoo without its preconditioner: with precondition_frequency 100 (Distributed Shampoo's
# example; start_preconditioning_step -1 = 100) all 30 steps are its grafted Adam alone (2.906).
DEFAULTS_STEPS = 30
DEFAULTS_BOUND = {"muon": 2.86, "okls": 2.87, "soap": 2.97, "shampoo": 2.84, "emagram": 2.90,
                  "adamw": 2.95}  # measured 2.818, 2.833, 2.931, 2.801, 2.859, 2.906
SMALL = {**TINY, "model.dim": 64, "model.hidden": 256, "model.seq_len": 64, "eval_batches": 8}


def _defaults_train(rank: int, world: int, out: str) -> None:
    from matrixfsdp.launch.train import train

    cases = [(name, {}) for name in OPTIMIZER_NAMES] + [
        ("shampoo", {"lr": 0.02}), ("adamw", {"lr": 0.02}),
        ("shampoo", {"optimizer_kwargs.precondition_frequency": 100})]
    results = {}
    for i, (name, changed) in enumerate(cases):
        cfg = load_config(None, optimizer=name, steps=DEFAULTS_STEPS, eval_every=DEFAULTS_STEPS,
                          checkpoint_every=DEFAULTS_STEPS, out=f"{out}/{i}_{name}", **SMALL, **changed)
        metrics = train(cfg)
        results[name, tuple(changed.items())] = (metrics[0]["loss"], metrics[-1]["val_loss"])
    for (name, changed), (first, val) in results.items():
        bound = DEFAULTS_BOUND[name]
        assert first > 5.0, (name, first)
        if not changed:
            assert val <= bound, f"{name} defaults: val loss {val:.3f} after {DEFAULTS_STEPS} steps > {bound}"
        else:
            assert val > bound, f"{name} with {changed} reached {val:.3f} <= {bound}: the test cannot fail"


def test_recommended_defaults_train_the_test_model(tmp_path: Path) -> None:
    run_world(1, _defaults_train, str(tmp_path))


def _compare(out: Path, optimizers: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return _cli("compare", "--optimizers", optimizers, "--out", str(out), "--steps", "8",
                "--set", "eval_every=4", "--set", "checkpoint_every=3", "--set", "eval_batches=1",
                *TINY_FLAGS, env=env)


def _mtime(path: Path) -> int:
    return path.stat().st_mtime_ns


def test_compare_end_to_end_resumes_after_kill(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    first = _compare(out, "muon")
    assert first.returncode == 0, first.stderr
    assert "| muon |" in (out / "compare.md").read_text()
    muon_metrics = out / "muon" / "metrics.jsonl"
    muon_mtime, table_mtime = _mtime(muon_metrics), _mtime(out / "compare.md")
    # adamw is killed at step 5 (its last checkpoint is step 3); muon is finished: not rerun
    killed = _compare(out, "muon,adamw", env={"MATRIXFSDP_FAIL_AT_STEP": "5"})
    assert killed.returncode == 1 and "run the same command again" in killed.stderr
    assert "compare 1/2 muon: finished earlier, not rerun" in killed.stderr
    assert _mtime(out / "compare.md") == table_mtime  # no table from a failed comparison
    resumed = _compare(out, "muon,adamw")
    assert resumed.returncode == 0, resumed.stderr
    assert "compare 2/2 adamw: resuming from step 3" in resumed.stderr
    assert _mtime(muon_metrics) == muon_mtime
    adamw = [json.loads(line) for line in (out / "adamw" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in adamw] == list(range(1, 9))
    for run in ("muon", "adamw"):
        last = json.loads((out / run / "metrics.jsonl").read_text().splitlines()[-1])
        assert len(last["optimizer_state_bytes"]) == 2 and max(last["optimizer_state_bytes"]) > 0
        assert sum(last["matrix_comm_bytes_sent_per_rank"]) > 0
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = (out / "compare.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "optimizer |" not in line]
    assert sorted(row.split("|")[1].strip() for row in rows) == ["adamw", "muon"]
    assert "matrixfsdp compare --optimizers muon,adamw" in table
    assert resumed.stdout.count("| muon |") == 1 and "optimizers in" in resumed.stdout


def test_matrix_optimizer_docstring_lists_the_recommended_values() -> None:
    from matrixfsdp.optim import MatrixOptimizer

    rows = {line.split()[0]: line.split()[1:3] for line in (MatrixOptimizer.__doc__ or "").splitlines()
            if line.split() and line.split()[0] in OPTIMIZER_NAMES}
    assert set(rows) == set(OPTIMIZER_NAMES)
    for name, (lr, wd) in rows.items():
        rec = recommended_hyperparameters(name)
        assert (float(lr), float(wd)) == (rec.lr, rec.weight_decay), name


def test_overall_eta_uses_measured_seconds_per_step() -> None:
    from matrixfsdp.launch.compare import _Eta

    eta = _Eta(steps_left=1000)
    assert eta.text() == "overall ETA after the first steps"
    assert eta.text(current_steps=100, current_seconds=50.0) == "overall ETA 7m30s"  # 900 x 0.5 s
    eta.record(400, 100.0)
    assert eta.text() == "overall ETA 2m30s"  # 600 steps x 0.25 s
    assert eta.text(current_steps=100, current_seconds=100.0) == "overall ETA 3m20s"  # 500 x 0.4 s


def test_lr_sweep_table_marks_the_best_and_the_default_gap() -> None:
    from benchmarks.lr_sweep import sweep_table

    table = sweep_table({"soap": {0.3333: (0.001, 1.70), 1.0: (0.003, 1.57), 3.0: (0.009, 1.58)},
                         "emagram": {0.3333: (0.02, 1.76), 1.0: (0.06, 1.60), 3.0: (0.18, None)}})
    soap = next(line for line in table.splitlines() if line.startswith("| soap"))
    assert "| x1 | +0.0000 |" in soap and "1.7000 (lr 0.001)" in soap
    emagram = next(line for line in table.splitlines() if line.startswith("| emagram"))
    assert "| — |" in emagram  # a run not finished yet
    okls = sweep_table({"okls": {0.3333: (0.0314, 1.4884), 1.0: (0.09434, 1.4995)}})
    assert "| x0.3333 | +0.0111 |" in okls


def test_set_numbers_and_optimizer_kwargs_are_checked_before_any_rank(tmp_path: Path) -> None:
    from matrixfsdp.launch.cli import config_overrides

    # YAML 1.1 reads 1e-12 as a string; --set makes it the number Distributed Shampoo users type
    got = config_overrides(["--optimizer", "shampoo", "--set", "optimizer_kwargs.eps=1e-12", "--set", "lr=3E-3",
                            "--set", "out=1e5x", "--set", "optimizer_kwargs.eps_mode=absolute",
                            "--set", "optimizer_kwargs.betas=[0.9, 1.0e0]"])
    assert got["optimizer_kwargs.eps"] == 1e-12 and got["lr"] == 3e-3 and got["out"] == "1e5x"
    assert got["optimizer_kwargs.betas"] == [0.9, 1.0]
    assert load_config(None, **got).optimizer_kwargs["eps"] == 1e-12
    with pytest.raises(ConfigError, match=r"optimizer_kwargs: ShampooConfig.eps must be >= 0"):
        load_config(None, optimizer="shampoo", **{"optimizer_kwargs.eps": -1.0})
    with pytest.raises(ConfigError, match=r"optimizer 'soap' does not take .*'beta9'"):
        load_config(None, optimizer="soap", **{"optimizer_kwargs.beta9": 0.9})
    proc = _cli("train", "--optimizer", "shampoo", "--set", "optimizer_kwargs.eps_mode=relatve",
                "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "ShampooConfig.eps_mode" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()  # no rank started
