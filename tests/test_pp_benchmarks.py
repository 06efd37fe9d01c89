"""Smoke test of the pipeline benchmark (``benchmarks/pp_step.py``) and its projection."""

from __future__ import annotations

import json

from benchmarks import pp_projection, pp_step


def test_pp_projection() -> None:
    rows = pp_projection.projection(8)
    ours, recon = rows["matrixfsdp"], rows["FSDP2 + reconstruction"]
    assert ours["step_gb"] == 0 and recon["step_gb"] > 0
    assert ours["reduce_gb"] == recon["reduce_gb"]
    assert rows["matrixfsdp before issue 28"]["reduce_gb"] == 8 * ours["reduce_gb"]
    assert ours["step_compute_s"] < recon["step_compute_s"] / 7  # LPT over 8 owners
    assert "Llama-3-70B" in pp_projection.render_projection()


def test_pp_step_runs(capsys, tmp_path) -> None:
    """The table prints; with the exchange form matrixfsdp moves FSDP2's layer-unit bytes less
    the units' norms (2 % of them here)."""
    out_json = tmp_path / "rows.json"
    pp_step.main(["--dim", "16", "--layers", "2", "--seq", "5", "--rows", "2", "--micro", "1",
                  "2", "--reps", "2", "--collectives", "alltoall", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "| True | 2 |" in out and "Projection" in out
    rows = {(r["strategy"], r["micro"]): r for r in json.loads(out_json.read_text())}
    for micro in (1, 2):
        ours, fsdp2 = rows["matrixfsdp", micro], rows["fsdp2", micro]
        assert 0.95 * fsdp2["matrix_bytes"] < ours["matrix_bytes"] <= fsdp2["matrix_bytes"], rows
        assert ours["fsdp2_over_ours"] > 0
