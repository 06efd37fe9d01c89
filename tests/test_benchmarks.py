"""The benchmark suite at tiny size, so it never rots (world 2, 2 measured steps, ~30 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.analysis import PHASES
from benchmarks.config import MEMORY_BASELINES, STRATEGIES, STRATEGY_LABELS, BenchConfig
from benchmarks.costmodel import HSDP_MODELS, fit_alpha_beta, project, project_hsdp
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
                   "projected: Llama-2-7B", "gloo loopback fits",
                   "Peak memory per rank during the step", "HSDP (2x1 mesh) against flat",
                   "flat (1x64) against HSDP (8x8)", "Llama-3-70B"):
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
    memory = run2["memory"]  # peak during each phase, every strategy + the memory baselines
    assert set(memory) == {*STRATEGIES, *MEMORY_BASELINES}
    for name, m in memory.items():
        assert all(m["live"][ph] >= m["live_start"] > 0 and m["rss"][ph] > 0 for ph in PHASES), name
    mismatched = {n: (c["modeled"], s[n]["comm"]) for n, c in run2["schedule_check"].items()
                  if not c["match"]}
    assert not mismatched, f"modeled vs counted: {mismatched}"
    # HSDP at world 2 is 2x1: the owners' all-reduce crosses replicas, nothing moves in a shard
    # group; the owner all-to-all Muon baselines follow the same losses (checked above).
    hsdp = s["matrixfsdp_hsdp"]
    assert hsdp["comm"]["optimizer"]["calls"] == 0
    assert hsdp["by_dim"]["backward"]["replicate"]["calls"] > 0
    assert "shard" not in hsdp["by_dim"].get("forward", {})
    assert hsdp["library_by_dim"]["replicate"]["backward"]["calls"] > 0
    assert s["distmuon"]["by_dim"]["optimizer"]["shard"]["calls"] == 2 * 2  # 2 blocks, 2 each
    assert run2["contention"] > 0 and run2["ideal_optimizer_s"] > 0
    for name, p in run2["predicted"].items():
        assert p["total"] > 0, name


def test_projection_shape(tiny: tuple[dict, Path]) -> None:
    proj = tiny[0]["runs"]["muon"]["projection"]["strategies"]
    assert proj["matrixfsdp"]["calls"]["optimizer"] == 0
    assert proj["matrixfsdp"]["recv_bytes"]["optimizer"] == 0
    assert proj["fsdp2_recon"]["optimizer_s"] > 10 * proj["matrixfsdp"]["optimizer_s"]
    assert proj["zero1_owner"]["resident"]["params"] > 30 * proj["matrixfsdp"]["resident"]["params"]


def test_hsdp_projection_targets() -> None:
    """Llama-3-8B on 8x8: shard groups of 8 balance perfectly (flat 64: 1.077); owner-HSDP
    crosses nodes with FSDP2-HSDP's bytes plus the 4-byte presence flags of its owned matrices,
    and with exactly FSDP2-HSDP's bytes without them."""
    proj = project_hsdp("muon", HSDP_MODELS["llama3-8b"],
                        strategies=["matrixfsdp", "matrixfsdp_hsdp", "matrixfsdp_noflags_hsdp",
                                    "fsdp2_recon_hsdp"])
    st = proj["strategies"]
    assert st["matrixfsdp_hsdp"]["plan_imbalance_bytes"] == pytest.approx(1.0, abs=1e-12)
    assert st["matrixfsdp"]["plan_imbalance_bytes"] == pytest.approx(1.0769, abs=1e-4)
    owned = 224 // 8  # 28 matrices per owner, a ring all-reduce over 8 replicas moves 2 * 7/8
    flags = 2 * 7 * owned * 4 // 8
    assert st["matrixfsdp_hsdp"]["inter_node_bytes"] - st["fsdp2_recon_hsdp"]["inter_node_bytes"] \
        == flags
    assert st["matrixfsdp_noflags_hsdp"]["inter_node_bytes"] \
        == st["fsdp2_recon_hsdp"]["inter_node_bytes"]
    assert st["matrixfsdp_noflags_hsdp"]["intra_node_bytes"] \
        == st["matrixfsdp_hsdp"]["intra_node_bytes"]
    assert st["matrixfsdp"]["inter_node_bytes"] > 7 * st["matrixfsdp_hsdp"]["inter_node_bytes"]
    assert st["matrixfsdp_hsdp"]["calls"]["optimizer"] == 0


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-70b"])
def test_memory_projection(preset: str) -> None:
    from benchmarks.memory import project_peak

    for world in (8, 64):
        p = project_peak(preset, world)
        assert p["fsdp2_recon"] >= p["fsdp2_sgdm"] > p["model_bytes"] / world
        assert 0.9 * p["fsdp2_sgdm"] < p["matrixfsdp"] < 1.15 * p["fsdp2_sgdm"], (world, p)


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


def test_package_ships_only_matrixfsdp() -> None:
    """``pip install`` installs ``matrixfsdp`` alone; benchmarks/ runs from a checkout."""
    tomllib = pytest.importorskip("tomllib")
    find_packages = pytest.importorskip("setuptools").find_packages

    root = Path(__file__).resolve().parents[1]
    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = find_packages(str(root), include=find["find"]["include"])
    assert "matrixfsdp" in packages and "matrixfsdp.optim.functional" in packages
    assert all(p.split(".")[0] == "matrixfsdp" for p in packages), packages


def test_benchmarks_build_the_cli_model() -> None:
    from benchmarks.config import ModelConfig
    from benchmarks.model import build_gpt
    from matrixfsdp.launch.model import GPT

    model = build_gpt(ModelConfig(dim=32, layers=2, heads=2, mlp_hidden=64, vocab=64, seq_len=16))
    assert type(model) is GPT and model.layers[0].up.weight.shape == (64, 32)


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
