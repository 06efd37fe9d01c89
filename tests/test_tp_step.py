"""The TP step exchange (matrixfsdp.optim.tp_step) against single-process full-matrix steps.

Core: TP layouts built by hand (``distribute_tensor`` on ``mesh["tp"]`` + ``tp_layout_of``), no
wrapped model: world 4 as dp 2 x tp 2 and dp 1 x tp 4, world 3 as tp 3, world 2 as tp 2. Matrix
``i`` belongs to dp row ``i % dp`` (its owner row). The reference steps each whole matrix in one
process with the registered step function called directly.

End to end: a ``TinyTransformer`` whose MLPs are ``parallelize_module``'d (Colwise ``up``, Rowwise
``down``) and wrapped by ``fully_shard_matrix(model, mesh["dp"])``, ``MatrixOptimizer`` Muon
against a single-process model stepped with the registered Muon on whole matrices and AdamW on
the rest, 3 steps at dp 2 x tp 2.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp as mf
from matrixfsdp.optim import get_matrix_optimizer, tp_step
from matrixfsdp.optim.offload import make_state_placement
from matrixfsdp.optim.tp_step import (
    TpMatrix,
    WholeStepper,
    assign_step_owners,
    step_cost,
    step_tp_matrices,
    tp_step_owners,
)
from matrixfsdp.runtime.tp import tp_layout_of

from .checks import (
    FREE_RUNNING_KWARGS,
    RegisteredStepReference,
    assert_close_dicts,
    count_collectives,
    reference_values,
)
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

OPTIMIZERS = ["muon", "shampoo", "soap", "okls", "emagram", "adamw"]
# (global shape, TP shard dim): both dims, uneven torch.chunk sizes (10 over 3 or 4; 5 over 4
# leaves one tp rank an empty shard), repeated shapes for batch_same_shape.
SHAPES = [((10, 6), 0), ((6, 10), 1), ((8, 8), 1), ((7, 5), 0), ((8, 8), 1), ((5, 6), 0),
          ((8, 8), 1), ((6, 5), 1), ((10, 6), 0), ((8, 8), 1)]
STEPS = 3
LR, WD = 0.02, 0.01
RTOL = 1e-5  # relative per matrix; the unbatched exchange is exact (asserted bit for bit)


def _mesh(dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _full(index: int, shape: tuple[int, ...], step: int = -1) -> torch.Tensor:
    """Matrix ``index``'s initial value (``step=-1``) or its gradient at ``step``: one rule."""
    gen = torch.Generator().manual_seed(7919 * index + step + 1)
    return torch.randn(shape, generator=gen)


def _setup(mesh: DeviceMesh, name: str) -> tuple[list[TpMatrix], dict[str, int]]:
    """This rank's TP matrices (its owner row's), step owners assigned; FQN -> matrix index."""
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows, index_of = [], {}
    for i, (shape, dim) in enumerate(SHAPES):
        # Every rank holds the whole value: no scatter (src_data_rank=None)
        tensor = distribute_tensor(_full(i, shape), mesh["tp"], [Shard(dim)], src_data_rank=None)
        layout = tp_layout_of(f"m{i}", tensor, mesh["dp"])
        assert layout is not None and layout.shard_dim == dim
        if i % dp == dp_rank:
            rows.append((f"m{i}", nn.Parameter(tensor.to_local().clone()), layout))
            index_of[f"m{i}"] = i
    owners = assign_step_owners([step_cost(lay.global_shape, name) for _, _, lay in rows],
                                mesh["tp"].size())
    return [TpMatrix(f, p, lay, o) for (f, p, lay), o in zip(rows, owners, strict=True)], index_of


def _set_grads(matrices: list[TpMatrix], index_of: dict[str, int], step: int) -> None:
    for m in matrices:
        full = _full(index_of[m.fqn], m.tp.global_shape, step)
        m.param.grad = m.tp.slice_of(full, m.tp.tp_rank).clone()


def _hyper(name: str) -> dict:
    spec = get_matrix_optimizer(name)
    return {"lr": LR, "weight_decay": WD, "initial_lr": LR,
            "config": spec.make_config(FREE_RUNNING_KWARGS.get(name, {}))}


def _run(mesh: DeviceMesh, name: str, *, batch: bool = False, offload: bool = False,
         bucket_bytes: int = tp_step.TP_STEP_BUCKET_BYTES, spec=None):
    """``STEPS`` TP steps; returns the matrices, their state and the per-step stats."""
    matrices, index_of = _setup(mesh, name)
    spec = spec or get_matrix_optimizer(name)
    state: dict = {}
    placement = make_state_placement("cpu" if offload else None, torch.device("cpu"))
    stepper = WholeStepper(spec, _hyper(name), state, placement, batch)
    stats = []
    for step in range(STEPS):
        _set_grads(matrices, index_of, step)
        stats.append(step_tp_matrices(matrices, stepper, bucket_bytes=bucket_bytes))
    return matrices, index_of, state, stats


def _reference(name: str, index: int, shape: tuple[int, ...],
               local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
    """The single-process step of ``local(full matrix)``: the registered functions, called
    directly. Returns the parameter and state after ``STEPS`` steps."""
    spec, hyper = get_matrix_optimizer(name), _hyper(name)
    param = local(_full(index, shape)).clone()
    state = spec.init_state_fn(param, hyper["config"])
    for step in range(STEPS):
        grad = local(_full(index, shape, step)).clone()
        spec.step_fn(param, grad, state, step=step + 1, **hyper)
    return param, state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- subtests -------------------------------------------------------------------------------------
def _matches_full_step(mesh: DeviceMesh, name: str, batch: bool) -> None:
    matrices, index_of, state, _ = _run(mesh, name, batch=batch)
    me = mesh["tp"].get_local_rank()
    for m in matrices:
        ref, ref_state = _reference(name, index_of[m.fqn], m.tp.global_shape)
        expect = m.tp.slice_of(ref, me)
        if batch:
            assert _rel(m.param.detach(), expect) <= RTOL or expect.numel() == 0, (m.fqn, name)
        else:
            assert torch.equal(m.param.detach(), expect), (m.fqn, name, _rel(m.param, expect))
        if m.step_owner != me:
            assert m.param not in state, f"{m.fqn}: state on tp rank {me}, not its step owner"
            continue
        got = state[m.param]
        assert float(got["step"]) == STEPS and set(got) - {"step"} == set(ref_state), m.fqn
        for key, value in ref_state.items():  # whole-matrix state, as a single process keeps
            assert got[key].shape == value.shape, (m.fqn, key)
            assert _rel(got[key], value) <= RTOL or value.norm() == 0, (m.fqn, key)


def _batches_happen(mesh: DeviceMesh, required: bool) -> None:
    """With batch_same_shape, a step owner of two same-shape matrices steps a (B, m, n) stack
    (the results were checked above); ``required``: the mesh's assignment has such an owner."""
    spec = get_matrix_optimizer("muon")
    ndims: list[int] = []

    def recording(param, grad, state, **kw):
        ndims.append(param.ndim)
        spec.step_fn(param, grad, state, **kw)

    matrices, _, _, _ = _run(mesh, "muon", batch=True,
                             spec=dataclasses.replace(spec, step_fn=recording))
    me = mesh["tp"].get_local_rank()
    mine = [m.tp.global_shape for m in matrices if m.step_owner == me]
    assert (3 in ndims) == (len(set(mine)) < len(mine)), (mine, ndims)
    any_batched = torch.tensor([float(3 in ndims)])
    dist.all_reduce(any_batched, op=dist.ReduceOp.MAX)
    assert any_batched.item() == 1.0 or not required, "no step owner batched"


def _offload_and_buckets_exact(mesh: DeviceMesh) -> None:
    """offload_state='cpu' and one wave per bucket give the on-device one-bucket bits."""
    base, _, base_state, _ = _run(mesh, "shampoo")
    for kwargs in ({"offload": True}, {"bucket_bytes": 1}):
        matrices, _, state, stats = _run(mesh, "shampoo", **kwargs)
        for a, b in zip(matrices, base, strict=True):
            assert torch.equal(a.param, b.param), (a.fqn, kwargs)
            assert (a.param in state) == (b.param in base_state), (a.fqn, kwargs)
            for key, value in state.get(a.param, {}).items():
                assert torch.equal(value, base_state[b.param][key]), (a.fqn, key, kwargs)
        if "bucket_bytes" in kwargs:  # one wave (every step owner's j-th matrix) per bucket
            per_owner = [sum(m.step_owner == r for m in matrices) for r in range(mesh["tp"].size())]
            assert all(s.buckets == max(per_owner) for s in stats), (stats, per_owner)


def _bytes_exact_and_tp_only(mesh: DeviceMesh) -> None:
    """Per step, this rank sends the shards the model says, through the tp group only."""
    me, size = mesh["tp"].get_local_rank(), mesh["tp"].size()
    tp_ranks = dist.get_process_group_ranks(mesh["tp"].get_group())
    matrices, index_of = _setup(mesh, "muon")
    stepper = WholeStepper(get_matrix_optimizer("muon"), _hyper("muon"), {})
    calls: list[tuple[list[int], int]] = []
    real = dist.all_to_all_single

    def spy(out, inp, out_splits, in_splits, group=None, async_op=False):
        calls.append((dist.get_process_group_ranks(group), sum(in_splits) - in_splits[me]))
        return real(out, inp, out_splits, in_splits, group=group, async_op=async_op)

    _set_grads(matrices, index_of, 0)
    stats: list = []
    with mock.patch.object(tp_step.dist, "all_to_all_single", spy):
        collectives = count_collectives(
            lambda: stats.append(step_tp_matrices(matrices, stepper, bucket_bytes=700)))
    (stat,) = stats
    assert stat.buckets > 1 and collectives == len(calls) == 2 * stat.buckets
    assert all(ranks == tp_ranks for ranks, _ in calls), calls
    numel = lambda m, r: m.tp.shape_on(r)[0] * m.tp.shape_on(r)[1]  # noqa: E731
    expected = sum(2 * 4 * numel(m, me) if m.step_owner != me else
                   sum(4 * numel(m, r) for r in range(size) if r != me) for m in matrices)
    assert stat.bytes_sent == sum(sent for _, sent in calls) == expected
    # The tp group's total: parameter and gradient of the non-step-owners' shards in, the
    # parameter shards out, 4 bytes each.
    total = torch.tensor([stat.bytes_sent], dtype=torch.float64)
    dist.all_reduce(total, group=mesh["tp"].get_group())
    model = sum(3 * 4 * (_global_numel(m) - numel(m, m.step_owner))
                for m in matrices)
    assert int(total.item()) == model


def _global_numel(m: TpMatrix) -> int:
    return m.tp.global_shape[0] * m.tp.global_shape[1]


def _shard_local_muon_differs(mesh: DeviceMesh) -> None:
    """Muon on each TP shard alone is another algorithm: far outside the test's tolerance."""
    me = mesh["tp"].get_local_rank()
    matrices, index_of = _setup(mesh, "muon")
    worst = 0.0
    for m in matrices:
        i, shape = index_of[m.fqn], m.tp.global_shape
        if m.tp.local_sizes[me] == 0:
            continue
        whole, _ = _reference("muon", i, shape)
        shard, _ = _reference("muon", i, shape, lambda t, m=m: m.tp.slice_of(t, me))
        worst = max(worst, _rel(shard, m.tp.slice_of(whole, me)))
    assert worst > 1000 * RTOL, worst


def _world(rank: int, world: int, meshes: list[tuple[int, int]], names: list[str],
           end_to_end: bool) -> None:
    subtests: dict[str, Callable[[], None]] = {}
    for dp, tp in meshes:
        mesh = _mesh(dp, tp)
        for name in names:
            for batch in (False, True):
                subtests[f"{dp}x{tp} {name} batch={batch}"] = functools.partial(
                    _matches_full_step, mesh, name, batch)
        subtests[f"{dp}x{tp} batches"] = functools.partial(_batches_happen, mesh,
                                                            (dp, tp) == (2, 2))
        subtests[f"{dp}x{tp} offload/buckets"] = functools.partial(_offload_and_buckets_exact,
                                                                   mesh)
        subtests[f"{dp}x{tp} bytes"] = functools.partial(_bytes_exact_and_tp_only, mesh)
        subtests[f"{dp}x{tp} shard-local differs"] = functools.partial(
            _shard_local_muon_differs, mesh)
        if end_to_end and (dp, tp) == (2, 2):  # one world: the end-to-end checks join it
            subtests.update(_e2e_subtests(mesh))
    run_subtests(rank, subtests)


@pytest.mark.parametrize(("world", "meshes", "names", "end_to_end"), [
    (4, [(2, 2), (1, 4)], OPTIMIZERS, True),
    (3, [(1, 3)], OPTIMIZERS, False),
    (2, [(1, 2)], ["muon", "adamw"], False),
], ids=["world4-dp2tp2-dp1tp4-e2e", "world3-tp3", "world2-tp2"])
def test_tp_step_matches_full_matrix_step(world: int, meshes: list, names: list,
                                          end_to_end: bool) -> None:
    """Core checks at every mesh; at world 4 also the end-to-end Muon run (one world)."""
    run_world(world, _world, meshes, names, end_to_end)


# -- end to end: parallelize_module + fully_shard_matrix + MatrixOptimizer ---------------------
E2E = {"lr": 0.02, "weight_decay": 0.01, "tail_lr": 1e-2, "tail_weight_decay": 0.1}


def _e2e_model(ref: nn.Module, mesh: DeviceMesh) -> nn.Module:
    model = copy.deepcopy(ref)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return mf.fully_shard_matrix(model, mesh["dp"])


def _e2e_reference(ref: nn.Module, matrix_fqns: set[str], name: str) -> RegisteredStepReference:
    """One process: the registered ``name`` on each whole matrix, torch's AdamW on the rest."""
    named = dict(ref.named_parameters())
    tail = torch.optim.AdamW([p for f, p in named.items() if f not in matrix_fqns],
                             lr=E2E["tail_lr"], weight_decay=E2E["tail_weight_decay"])
    return RegisteredStepReference({f: named[f] for f in matrix_fqns}, tail, name=name,
                                   lr=E2E["lr"], weight_decay=E2E["weight_decay"],
                                   config=FREE_RUNNING_KWARGS.get(name, {}))


def _dp_rank(mesh: DeviceMesh) -> tuple[int, int]:
    return mesh["dp"].get_local_rank(), mesh["dp"].size()


def _expected_tp_bytes(model: nn.Module, mesh: DeviceMesh, name: str = "muon") -> int:
    """The model's figure for this rank: per TP matrix of its row, its parameter and gradient
    shards to the step owner, or (as step owner) the other shards' parameters back; fp32."""
    row = [mp for mp in mf.get_state(model).params.values() if mp.tp is not None and mp.is_owner]
    owners = tp_step_owners([(mp.fqn, mp.tp) for mp in row], name)
    me, size = mesh["tp"].get_local_rank(), mesh["tp"].size()
    numel = lambda mp, r: math.prod(mp.tp.shape_on(r))  # noqa: E731
    return sum(8 * numel(mp, me) if owner != me else
               sum(4 * numel(mp, r) for r in range(size) if r != me)
               for mp, owner in zip(row, owners, strict=True))


def _e2e_muon(mesh: DeviceMesh, offload: bool, name: str = "muon") -> None:
    """3 steps equal the single-process full-matrix steps; the step crosses no dp link."""
    torch.manual_seed(0)
    ref = TinyTransformer(dim=16, hidden=40, layers=2)
    model = _e2e_model(ref, mesh)
    runtime = mf.get_state(model)
    assert {f for f, mp in runtime.params.items() if mp.tp is not None} == {
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("up", "down")}
    opt = mf.MatrixOptimizer(model, name, **E2E, **FREE_RUNNING_KWARGS.get(name, {}),
                             offload_state="cpu" if offload else None, skip_nonfinite=offload)
    reference = _e2e_reference(ref, set(runtime.params), name)
    (me, batches), row_has_tp = _dp_rank(mesh), any(
        mp.tp is not None and mp.is_owner for mp in runtime.params.values())
    for step in range(3):
        tokens = global_batch(step)
        if name == "soap" and step:
            _teacher_force(model, opt, ref, reference)
        if offload and step == 1:
            _skipped_step(model, opt, local_batch(tokens, me, batches), mesh)
        lm_loss(model, local_batch(tokens, me, batches)).backward()
        sum(lm_loss(ref, local_batch(tokens, i, batches)) for i in range(batches)).div(
            batches).backward()
        runtime.comm.counter.reset()
        calls = count_collectives(opt.step)
        if not offload:  # the TP exchanges only (skip_nonfinite adds the norm's reduction)
            assert calls == 2 * row_has_tp, calls
            assert runtime.comm.counter.snapshot()["optimizer"]["calls"] == 0
        assert opt.tp_step_bytes == _expected_tp_bytes(model, mesh, name)
        reference.step()
        opt.zero_grad()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert_close_dicts({k: v.detach().cpu() for k, v in full.items()}, reference_values(ref),
                       1e-5, f"TP {name}, 3 steps (offload={offload})")
    if name == "muon":
        _check_tp_state(model, opt, mesh)


def _teacher_force(model: nn.Module, opt: mf.MatrixOptimizer, ref: nn.Module,
                   reference: RegisteredStepReference) -> None:
    """SOAP: the reference continues from the library's parameters and matrix state.

    SOAP's step-1 eigenbasis of a rank-deficient factor (``L = G G^T`` of a non-square ``G``)
    is any basis of its null space, and Adam in that basis is not rotation invariant: the TP
    gradient's rounding (row-parallel partial sums) picks another null-space basis than one
    process does, and free-running steps then differ by O(1) there (measured 5-8% after step 2
    on ``up``/``down``) with both runs exact. Each step is checked from the same start instead
    (torch's full optimizer state dict: the state view of TP matrices is exercised too)."""
    values = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        for fqn, p in ref.named_parameters():
            p.copy_(values[fqn])
        for fqn, entry in reference.state.items():
            if fqn not in state["state"]:  # never stepped (the blocks' unused matrices)
                continue
            for key, value in entry.items():
                value.copy_(state["state"][fqn][key])


def _skipped_step(model: nn.Module, opt: mf.MatrixOptimizer, tokens: torch.Tensor,
                  mesh: DeviceMesh) -> None:
    """A NaN in one TP shard's gradient on one rank: every rank skips, nothing changes."""
    before = {f: p.detach().clone() for f, p in model.named_parameters()}
    lm_loss(model, tokens).backward()
    runtime = mf.get_state(model)
    if dist.get_rank() == 0:
        mp = next(mp for mp in runtime.params.values() if mp.tp is not None and mp.is_owner)
        mp.sharded.grad.view(-1)[0] = float("nan")
    opt.step()
    assert opt.last_step_skipped and opt.tp_step_bytes == 0
    for f, p in model.named_parameters():
        assert torch.equal(p.detach(), before[f]), f"{f} changed in a skipped step"
    opt.zero_grad()


def _check_tp_state(model: nn.Module, opt: mf.MatrixOptimizer, mesh: DeviceMesh) -> None:
    """Whole-matrix state on the step owner only."""
    runtime = mf.get_state(model)
    row = [mp for mp in runtime.params.values() if mp.tp is not None and mp.is_owner]
    owners = tp_step_owners([(mp.fqn, mp.tp) for mp in row], "muon")
    for mp, owner in zip(row, owners, strict=True):
        if owner == mesh["tp"].get_local_rank():
            assert opt.state[mp.sharded]["momentum_buffer"].shape == mp.tp.global_shape, mp.fqn
        else:
            assert mp.sharded not in opt.state, f"{mp.fqn}: state off its step owner"


def _e2e_torch_class_refused(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    model = _e2e_model(TinyTransformer(dim=16, hidden=40, layers=2), mesh)
    with pytest.raises(NotImplementedError, match=r"TP matrix 'layers\.0\.up\.weight'.*'muon'"):
        mf.MatrixOptimizer(model, torch.optim.SGD)


def _e2e_subtests(mesh: DeviceMesh) -> dict[str, Callable[[], None]]:
    return {
        "e2e muon": functools.partial(_e2e_muon, mesh, False),
        "e2e muon offload+skip_nonfinite": functools.partial(_e2e_muon, mesh, True),
        "e2e torch class refused": functools.partial(_e2e_torch_class_refused, mesh),
        **{f"e2e {name}": functools.partial(_e2e_muon, mesh, False, name)
           for name in ("shampoo", "soap", "okls", "emagram")},
    }


# -- single process -------------------------------------------------------------------------------
def test_assign_step_owners_lpt() -> None:
    assert assign_step_owners([1.0, 5.0, 3.0, 3.0, 2.0], 2) == [1, 0, 1, 1, 0]
    assert assign_step_owners([2.0, 2.0, 2.0], 3) == [0, 1, 2]  # ties by index, then rank
    assert assign_step_owners([], 4) == []
    with pytest.raises(ValueError, match="tp_size"):
        assign_step_owners([1.0], 0)


def test_step_cost_models() -> None:
    assert step_cost((64, 32), "muon") > step_cost((32, 32), "muon")
    assert step_cost((64, 32), "adamw") == 64 * 32
    assert step_cost((64, 32), "my_optimizer") == 64 * 32 * 32  # the flop proxy


def test_bucket_plan_gives_every_step_owner_work() -> None:
    """Waves: bucket j holds every step owner's j-th largest matrix; small waves merge within
    the byte budget per step owner, large ones stay alone (each owner computes in each bucket)."""
    owners = [0, 1, 2, 3, 0, 1, 2, 3]
    big = tp_step.bucket_plan([100] * 8, owners, [1.0] * 8, bucket_bytes=64)
    assert big == [[0, 1, 2, 3], [4, 5, 6, 7]]
    small = tp_step.bucket_plan([10] * 8, owners, [1.0] * 8, bucket_bytes=64)
    assert small == [[0, 1, 2, 3, 4, 5, 6, 7]]
    by_cost = tp_step.bucket_plan([100] * 4, [0, 0, 1, 1], [1.0, 5.0, 2.0, 1.0], bucket_bytes=1)
    assert by_cost == [[1, 2], [0, 3]]  # each owner's costliest first
