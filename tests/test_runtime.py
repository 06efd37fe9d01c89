"""The owner-shaped runtime against a single-process reference on the same global batch."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import matrixfsdp as mf
from matrixfsdp.collectives import Phase
from matrixfsdp.collectives.torch_backend import PADDED_MAX_BYTES, gather_form, reduce_form
from matrixfsdp.planner import make_plan
from matrixfsdp.runtime.selection import default_groups, param_specs, select_params

from .checks import assert_close_dicts, count_collectives, full_values, reference_values
from .dist_utils import DEVICES, device_type, run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

GRAD_RTOL = 1e-6
PARAM_RTOL = 1e-5


def _pair(**model_kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = TinyTransformer(**model_kwargs)
    return ref, copy.deepcopy(ref)


# -- subtests ----------------------------------------------------------------------------------
def _grads_match(rank: int, world: int) -> None:
    ref, model = _pair()
    mf.fully_shard_matrix(model)
    tokens = global_batch(0)
    lm_loss(ref, tokens).backward()
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    state = mf.get_state(model)
    for fqn, mp in state.params.items():
        if not mp.is_owner:
            assert mp.sharded.grad is None, f"non-owner holds a gradient for {fqn}"
        elif "unused" not in fqn:
            assert mp.sharded.grad.shape == mp.shape, fqn
    assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL, "grad")


def _sgd_parity(
    rank: int, world: int, *, steps: int = 5, micro: int = 1, reshard_after_forward: bool = True,
    planner: object = None, collectives: str = "auto", **model_kwargs,
) -> None:
    ref, model = _pair(**model_kwargs)
    mf.fully_shard_matrix(model, reshard_after_forward=reshard_after_forward, planner=planner,
                          collectives=collectives)
    notes = mf.get_plan(model).notes
    assert (planner is None) == (not notes), notes
    for fqn in notes:  # demoted matrices are plain FSDP2 tail parameters
        assert isinstance(dict(model.named_parameters())[fqn], torch.distributed.tensor.DTensor)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(steps):
        tokens = global_batch(step)
        local = local_batch(tokens, rank, world)
        for m in range(micro):
            rows = [local_batch(local_batch(tokens, r, world), m, micro) for r in range(world)]
            lm_loss(ref, torch.cat(rows)).backward()
            mf.set_requires_gradient_sync(model, m == micro - 1)
            lm_loss(model, local_batch(local, m, micro)).backward()
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), PARAM_RTOL, "param")


def _memory_and_pinning(rank: int, world: int) -> None:
    _ref, model = _pair()
    original_ptrs = {fqn: p.data_ptr() for fqn, p in model.named_parameters()}
    mf.fully_shard_matrix(model)
    state = mf.get_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def check_outside() -> None:
        owned = 0
        for fqn, mp in state.params.items():
            if mp.is_owner:
                # The owner's matrix is the original storage, pinned by the unsharded leaf.
                assert mp.sharded.data_ptr() == original_ptrs[fqn], f"{fqn} was copied"
                assert mp.unsharded.data_ptr() == mp.sharded.data_ptr(), f"{fqn} not pinned"
                owned += mp.numel * mp.dtype.itemsize
            else:
                assert mp.sharded.numel() == 0, fqn
                assert mp.sharded.untyped_storage().nbytes() == 0, fqn
                assert mp.unsharded.untyped_storage().nbytes() == 0, f"{fqn} not freed"
            assert dict(model.named_parameters())[fqn] is mp.sharded
        assert state.resident_matrix_bytes() == owned

    check_outside()
    for step in range(3):
        loss = lm_loss(model, local_batch(global_batch(step), rank, world))
        if world > 1:  # between forward and backward: resharded (reshard_after_forward=True)
            assert any(not mp.is_owner for mp in state.params.values())
            for mp in state.params.values():
                if not mp.is_owner:
                    assert mp.unsharded.untyped_storage().nbytes() == 0, mp.fqn
        loss.backward()
        check_outside()
        opt.step()
        opt.zero_grad()
        check_outside()


def _collective_counts(rank: int, world: int) -> None:
    for reshard, collectives in ((True, "alltoall"), (False, "alltoall"), (True, "p2p"),
                                 (True, "auto")):
        _, model = _pair()
        mf.fully_shard_matrix(model, reshard_after_forward=reshard, collectives=collectives)
        state = mf.get_state(model)
        if collectives == "alltoall":  # one exchange per group to gather, one to reduce
            gathers = reduces = len(state.groups)
        elif collectives == "p2p":  # one broadcast per matrix, one reduce per owner segment
            gathers = sum(len(g.params) for g in state.groups)
            reduces = sum(sum(1 for n in g.gather_numels if n) for g in state.groups)
        else:  # "auto" on gloo, groups this small: one padded all-gather, one all-reduce
            gathers = reduces = len(state.groups)
        not_owned = sum(
            mp.numel * mp.dtype.itemsize for mp in state.params.values() if not mp.is_owner
        )
        if collectives == "auto":  # padded: every peer's segment as long as the longest
            not_owned = sum(max(g.gather_numels) * (world - 1) * 4 for g in state.groups)
        counter = state.comm.counter
        counter.reset()
        # "auto" on NCCL: the exchange while a group's owners cover about half the ranks, else
        # broadcast; reduce in place per segment. On gloo: one padded call each way while the
        # padded buffer is at most PADDED_MAX_BYTES, else broadcast and reduce in rounds.
        one_owner = [1] + [0] * (world - 1)
        large = PADDED_MAX_BYTES // (4 * world) + 1
        assert state.comm._on_gloo(torch.zeros(1))
        assert gather_form("auto", one_owner, world, gloo=False) == (
            "broadcast" if world >= 4 else "alltoall")
        assert gather_form("auto", [1] * world, world, gloo=False) == "alltoall"
        assert gather_form("auto", [1] * world, world, gloo=True) == "allgather"
        assert gather_form("auto", [large] * world, world, gloo=True) == "broadcast"
        assert reduce_form("auto", gloo=False) == "reduce"
        assert reduce_form("auto", gloo=True) == "rounds"
        assert reduce_form("auto", gloo=True, padded_bytes=PADDED_MAX_BYTES) == "allreduce"
        assert reduce_form("auto", gloo=True, padded_bytes=PADDED_MAX_BYTES + 1) == "rounds"
        assert reduce_form("auto", gloo=False, padded_bytes=8) == "reduce"
        loss = lm_loss(model, local_batch(global_batch(0), rank, world))
        fwd = counter.snapshot()[Phase.FORWARD.value]
        loss.backward()
        bwd = counter.snapshot()[Phase.BACKWARD.value]
        if world == 1:
            assert fwd["calls"] == bwd["calls"] == 0
            continue
        assert fwd["calls"] == gathers, fwd
        assert fwd["bytes_received"] == not_owned, (fwd, not_owned)
        gathers_in_backward = gathers if reshard else 0
        assert bwd["calls"] == gathers_in_backward + reduces, (reshard, bwd)
        assert counter.snapshot()[Phase.OPTIMIZER.value]["calls"] == 0


def _profiled_calls_per_group(rank: int, world: int) -> None:
    """Counted by the profiler (backend ops): per block one gather in forward, one in backward and
    one reduction, the tail included (see [Note: tail units]): no more than stock FSDP2 on the
    same model; with a unit per block tail and the buffer-free forms, more."""
    if world == 1:
        return
    torch.manual_seed(0)
    ref = TinyTransformer(layers=4)
    stock = copy.deepcopy(ref)
    for layer in stock.layers:
        fully_shard(layer)
    fully_shard(stock)
    tokens = local_batch(global_batch(0), rank, world)

    def calls(model: nn.Module) -> int:
        lm_loss(model, tokens).backward()  # warm-up: FSDP2's lazy init
        return count_collectives(lambda: lm_loss(model, tokens).backward())

    ours = calls(mf.fully_shard_matrix(copy.deepcopy(ref)))
    blocks = len(ref.layers)
    assert ours == 3 * blocks + 2, ours  # + the root unit's gather and reduction
    assert ours <= calls(stock), (ours, calls(stock))
    before = calls(mf.fully_shard_matrix(copy.deepcopy(ref), tail_units="groups",
                                         collectives="p2p"))
    assert before > ours, (before, ours)


def _plan_identical(rank: int, world: int) -> None:
    _, model = _pair()
    probe = copy.deepcopy(model)
    mf.fully_shard_matrix(model)
    plan = mf.get_plan(model)
    hashes = [None] * world
    dist.all_gather_object(hashes, plan.plan_hash())
    assert len(set(hashes)) == 1, hashes
    # A pure function of the model: recomputing it without any process group gives the same.
    sites = select_params(probe, default_groups(probe), None, device_type())
    assert plan.mesh_shape == (1, world)  # a flat mesh: one replica
    assert make_plan(param_specs(sites), world).with_mesh_shape(1, world).plan_hash() == plan.plan_hash()
    assert mf.Plan.from_json(plan.to_json()) == plan
    roles = {p.fqn: p.role for p in plan.params}
    assert roles["head.weight"] == "tail" and roles["embed.weight"] == "tail"
    assert roles["layers.0.attn.k.weight"] == "matrix"
    assert all(0 <= p.owner_rank < world for p in plan.matrices)


def _forged_plan_raises(rank: int, world: int) -> None:
    if world == 1:
        return
    _, model = _pair()

    def forged(specs, world_size):
        plan = mf.LPTPlanner()(specs, world_size)
        if rank != 1:
            return plan
        rows = [
            p._replace(owner_rank=(p.owner_rank + 1) % world_size) if p.role == "matrix" else p
            for p in plan.params
        ]
        return mf.Plan(world_size=world_size, planner="forged", params=rows)

    with pytest.raises(ValueError, match="different owner plans"):
        mf.fully_shard_matrix(model, planner=forged)


def _unused_on_some_ranks(rank: int, world: int) -> None:
    """A branch used only on rank 0's data: the owner gets the exact global-batch gradient."""
    ref, model = _pair()
    mf.fully_shard_matrix(model)
    tokens = global_batch(0)
    total = 0.0
    for r in range(world):
        ref.layers[1].use_unused = r == 0
        total = total + lm_loss(ref, local_batch(tokens, r, world)) / world
    total.backward()
    model.layers[1].use_unused = rank == 0
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    grads = full_values(model, "grad")
    assert grads["layers.1.unused.weight"] is not None
    assert grads["layers.0.unused.weight"] is None  # used nowhere: None, as on one device
    assert_close_dicts(grads, reference_values(ref, "grad"), GRAD_RTOL, "grad")


def _frozen_matrix(rank: int, world: int) -> None:
    """A frozen matrix is gathered for forward but never reduced, and never changes."""
    ref, model = _pair()
    for m in (ref, model):
        m.layers[0].up.weight.requires_grad_(False)
    frozen_before = reference_values(ref)["layers.0.up.weight"]
    mf.fully_shard_matrix(model)
    state = mf.get_state(model)
    group0 = next(g for g in state.groups if g.name == "layers.0")
    assert all(p.fqn != "layers.0.up.weight" for p in group0.trainable)
    assert sum(group0.reduce_numels) == sum(p.numel + 1 for p in group0.trainable)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(2):
        tokens = global_batch(step)
        lm_loss(ref, tokens).backward()
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        assert state.params["layers.0.up.weight"].sharded.grad is None
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    values = full_values(model)
    assert torch.equal(values["layers.0.up.weight"], frozen_before)
    assert_close_dicts(values, reference_values(ref), PARAM_RTOL, "param")


def _bad_inputs(rank: int, world: int) -> None:
    _, model = _pair()
    mf.fully_shard_matrix(model)
    with pytest.raises(ValueError, match="already wrapped"):
        mf.fully_shard_matrix(model)

    _, model = _pair()
    mesh3d = init_device_mesh(device_type(), (1, 1, world), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match=r"\(1, 1, \d\) \(3 dims\).*2-D HSDP mesh"):
        mf.fully_shard_matrix(model, mesh3d)

    _, model = _pair()
    with pytest.raises(ValueError, match=r"layers\.0\.norm1\.weight.*\(16,\)"):
        mf.fully_shard_matrix(model, matrix_filter=lambda fqn, p: "norm1" in fqn)

    _, model = _pair()
    model.layers[0].attn.q.weight = nn.Parameter(torch.empty(16, 16, device="meta"))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q\.weight.*meta"):
        mf.fully_shard_matrix(model, init_device_mesh(device_type(), (world,)))

    _, model = _pair(tie=True)
    with pytest.raises(ValueError, match=r"embed\.weight.*shared with 'head\.weight'"):
        mf.fully_shard_matrix(model, matrix_filter=lambda fqn, p: p.ndim == 2)

    with pytest.raises(ValueError, match="not wrapped"):
        mf.get_plan(nn.Linear(2, 2))


def _world_runtime(rank: int, world: int) -> None:
    run_subtests(rank, {
        "grads_match_reference": functools.partial(_grads_match, rank, world),
        "sgd_5_steps": functools.partial(_sgd_parity, rank, world),
        "sgd_activation_checkpointing": functools.partial(
            _sgd_parity, rank, world, checkpointing=True
        ),
        "sgd_no_reshard_after_forward": functools.partial(
            _sgd_parity, rank, world, reshard_after_forward=False
        ),
        "sgd_two_micro_batches": functools.partial(_sgd_parity, rank, world, micro=2),
        "sgd_tied_tail_embedding": functools.partial(_sgd_parity, rank, world, steps=3, tie=True),
        "sgd_oversized_to_tail": functools.partial(
            _sgd_parity, rank, world, steps=3, planner=mf.LPTPlanner(memory_cap_bytes=2559)
        ),
        "sgd_p2p_collectives": functools.partial(_sgd_parity, rank, world, steps=3,
                                                 collectives="p2p"),
        "sgd_alltoall_collectives": functools.partial(_sgd_parity, rank, world, steps=3,
                                                      collectives="alltoall"),
        "memory_and_pinning": functools.partial(_memory_and_pinning, rank, world),
        "collective_counts": functools.partial(_collective_counts, rank, world),
        "profiled_calls_per_group": functools.partial(_profiled_calls_per_group, rank, world),
        "plan_identical": functools.partial(_plan_identical, rank, world),
        "forged_plan_raises": functools.partial(_forged_plan_raises, rank, world),
        "unused_on_some_ranks": functools.partial(_unused_on_some_ranks, rank, world),
        "frozen_matrix": functools.partial(_frozen_matrix, rank, world),
        "bad_inputs": functools.partial(_bad_inputs, rank, world),
    })


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_runtime(device: str, world: int) -> None:
    run_world(world, _world_runtime, device=device)
