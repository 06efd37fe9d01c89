"""The benchmark suite at tiny size, so it never rots (world 2, 2 measured steps, ~30 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.config import STRATEGIES, STRATEGY_LABELS, BenchConfig
from benchmarks.costmodel import fit_alpha_beta, project
from benchmarks.run import run
from benchmarks.strategies.base import chunk_sizes, local_rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One tiny invocation shared by the checks below (world 2, Muon, memory worlds included)."""
    out = tmp_path_factory.mktemp("bench") / "report.md"
    results = run(["--tiny", "--worlds", "2", "--steps", "2", "--warmup", "1",
                   "--optimizers", "muon", "--out", str(out)])
    return results, out


def test_report_files_name_every_strategy(tiny: tuple[dict, Path]) -> None:
    _, out = tiny
    text = out.read_text()
    for name in STRATEGIES:
        assert STRATEGY_LABELS[name] in text, f"{name} missing from the markdown report"
    for needle in ("Command: `python -m benchmarks.run --tiny", "torch ", "cores", "Targets:",
                   "projected: Llama-2-7B", "gloo loopback fits"):
        assert needle in text, needle
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["runs"]["muon"]["worlds"]["2"]["strategies"]) == set(STRATEGIES)
    assert out.with_suffix(".png").stat().st_size > 1000


def test_figures_are_sane(tiny: tuple[dict, Path]) -> None:
    results, _ = tiny
    run2 = results["runs"]["muon"]["worlds"][2]
    s = run2["strategies"]
    for name, fig in s.items():
        assert fig["times"]["steps"] == 2
        assert fig["times"]["total"] > 0 and fig["times"]["optimizer"] > 0, name
        assert fig["peak_rss"] > fig["peak_rss_delta"] > 0, name
        assert fig["resident"]["params"] > 0 and fig["resident"]["state"] > 0, name
    mf = s["matrixfsdp"]
    assert mf["comm"]["optimizer"] == {"calls": 0, "recv": 0, "sent": 0}
    assert mf["library_counter"]["optimizer"]["calls"] == 0
    assert mf["comm"]["forward"]["calls"] > 0 and mf["comm"]["backward"]["calls"] > 0
    assert s["zero1_owner"]["resident"]["total"] > mf["resident"]["total"]
    assert s["ddp"]["resident"]["total"] > s["zero1_owner"]["resident"]["total"]
    assert s["ddp"]["comm"]["forward"]["calls"] == 0
    # reconstruction gathers each matrix's gradient and momentum: 2 calls per matrix
    matrices = len(run2["reference"]["per_matrix"])
    assert s["fsdp2_recon"]["comm"]["optimizer"]["calls"] == 2 * matrices
    assert s["gather_once"]["comm"]["optimizer"]["calls"] == 2
    assert max(run2["loss_diff_vs_ddp"].values()) < 1e-4
    assert all(c["match"] for c in run2["schedule_check"].values()), run2["schedule_check"]
    assert run2["contention"] > 0 and run2["ideal_optimizer_s"] > 0
    for name, p in run2["predicted"].items():
        assert p["total"] > 0, name


def test_projection_shape(tiny: tuple[dict, Path]) -> None:
    proj = tiny[0]["runs"]["muon"]["projection"]["strategies"]
    assert proj["matrixfsdp"]["calls"]["optimizer"] == 0
    assert proj["matrixfsdp"]["recv_bytes"]["optimizer"] == 0
    assert proj["fsdp2_recon"]["optimizer_s"] > 10 * proj["matrixfsdp"]["optimizer_s"]
    assert proj["zero1_owner"]["resident"]["params"] > 30 * proj["matrixfsdp"]["resident"]["params"]


def test_alpha_beta_fit_recovers_a_line() -> None:
    samples = [{"op": "all_reduce", "size": x, "seconds": 1e-4 + x * 2e-9}
               for x in (1 << 10, 1 << 14, 1 << 18, 1 << 22)]
    fit = fit_alpha_beta([samples, samples])["all_reduce"]
    assert fit["alpha_s"] == pytest.approx(1e-4, rel=1e-6)
    assert fit["beta_s_per_byte"] == pytest.approx(2e-9, rel=1e-6)


def test_rows_follow_torch_chunk() -> None:
    for rows, world in ((10, 4), (3, 4), (8, 2), (1, 3)):
        full = torch.arange(rows)
        chunks = list(torch.chunk(full, world))
        assert chunk_sizes(rows, world) == [len(c) for c in chunks] + [0] * (world - len(chunks))
        for r in range(len(chunks)):
            assert torch.equal(local_rows(full, r, world), chunks[r])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        BenchConfig(world_size=3, global_batch=8)
    with pytest.raises(ValueError, match="unknown strategies"):
        BenchConfig(strategies=("nope",))
    assert project("muon", ["matrixfsdp"])["strategies"]["matrixfsdp"]["optimizer_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_script_skips_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.gpu import main

    assert main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_gpu_script_runs_every_section_on_cpu(tmp_path: Path) -> None:
    """``--device cpu --tiny``: the GPU script's own code, at toy sizes, so a GPU run cannot fail
    on a Python bug; every section must produce its rows and pass its checks."""
    from benchmarks.gpu import main

    out = tmp_path / "gpu.md"
    assert main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    text = out.read_text()
    for label in ("Newton–Schulz", "Scaled CANS, fp16", "QR refresh", "eigh, fp32",
                  "runtime, world 1, gloo", "reload bitwise: yes", "put_signal loopback",
                  "bytes equal: yes", "equal to NCCL path: yes", "offload_state='cpu'",
                  "bitwise equal to on-device: yes"):
        assert label in text, label
    assert "FAILED" not in text
