"""Markdown tables, JSON and a PNG chart of one benchmark invocation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .analysis import PHASES, targets
from .config import STRATEGY_LABELS

__all__ = ["memory_table", "render_markdown", "write_json", "write_png"]

BASELINES = ("ddp", "fsdp2_recon", "gather_once", "zero1_owner", "fsdp2_adamw")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _label(name: str) -> str:
    return STRATEGY_LABELS.get(name, name)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _strategy_table(run: dict[str, Any]) -> list[str]:
    header = ["strategy", "opt step ms", "fwd+bwd ms", "total ms", "opt CPU ms",
              "fwd coll", "bwd coll", "opt coll", "fwd+bwd sent", "resident (params / grads / "
              "state)", "peak RSS in the step (Δ over start)"]
    rows = []
    for name, s in run["strategies"].items():
        t, c, r = s["times"], s["comm"], s["resident"]
        coll = [f"{c[ph]['calls']} / {fmt_bytes(c[ph]['recv'])}" for ph in PHASES]
        coll.append(fmt_bytes(s.get("fwd_bwd_sent", 0)))
        rss = (f"{fmt_bytes(s['peak_rss'])} ({fmt_bytes(s['peak_rss_delta'])})"
               if "peak_rss" in s else "not run")
        rows.append([_label(name), _ms(t["optimizer"]), _ms(t["fwd_bwd"]), _ms(t["total"]),
                     _ms(t["optimizer_cpu"]), *coll,
                     f"{fmt_bytes(r['total'])} ({fmt_bytes(r['params'])} / "
                     f"{fmt_bytes(r['grads'])} / {fmt_bytes(r['state'])})", rss])
    return _table(header, rows)


def _ratio_table(run: dict[str, Any]) -> list[str]:
    s = run["strategies"]
    if "matrixfsdp" not in s:
        return []
    mf = s["matrixfsdp"]
    header = ["baseline ÷ matrixfsdp", "opt step", "fwd+bwd", "total", "opt bytes recv",
              "resident", "peak RSS"]
    rows = []
    for name in [b for b in (*BASELINES, "matrixfsdp_p2p") if b in s]:
        b = s[name]
        opt_bytes = b["comm"]["optimizer"]["recv"]
        mf_bytes = mf["comm"]["optimizer"]["recv"]
        bytes_cell = (f"{fmt_bytes(opt_bytes)} vs 0" if mf_bytes == 0
                      else f"{opt_bytes / mf_bytes:.2f}x")
        rss = (f"{b['peak_rss'] / mf['peak_rss']:.2f}x"
               if "peak_rss" in b and "peak_rss" in mf else "-")
        rows.append([_label(name),
                     *(f"{b['times'][k] / mf['times'][k]:.2f}x"
                       for k in ("optimizer", "fwd_bwd", "total")),
                     bytes_cell, f"{b['resident']['total'] / mf['resident']['total']:.2f}x", rss])
    return _table(header, rows)


MEMORY_BASE = "fsdp2_sgdm"


def memory_table(memory: dict[str, Any]) -> list[str]:
    """Peak per rank *during* each phase of a step: live tensor bytes and RSS (Δ over the RSS
    before the model was built), busiest rank, with each strategy's whole-step peak ÷ the
    baseline's (stock FSDP2 with Muon's optimizer-state size) where it was measured."""
    header = ["strategy", "live fwd", "live bwd", "live opt", "RSS Δ fwd", "RSS Δ bwd",
              "RSS Δ opt", "peak live ÷ FSDP2+SGD-m", "peak RSS Δ ÷ FSDP2+SGD-m"]
    base = memory.get(MEMORY_BASE)
    rows = []
    for name, m in memory.items():
        live, rss = m["live"], m["rss"]
        ratios = ["-", "-"]
        if base is not None:
            ratios = [f"{max(m[k].values()) / max(base[k].values()):.2f}x" for k in ("live", "rss")]
        rows.append([_label(name), *(fmt_bytes(live[ph]) for ph in PHASES),
                     *(fmt_bytes(rss[ph]) for ph in PHASES), *ratios])
    return _table(header, rows)


def _prediction_table(run: dict[str, Any]) -> list[str]:
    header = ["strategy", "fwd+bwd measured / predicted ms", "opt measured / predicted ms",
              "total measured / predicted ms", "total error"]
    rows = []
    for name, p in run["predicted"].items():
        t = run["strategies"][name]["times"]
        err = (p["total"] - t["total"]) / t["total"]
        rows.append([_label(name), f"{_ms(t['fwd_bwd'])} / {_ms(p['fwd_bwd'])}",
                     f"{_ms(t['optimizer'])} / {_ms(p['optimizer'])}",
                     f"{_ms(t['total'])} / {_ms(p['total'])}", f"{err:+.0%}"])
    return _table(header, rows)


def _alpha_beta_lines(run: dict[str, Any]) -> list[str]:
    parts = []
    for op, f in run["alpha_beta"].items():
        bw = f"{1 / f['beta_s_per_byte'] / 1e9:.2f}" if f["beta_s_per_byte"] > 0 else "∞"
        parts.append(f"{op}: α = {f['alpha_s'] * 1e6:.0f} µs, 1/β = {bw} GB/s "
                     f"(max fit error {f['max_rel_err']:.0%})")
    return ["gloo loopback fits (seconds = α + β·size): " + "; ".join(parts) + "."]


def _check_lines(run: dict[str, Any]) -> list[str]:
    diffs = run["loss_diff_vs_ddp"]
    steps = len(next(iter(run["strategies"].values()))["losses"])
    reference = run.get("loss_reference", "ddp")
    if diffs:
        lines = [f"Loss trajectories ({steps} steps, warm-up included): max |loss − "
                 f"{_label(reference)} loss| over the matrix-optimizer strategies = "
                 f"{max(diffs.values()):.2e} ("
                 + ", ".join(f"{_label(n)} {v:.1e}" for n, v in diffs.items()) + ")."]
    else:
        lines = [f"Loss trajectories ({steps} steps): not compared (neither DDP nor flat "
                 "matrixfsdp, the references, was run with another matrix-optimizer strategy)."]
    check = run["schedule_check"]
    bad = [n for n, c in check.items() if not c["match"]]
    res_err = max(c["resident_rel_err"] for c in check.values())
    lines.append("Analytic schedule vs counted collectives (calls and busiest-rank bytes per "
                 f"phase): {'all match' if not bad else 'MISMATCH for ' + ', '.join(bad)}; "
                 f"resident-bytes model within {res_err:.2%} of the counted bytes.")
    lib = run["strategies"].get("matrixfsdp", {}).get("library_counter")
    if lib:
        lines.append("matrixfsdp's own CommCounter in the counted step (owner-segment ops only): "
                     + ", ".join(f"{ph} {v['calls']} calls" for ph, v in lib.items()) + ".")
    return lines


def _targets_table(run: dict[str, Any]) -> list[str]:
    rows = []
    for t in targets(run):
        value = t["value"]
        cell = f"{value:.3g}" if isinstance(value, float) else str(value)
        rows.append([t["target"], cell, t["threshold"], "met" if t["met"] else "NOT met"])
    return _table(["target", "value", "threshold", "verdict"], rows)


def _projection_table(proj: dict[str, Any]) -> list[str]:
    header = ["strategy", "opt step ms", "fwd+bwd ms (compute / comm)", "total ms",
              "coll calls fwd / bwd / opt", "opt bytes recv / rank", "resident / rank"]
    rows = []
    ref = proj["strategies"].get("matrixfsdp")
    for name, s in proj["strategies"].items():
        rows.append([
            _label(name), f"{s['optimizer_s'] * 1e3:.1f}",
            f"{s['fwd_bwd_s'] * 1e3:.0f} ({s['fwd_bwd_compute_s'] * 1e3:.0f} / "
            f"{s['fwd_bwd_comm_s'] * 1e3:.0f})", f"{s['total_s'] * 1e3:.0f}",
            " / ".join(str(s["calls"][ph]) for ph in PHASES),
            fmt_bytes(s["recv_bytes"]["optimizer"]), fmt_bytes(sum(s["resident"].values())),
        ])
    lines = _table(header, rows)
    if ref is not None and "fsdp2_recon" in proj["strategies"]:
        v = proj["strategies"]["fsdp2_recon"]["optimizer_s"] / ref["optimizer_s"]
        lines.append("")
        lines.append(f"Projected optimizer step, FSDP2 reconstruction ÷ matrixfsdp: {v:.1f}x; "
                     f"ideal matrix step (FLOPs ÷ {proj['hardware']['nodes'] * 8} ranks): "
                     f"{proj['ideal_matrix_step_s'] * 1e3:.1f} ms; plan max/mean cost "
                     f"{proj['plan_imbalance_cost']:.3f} (bound {proj['plan_imbalance_bound']:.3f}).")
    return lines


HSDP_MEASURED = ("matrixfsdp", "matrixfsdp_hsdp", "matrixfsdp_noflags_hsdp", "distmuon",
                 "distmuon_hsdp", "fsdp2_adamw")


def _dim_cell(s: dict[str, Any], phases: tuple[str, ...], dim: str) -> str:
    calls = sum(s["by_dim"].get(ph, {}).get(dim, {}).get("calls", 0) for ph in phases)
    recv = sum(s["by_dim"].get(ph, {}).get(dim, {}).get("recv", 0) for ph in phases)
    return f"{calls} / {fmt_bytes(recv)}" if calls else "0"


def _hsdp_table(run: dict[str, Any]) -> list[str]:
    """Flat against HSDP, measured in the same interleaved world."""
    s = run["strategies"]
    names = [n for n in HSDP_MEASURED if n in s]
    if "matrixfsdp_hsdp" not in s:
        return []
    header = ["strategy", "fwd+bwd ms", "opt step ms", "total ms",
              "fwd+bwd: shard dim calls / recv", "fwd+bwd: replicate dim calls / recv",
              "opt: shard dim", "opt: replicate dim", "peak live tensor bytes in the step"]
    rows = []
    for name in names:
        t = s[name]["times"]
        mem = run.get("memory", {}).get(name)
        live = fmt_bytes(max(mem["live"].values())) if mem else "not run"
        rows.append([_label(name), _ms(t["fwd_bwd"]), _ms(t["optimizer"]), _ms(t["total"]),
                     _dim_cell(s[name], ("forward", "backward"), "shard"),
                     _dim_cell(s[name], ("forward", "backward"), "replicate"),
                     _dim_cell(s[name], ("optimizer",), "shard"),
                     _dim_cell(s[name], ("optimizer",), "replicate"), live])
    lines = _table(header, rows)
    flat, hsdp = s.get("matrixfsdp"), s["matrixfsdp_hsdp"]
    if flat is not None:
        ratio = hsdp["times"]["fwd_bwd"] / flat["times"]["fwd_bwd"]
        lines += ["", f"matrixfsdp HSDP ÷ flat, forward+backward (medians, same run): "
                      f"{ratio:.3f} (target <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'})."]
        lib = hsdp.get("library_by_dim", {})
        if lib:
            lines.append("matrixfsdp HSDP's own CommCounter (owner ops, counted step, rank 0): "
                         + "; ".join(f"{dim}: " + ", ".join(
                             f"{ph} {v['calls']} calls / {fmt_bytes(v['bytes_received'])}"
                             for ph, v in phases.items() if v["calls"])
                                     for dim, phases in lib.items()) + ".")
    return lines


def _hsdp_projection_table(projections: dict[str, Any]) -> list[str]:
    header = ["model", "strategy", "mesh", "plan max/mean (bytes)", "inter-node bytes / GPU",
              "intra-node bytes / GPU", "fwd+bwd ms (compute / comm)", "opt step ms (comm)",
              "total ms", "resident / GPU"]
    rows = []
    for proj in projections.values():
        for name, f in proj["strategies"].items():
            r, sh = f["mesh_shape"]
            rows.append([proj["model"]["name"], _label(name), f"{r}x{sh}",
                         f"{f['plan_imbalance_bytes']:.3f}", fmt_bytes(f["inter_node_bytes"]),
                         fmt_bytes(f["intra_node_bytes"]),
                         f"{f['fwd_bwd_s'] * 1e3:.0f} ({f['fwd_bwd_compute_s'] * 1e3:.0f} / "
                         f"{f['fwd_bwd_comm_s'] * 1e3:.0f})",
                         f"{f['optimizer_s'] * 1e3:.0f} ({f['optimizer_comm_s'] * 1e3:.0f})",
                         f"{f['total_s'] * 1e3:.0f}", fmt_bytes(sum(f["resident"].values()))])
    lines = _table(header, rows)
    lines += ["", "HSDP projection: a shard group is one node (NVLink), a replicate group one GPU "
              "per node (InfiniBand); inter-node bytes are what the busiest GPU receives per step "
              "from GPUs on other nodes (direct exchange: all-gather / reduce-scatter (N−G)/N of "
              "the buffer, all-reduce twice that, broadcast the buffer from a remote root, reduce "
              "one buffer per remote peer at the root, all-to-all the remote rows); a phase's "
              "communication is the busiest GPU's sum over the collectives it takes part in. The "
              "owner all-to-all Muon baseline sends direction and update rows in the gather dtype "
              "(bf16, as torchtitan's) and pipelines them with Newton–Schulz over one wave per "
              "block: max(compute, comm) + min(compute, comm) / waves. Under HSDP every replica "
              "repeats its shard group's optimizer step (one GPU steps 1/8 of the matrices, not "
              "1/64). Resident = parameters + gradients + optimizer state (fp32), activations "
              "excluded.", ""]
    for proj in projections.values():
        st = proj["strategies"]
        if "fsdp2_recon_hsdp" not in st:
            continue
        base = st["fsdp2_recon_hsdp"]["inter_node_bytes"]
        for name, why in (("matrixfsdp_hsdp", "the presence flags, 4 B per owned matrix, "
                                              "all-reduced with the gradients"),
                          ("matrixfsdp_noflags_hsdp", "gradients only")):
            if name in st:
                a = st[name]["inter_node_bytes"]
                lines.append(f"{proj['model']['name']}: {_label(name)} inter-node bytes ÷ "
                             f"FSDP2-HSDP's = {a / base:.9f} ({a - base:+d} B: {why}).")
    return lines


def _assumption_lines(proj: dict[str, Any]) -> list[str]:
    hw, m = proj["hardware"], proj["model"]
    d = m["dtypes"]
    return [
        f"Projection assumptions: {hw['name']}; achieved GEMM rate {hw['gemm_tflops']:.0f} "
        f"TFLOP/s (dense bf16; forward+backward, Newton–Schulz and CANS alike); NVLink "
        f"{hw['nvlink_gbps']:.0f} GB/s and α {hw['alpha_nvlink_s'] * 1e6:.0f} µs, InfiniBand "
        f"{hw['ib_gbps']:.0f} GB/s per GPU and α {hw['alpha_ib_s'] * 1e6:.0f} µs; HBM "
        f"{hw['hbm_gbps']:.0f} GB/s for element-wise AdamW. Model: {m['name']} shapes "
        f"({m['layers']} layers, d={m['dim']}, ffn={m['ffn']}, vocab={m['vocab']}, "
        f"{m['heads']} heads / {m['kv_heads']} KV heads, untied head), "
        f"{m['tokens_per_gpu']} tokens per GPU per step (seq {m['seq_len']}); gathers in "
        f"{d['gather']} B/elt, gradients {d['grad']} B, master weights {d['param']} B, state "
        f"{d['state']} B. Collectives: ring all-gather / reduce-scatter / all-reduce, pipelined "
        "broadcast / reduce, all-to-all bounded by each rank's busiest link; forward+backward "
        "= max(compute, communication) (prefetch overlap), optimizer = compute + communication. "
        "Owners come from matrixfsdp's LPT planner with the optimizer's cost model.",
    ]


def _definition_lines() -> list[str]:
    return [
        "Definitions: times are the slowest rank per measured step, median over steps; ranks are "
        "fenced by barriers between phases (barriers are not timed or counted). 'opt CPU' is the "
        "process CPU time of the optimizer step (not inflated by ranks sharing cores). Collective "
        "columns are 'calls / bytes received by the busiest rank' per phase ('fwd+bwd sent': bytes "
        "the busiest rank sends in forward+backward, which exposes an owner's fan-out), counted "
        "from the "
        "profiler's gloo events in one extra step (every backend collective, FSDP2's included; "
        "gloo runs FSDP2's reduce-scatter as an all-reduce). Resident bytes are counted from "
        "tensors after the optimizer step (parameters incl. matrixfsdp's unsharded leaves, "
        "gradients, optimizer state; DTensors count their local shard; aliases once), busiest "
        "rank. Peak memory is measured in a fresh process per strategy, after the warm-up steps "
        "(optimizer state exists), during each phase of one step: RSS high-water mark (VmHWM "
        "reset before each phase, glibc told to mmap allocations >= 64 KiB and return freed "
        "memory at once, so RSS follows live memory; Δ: above the RSS before the model was "
        "built) and live tensor bytes (matrixfsdp.memory.LiveBytesTracker over a further step: "
        "every tensor allocated and freed, parameters, gradients and optimizer state included), "
        "busiest rank. The "
        "ideal optimizer step is the single-process, single-thread step (matrices + tail AdamW, measured by rank 0 alone "
        "between rounds) divided by N.",
    ]


def render_markdown(results: dict[str, Any]) -> str:
    meta, cfg = results["meta"], results["config"]
    lines = [
        "# matrixfsdp benchmark",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['cpu']} ({meta['cores']} cores); "
        f"torch {meta['torch']}; python {meta['python']}; commit {meta['commit']}; load average "
        f"{meta.get('load_average') or 0:.2f} at start, {meta.get('load_average_end') or 0:.2f} at "
        f"end (other jobs share this machine); {meta.get('wall_seconds', 0):.0f} s in all.  ",
        f"Model: GPT decoder dim {cfg['model']['dim']}, {cfg['model']['layers']} layers, "
        f"{cfg['model']['heads']} heads, MLP {cfg['model']['mlp_hidden']}, vocab "
        f"{cfg['model']['vocab']}, seq {cfg['model']['seq_len']} ({meta['params']:,} parameters, "
        f"{meta['matrices']} matrices); global batch {cfg['global_batch']} sequences; "
        f"{cfg['warmup']} warm-up + {cfg['steps']} measured steps, strategies interleaved "
        "(order rotated every step); gloo, one thread per rank.",
        "",
    ]
    for opt, run in results["runs"].items():
        lines += [f"## {opt}", "", f"Optimizer settings: {run['optim']}.", ""]
        for world, wr in run["worlds"].items():
            ref = wr["reference"]
            memory = (["Peak memory per rank during the step (forward, backward, optimizer):",
                       "", *memory_table(wr["memory"]), ""] if wr.get("memory") else [])
            lines += [f"### {opt}, world size {world}", "", *_strategy_table(wr), "",
                      *_ratio_table(wr), "", *memory, *_check_lines(wr), ""]
            if "matrixfsdp_hsdp" in wr["strategies"]:
                lines += [f"HSDP ({wr.get('hsdp_shape', '?')} mesh) against flat, same run:", "",
                          *_hsdp_table(wr), ""]
            lines += [f"Single-process references (rank 0 alone, interleaved with the rounds): "
                      f"matrix step {_ms(ref['matrix_step'])} ms, tail AdamW "
                      f"{_ms(ref['tail_adamw'])} ms, forward+backward at the local batch "
                      f"{_ms(ref['fwd_bwd'])} ms; ideal optimizer step (÷ {world}) "
                      f"{_ms(wr['ideal_optimizer_s'])} ms wall, {_ms(wr['ideal_optimizer_cpu_s'])} ms CPU. "
                      f"Contention factor (same GEMM work on "
                      f"all {world} ranks at once ÷ one rank alone): {wr['contention']:.2f}.", "",
                      "Targets:", "", *_targets_table(wr), "",
                      "Cost model at this scale:", "", *_prediction_table(wr), "",
                      *_alpha_beta_lines(wr), ""]
        if "projection" in run:
            lines += [f"### {opt}, projected: Llama-2-7B shapes on 8 x 8 GPUs", "",
                      *_projection_table(run["projection"]), "",
                      *_assumption_lines(run["projection"]), ""]
        if "hsdp_projection" in run:
            first = next(iter(run["hsdp_projection"].values()))
            lines += [f"### {opt}, projected: flat (1x64) against HSDP (8x8) on 8 x 8 GPUs", "",
                      *_hsdp_projection_table(run["hsdp_projection"]), "",
                      *_assumption_lines(first), ""]
    lines += ["## Notes", "", *_definition_lines(), ""]
    return "\n".join(lines)


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, default=str))


def write_png(results: dict[str, Any], path: Path) -> None:
    """Stacked bars (forward+backward, optimizer step) per strategy, one panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(opt, w, wr) for opt, run in results["runs"].items()
              for w, wr in run["worlds"].items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (opt, world, wr) in zip(axes[0], panels, strict=True):
        names = list(wr["strategies"])
        fb = [wr["strategies"][n]["times"]["fwd_bwd"] * 1e3 for n in names]
        op = [wr["strategies"][n]["times"]["optimizer"] * 1e3 for n in names]
        y = range(len(names))
        ax.barh(y, fb, label="forward+backward", color="#4c72b0")
        ax.barh(y, op, left=fb, label="optimizer step", color="#dd8452")
        ax.set_yticks(list(y), [_label(n) for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median, slowest rank)")
        ax.set_title(f"{opt}, world {world}")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.report RESULTS.json``: render the markdown of saved results again
    (next to the JSON), e.g. after a change of wording; the figures are the saved ones."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.report")
    p.add_argument("results", type=Path)
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    args.results.with_suffix(".md").write_text(render_markdown(results))


if __name__ == "__main__":
    main()
