"""HSDP: owner sharding inside each shard group, replication across the replicate dim.

One gloo world of 4 runs every subtest on meshes 2x2, 1x4 and 4x1 against a single-process
reference on the same global batch (each of the 4 ranks takes a quarter of it).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.memory import matrix_memory
from matrixfsdp.planner import make_plan
from matrixfsdp.runtime import WorkKind
from matrixfsdp.runtime.selection import default_groups, param_specs, select_params

from .checks import (
    FREE_RUNNING_KWARGS,
    assert_close_dicts,
    count_collectives,
    full_values,
    reference_values,
)
from .dist_utils import run_subtests, run_world
from .hsdp_checkpoints import (
    assert_replicas_equal,
    hsdp_mesh,
    legacy_layout_loads,
    load_and_compare,
    save_and_record,
)
from .models import TinyTransformer, global_batch, lm_loss, local_batch
from .test_optim_dist import ReferenceStepper
from .test_streams import hsdp_checker_has_teeth, race_free_training

GRAD_RTOL = 1e-6
PARAM_RTOL = 1e-5
SHAPES = ((2, 2), (1, 4), (4, 1))
LR = {"muon": 0.02, "okls": 0.01}


def _pair(**model_kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = TinyTransformer(**model_kwargs)
    return ref, copy.deepcopy(ref)


def _wrap(model: nn.Module, shape: tuple[int, int], **kwargs) -> nn.Module:
    return mf.fully_shard_matrix(model, hsdp_mesh(shape), **kwargs)


def _reference_loss(ref: nn.Module, tokens: torch.Tensor, world: int,
                    unused_on: tuple[int, ...] = ()) -> torch.Tensor:
    """The mean of every rank's local loss (rank r uses the unused branch iff r in unused_on)."""
    total = 0.0
    for r in range(world):
        ref.layers[1].use_unused = r in unused_on
        total = total + lm_loss(ref, local_batch(tokens, r, world)) / world
    ref.layers[1].use_unused = False
    return total


# -- subtests --------------------------------------------------------------------------------------
def _grads_unused_frozen(rank: int, world: int, shape: tuple[int, int]) -> None:
    """One backward: grads == the reference's; a branch used on ranks 0 and 3 only (in 2x2: one
    rank of each replica, in different shard coordinates) gets the exact global average; one
    used nowhere stays None; a frozen matrix gets nothing and is never reduced."""
    ref, model = _pair()
    for m in (ref, model):
        m.layers[0].up.weight.requires_grad_(False)
    _wrap(model, shape)
    state = mf.get_state(model)
    assert mf.get_plan(model).mesh_shape == shape and mf.get_plan(model).world_size == shape[1]
    tokens = global_batch(0)
    _reference_loss(ref, tokens, world, unused_on=(0, 3)).backward()
    model.layers[1].use_unused = rank in (0, 3)
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    assert state.queue.peak.get(WorkKind.ALL_REDUCE, 0) == (1 if shape[0] > 1 else 0)
    grads = full_values(model, "grad")
    assert grads["layers.1.unused.weight"] is not None
    assert grads["layers.0.unused.weight"] is None and grads["layers.0.up.weight"] is None
    assert_close_dicts(grads, reference_values(ref, "grad"), GRAD_RTOL, f"grad {shape}")
    for mp in state.params.values():
        if not mp.is_owner:
            assert mp.sharded.grad is None and mp.unsharded.untyped_storage().nbytes() == 0


def _use_every_branch(*models: nn.Module) -> None:
    for m in models:
        for layer in m.layers:
            layer.use_unused = True


def _owned_grads_across_replicas_equal(model: nn.Module) -> None:
    """Every owner's gradient is bitwise the one its peers in the other replicas hold."""
    state = mf.get_state(model)
    group, replicas = state.dp_mesh.replicate_group, state.mesh_shape[0]
    for mp in state.params.values():
        if not mp.is_owner or mp.sharded.grad is None:
            continue
        local = mp.sharded.grad.detach().reshape(-1).clone()
        gathered = [torch.empty_like(local) for _ in range(replicas)]
        dist.all_gather(gathered, local, group=group)  # owners of one matrix: one per replica
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{mp.fqn} grad differs"


def _zero_output(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
    return output * 0.0  # the module takes part, its gradient is exactly zero


def _no_presence_flags(rank: int, world: int, shape: tuple[int, int]) -> None:
    """``replicate_presence_flags=False``: only values cross replicas, presence travels in a
    signed zero ([Note: presence flags]). Exact in every case, the same in every replica: a branch
    used by one rank of replica 0 only (its owner in replica 1 saw no gradient in its replica);
    a branch used nowhere (``None`` everywhere); a branch used in replica 0 only whose gradient
    is exactly zero (zeros, not ``None``, everywhere)."""
    ref, model = _pair()
    _wrap(model, shape, replicate_presence_flags=False)
    state = mf.get_state(model)
    tokens = global_batch(0)
    for m in (ref, model):
        m.layers[0].use_unused = True
        m.layers[2].use_unused = True
    _reference_loss(ref, tokens, world, unused_on=(1,)).backward()
    model.layers[1].use_unused = rank == 1  # replica 0 only (in 2x2 and 4x1)
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    grads = full_values(model, "grad")
    assert grads["layers.1.unused.weight"] is not None
    assert_close_dicts(grads, reference_values(ref, "grad"), GRAD_RTOL, f"no flags {shape}")
    _owned_grads_across_replicas_equal(model)

    for unused_on, zero in (((), False), ((1,), True)):
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        hooks = [m.layers[1].unused.register_forward_hook(_zero_output) for m in (ref, model)
                 if zero]
        _reference_loss(ref, tokens, world, unused_on=unused_on).backward()
        model.layers[1].use_unused = rank in unused_on
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        grads = full_values(model, "grad")
        what = f"no flags {shape}, branch on ranks {unused_on}, zero gradient {zero}"
        assert (grads["layers.1.unused.weight"] is None) == (not unused_on), what
        if zero:
            assert not grads["layers.1.unused.weight"].any(), what
        assert_close_dicts(grads, reference_values(ref, "grad"), GRAD_RTOL, what)
        _owned_grads_across_replicas_equal(model)
        assert all(g.state.value == "sharded" for g in state.groups)
        for hook in hooks:
            hook.remove()
    for m in (ref, model):
        m.layers[1].use_unused = False

    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    _use_every_branch(ref, model)
    tokens = global_batch(1)
    lm_loss(ref, tokens).backward()
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL,
                       f"no flags, next step {shape}")


def _free_running(rank: int, world: int, shape: tuple[int, int], name: str, *,
                  steps: int = 5, checkpointing: bool = False,
                  presence_flags: bool = True) -> None:
    """Five steps of a matrix optimizer (fp32 math) against one process; replicas bitwise
    equal (parameters and optimizer state); the optimizer step communicates nothing. Without
    presence flags every matrix takes part in the loss (the mode's contract)."""
    ref, model = _pair(checkpointing=checkpointing)
    if not presence_flags:
        _use_every_branch(ref, model)
    _wrap(model, shape, replicate_presence_flags=presence_flags)
    state = mf.get_state(model)
    kwargs = FREE_RUNNING_KWARGS.get(name, {})
    opt = mf.MatrixOptimizer(model, optimizer=name, lr=LR[name], weight_decay=0.1, tail_lr=1e-2,
                             tail_weight_decay=0.1, **kwargs)
    matrix_fqns = {p.fqn for p in mf.get_plan(model).matrices}
    stepper = ReferenceStepper(ref, matrix_fqns, name, LR[name], kwargs)
    for step in range(steps):
        tokens = global_batch(step)
        lm_loss(ref, tokens).backward()
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        stepper.step()
        state.comm.counter.reset()
        assert count_collectives(opt.step) == 0, "the optimizer step communicated"
        assert state.comm.counter.snapshot()["optimizer"]["calls"] == 0
        stepper.zero_grad()
        opt.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), PARAM_RTOL, f"{name} {shape}")
    assert_replicas_equal(model, opt)


def _expert_slices(rank: int, world: int) -> None:
    """Sharded expert stacks (FSDP2 Shard(0) on the shard dim, replicated across replicas):
    the matrix optimizer steps each rank's experts; three Muon steps match one process."""
    from .test_experts import _loss as moe_loss
    from .test_experts import _pair as moe_pair
    from .test_experts import _stacks_and_gates

    ref, model = moe_pair()
    mf.fully_shard_matrix(model, hsdp_mesh((2, 2)), matrix_filter=_stacks_and_gates,
                          planner=mf.LPTPlanner(stacks="slices"))
    plan = mf.get_plan(model)
    assert plan["layers.0.w_in"].role == "sharded_stack"
    kwargs = FREE_RUNNING_KWARGS["muon"]
    opt = mf.MatrixOptimizer(model, optimizer="muon", lr=0.02, weight_decay=0.1, tail_lr=1e-2,
                             tail_weight_decay=0.1, **kwargs)
    fqns = {p.fqn for p in (*plan.matrices, *plan.sharded_stacks)}
    stepper = ReferenceStepper(ref, fqns, "muon", 0.02, kwargs)
    for step in range(3):
        tokens = global_batch(step)
        moe_loss(ref, tokens).backward()
        moe_loss(model, local_batch(tokens, rank, world)).backward()
        stepper.step()
        opt.step()
        stepper.zero_grad()
        opt.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), PARAM_RTOL, "expert slices")
    assert_replicas_equal(model, opt)


def _accumulation(rank: int, world: int, shape: tuple[int, int],
                  presence_flags: bool = True) -> None:
    """Two micro-batches: sync off communicates no gradient (neither dim); the synced backward
    reduces and all-reduces the sum. Then the same with only the replicate all-reduce off."""
    for mode in ("sync", "all_reduce"):
        ref, model = _pair()
        if not presence_flags:
            _use_every_branch(ref, model)
        _wrap(model, shape, replicate_presence_flags=presence_flags)
        counter = mf.get_state(model).comm.counter
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        for step in range(2):
            tokens = global_batch(step)
            local = local_batch(tokens, rank, world)
            for m in range(2):
                rows = [local_batch(local_batch(tokens, r, world), m, 2) for r in range(world)]
                lm_loss(ref, torch.cat(rows)).backward()
                setter = (mf.set_requires_gradient_sync if mode == "sync"
                          else mf.set_requires_all_reduce)
                setter(model, m == 1)
                counter.reset()
                lm_loss(model, local_batch(local, m, 2)).backward()
                ops = counter.by_op
                reduced = ops.get("reduce_to_owners", None)
                all_reduced = ops.get("all_reduce_replicas", None)
                if m == 0:
                    assert all_reduced is None, "all-reduce with it turned off"
                    assert (reduced is None) == (mode == "sync" or shape[1] == 1), mode
                elif shape[0] > 1:
                    assert all_reduced is not None and all_reduced.calls > 0
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad()
            opt.zero_grad()
        assert_close_dicts(full_values(model), reference_values(ref), PARAM_RTOL,
                           f"accumulation {mode} {shape}")


def _partial_sum_cleared(rank: int, world: int, shape: tuple[int, int]) -> None:
    """A micro-batch reduced with the replicate all-reduce off leaves partial sums (the owners'
    and FSDP2's for the tail); ``MatrixOptimizer.zero_grad`` and a skipped step drop them, so the
    next synced backward's gradient is its own micro-batch's alone."""
    for clear in ("zero_grad", "skipped_step"):
        ref, model = _pair()
        _wrap(model, shape)
        state = mf.get_state(model)
        opt = mf.MatrixOptimizer(model, "muon", skip_nonfinite=True)
        mf.set_requires_all_reduce(model, False)
        lm_loss(model, local_batch(global_batch(5), rank, world)).backward()
        if clear == "zero_grad":
            opt.zero_grad()
        else:
            norm_param = dict(model.named_parameters())["norm.weight"]
            norm_param.grad = torch.full_like(norm_param, float("inf"))
            opt.step()
            assert opt.last_step_skipped
        assert all(g._unreduced is None for g in state.groups)
        mf.set_requires_all_reduce(model, True)
        tokens = global_batch(6)
        lm_loss(ref, tokens).backward()
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL,
                           f"partial sum cleared by {clear} {shape}")


def _counted_per_dim(rank: int, world: int, shape: tuple[int, int],
                     presence_flags: bool = True) -> None:
    """Exact calls and bytes per mesh dim of one forward+backward (all-to-all collectives);
    without presence flags the replicate all-reduce carries the gradients only."""
    _, model = _pair()
    if not presence_flags:
        _use_every_branch(model)
    _wrap(model, shape, collectives="alltoall", replicate_presence_flags=presence_flags)
    state = mf.get_state(model)
    counter = state.comm.counter
    counter.reset()
    all_reduced: list[int] = []  # storage bytes of every buffer all-reduced over the replicas
    replicate = state.groups[0].replicate  # one communicator, shared by every group
    if replicate is not None:
        original = replicate.all_reduce
        replicate.all_reduce = lambda t, **kw: (  # type: ignore[method-assign]
            all_reduced.append(t.untyped_storage().nbytes()), original(t, **kw))[1]
    lm_loss(model, local_batch(global_batch(0), rank, world)).backward()
    shard, rep = counter.snapshot("shard"), counter.snapshot("replicate")
    groups = len(state.groups)
    not_owned = sum(mp.numel * 4 for mp in state.params.values() if not mp.is_owner)
    if shape[1] == 1:  # one rank per shard group: nothing moves inside it
        assert shard["forward"]["calls"] == shard["backward"]["calls"] == 0
    else:
        assert shard["forward"]["calls"] == groups
        assert shard["forward"]["bytes_received"] == not_owned
        assert shard["backward"]["calls"] == 2 * groups  # re-gather + reduce per group
    owned = [[p for p in g.trainable_by[state.comm.rank]] for g in state.groups]
    if shape[0] == 1:
        assert counter.by_dim.get("replicate") is None
    else:
        assert rep["forward"]["calls"] == 0
        assert rep["backward"]["calls"] == sum(1 for o in owned if o)
        payload = sum((p.numel + presence_flags) * 4 for o in owned for p in o)
        assert rep["backward"]["bytes_sent"] == rep["backward"]["bytes_received"] == payload
        # Each all-reduce holds a copy of the owner's segment only, never the group's buffer,
        # and the plan's memory model accounts for exactly that buffer.
        want = sorted((sum(p.numel for p in o) + len(o)) * 4 for o in owned if o)
        assert sorted(all_reduced) == want, (all_reduced, want)
        mm = matrix_memory(state.plan, state.comm.rank)
        assert sorted(g.all_reduce_buffer for g in mm.groups.values() if g.all_reduce_buffer) \
            == sorted(all_reduced)


def _clip(rank: int, world: int, shape: tuple[int, int]) -> None:
    """The norm of one replica's shards, identical on every rank; clipped grads as reference."""
    for norm_type in (2.0, float("inf")):
        ref, model = _pair()
        _wrap(model, shape)
        tokens = global_batch(0)
        lm_loss(ref, tokens).backward()
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type=norm_type)
        counter = mf.get_state(model).comm.counter
        counter.reset()
        got = mf.clip_grad_norm_(model, 0.5, norm_type=norm_type)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert counter.by_dim.get("replicate") is None, "clipping crossed replicas"
        everyone = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(everyone, got)
        assert all(torch.equal(e, everyone[0]) for e in everyone), everyone
        assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL,
                           f"clipped {norm_type} {shape}")


def _plan_and_hash(rank: int, world: int) -> None:
    """The plan records (replicate, shard); its hash covers the shape; all replicas agree."""
    _, model = _pair()
    probe = copy.deepcopy(model)
    _wrap(model, (2, 2))
    plan = mf.get_plan(model)
    assert plan.mesh_shape == (2, 2) and plan.world_size == 2 and plan.replicate_size == 2
    sites = select_params(probe, default_groups(probe), None, "cpu")
    flat = make_plan(param_specs(sites), 2)
    assert flat.params == plan.params  # the same owners as a flat 2-rank plan
    assert flat.with_mesh_shape(2, 2).plan_hash() == plan.plan_hash()
    assert flat.with_mesh_shape(1, 2).plan_hash() != plan.plan_hash()
    assert mf.Plan.from_json(plan.to_json()) == plan
    hashes = [None] * world
    dist.all_gather_object(hashes, plan.plan_hash())
    assert len(set(hashes)) == 1

    def forged(specs, world_size):  # replica 1 computes other owners than replica 0
        p = mf.LPTPlanner()(specs, world_size)
        if rank < 2:
            return p
        rows = [r._replace(owner_rank=(r.owner_rank + 1) % world_size) if r.role == "matrix"
                else r for r in p.params]
        return mf.Plan(world_size=world_size, planner="forged", params=rows)

    _, model = _pair()
    with pytest.raises(ValueError, match="different owner plans"):
        _wrap(model, (2, 2), planner=forged)


def _unnamed_mesh(rank: int, world: int) -> None:
    """An unnamed 2-D mesh is taken as FSDP2 takes it: dim 0 replicates, dim 1 shards."""
    ref, model = _pair()
    mf.fully_shard_matrix(model, hsdp_mesh((2, 2), named=False))
    state = mf.get_state(model)
    assert state.mesh_shape == (2, 2) and state.mesh.mesh_dim_names == ("replicate", "shard")
    assert state.replica_rank == rank // 2
    tokens = global_batch(1)
    lm_loss(ref, tokens).backward()
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), GRAD_RTOL,
                       "unnamed mesh")


def _bad_meshes(rank: int, world: int) -> None:
    cases = [
        (init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")),
         r"shape \(1, 2, 2\) \(3 dims\).*mesh_dim_names=\('replicate', 'shard'\)"),
        (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
         r"shape \(2, 2\) with dims \('dp', 'tp'\) has model-parallel dims \('tp',\).*sub-mesh"),
        (init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate")),
         r"shape \(2, 2\).*replicate dim first"),
        (init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), r"shape \(4,\).*model-parallel"),
    ]
    for mesh, pattern in cases:
        _, model = _pair()
        with pytest.raises(ValueError, match=pattern):
            mf.fully_shard_matrix(model, mesh)
    with pytest.raises(ValueError, match=r"replicate=3 over 4 ranks: 3 does not divide 4.*"
                                         r"\[1, 2, 4\]"):
        mf.init_hsdp_mesh(replicate=3)
    with pytest.raises(ValueError, match=r"shard=3 over 4 ranks"):
        mf.init_hsdp_mesh(shard=3)
    with pytest.raises(ValueError, match=r"\(2, 4\) holds 8 ranks"):
        mf.init_hsdp_mesh(replicate=2, shard=4)
    mesh = mf.init_hsdp_mesh(replicate=2)
    assert tuple(mesh.shape) == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard")


def _cli_train_replicate(rank: int, world: int, root: str) -> None:
    """``matrixfsdp train --replicate 2`` on 4 ranks: a 2x2 mesh, training, HSDP checkpoints."""
    from matrixfsdp.launch.cli import config_overrides
    from matrixfsdp.launch.config import load_config
    from matrixfsdp.launch.data import ByteCorpus
    from matrixfsdp.launch.train import _build, _save, _train_step

    tiny = ["--set", "corpus_bytes=10000", "--set", "model.dim=32", "--set", "model.hidden=64",
            "--set", "model.layers=2", "--set", "model.heads=2", "--set", "model.seq_len=32",
            "--set", "warmup_steps=1", "--set", "global_batch=8", "--set", "eval_batches=1"]
    overrides = config_overrides(["--replicate", "2", "--steps", "3", "--out",
                                  f"{root}/cli", "--set", "replicate_presence_flags=false", *tiny])
    assert overrides["replicate"] == 2 and overrides["replicate_presence_flags"] is False
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it: one thread per rank
    text = bytes(range(256)) * 64  # the corpus is beside the point: skip the stdlib walk
    with mock.patch.object(ByteCorpus, "_read_stdlib", staticmethod(lambda n: text[:n])):
        ctx = _build(load_config(None, **overrides))  # what each rank of the launch runs
    state = mf.get_state(ctx.model)
    assert state.mesh_shape == (2, 2)
    assert not any(g.replicate_presence_flags for g in state.groups)
    record = _train_step(ctx, 0)  # every matrix of the GPT takes part: no flag needed
    assert record["loss"] > 0 and record["matrix_comm_bytes_sent"]["optimizer"] <= 4
    _save(ctx, 1)
    layout = mf.checkpoint.read_layout(mf.checkpoint.latest(Path(root) / "cli" / "checkpoints"))
    assert layout.mesh_shape == (2, 2)


def _world(rank: int, world: int, root: str) -> None:
    subtests = {}
    for shape in SHAPES:
        tag = f"{shape[0]}x{shape[1]}"
        subtests[f"grads_unused_frozen_{tag}"] = functools.partial(
            _grads_unused_frozen, rank, world, shape)
        for name in ("muon", "okls") if shape == (2, 2) else ("muon",):
            subtests[f"{name}_5_steps_{tag}"] = functools.partial(
                _free_running, rank, world, shape, name)
        subtests[f"accumulation_{tag}"] = functools.partial(_accumulation, rank, world, shape)
        subtests[f"counted_per_dim_{tag}"] = functools.partial(_counted_per_dim, rank, world, shape)
    for shape in ((2, 2), (4, 1)):
        tag = f"{shape[0]}x{shape[1]}"
        subtests[f"no_presence_flags_{tag}"] = functools.partial(
            _no_presence_flags, rank, world, shape)
    subtests["counted_per_dim_no_flags_2x2"] = functools.partial(
        _counted_per_dim, rank, world, (2, 2), presence_flags=False)
    subtests["accumulation_no_flags_2x2"] = functools.partial(
        _accumulation, rank, world, (2, 2), presence_flags=False)
    subtests["muon_5_steps_no_flags_2x2"] = functools.partial(
        _free_running, rank, world, (2, 2), "muon", presence_flags=False)
    subtests["activation_checkpointing_2x2"] = functools.partial(
        _free_running, rank, world, (2, 2), "muon", steps=3, checkpointing=True)
    subtests["clip_2x2"] = functools.partial(_clip, rank, world, (2, 2))
    subtests["partial_sum_cleared_2x2"] = functools.partial(_partial_sum_cleared, rank, world,
                                                            (2, 2))
    subtests["streams_race_free_2x2"] = functools.partial(
        race_free_training, rank, world, mesh=hsdp_mesh((2, 2)), micro=2, keep_reducing=True)
    subtests["streams_checker_has_teeth_2x2"] = functools.partial(
        hsdp_checker_has_teeth, rank, world, hsdp_mesh((2, 2)))
    subtests["expert_slices_2x2"] = functools.partial(_expert_slices, rank, world)
    subtests["plan_and_hash"] = functools.partial(_plan_and_hash, rank, world)
    subtests["unnamed_mesh"] = functools.partial(_unnamed_mesh, rank, world)
    subtests["bad_meshes"] = functools.partial(_bad_meshes, rank, world)
    subtests["save_2x2"] = functools.partial(save_and_record, rank, world, root, "hsdp2x2", (2, 2))
    subtests["save_flat4"] = functools.partial(save_and_record, rank, world, root, "flat4", None)
    subtests["load_1x4_into_2x2"] = functools.partial(load_and_compare, rank, world, root, "flat4",
                                                      (2, 2))
    subtests["legacy_layout"] = functools.partial(legacy_layout_loads, rank, world, root)
    subtests["cli_train_replicate"] = functools.partial(_cli_train_replicate, rank, world, root)
    run_subtests(rank, subtests)


def _load_world(rank: int, world: int, root: str) -> None:
    shape = (2, 1) if world == 2 else None  # 2x2 -> 2x1 (HSDP), 2x2 -> 1x3 (flat)
    run_subtests(rank, {f"load_2x2_into_{shape or world}": functools.partial(
        load_and_compare, rank, world, root, "hsdp2x2", shape)})


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every world-4 subtest (parity, counts, bad input, saves) in one spawned world."""
    root = tmp_path_factory.mktemp("hsdp")
    run_world(4, _world, str(root))
    return str(root)


def _world_on_device(rank: int, world: int) -> None:
    """The 2x2 parity subtests, on whatever device the world runs on."""
    run_subtests(rank, {
        "grads_unused_frozen_2x2": functools.partial(_grads_unused_frozen, rank, world, (2, 2)),
        "muon_5_steps_2x2": functools.partial(_free_running, rank, world, (2, 2), "muon"),
        "accumulation_2x2": functools.partial(_accumulation, rank, world, (2, 2)),
        "no_presence_flags_2x2": functools.partial(_no_presence_flags, rank, world, (2, 2)),
        "clip_2x2": functools.partial(_clip, rank, world, (2, 2)),
    })


@pytest.mark.gpu
def test_hsdp_on_cuda() -> None:
    run_world(4, _world_on_device, device="cuda")


def test_hsdp_world4(world4: str) -> None:
    assert (Path(world4) / "hsdp2x2" / ".metadata").is_file()


@pytest.mark.parametrize("world", [3, 2])
def test_hsdp_checkpoint_reshard(world4: str, world: int) -> None:
    run_world(world, _load_world, world4)


def test_plan_mesh_shape_compatibility() -> None:
    """Plans written before the mesh shape existed load, hash as before and read as flat."""
    from matrixfsdp.planner import ParamSpec, Plan

    specs = [ParamSpec("a", (4, 4), role="matrix", group="g"), ParamSpec("b", (4,))]
    old = make_plan(specs, 2)
    raw = old.model_dump(mode="json")
    raw.pop("mesh_shape")
    raw.pop("expert_grid")
    legacy = Plan.model_validate(raw)
    assert legacy.mesh_shape is None and legacy.replicate_size == 1
    # The digest formula of plans before the mesh shape (and row orientations and meshes):
    # canonical JSON of the fields they had.
    old_form = {**raw, "params": [row[:7] for row in raw["params"]]}
    assert all(row[7:] == ["out_in", "dense"] for row in raw["params"])
    digest = hashlib.sha256(json.dumps(old_form, sort_keys=True, separators=(",", ":")).encode())
    assert legacy.plan_hash() == old.plan_hash() == digest.hexdigest()
    assert Plan.from_json(old.with_mesh_shape(3, 2).to_json()).mesh_shape == (3, 2)
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 3\) must be"):
        Plan.model_validate({**raw, "mesh_shape": (2, 3)})


def test_cli_plan_and_train_replicate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``matrixfsdp plan --replicate``: one replica's plan (Llama-3-8B balances perfectly in
    shard groups of 8); a replicate count that does not divide the ranks fails before launch."""
    from matrixfsdp.launch.cli import main

    assert main(["plan", "--world-size", "64", "--replicate", "8", "--model", "llama3-8b",
                 "--optimizer", "adamw"]) == 0
    text = capsys.readouterr().out
    assert "64 ranks = 8 replicas x 8" in text and "mesh (replicate, shard): (8, 8)" in text
    assert "imbalance max/mean by bytes: 1.0000" in text
    assert main(["plan", "--world-size", "64", "--model", "llama3-8b", "--optimizer",
                 "adamw"]) == 0
    assert "imbalance max/mean by bytes: 1.0769" in capsys.readouterr().out
    assert main(["plan", "--world-size", "64", "--replicate", "7"]) == 2
    assert "--replicate 7 must be a positive divisor" in capsys.readouterr().err
    out = tmp_path / "run"
    assert main(["train", "--nproc", "4", "--replicate", "3", "--out", str(out)]) == 2
    assert "--replicate 3 does not divide the 4 ranks" in capsys.readouterr().err
