"""Pipeline-parallel configurations of the differential harness (seeds from ``PP_SEED_BASE``).

[Note: differential pipeline configurations]
A seed draws a ``PPConfig``: the model's width, hidden size and layer count, a
``torch.distributed.pipelining`` schedule (every one: single-stage, looped, zero-bubble), the
microbatch count and rows per microbatch, the data-parallel mesh of each stage (flat dp 2 or HSDP
1 x 2) at world 4 = pp 2 x dp 2, ``reshard_after_forward``, ``tail_units``, activation
checkpointing, stages without matrices (an embedding-only first and a head-only last stage, for
schedules with two chunks per rank) and the matrix optimizer. The stages are cut from one seeded
model as torchtitan cuts them and wrapped with ``fully_shard_matrix``; one ``MatrixOptimizer``
per chunk trains ``STEPS`` steps. Every rank replays one process on the global batch (the whole
model; each (dp rank, microbatch) slice's gradient averaged in float64, as the harness's
reference averages ranks; the registered step on each whole matrix, AdamW on the rest) and
compares its own stages:
each step's gradients within bounds from a float64 rerun of the reference (see [Note: tolerances
from float64] in ``tests/checks.py``), parameters after the last step within ``PARAM_RTOL``.
From the second step on the reference starts from the library's parameters (teacher forcing, as
the harness does: an fp32 difference of 1e-7 in a gradient must not compound; AdamW on an
embedding row whose gradient is nearly zero turned 1e-7 into 1.03e-5 over two free-running
steps, seed 4000063).
Seeds run one after another in one world of 4, each on fresh process groups with a short
timeout; whether each passed is agreed on the default group.

``MATRIXFSDP_DIFF_PP_SEEDS=100`` adds seeds ``PP_SEED_BASE`` + 0..99 (``=a:b``: that range) to
``PP_CI_SEEDS``; ``MATRIXFSDP_DIFF_SEED`` (one or more seeds from ``PP_SEED_BASE`` on) runs only
those. ``python -m tests.diff_pp 4000003`` prints a seed's config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import random
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import matrixfsdp as mf

from .checks import (
    FREE_RUNNING_KWARGS,
    RegisteredStepReference,
    float64_rtols,
    full_values,
    reference_values,
)
from .models import global_batch, lm_loss, local_batch
from .pp_models import MULTI, SINGLE, ZERO_BUBBLE, PPTransformer, build_pipeline, pp_meshes

__all__ = ["PP_CI_SEEDS", "PP_SEED_BASE", "PPConfig", "draw_pp_config", "pp_feature_universe",
           "pp_selected_seeds", "run_pp_configs"]

PP_SEED_BASE = 4_000_000
# Chosen to cover a single-stage, a looped and a zero-bubble schedule, HSDP, tail units per
# group, checkpointing and stages without matrices (checked in tests/test_differential.py).
PP_CI_SEEDS = (4000029, 4000006, 4000008)
STEPS = 2
PARAM_RTOL = 1e-5
GROUP_TIMEOUT_S = 60
LR = {"muon": 0.02, "shampoo": 0.01, "soap": 0.01, "okls": 0.01, "emagram": 0.01, "adamw": 0.01}
SCHEDULES = (*SINGLE, *MULTI, *ZERO_BUBBLE)


@dataclasses.dataclass(frozen=True)
class PPConfig:
    seed: int
    dim: int
    hidden: int
    layers: int
    schedule: str
    micro: int
    rows: int  # per microbatch and dp rank
    seq: int
    dp: tuple[int, ...]
    reshard_after_forward: bool
    tail_units: str
    checkpointing: bool
    edge_stages: bool
    optimizer: str

    def summary(self) -> str:
        return (f"{self.schedule} x{self.micro} (rows {self.rows}, seq {self.seq}), dp "
                f"{'x'.join(map(str, self.dp))}, model {self.dim}/{self.hidden}/{self.layers}, "
                f"raf={self.reshard_after_forward}, tail_units={self.tail_units}, "
                f"checkpointing={self.checkpointing}, edge_stages={self.edge_stages}, "
                f"{self.optimizer}")

    def features(self) -> set[str]:
        kind = ("single" if self.schedule in SINGLE else
                "looped" if self.schedule in MULTI else "zero_bubble")
        return {f"schedule={kind}", f"dp={'x'.join(map(str, self.dp))}",
                f"tail_units={self.tail_units}", f"checkpointing={self.checkpointing}",
                f"edge_stages={self.edge_stages}", f"raf={self.reshard_after_forward}"}


def pp_feature_universe() -> set[str]:
    return {"schedule=single", "schedule=looped", "schedule=zero_bubble", "dp=1x2",
            "tail_units=groups", "checkpointing=True", "edge_stages=True", "raf=False"}


def draw_pp_config(seed: int) -> PPConfig:
    rng = random.Random(f"pp:{seed}")
    schedule = rng.choice(SCHEDULES)
    micros = {"ScheduleGPipe": (1, 2, 4, 8)}.get(
        schedule, (4, 8) if schedule in ZERO_BUBBLE else (2, 4, 8))
    two_chunks = schedule not in SINGLE
    edge = two_chunks and rng.random() < 0.3
    return PPConfig(
        seed=seed, dim=rng.choice((8, 16)), hidden=rng.choice((24, 40)),
        layers=4 if edge else rng.choice((4, 8)), schedule=schedule, micro=rng.choice(micros),
        rows=rng.choice((1, 2)), seq=rng.choice((5, 9)),
        dp=rng.choice(((2,), (2,), (1, 2))), reshard_after_forward=rng.random() < 0.7,
        tail_units=rng.choice(("auto", "auto", "groups")), checkpointing=rng.random() < 0.25,
        edge_stages=edge, optimizer=rng.choice(tuple(LR)),
    )


def _parts(cfg: PPConfig, n_stages: int, stage: int) -> tuple[list[int], bool, bool]:
    if cfg.edge_stages:  # embedding-only first stage, head-only last stage
        per = cfg.layers // (n_stages - 2)
        if stage in (0, n_stages - 1):
            return [], stage == 0, stage == n_stages - 1
        return list(range((stage - 1) * per, stage * per)), False, False
    per = cfg.layers // n_stages
    return list(range(stage * per, (stage + 1) * per)), stage == 0, stage == n_stages - 1


def _run(cfg: PPConfig) -> list[str]:
    """Train the config; this rank's stages' mismatches (empty: passed)."""
    meshes = pp_meshes(2, cfg.dp, timeout_s=GROUP_TIMEOUT_S)
    dtype = torch.float64 if cfg.optimizer == "soap" else torch.float32  # see tests/test_pp.py
    torch.manual_seed(cfg.seed)
    full = PPTransformer(layers=cfg.layers, dim=cfg.dim, hidden=cfg.hidden).to(dtype)
    full.checkpointing = cfg.checkpointing
    pipe = build_pipeline(full, meshes, cfg.schedule, cfg.micro,
                          parts=functools.partial(_parts, cfg),
                          reshard_after_forward=cfg.reshard_after_forward,
                          tail_units=cfg.tail_units)
    kwargs = FREE_RUNNING_KWARGS.get(cfg.optimizer, {})
    hyper = {"lr": LR[cfg.optimizer], "weight_decay": 0.1}
    opts = [mf.MatrixOptimizer(m, cfg.optimizer, **hyper, tail_lr=1e-2, tail_weight_decay=0.1,
                               **kwargs) for m in pipe.modules]
    ref = copy.deepcopy(full)
    named = dict(ref.named_parameters())
    fqns = {f for f, p in named.items() if f.startswith("layers.") and p.ndim == 2}
    tail = torch.optim.AdamW([p for f, p in named.items() if f not in fqns], lr=1e-2,
                             weight_decay=0.1)
    reference = RegisteredStepReference({f: named[f] for f in fqns}, tail, name=cfg.optimizer,
                                        config=kwargs, **hyper)
    failures: list[str] = []
    batch = cfg.rows * cfg.micro * meshes.dp_size
    for step in range(STEPS):
        if step:  # teacher forcing: the reference continues from the library's parameters
            _force(ref, pipe.modules)
        tokens = global_batch(cfg.seed * 10 + step, batch=batch, seq=cfg.seq)
        pipe.step(local_batch(tokens, meshes.dp_rank, meshes.dp_size))
        _reference_grads(ref, tokens, meshes.dp_size, cfg.micro)
        rtols = float64_rtols(ref, lambda m, t=tokens: _reference_grads(m, t, meshes.dp_size,
                                                                          cfg.micro))
        failures += [f"step {step} {f}" for f in _compare(pipe.modules, ref, "grad", rtols)]
        reference.step()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return failures + _compare(pipe.modules, ref, "data", PARAM_RTOL)


def _force(ref: nn.Module, modules: list[nn.Module]) -> None:
    """Every stage's parameters (gathered over the world) into the reference."""
    mine: dict[str, torch.Tensor] = {}
    for module in modules:
        mine.update(full_values(module))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    values = {k: v for row in rows for k, v in row.items()}
    with torch.no_grad():
        for fqn, p in ref.named_parameters():
            p.copy_(values[fqn])


def _reference_grads(ref: nn.Module, tokens: torch.Tensor, dp: int, micro: int) -> None:
    """One process: each (dp rank, microbatch) slice's gradient, averaged in float64 (the
    harness's reference, see [Note: differential reference] in tests/test_differential.py)."""
    total: dict[str, torch.Tensor] = {}
    for r in range(dp):
        local = local_batch(tokens, r, dp)
        for m in range(micro):
            ref.zero_grad(set_to_none=True)
            lm_loss(ref, local_batch(local, m, micro)).backward()
            for fqn, p in ref.named_parameters():
                if p.grad is not None:
                    total[fqn] = total.get(fqn, 0) + p.grad.double()
    for fqn, p in ref.named_parameters():
        p.grad = None if fqn not in total else (total[fqn] / (dp * micro)).to(p.dtype)


def _compare(modules: list[nn.Module], ref: nn.Module, attr: str,
             rtol: float | dict[str, float]) -> list[str]:
    want = reference_values(ref, attr)
    out = []
    for module in modules:
        for fqn, got in full_values(module, attr).items():
            w = want[fqn]
            if got is None or w is None:
                if (got is None) != (w is None):
                    out.append(f"{attr} {fqn}: got None={got is None}, want None={w is None}")
                continue
            err = ((got.double() - w.double()).norm() / max(w.double().norm().item(), 1e-30)).item()
            bound = rtol if isinstance(rtol, float) else rtol[fqn]
            if err > bound:
                out.append(f"{attr} {fqn}: relative error {err:.2e} > {bound:.1e}")
    return out


def run_pp_configs(rank: int, world: int, seeds: list[int]) -> None:
    """Every seed in one world of 4; raises on every rank naming each failing seed."""
    report: dict[int, list[str]] = {}
    for seed in seeds:
        cfg = draw_pp_config(seed)
        try:
            failures = _run(cfg)
        except Exception:  # a peer stuck in a collective fails on the group timeout
            failures = [traceback.format_exc(limit=-6)]
        rows: list = [None] * world
        dist.all_gather_object(rows, failures)
        failed = [f"rank {r}: {f}" for r, row in enumerate(rows) for f in row]
        if failed:
            report[seed] = failed
    if report:
        lines = [f"pipeline differential: {len(report)} of {len(seeds)} seeds failed"]
        for seed, failed in report.items():
            lines += [f"\nseed {seed}: {draw_pp_config(seed).summary()}", *failed[:8],
                      f"  reproduce: MATRIXFSDP_DIFF_SEED={seed} python -m pytest -q "
                      "tests/test_differential.py -k pp"]
        raise AssertionError("\n".join(lines))


def pp_selected_seeds() -> list[int]:
    """``MATRIXFSDP_DIFF_SEED``'s pipeline seeds alone, else ``PP_CI_SEEDS`` and
    ``MATRIXFSDP_DIFF_PP_SEEDS``'s."""
    only = os.environ.get("MATRIXFSDP_DIFF_SEED", "").strip()
    if only:
        return sorted({int(s) for s in only.split(",") if s.strip() and int(s) >= PP_SEED_BASE})
    seeds = set(PP_CI_SEEDS)
    extra = os.environ.get("MATRIXFSDP_DIFF_PP_SEEDS", "").strip()
    if extra:
        start, _, stop = extra.rpartition(":")
        if not stop.isdigit() or (start and not start.isdigit()):
            raise ValueError(f"MATRIXFSDP_DIFF_PP_SEEDS must be a count n or a range a:b, "
                             f"got {extra!r}")
        seeds.update(range(PP_SEED_BASE + int(start or 0), PP_SEED_BASE + int(stop)))
    return sorted(seeds)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"seed {arg}: {draw_pp_config(int(arg)).summary()}")
