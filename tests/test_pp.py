"""Pipeline parallelism: torch.distributed.pipelining schedules on stages wrapped with
``fully_shard_matrix``, against one process on the same global batch.

World 4 = pp 2 x dp 2 on gloo (rank-major: ranks 0-1 hold the first pp rank's stages). Stages
are cut from the whole model as torchtitan cuts them (see ``tests/pp_models.py``), so their
FQNs are the whole model's. Every schedule step runs its microbatches' backwards with gradient
sync off and reduces at the end of the step (``perform_reduce_grad``): the matrices are then
reduced once per step whatever the microbatch count, as FSDP2 reduces its shards.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

import matrixfsdp as mf
from matrixfsdp.runtime.group import MatrixGroup

from .checks import (
    FREE_RUNNING_KWARGS,
    RegisteredStepReference,
    _host,
    _whole,
    assert_close_dicts,
    float64_rtols,
    full_values,
    reference_values,
)
from .dist_utils import run_subtests, run_world
from .models import global_batch, lm_loss, local_batch
from .pp_models import (
    MULTI,
    SINGLE,
    Pipeline,
    PPMeshes,
    PPTransformer,
    build_pipeline,
    default_parts,
    pp_meshes,
)

logger = logging.getLogger(__name__)

GRAD_RTOL = 1e-6
PARAM_RTOL = 1e-5
BATCH = 16  # 8 rows per dp rank: 1, 4 and 8 microbatches split it evenly
LR = {"muon": 0.02, "shampoo": 0.01, "soap": 0.01, "okls": 0.01, "emagram": 0.01, "adamw": 0.01}


def _tokens(step: int, meshes: PPMeshes) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = global_batch(step, batch=BATCH)
    return tokens, local_batch(tokens, meshes.dp_rank, meshes.dp_size)


def _full() -> nn.Module:
    torch.manual_seed(0)
    return PPTransformer()


def _stage_values(pipe: Pipeline, attr: str) -> dict[str, torch.Tensor | None]:
    """Every local stage's parameters or gradients, whole, keyed by full-model FQN."""
    out: dict[str, torch.Tensor | None] = {}
    for module in pipe.modules:
        out.update(full_values(module, attr))
    return out


def _check_against(pipe: Pipeline, ref: nn.Module, attr: str, rtol: float | dict[str, float],
                   what: str) -> None:
    got = _stage_values(pipe, attr)
    want = reference_values(ref, attr)
    assert_close_dicts(got, {k: want[k] for k in got}, rtol, what)


def _zero_grad(pipe: Pipeline) -> None:
    for module in pipe.modules:
        for p in module.parameters():
            p.grad = None


# -- exact gradients and steps ---------------------------------------------------------------------
def _grads(meshes: PPMeshes, schedule: str, micro: int = 4, *, reference: str = "one_process",
           rtol: float = GRAD_RTOL, **wrap_kwargs) -> None:
    """Step-0 gradients equal one process on the global batch (or FSDP2 on the same stages)."""
    full = _full()
    checkpointing = wrap_kwargs.pop("checkpointing", False)
    full.checkpointing = checkpointing
    pipe = build_pipeline(full, meshes, schedule, micro, **wrap_kwargs)
    tokens, local = _tokens(0, meshes)
    pipe.step(local)
    if reference == "fsdp2":  # bf16 compute: FSDP2 on the same stages computes the same way
        fsdp2 = build_pipeline(full, meshes, schedule, micro, wrap="fsdp2", **wrap_kwargs)
        fsdp2.step(local)
        want = {n: None if p.grad is None else _host(_whole(p.grad))
                for m in fsdp2.modules for n, p in m.named_parameters()}
        assert_close_dicts(_stage_values(pipe, "grad"), want, rtol, f"{schedule} grad")
        return
    ref = copy.deepcopy(full)
    lm_loss(ref, tokens).backward()
    rtols = float64_rtols(ref, lambda m: lm_loss(m, tokens).backward())
    _check_against(pipe, ref, "grad", rtols, f"{schedule} grad (micro={micro})")


def _matrix_fqns(pipe: Pipeline) -> set[str]:
    """Every stage's matrices, over the whole world (each rank knows its own stages')."""
    mine = sorted({f for m in pipe.modules for f in mf.get_state(m).params})
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return {f for row in rows for f in row}


def _steps(meshes: PPMeshes, schedule: str, name: str, steps: int = 3, micro: int = 4,
           wrap_kwargs: dict | None = None, parts=default_parts) -> None:
    """``steps`` steps of ``name`` (one MatrixOptimizer per chunk) equal one process (SOAP in
    float64, as tests/test_optim_dist.py runs it: its fp32 eigenbases of rank-deficient factors
    are arbitrary in their null spaces)."""
    full = _full().to(torch.float64 if name == "soap" else torch.float32)
    pipe = build_pipeline(full, meshes, schedule, micro, parts=parts, **(wrap_kwargs or {}))
    kwargs = FREE_RUNNING_KWARGS.get(name, {})
    hyper = {"lr": LR[name], "weight_decay": 0.1}
    opts = [mf.MatrixOptimizer(m, name, **hyper, tail_lr=1e-2, tail_weight_decay=0.1, **kwargs)
            for m in pipe.modules]
    ref = copy.deepcopy(full)
    named = dict(ref.named_parameters())
    fqns = _matrix_fqns(pipe)
    assert fqns == {f for f, p in named.items() if f.startswith("layers.") and p.ndim == 2}
    tail = torch.optim.AdamW([p for f, p in named.items() if f not in fqns], lr=1e-2,
                             weight_decay=0.1)
    reference = RegisteredStepReference({f: named[f] for f in fqns}, tail, name=name,
                                        config=kwargs, **hyper)
    for module, opt in zip(pipe.modules, opts, strict=True):  # a stage without matrices:
        kinds = Counter(g["kind"] for g in opt.param_groups for _ in g["params"])  # only its tail
        assert kinds["matrix"] == len(mf.get_state(module).params), kinds
        assert kinds["matrix"] + kinds["tail"] == len(list(module.parameters())), kinds
    for step in range(steps):
        tokens, local = _tokens(step, meshes)
        pipe.step(local)
        lm_loss(ref, tokens).backward()
        if step == 0:
            rtols = float64_rtols(ref, lambda m, t=tokens: lm_loss(m, t).backward())
            _check_against(pipe, ref, "grad", rtols, f"{schedule} step-0 grad")
        reference.step()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    _check_against(pipe, ref, "data", PARAM_RTOL, f"{schedule} {name}, {steps} steps")


# -- one reduction per step --------------------------------------------------------------------------
@contextlib.contextmanager
def _counting() -> Iterator[Counter]:
    """Group-level gathers and reductions, matrices (ours) and FSDP2's param groups."""
    counts: Counter = Counter()

    def counted(key, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counts[key(*args)] += 1
            return fn(*args, **kwargs)
        return wrapper

    def fsdp2_key(kind):
        def key(params, *_):
            block = params[0]._param_fqn.startswith("layers.")
            return f"fsdp2_{kind}_{'block' if block else 'root'}"
        return key

    patches = [
        (MatrixGroup, "_start_gather", counted(lambda *_: "gather", MatrixGroup._start_gather)),
        (MatrixGroup, "_start_reduce", counted(lambda *_: "reduce", MatrixGroup._start_reduce)),
        (_fsdp_param_group, "foreach_all_gather",
         counted(fsdp2_key("gather"), _fsdp_param_group.foreach_all_gather)),
        (_fsdp_param_group, "foreach_reduce",
         counted(fsdp2_key("reduce"), _fsdp_param_group.foreach_reduce)),
    ]
    with contextlib.ExitStack() as stack:
        for owner, attr, new in patches:
            stack.enter_context(_patched(owner, attr, new))
        yield counts


@contextlib.contextmanager
def _patched(owner: object, attr: str, new: object) -> Iterator[None]:
    old = getattr(owner, attr)
    setattr(owner, attr, new)
    try:
        yield
    finally:
        setattr(owner, attr, old)


def _step_counts(meshes: PPMeshes, schedule: str, micro: int, wrap: str,
                 reshard_after_forward: bool = True) -> dict[str, int]:
    """Gathers and reductions of the second step (the first also infers stage metadata)."""
    pipe = build_pipeline(_full(), meshes, schedule, micro, wrap=wrap,
                          reshard_after_forward=reshard_after_forward)
    _, local = _tokens(0, meshes)
    pipe.step(local)
    _zero_grad(pipe)
    counters = [mf.get_state(m).comm.counter for m in pipe.modules] if wrap == "matrix" else []
    for c in counters:
        c.reset()
    _, local = _tokens(1, meshes)
    with _counting() as counts:
        pipe.step(local)
    out = dict(counts)
    for c in counters:
        for op in ("reduce_to_owners", "all_reduce_replicas"):
            stats = c.by_op.get(op)
            if stats is not None:
                out[f"{op}_calls"] = out.get(f"{op}_calls", 0) + stats.calls
                out[f"{op}_bytes"] = out.get(f"{op}_bytes", 0) + stats.bytes_sent
    if wrap == "matrix":
        out["groups"] = sum(len(mf.get_state(m).groups) for m in pipe.modules)
    return out


def _one_reduction_per_step(meshes: PPMeshes, schedule: str) -> None:
    """Reductions (group reductions, reduce calls and bytes) per step: the same with 1 (2 where
    the schedule needs a microbatch per stage), 4 and 8 microbatches; one per group."""
    micros = {"ScheduleGPipe": (1, 4, 8), "Schedule1F1B": (2, 4, 8),
              "ScheduleInterleaved1F1B": (2, 4, 8)}.get(schedule, (4, 8))
    counts = {micro: _step_counts(meshes, schedule, micro, "matrix") for micro in micros}
    keys = ("reduce", "reduce_to_owners_calls", "reduce_to_owners_bytes")
    first = {k: counts[micros[0]][k] for k in keys}
    for micro in micros[1:]:
        assert {k: counts[micro][k] for k in keys} == first, counts
    assert first["reduce"] == counts[micros[0]]["groups"], counts  # one reduction per group
    assert first["reduce_to_owners_bytes"] > 0, counts


def _gathers_vs_fsdp2(meshes: PPMeshes, schedule: str, micro: int,
                      reshard_after_forward: bool) -> None:
    ours = _step_counts(meshes, schedule, micro, "matrix", reshard_after_forward)
    fsdp2 = _step_counts(meshes, schedule, micro, "fsdp2", reshard_after_forward)
    # One FSDP2 unit per layer, one matrix group per layer: per-unit gathers compare directly;
    # the tail (norms, biases; embedding and head) is FSDP2's root unit in both.
    assert ours["gather"] <= fsdp2["fsdp2_gather_block"], (ours, fsdp2)
    assert ours["reduce"] == fsdp2["fsdp2_reduce_block"], (ours, fsdp2)
    assert ours["fsdp2_gather_root"] <= fsdp2["fsdp2_gather_root"], (ours, fsdp2)
    assert ours["fsdp2_reduce_root"] == fsdp2["fsdp2_reduce_root"], (ours, fsdp2)
    logger.info("gathers per step, %s micro=%d raf=%s: ours %s, fsdp2 %s", schedule, micro,
                reshard_after_forward, ours, fsdp2)


# -- the world -------------------------------------------------------------------------------------
def _world(rank: int, world: int, pp: int, dp: tuple[int, ...], cases: dict) -> None:
    meshes = pp_meshes(pp, dp)
    run_subtests(rank, {name: functools.partial(fn, meshes) for name, fn in cases.items()})


def _cases_schedules() -> dict:
    cases: dict = _cases_edge_stages()
    for schedule in (*SINGLE, *MULTI):
        cases[f"muon_{schedule}"] = functools.partial(_steps, schedule=schedule, name="muon")
    return cases


def _edge_parts(n_stages: int, stage: int) -> tuple[list[int], bool, bool]:
    """An embedding-only first stage and a norm + head-only last stage: no matrices there."""
    inner = n_stages - 2
    per = 4 // inner
    if stage == 0:
        return [], True, False
    if stage == n_stages - 1:
        return [], False, True
    return list(range((stage - 1) * per, stage * per)), False, False


def _cases_edge_stages() -> dict:
    return {"no_matrix_stages": functools.partial(
        _steps, schedule="ScheduleInterleaved1F1B", name="muon", parts=_edge_parts)}


def _cases_counts() -> dict:
    cases: dict = {}
    for schedule in (*SINGLE, "ScheduleInterleaved1F1B"):
        cases[f"one_reduction_{schedule}"] = functools.partial(_one_reduction_per_step,
                                                               schedule=schedule)
    for raf in (True, False):
        cases[f"gathers_vs_fsdp2_raf{raf}"] = functools.partial(
            _gathers_vs_fsdp2, schedule="ScheduleGPipe", micro=4, reshard_after_forward=raf)
    cases["gathers_vs_fsdp2_1f1b"] = functools.partial(
        _gathers_vs_fsdp2, schedule="Schedule1F1B", micro=8, reshard_after_forward=True)
    return cases


def test_pp_schedules_exact() -> None:
    """pp 2 x dp 2: GPipe, 1F1B, Interleaved1F1B, LoopedBFS; 3 Muon steps == one process."""
    run_world(4, _world, 2, (2,), _cases_schedules())


def test_pp_one_reduction_per_step() -> None:
    """Reductions per step equal with 1, 4 and 8 microbatches; gathers at most FSDP2's."""
    run_world(4, _world, 2, (2,), _cases_counts())


def test_pp_hsdp() -> None:
    """pp 2 x HSDP (1 x 2): the same steps and counts."""
    run_world(4, _world, 2, (1, 2), {
        "muon_gpipe": functools.partial(_steps, schedule="ScheduleGPipe", name="muon"),
        "muon_interleaved": functools.partial(_steps, schedule="ScheduleInterleaved1F1B",
                                              name="muon"),
        "one_reduction": functools.partial(_one_reduction_per_step, schedule="ScheduleGPipe"),
    })
