"""The EP step benchmark (benchmarks/ep_step.py, issue 27) at toy size, so it never rots: the
three placements take the same steps, matrixfsdp's step moves nothing while the FSDP2-EP
baselines move the bytes counted by hand, and the DeepSeek-V3 projection follows its formulas.
~40 s (one world of 4 ranks)."""

from __future__ import annotations

import math

import pytest

from benchmarks.ep_model import EPBenchConfig
from benchmarks.ep_projection import DEEPSEEK_V3, project_ep, projections, render_projection
from benchmarks.ep_step import render_measured, run_measured
from matrixfsdp.planner import matrix_cost

TINY = EPBenchConfig(efsdp=2, ep=2, layers=2, dim=32, hidden=64, experts=4, vocab=64,
                     global_batch=8, seq_len=16, reps=2, warmup=1)


@pytest.fixture(scope="module")
def tiny() -> dict:
    return run_measured(TINY)


def test_matrixfsdp_step_moves_nothing(tiny: dict) -> None:
    f = tiny["strategies"]["matrixfsdp"]
    assert f["sent_bytes"] == f["recv_bytes"] == f["expert_sent_bytes"] == 0
    assert f["calls"] == 0, "matrixfsdp's optimizer step issued a collective"


def test_baseline_bytes_match_hand_counts(tiny: dict) -> None:
    """Per rank, fp32: each local expert stack is Shard(1) over efsdp 2, w_in (2, 32, 32) and
    w_out (2, 16, 64) per layer (8192 elements in 2 layers); dense mix (8, 32) and gate (1, 32)
    over the world of 4 (576 elements)."""
    stored = 2 * (2 * 32 * 32 + 2 * 16 * 64) * 4
    assert tiny["expert_bytes_per_rank"] == stored
    recon, owner = tiny["strategies"]["fsdp2_recon"], tiny["strategies"]["transient_owner"]
    dense = 2 * (8 * 32 + 32) * 4
    # (b): an all-gather per parameter: (n - 1) x the local shard.
    assert recon["expert_sent_bytes"] == (2 - 1) * stored
    assert recon["sent_bytes"] == recon["recv_bytes"] == stored + 3 * dense
    assert recon["calls"] == 8  # 2 layers x (mix, gate, w_in, w_out)
    # (c): 2 (efsdp - 1) / efsdp of the stored expert bytes; dense: the busiest rank owns one
    # mix (LPT), sends its rows of the 3 others (256 + 32 + 32) and 3 x its 256 back.
    assert owner["expert_sent_bytes"] == 2 * (2 - 1) / 2 * stored
    assert owner["sent_bytes"] == owner["recv_bytes"] == stored + (320 + 3 * 256) * 4
    assert owner["calls"] == 4  # per group (experts, dense): gather and return


def test_three_placements_take_the_same_steps(tiny: dict) -> None:
    strategies = tiny["strategies"]
    for name, f in strategies.items():
        assert f["deviation"] <= 1e-5, (name, f["deviation"])
        assert f["losses"] == pytest.approx(strategies["matrixfsdp"]["losses"], rel=1e-5)
        assert all(f[k]["median_s"] > 0 for k in ("fwd_bwd", "step", "total"))
        assert min(f["memory"].values()) > 0 and f["peak"] == max(f["memory"].values())
    text = render_measured(tiny)
    assert "matrixfsdp-EP" in text and text.count("\n| (") == 3


def test_projection_follows_its_formulas() -> None:
    """DeepSeek-V3 at EP 64: 4 local experts x 3 x 58 = 696 matrices per ep rank; (c) moves
    2 (efsdp - 1) / efsdp of the stored expert bytes each way, (b) (efsdp - 1) x, (a) none."""
    for efsdp in (8, 16):
        p = project_ep(DEEPSEEK_V3, 64, efsdp)
        stored = 696 * 7168 * 2048 * 4 / efsdp
        assert p["matrices_per_ep_rank"] == 696 and p["stored_expert_bytes"] == stored
        a, b, c = (p["strategies"][k] for k in ("matrixfsdp", "fsdp2_recon", "transient_owner"))
        assert a["sent_bytes"] == a["recv_bytes"] == a["comm_s"] == a["collectives"] == 0
        assert c["sent_bytes"] == pytest.approx(2 * (efsdp - 1) / efsdp * stored)
        assert b["recv_bytes"] == pytest.approx((efsdp - 1) * stored)
        assert c["matrices_busiest"] == math.ceil(696 / efsdp)
        assert b["matrices_busiest"] == 696
        assert a["matrices_busiest"] % 4 == 0 and a["matrices_busiest"] >= 696 / efsdp
        flops = a["matrices_busiest"] * matrix_cost((2048, 7168), "muon")
        assert a["compute_s"] >= flops / (p["hardware"]["gemm_tflops"] * 1e12)
        assert a["overlapped_s"] < c["overlapped_s"] < b["overlapped_s"]
    assert "not a measurement" in render_projection(projections())


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="not a multiple of ep"):
        EPBenchConfig(experts=6, ep=4, efsdp=1)
    with pytest.raises(ValueError, match="unknown strategies"):
        EPBenchConfig(strategies=("nope",))
