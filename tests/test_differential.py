"""Differential harness: seeded random configurations against a single-process reference.

Each seed draws a :class:`~tests.diff_models.DiffConfig` (model shape, usage pattern, world size
1-4, flat, 2x2 HSDP, dp x tp or HSDP x tp mesh, optimizer, mixed precision; see [Note: differential configurations]
in ``tests/diff_models.py``), wraps a seeded model with ``fully_shard_matrix``, trains it for 2
optimizer steps with the pattern on each rank's slice of the global batch, and compares it with
one process replaying the same pattern (see [Note: differential reference] in ``tests/diff_reference.py``).

Run: ``python -m pytest -q tests/test_differential.py`` runs the fixed CI seed set (``CI_SEEDS``,
every pattern, mesh and optimizer at least once); ``MATRIXFSDP_DIFF_SEEDS=200`` adds seeds
0..199 (``=a:b`` adds ``range(a, b)``); ``MATRIXFSDP_DIFF_TP_SEEDS=100`` adds as many
tensor-parallel seeds (``TP_SEED_BASE`` + 0..99, world 4 as dp 2 x tp 2; ``TP_CI_SEEDS`` are in
the fixed set); ``MATRIXFSDP_DIFF_HSDP_TP_SEEDS=100`` adds HSDP x tensor-parallel seeds
(``HSDP_TP_SEED_BASE`` + 0..99, world 4 as 1x2x2 or 2x1x2; ``HSDP_TP_CI_SEEDS`` are fixed);
``MATRIXFSDP_DIFF_EP_SEEDS=100`` adds expert-parallel seeds (``EP_SEED_BASE`` + 0..99, world 4
as replicate x efsdp x ep in ``EP_LAYOUTS``; ``EP_CI_SEEDS`` are fixed);
``MATRIXFSDP_DIFF_PP_SEEDS=100`` adds pipeline-parallel seeds (``PP_SEED_BASE`` + 0..99, world 4
as pp 2 x dp 2; ``PP_CI_SEEDS`` are fixed; see [Note: differential pipeline configurations] in
``tests/diff_pp.py``);
``MATRIXFSDP_DIFF_SEED=17`` (or ``=17,40``) runs only those. A failure names every failing
seed, its config, what differed and a one-line reproduction. ``python -m tests.test_differential 17`` prints a seed's config.
``MATRIXFSDP_DIFF_TAIL_ONLY=1`` selects no matrix but the rank-dependent branch and a singly
frozen matrix, so stock FSDP2 trains the rest: a failure that goes away with it, or stays only
on those two, is the matrix runtime's.

[Note: differential reference] in ``tests/diff_reference.py`` says what the reference replays
and how it is compared.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp as mf

from .checks import FREE_RUNNING_KWARGS, full_optimizer_state, full_values
from .diff_ep import EP_CI_SEEDS, EpMeshes, distribute_experts, ep_feature_universe, ep_meshes
from .diff_models import (
    CI_SEEDS,
    HSDP_TP_CI_SEEDS,
    TP_CI_SEEDS,
    DiffConfig,
    build_model,
    call_tokens,
    draw_config,
    feature_universe,
    features,
    hsdp_tp_feature_universe,
    root_matrix_filter,
    selected_seeds,
    tp_feature_universe,
)
from .diff_pp import (
    PP_CI_SEEDS,
    draw_pp_config,
    pp_feature_universe,
    pp_selected_seeds,
    run_pp_configs,
)
from .diff_reference import (
    ADAMW,
    BF16,
    LOSS_RTOL,
    SGD,
    TP_MP_LOSS_RTOL,
    TP_RTOL,
    Grads,
    Reference,
    _digest,
    run_backward_phase,
)
from .dist_utils import run_world
from .test_optim_dist import _make_opt

GROUP_TIMEOUT_S = 60  # per-config process groups: a stuck collective fails the config
STEPS = 2
SEEDS_PER_WORLD = 40
REPRODUCE = "MATRIXFSDP_DIFF_SEED={seed} python -m pytest -q tests/test_differential.py"


# -- one rank's training (the library) -------------------------------------------------------------
def _set_frozen(model: nn.Module, fqns: tuple[str, ...], frozen: bool) -> None:
    for fqn, p in model.named_parameters():
        if fqn in fqns:
            p.requires_grad_(not frozen)


def _between_forward(cfg: DiffConfig, model: nn.Module, rank: int) -> None:
    """A forward that trains nothing, between step 0 and step 1."""
    if cfg.between.startswith("eval"):
        model.eval()
    grad_mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                 "eval_no_grad": torch.no_grad}.get(cfg.between, torch.enable_grad)
    with grad_mode():
        model(call_tokens(cfg, rank, 99, 0, 0))
    model.train()


def _config_mesh(cfg: DiffConfig, index: int
                 ) -> tuple[DeviceMesh | EpMeshes, list[dist.ProcessGroup]]:
    """Config ``index``'s mesh on fresh gloo groups with a short timeout (see the Note).

    Its dim names are unique: DTensor caches sharding decisions by mesh equality, which
    ignores the process groups, so two configs' equal meshes would share the first one's groups.
    """
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    rank = dist.get_rank()
    if cfg.mesh == "ep":
        return ep_meshes(cfg, index, GROUP_TIMEOUT_S)
    if cfg.mesh == "flat":
        group = dist.new_group(list(range(cfg.world)), timeout=timeout)
        return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"dp{index}",)), [group]
    # hsdp: (replicate, shard); tp: (dp, tp); hsdp_tp: (replicate, shard, tp); rank-major layout
    layout = torch.arange(cfg.world).view(cfg.mesh_shape)
    mine = []
    for dim in range(layout.ndim):  # every rank creates every group of every dim, in one order
        for ranks in layout.movedim(dim, -1).reshape(-1, layout.shape[dim]).tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine.append(group)
    kinds = {"hsdp": ("replicate", "shard"), "tp": ("dp", "tp"),
             "hsdp_tp": ("replicate", "shard", "tp")}[cfg.mesh]
    names = tuple(f"{kind}{index}" for kind in kinds)
    return DeviceMesh.from_group(mine, "cpu", mesh=layout, mesh_dim_names=names), mine


def _tail_only_filter(cfg: DiffConfig) -> Callable[[str, nn.Parameter], bool]:
    """``MATRIXFSDP_DIFF_TAIL_ONLY``: matrices only where stock FSDP2 is not valid (see
    [Note: differential configurations]): the rank-dependent branch, a singly frozen matrix."""
    kept = set(cfg.freeze) if len(cfg.freeze) == 1 else set()
    return lambda fqn, param: fqn.endswith(".branch.weight") or fqn in kept


def _wrap(cfg: DiffConfig, model: nn.Module, mesh: DeviceMesh | EpMeshes) -> None:
    shape = cfg.shape
    expert_mesh = None
    if isinstance(mesh, EpMeshes):  # experts over ep first, as torchtitan does; then owners
        distribute_experts(model, mesh)
        mesh, expert_mesh = mesh.dense, mesh.experts
    if cfg.is_tp:  # tensor parallelism first, as torchtitan does; then owners over dp
        *dp_names, tp_name = mesh.mesh_dim_names
        for i in cfg.tp_blocks:
            parallelize_module(model.layers[i], mesh[tp_name],
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
        mesh = mesh[tuple(dp_names)] if len(dp_names) > 1 else mesh[dp_names[0]]
    matrix_filter = root_matrix_filter if shape.root_matrices else None
    if os.environ.get("MATRIXFSDP_DIFF_TAIL_ONLY") == "1":  # stock FSDP2 (see the module doc)
        matrix_filter = _tail_only_filter(cfg)
    mf.fully_shard_matrix(
        model, mesh, expert_mesh=expert_mesh, matrix_filter=matrix_filter,
        reshard_after_forward=cfg.reshard_after_forward,
        mp_policy=BF16 if cfg.mixed_precision else None,
        planner=mf.LPTPlanner(stacks=cfg.stacks) if "moe" in shape.kinds else None,
        collectives=cfg.collectives,
    )
    if cfg.is_tp:  # the harness's own check: every parallelized MLP is a TP matrix pair
        tp_matrices = {f for f, mp in mf.get_state(model).params.items() if mp.tp is not None}
        want = {f"layers.{i}.{m}.weight" for i in cfg.tp_blocks for m in ("up", "down")}
        if tp_matrices != want:
            raise RuntimeError(f"TP matrices {sorted(tp_matrices)}, expected {sorted(want)}")


def _library_optimizer(cfg: DiffConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), **SGD)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **ADAMW)
    return _make_opt(model, cfg.optimizer, batch_same_shape=False,
                     **FREE_RUNNING_KWARGS.get(cfg.optimizer, {}))


@dataclasses.dataclass
class RankOutcome:
    """What one rank reports for one config (gathered on every rank, see the Note)."""

    error: str | None = None
    mismatches: list[str] = dataclasses.field(default_factory=list)  # rank 0: vs the reference
    losses: dict[str, float] = dataclasses.field(default_factory=dict)  # "step/micro" -> loss
    digests: list[str] = dataclasses.field(default_factory=list)  # HSDP: values seen per check


def _train(cfg: DiffConfig, rank: int, mesh: DeviceMesh, outcome: RankOutcome,
           reference_out: list) -> None:
    """Wrap, train 2 steps, compare on rank 0 (``reference_out`` gets the Reference)."""
    model = build_model(cfg.shape, cfg.seed)
    model.block_checkpoint = cfg.block_checkpoint
    if cfg.freeze and cfg.freeze_at == "before_wrap":
        _set_frozen(model, cfg.freeze, True)
    master = copy.deepcopy(model) if rank == 0 else None
    _wrap(cfg, model, mesh)
    if cfg.freeze and cfg.freeze_at == "after_wrap":
        _set_frozen(model, cfg.freeze, True)
        if master is not None:
            _set_frozen(master, cfg.freeze, True)
    opt = _library_optimizer(cfg, model)
    ref = Reference(cfg, master, mf.get_plan(model)) if rank == 0 else None
    reference_out.append(ref)
    # Read only right after wrapping and after each step: after a forward without backward the
    # tail's root FSDP2 module stays unsharded and its registered parameters are bf16 copies.
    start = full_values(model)
    for step in range(STEPS):
        if step == 1:
            _between_steps(cfg, model, rank, ref)
        snapshots: list[Grads] = []
        losses = run_backward_phase(cfg, model, cfg.data_rank(rank), step,
                                    functools.partial(mf.set_requires_gradient_sync, model),
                                    functools.partial(_snapshot, model, snapshots, outcome))
        outcome.losses.update({f"{step}/{m}": v for m, v in enumerate(losses)})
        opt.step()
        if cfg.optimizer == "soap":  # the reference adopts the library's first eigenbases
            state = full_optimizer_state(model, opt)  # collective
            if ref is not None:
                ref.library_state.clear()
                ref.library_state.update(state)
        after = full_values(model)
        outcome.digests.append(_digest(after))
        if ref is not None:
            try:
                outcome.mismatches += ref.check_step(step, start, snapshots, after)
            except Exception:  # the library run goes on: its peers are in its collectives
                outcome.mismatches.append(f"the reference raised (a harness bug or an invalid "
                                          f"config): {_short_traceback()}")
                ref = None
        opt.zero_grad(set_to_none=cfg.set_to_none)
        start = after


def _between_steps(cfg: DiffConfig, model: nn.Module, rank: int, ref: Reference | None) -> None:
    """Between step 0 and step 1: the forward that trains nothing, then (un)freezing."""
    if cfg.between != "none":
        _between_forward(cfg, model, cfg.data_rank(rank))
    if cfg.freeze and (cfg.freeze_at == "after_step0" or cfg.unfreeze_after_step0):
        frozen = cfg.freeze_at == "after_step0"
        _set_frozen(model, cfg.freeze, frozen)
        if ref is not None:
            _set_frozen(ref.master, cfg.freeze, frozen)


def _snapshot(model: nn.Module, snapshots: list[Grads], outcome: RankOutcome,
              synced: bool) -> None:
    """After a backward that synchronized: the library's whole gradients (collective)."""
    if synced:
        snapshots.append(full_values(model, "grad"))
        outcome.digests.append(_digest(snapshots[-1]))


# -- one config on every rank, agreed --------------------------------------------------------------
def _run_config(cfg: DiffConfig, rank: int, index: int) -> tuple[RankOutcome, Reference | None]:
    outcome, reference_out = RankOutcome(), []
    groups: list[dist.ProcessGroup] = []
    try:
        mesh, groups = _config_mesh(cfg, index)
        _train(cfg, rank, mesh, outcome, reference_out)
    except Exception as exc:  # reported below, agreed by every rank
        outcome.error = f"rank {rank} raised {type(exc).__name__}: {exc}\n{_short_traceback()}"
    if outcome.error is None:
        for group in groups:
            dist.destroy_process_group(group)
    return outcome, (reference_out[0] if reference_out else None)


def _short_traceback(lines: int = 14) -> str:
    return "\n".join(traceback.format_exc().rstrip().splitlines()[-lines:])


def _verdict(cfg: DiffConfig, outcomes: list[dict], ref: Reference | None) -> list[str]:
    """Rank 0: every reason ``cfg`` failed (empty: it passed)."""
    failures = [o["error"] for o in outcomes if o["error"] and "imed out" not in o["error"]]
    failures += [o["error"] for o in outcomes if o["error"] and "imed out" in o["error"]]
    failures += outcomes[0]["mismatches"]
    loss_rtol, loss_floor = LOSS_RTOL, 1e-30
    if cfg.is_tp:  # under mixed precision: relative to the loss, or to 1 when smaller
        loss_rtol, loss_floor = (TP_MP_LOSS_RTOL, 1.0) if cfg.mixed_precision else (TP_RTOL, 1e-30)
    if ref is not None and not failures:
        for rank, o in enumerate(outcomes):
            for key, loss in o["losses"].items():
                want = ref.losses.get(f"{key}/{cfg.data_rank(rank)}")
                if want is None or not abs(loss - want) <= loss_rtol * max(abs(want), loss_floor):
                    failures.append(f"loss step/micro {key} rank {rank}: library {loss!r}, "
                                    f"reference {want!r}")
        if cfg.mesh in ("hsdp", "hsdp_tp", "ep") and len({tuple(o["digests"]) for o in outcomes}) > 1:
            failures.append("HSDP replicas hold different values or gradients: "
                            f"{[o['digests'] for o in outcomes]}")
    return failures


def _world_main(rank: int, world: int, configs: list[DiffConfig], results: str) -> None:
    for index, cfg in enumerate(configs):
        outcome, ref = _run_config(cfg, rank, index)
        outcomes: list = [None] * world
        dist.all_gather_object(outcomes, dataclasses.asdict(outcome))  # every rank reaches it
        if rank == 0:
            failures = _verdict(cfg, outcomes, ref)
            with open(results, "a") as f:
                f.write(json.dumps({"seed": cfg.seed, "failures": failures}) + "\n")


# -- pytest ----------------------------------------------------------------------------------------
def _read_results(path: Path) -> dict[int, list[str]]:
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["seed"]] = record["failures"]
    return records


def run_seeds(world: int, seeds: list[int], results: Path) -> tuple[dict[int, list[str]], str]:
    """Every seed's failures (empty: passed). A world runs at most ``SEEDS_PER_WORLD`` seeds (a
    destroyed gloo group keeps its threads until the process ends). A world that dies (a rank
    aborted, e.g. by a gloo size mismatch) fails the seed it was running; a fresh world runs the
    seeds after it."""
    records: dict[int, list[str]] = {}
    remaining, trailing_crash = list(seeds), ""
    while remaining:
        batch, crash = remaining[:SEEDS_PER_WORLD], ""
        try:
            run_world(world, _world_main, [draw_config(s) for s in batch], str(results),
                      timeout=120 + 90 * len(batch))
        except AssertionError as exc:
            crash = str(exc)
        records.update(_read_results(results))
        unfinished = [s for s in batch if s not in records]
        if unfinished:  # the world died (or stopped) at the first of them
            reason = f"the world died running this seed: {crash[-2500:]}" if crash else "not run"
            records[unfinished[0]] = [reason]
        elif crash:
            trailing_crash = crash
        remaining = [s for s in remaining if s not in records]
    return records, trailing_crash


def _report(world: int, seeds: list[int], records: dict[int, list[str]], crash: str) -> str:
    failed = [s for s in seeds if records.get(s) or s not in records]
    lines = [f"differential harness, world {world}: {len(failed)} of {len(seeds)} seeds failed"]
    for seed in failed:
        reasons = records.get(seed, ["not run"])
        lines += [f"\nseed {seed}: {draw_config(seed).summary()}",
                  *(f"  {r}" for r in reasons[:10]),
                  *([f"  ... and {len(reasons) - 10} more"] if len(reasons) > 10 else []),
                  f"  reproduce: {REPRODUCE.format(seed=seed)}"]
    if crash:
        lines.append(f"\nthe world died after its last seed:\n{crash[-2500:]}")
    lines.append(f"\nfailing seeds: {','.join(map(str, failed))}")
    return "\n".join(lines)


def test_ci_seeds_cover_every_pattern() -> None:
    covered = set().union(*(features(draw_config(s)) for s in CI_SEEDS))
    assert feature_universe() <= covered, f"not covered: {sorted(feature_universe() - covered)}"


@pytest.mark.parametrize(("mesh", "seeds", "universe"), [
    ("tp", TP_CI_SEEDS, tp_feature_universe),
    ("hsdp_tp", HSDP_TP_CI_SEEDS, hsdp_tp_feature_universe),
    ("ep", EP_CI_SEEDS, ep_feature_universe),
])
def test_tp_ci_seeds_cover_every_pattern(mesh: str, seeds: tuple[int, ...],
                                         universe: Callable[[], set[str]]) -> None:
    configs = [draw_config(s) for s in seeds]
    assert all(c.mesh == mesh and (c.tp_blocks or mesh == "ep") for c in configs)
    covered = {f.removesuffix("@ranks") for c in configs for f in features(c)}
    missing = universe() - covered
    assert not missing, f"not covered: {sorted(missing)}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_differential(world: int, tmp_path: Path) -> None:
    seeds = [s for s in selected_seeds() if draw_config(s).world == world]
    if not seeds:
        pytest.skip(f"no selected seed draws world {world}")
    records, crash = run_seeds(world, seeds, tmp_path / "results.jsonl")
    if crash or any(records.get(s) or s not in records for s in seeds):
        raise AssertionError(_report(world, seeds, records, crash))


def test_pp_ci_seeds_cover_every_pattern() -> None:
    covered = set().union(*(draw_pp_config(s).features() for s in PP_CI_SEEDS))
    assert pp_feature_universe() <= covered, sorted(pp_feature_universe() - covered)


def test_differential_pp() -> None:
    """Pipeline-parallel seeds at world 4 (see ``tests/diff_pp.py``)."""
    seeds = pp_selected_seeds()
    if not seeds:
        pytest.skip("no selected pipeline seed")
    failed = []
    for start in range(0, len(seeds), SEEDS_PER_WORLD):
        batch = seeds[start:start + SEEDS_PER_WORLD]
        try:
            run_world(4, run_pp_configs, batch, timeout=120 + 60 * len(batch))
        except AssertionError as exc:
            failed.append(str(exc))
    assert not failed, "\n".join(failed)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        config = draw_config(int(arg))
        print(f"seed {arg}: {config.summary()}\n  {config}")
