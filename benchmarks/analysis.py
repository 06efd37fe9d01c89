"""Turn per-rank raw results into per-strategy figures, checks and target verdicts."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .config import BenchConfig
from .costmodel import fit_alpha_beta, predict_measured
from .measure import Collective, summarize
from .model import build_gpt
from .schedule import Setup, is_hsdp, per_rank_calls, per_rank_recv, resident_model, schedule
from .strategies import owner_plan

__all__ = ["aggregate_world", "memory_figures", "setup_for", "targets"]

PHASES = ("forward", "backward", "optimizer")
_TIMES = ("forward", "fwd_bwd", "optimizer", "fwd_bwd_cpu", "optimizer_cpu")


def _times(rank_results: list[dict[str, Any]], name: str) -> dict[str, float]:
    """Per measured step the slowest rank, then the median over steps."""
    per_rank = [[rec for rec in r["records"][name] if rec["measured"]] for r in rank_results]
    out = {}
    for key in _TIMES:
        out[key] = statistics.median(max(recs[i][key] for recs in per_rank)
                                     for i in range(len(per_rank[0])))
    out["total"] = statistics.median(
        max(recs[i]["fwd_bwd"] + recs[i]["optimizer"] for recs in per_rank)
        for i in range(len(per_rank[0])))
    out["steps"] = len(per_rank[0])
    return out


def _losses(rank_results: list[dict[str, Any]], name: str) -> list[float]:
    """Global-batch loss per step (warm-up included): the mean of equal-sized local losses."""
    per_rank = [[rec["loss"] for rec in r["records"][name]] for r in rank_results]
    return [statistics.fmean(step) for step in zip(*per_rank, strict=True)]


def _comm(rank_results: list[dict[str, Any]], name: str) -> dict[str, dict[str, int]]:
    sums = [summarize([Collective(**c) for c in r["counted"][name]["collectives"]])
            for r in rank_results]
    return {ph: {k: max(s.get(ph, {}).get(k, 0) for s in sums) for k in ("calls", "recv", "sent")}
            for ph in PHASES}


def _fwd_bwd_sent(rank_results: list[dict[str, Any]], name: str) -> int:
    return max(sum(c["sent"] for c in r["counted"][name]["collectives"]
                   if c["phase"] != "optimizer") for r in rank_results)


def _by_dim(rank_results: list[dict[str, Any]], name: str) -> dict[str, dict[str, dict[str, int]]]:
    """Per phase and mesh dim: calls and bytes received by the busiest rank (dist-level tally)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in rank_results:
        for ph, dims in r["counted"][name]["by_dim"].items():
            for dim, v in dims.items():
                slot = out.setdefault(ph, {}).setdefault(dim, {"calls": 0, "recv": 0})
                slot["calls"] = max(slot["calls"], v["calls"])
                slot["recv"] = max(slot["recv"], v["recv"])
    return out


def _resident(rank_results: list[dict[str, Any]], name: str) -> dict[str, Any]:
    per_rank = [r["counted"][name]["resident"] for r in rank_results]
    worst = max(per_rank, key=lambda d: sum(d.values()))
    return {**worst, "total": sum(worst.values()),
            "per_rank_total": [sum(d.values()) for d in per_rank]}


def setup_for(cfg: BenchConfig, name: str) -> Setup:
    """The schedule's setup of strategy ``name`` (HSDP: the plan over the shard size)."""
    torch.manual_seed(cfg.seed)
    replicate = cfg.hsdp_replicate if is_hsdp(name) else 1
    plan = owner_plan(build_gpt(cfg.model), cfg.world_size // replicate, cfg.optim.name)
    return Setup(plan, cfg.optim.name, replicate=replicate)


def _schedule_check(cfg: BenchConfig, comm: dict[str, Any], resident: dict[str, Any]) -> dict:
    """The analytic schedule / resident model against the counted figures, per strategy."""
    out = {}
    world = cfg.world_size
    for name in comm:
        setup = setup_for(cfg, name)
        ops = schedule(setup, name)
        modeled = {}
        for ph in PHASES:
            recv = [0] * world
            mine = [o for o in ops if o.phase == ph]
            for op in mine:
                recv = [a + b for a, b in zip(recv, per_rank_recv(op, world, setup.mesh_shape),
                                              strict=True)]
            modeled[ph] = {"calls": max(per_rank_calls(mine, world, setup.mesh_shape)),
                           "recv": max(recv)}
        res = max(sum(d.values()) for d in resident_model(setup, name))
        out[name] = {
            "match": all(modeled[ph]["calls"] == comm[name][ph]["calls"]
                         and modeled[ph]["recv"] == comm[name][ph]["recv"] for ph in PHASES),
            "modeled": modeled,
            "resident_modeled": res,
            "resident_rel_err": abs(res - resident[name]["total"]) / max(resident[name]["total"], 1),
        }
    return out


def _references(cfg: BenchConfig, timing: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """Median single-process references (rank 0, interleaved) and the contention factor."""
    refs = [r["reference"] for r in timing[0]["references"]]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in refs)
                           for k in ("fwd_bwd", "matrix_step", "tail_adamw", "optimizer_cpu")}
    out["per_matrix"] = {f: statistics.median(r["per_matrix"][f] for r in refs)
                         for f in refs[0]["per_matrix"]}
    torch.manual_seed(cfg.seed)
    model = build_gpt(cfg.model)
    out["params_all"] = sum(p.numel() for p in model.parameters())
    out["params_tail"] = out["params_all"] - sum(
        p.numel() for f, p in model.named_parameters() if f in out["per_matrix"])
    rounds = zip(*(r["references"] for r in timing), strict=True)
    share = statistics.median(max(x["probe_all"] for x in rnd) / rnd[0]["probe_alone"]
                              for rnd in rounds)
    return out, share


def memory_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Busiest rank per phase: live tensor bytes and RSS above the RSS before the model."""
    return {
        "live": {ph: max(r["live_by_phase"][ph] for r in ranks) for ph in PHASES},
        "rss": {ph: max(r["rss_by_phase"][ph] - r["rss_before"] for r in ranks) for ph in PHASES},
        "live_start": max(r["live_start"] for r in ranks),
        # per rank: the largest transient of one owner step call (0 where no call ran)
        "owner_step": [max((c["transient"] for c in r.get("owner_steps", [])), default=0)
                       for r in sorted(ranks, key=lambda r: r["rank"])],
    }


def aggregate_world(cfg: BenchConfig, timing: list[dict[str, Any]],
                    memory: dict[str, list[dict[str, Any]]] | None) -> dict[str, Any]:
    """Everything the report needs about one (optimizer, world size) run."""
    names = list(timing[0]["records"])
    strategies: dict[str, Any] = {}
    for name in names:
        strategies[name] = {"times": _times(timing, name), "losses": _losses(timing, name),
                            "comm": _comm(timing, name), "resident": _resident(timing, name),
                            "fwd_bwd_sent": _fwd_bwd_sent(timing, name)}
        strategies[name]["by_dim"] = _by_dim(timing, name)
        if memory and name in memory:
            ranks = memory[name]
            strategies[name]["peak_rss"] = max(r["peak_rss"] for r in ranks)
            strategies[name]["peak_rss_delta"] = max(r["peak_rss"] - r["rss_before"] for r in ranks)
        counted = timing[0]["counted"][name]
        for key in ("library_counter", "library_by_dim"):
            if key in counted:
                strategies[name][key] = counted[key]
    # The trajectory the others are compared with: DDP's, else flat matrixfsdp's (if run).
    loss_reference = next((n for n in ("ddp", "matrixfsdp") if n in strategies), None)
    loss_diff = {}
    for name, s in strategies.items():
        if loss_reference is not None and name not in ("fsdp2_adamw", loss_reference):
            reference = strategies[loss_reference]["losses"]
            loss_diff[name] = max(abs(a - b) for a, b in zip(s["losses"], reference, strict=True))
    memory_peaks = {name: memory_figures(ranks) for name, ranks in (memory or {}).items()}
    fits = fit_alpha_beta(r["comm_samples"] for r in timing)
    ref, share = _references(cfg, timing)
    predicted = predict_measured(timing, ref, cfg.world_size, share, fits)
    return {
        "world_size": cfg.world_size, "strategies": strategies, "loss_diff_vs_ddp": loss_diff,
        "loss_reference": loss_reference,
        "hsdp_shape": f"{cfg.hsdp_replicate}x{cfg.world_size // cfg.hsdp_replicate}",
        "memory": memory_peaks,
        "alpha_beta": fits, "predicted": predicted, "reference": ref, "contention": share,
        "ideal_optimizer_s": (ref["matrix_step"] + ref["tail_adamw"]) / cfg.world_size,
        "ideal_optimizer_cpu_s": ref["optimizer_cpu"] / cfg.world_size,
        "schedule_check": _schedule_check(cfg, {n: s["comm"] for n, s in strategies.items()},
                                          {n: s["resident"] for n, s in strategies.items()}),
    }


def targets(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for one (optimizer, world) run: value, threshold, met."""
    s = run["strategies"]
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, threshold: str, met: bool | None) -> None:
        out.append({"target": name, "value": value, "threshold": threshold, "met": met})

    if "matrixfsdp" not in s:
        return out
    mf = s["matrixfsdp"]
    opt, opt_cpu = mf["times"]["optimizer"], mf["times"]["optimizer_cpu"]
    if "fsdp2_recon" in s:
        v = s["fsdp2_recon"]["times"]["optimizer"] / opt
        add("optimizer step: FSDP2 reconstruction / matrixfsdp", v, ">= 4", v >= 4)
    ideal = run["ideal_optimizer_s"]
    add("optimizer step / ideal (single-process step ÷ N), wall", opt / ideal, "<= 1.2",
        opt / ideal <= 1.2)
    ideal_cpu = run["ideal_optimizer_cpu_s"]
    add("optimizer step / ideal, process CPU time", opt_cpu / ideal_cpu, "<= 1.2",
        opt_cpu / ideal_cpu <= 1.2)
    c = mf["comm"]["optimizer"]
    add("optimizer-step collective bytes (matrices and tail)", c["recv"] + c["sent"], "== 0",
        c["recv"] + c["sent"] == 0 and c["calls"] == 0)
    if "fsdp2_adamw" in s:
        v = mf["times"]["total"] / s["fsdp2_adamw"]["times"]["total"]
        add("total step / FSDP2 + AdamW", v, "<= 1.15", v <= 1.15)
    if "fsdp2_recon" in s:
        v = mf["resident"]["total"] / s["fsdp2_recon"]["resident"]["total"]
        add("resident bytes / FSDP2 (same optimizer state)", v, "<= 1.05", v <= 1.05)
    if "zero1_owner" in s:
        world = run["world_size"]
        v = s["zero1_owner"]["resident"]["total"] / mf["resident"]["total"]
        add("ZeRO-1 owner resident / matrixfsdp (params+grads+state) ÷ N", v / world, ">= 0.8",
            v / world >= 0.8)
        v = s["zero1_owner"]["resident"]["params"] / mf["resident"]["params"]
        add("ZeRO-1 owner resident / matrixfsdp (parameters only) ÷ N", v / world, ">= 0.8",
            v / world >= 0.8)
    return out
