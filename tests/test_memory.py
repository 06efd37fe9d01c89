"""ZeRO-3 memory at every moment of the step and at start-up (issue 10).

Bounded reductions (peak live bytes against the plan's bound; at most one reduction buffer
alive), no collective in flight across a mutation, meta-device init, ``add_param_group``,
``load_state_dict(assign=True)``, and the live-bytes tracker itself.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import matrixfsdp as mf
from matrixfsdp.checkpoint import load_full_state_dict
from matrixfsdp.collectives import TorchOwnerComm, torch_backend
from matrixfsdp.memory import LiveBytesTracker, matrix_memory
from matrixfsdp.runtime import GroupState
from matrixfsdp.runtime.pending import WorkKind
from matrixfsdp.runtime.state import DEFAULT_IN_FLIGHT
from matrixfsdp.runtime.state_dict_view import owner_view

from .checks import full_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

MUON = {"ns_dtype": "float32"}


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.untyped_storage().nbytes()


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _assert_equal_values(a: nn.Module, b: nn.Module, what: str) -> None:
    got, want = full_values(a), full_values(b)
    for fqn in want:
        assert torch.equal(got[fqn], want[fqn]), f"{what}: {fqn} differs"


# -- bounded reductions: live bytes against the plan's bound -----------------------------------
def _activation_bytes(model_kwargs: dict, tokens: torch.Tensor) -> int:
    """Peak live bytes of the same forward+backward on a plain model with frozen weights:
    saved activations and their gradients, no weight gradient."""
    torch.manual_seed(0)
    plain = TinyTransformer(**model_kwargs).requires_grad_(False)
    tracker = LiveBytesTracker()
    with tracker:
        h = plain.embed(tokens[:, :-1]).requires_grad_()
        for layer in plain.layers:
            h = layer(h)
        logits = plain.head(plain.norm(h))
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    return tracker.peak


def _tail_transient(model: nn.Module, state: object) -> int:
    """FSDP2's tail at its worst: two groups unsharded (all-gather output + parameters), one
    group's full gradients and its reduce-scatter input: six times the largest group's tail."""
    per_group: dict[str, int] = {}
    names = sorted((n for n, _ in model.named_modules() if n.startswith("layers.") and n.count(".") == 1),
                   key=len)
    for fqn, p in model.named_parameters():
        if fqn in state.params:  # type: ignore[attr-defined]
            continue
        group = next((g for g in names if fqn.startswith(g + ".")), "")
        per_group[group] = per_group.get(group, 0) + p.numel() * p.element_size()
    return 6 * max(per_group.values())


def _step_bound(model: nn.Module, opt: mf.MatrixOptimizer, rank: int, activations: int) -> int:
    """Owned matrices + their gradients + Muon's momentum + tail shards (parameter, gradient,
    AdamW's two moments) + the in-flight matrices and buffers the runtime's limits allow
    (``MatrixMemory.transient``) + FSDP2's tail transient + activations; the optimizer phase
    instead needs Newton-Schulz workspace (six times the largest owned matrix)."""
    state = mf.get_state(model)
    mm = matrix_memory(state.plan, rank, gloo=True)
    tail = sum(_local_bytes(p) for f, p in model.named_parameters() if f not in state.params)
    static = 3 * mm.owned + 4 * tail
    limits = DEFAULT_IN_FLIGHT
    moving = mm.transient(gathered=1 + limits[WorkKind.GATHER], reducing=limits[WorkKind.REDUCE])
    largest_owned = max((p.nbytes for p in state.plan.owned_by(rank)), default=0)
    return static + max(moving + _tail_transient(model, state) + activations, 6 * largest_owned)


class _PackedBuffers(TorchOwnerComm):
    """The default collectives plus, while each is in flight, the buffers the packed
    ``all_to_all_single`` forms held: a gather's own segment repeated N - 1 times (send) and
    every peer's segment (receive); a reduction's N received copies of the own segment."""

    def all_gather_into(self, parts, *, async_op=False):  # type: ignore[override]
        pending = super().all_gather_into(parts, async_op=async_op)
        own = sum(t.numel() for t in parts[self.rank])
        others = sum(t.numel() for part in parts for t in part) - own
        like = next(t for part in parts for t in part)
        pending._keepalive += [like.new_empty((self.world_size - 1) * own), like.new_empty(others)]
        return pending

    def reduce_to_owners(self, flat, numels, *, async_op=False):  # type: ignore[override]
        own, pending = super().reduce_to_owners(flat, numels, async_op=async_op)
        pending._keepalive.append(flat.new_empty(self.world_size * numels[self.rank]))
        return own, pending


def _held_buffers(alive: list[weakref.ref], settle_s: float = 0.25) -> int:
    """How many earlier reduction buffers are still alive, once gloo has let go of them.

    A waited gloo work is released to the waiter a moment before gloo's worker thread drops its
    own reference to the work (and so to the buffer). Poll for up to ``settle_s`` so that only
    buffers the runtime itself still holds are counted; those never go away by waiting.
    """
    deadline = time.monotonic() + settle_s
    while True:
        held = sum(ref() is not None for ref in alive)
        if held == 0 or time.monotonic() >= deadline:
            return held
        time.sleep(0.002)


def _measured_step(rank: int, world: int, *, reduce_limit: int | None = None,
                   packed: bool = False, padded: bool = True) -> tuple[int, int, int]:
    """(peak live bytes of one full step after warm-up, bound, most reduction buffers alive).

    ``padded=False``: ``"auto"`` keeps the buffer-free forms for these small groups too (see
    [Note: one call per group])."""
    if not padded:
        with mock.patch.object(torch_backend, "PADDED_MAX_BYTES", -1):
            return _measured_step(rank, world, reduce_limit=reduce_limit, packed=packed)
    kwargs = {"dim": 64, "hidden": 128, "layers": 8}
    torch.manual_seed(0)
    model = TinyTransformer(**kwargs)
    mf.fully_shard_matrix(model)
    state = mf.get_state(model)
    if reduce_limit is not None:  # emulate the old runtime: every reduction in flight to the end
        state.queue.limits[WorkKind.REDUCE] = reduce_limit
    if packed:  # emulate the old collectives' buffers (the groups share this one object)
        state.comm.__class__ = _PackedBuffers
    alive: list[weakref.ref] = []
    most = [0]
    issue = state.comm.reduce_to_owners

    def counting(flat: torch.Tensor, *args: object, **kw: object) -> object:
        most[0] = max(most[0], 1 + _held_buffers(alive))
        alive.append(weakref.ref(flat))
        return issue(flat, *args, **kw)

    state.comm.reduce_to_owners = counting  # type: ignore[method-assign]
    opt = mf.MatrixOptimizer(model, "muon", **MUON)
    tokens = local_batch(global_batch(0, batch=world), rank, world)
    for _ in range(2):  # warm-up: optimizer state exists
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    most[0] = 0
    tracker = LiveBytesTracker().track(model.parameters(), _state_tensors(opt))
    with tracker:
        with tracker.phase("forward"):
            loss = lm_loss(model, tokens)
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("optimizer"):
            opt.step()
    bound = _step_bound(model, opt, rank, _activation_bytes(kwargs, tokens))
    return tracker.peak, bound, most[0]


def _reductions_bounded(rank: int, world: int) -> None:
    for padded in (True, False):  # the one-call forms "auto" picks here, and the buffer-free ones
        peak, bound, most = _measured_step(rank, world, padded=padded)
        assert most == 1, f"{most} reduction buffers alive at once (limit 1)"
        assert peak <= bound, f"rank {rank}: peak live bytes {peak} > bound {bound} ({padded=})"
    if world > 1:  # the check has teeth: the old schedule breaks it
        old_peak, old_bound, old_most = _measured_step(rank, world, reduce_limit=64, padded=False)
        assert old_most == 8, old_most
        assert old_peak > old_bound, (old_peak, old_bound)
    if world == 4:  # and so do the old collectives' packed send/receive buffers
        old_peak, old_bound, _ = _measured_step(rank, world, packed=True, padded=False)
        assert old_bound == bound and old_peak > bound, (old_peak, bound)


# -- no collective in flight across a mutation -------------------------------------------------
class _MidForwardError(Exception):
    pass


def _raise(*args: object) -> None:
    raise _MidForwardError


def _interrupted_training(rank: int, world: int, *, interrupt: bool,
                          reshard_after_forward: bool) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(0)
    model = TinyTransformer(layers=4)
    mf.fully_shard_matrix(model, reshard_after_forward=reshard_after_forward)
    state = mf.get_state(model)
    opt = mf.MatrixOptimizer(model, "muon", **MUON)
    losses = []
    for step in range(5):
        tokens = local_batch(global_batch(step), rank, world)
        loss = lm_loss(model, tokens)
        loss.backward()
        losses.append(loss.item())
        if interrupt and step == 1:  # evaluate a prefix: the next block's gather is prefetched
            with torch.no_grad():
                model.layers[0](torch.randn(2, 5, 16))
            assert len(state.queue) == 1 and model.layers[1] is state.queue._entries[0].group.module
        if interrupt and step == 2:  # an exception mid-forward (inside layers.1)
            handle = model.layers[1].attn.register_forward_pre_hook(_raise)
            with pytest.raises(_MidForwardError):
                lm_loss(model, tokens)
            handle.remove()
        if interrupt and step == 3:  # a forward with grad on and no backward
            lm_loss(model, tokens)
        opt.step()
        assert len(state.queue) == 0
        for group in state.groups:
            assert group.state is GroupState.SHARDED
            for mp in group.params:
                assert mp.module._parameters[mp.name] is mp.sharded, mp.fqn
                if not mp.is_owner:
                    assert mp.unsharded.untyped_storage().nbytes() == 0, mp.fqn
        opt.zero_grad()
    return model, losses


def _no_collective_across_mutation(rank: int, world: int) -> None:
    for reshard in (True, False):
        clean, clean_losses = _interrupted_training(rank, world, interrupt=False,
                                                    reshard_after_forward=reshard)
        model, losses = _interrupted_training(rank, world, interrupt=True,
                                              reshard_after_forward=reshard)
        assert losses == clean_losses, (reshard, losses, clean_losses)
        _assert_equal_values(model, clean, f"reshard_after_forward={reshard}")
    # the public entry point, and the model's own load_state_dict, retire a prefetch too
    model, _ = _interrupted_training(rank, world, interrupt=False, reshard_after_forward=True)
    state = mf.get_state(model)
    torch.manual_seed(0)
    full = TinyTransformer(layers=4).state_dict()
    for retire in (lambda: mf.quiesce(model),
                   lambda: model.load_state_dict(model.state_dict()),
                   lambda: load_full_state_dict(model, full)):
        with torch.no_grad():
            model.layers[0](torch.randn(2, 5, 16))
        assert len(state.queue) == 1
        retire()
        assert len(state.queue) == 0
        assert all(g.state is GroupState.SHARDED for g in state.groups)


# -- meta-device init ---------------------------------------------------------------------------
def _init_weights(model: nn.Module) -> None:
    """torchtitan style: nn.init on each module's weight, every rank."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight)


def _train_losses(model: nn.Module, rank: int, world: int, steps: int = 3) -> list[float]:
    opt = mf.MatrixOptimizer(model, "muon", **MUON)
    losses = []
    for step in range(steps):
        loss = lm_loss(model, local_batch(global_batch(step), rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _meta_init(rank: int, world: int) -> None:
    torch.manual_seed(0)
    full = TinyTransformer(hidden=48).state_dict()
    with torch.device("meta"):
        model = TinyTransformer(hidden=48)
    mf.fully_shard_matrix(model)  # mesh=None: the device type comes from the gloo backend
    state = mf.get_state(model)
    assert state.mesh.device_type == "cpu"
    model.to_empty(device="cpu")
    owned, tail = 0, 0
    for fqn, p in model.named_parameters():
        assert not p.is_meta, fqn
        if fqn in state.params:
            mp = state.params[fqn]
            assert p is mp.sharded and not mp.unsharded.is_meta, fqn
            assert tuple(p.shape) == (tuple(mp.shape) if mp.is_owner else (0, mp.shape[1])), fqn
            owned += _local_bytes(p)
        else:
            tail += _local_bytes(p)
    # each rank allocated only its owned matrices and its tail shards
    assert owned == sum(p.nbytes for p in state.plan.owned_by(rank))
    assert state.resident_matrix_bytes() == owned
    placeholders = any(not mp.is_owner for mp in state.params.values())
    expect = pytest.warns(UserWarning, match="zero-element") if placeholders else nullcontext()
    with expect:  # on a non-owner's placeholder, nn.init is a no-op (and says so)
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding)):
                module.reset_parameters()
    for fqn, mp in state.params.items():
        if not mp.is_owner:
            continue
        w, bound = mp.sharded.detach(), 1.0 / math.sqrt(mp.shape[1])  # kaiming_uniform(a=√5)
        assert w.abs().max() <= bound, fqn
        assert w.abs().max() >= 0.8 * bound, fqn
        assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.25, (fqn, w.std())
    _init_weights(model)  # torchtitan-style init runs on every rank too
    load_full_state_dict(model, full)
    torch.manual_seed(0)
    eager = TinyTransformer(hidden=48)
    mf.fully_shard_matrix(eager)
    load_full_state_dict(eager, full)
    _assert_equal_values(model, eager, "meta init + load")
    assert _train_losses(model, rank, world) == _train_losses(eager, rank, world)
    _assert_equal_values(model, eager, "after 3 steps")


# -- optimizer groups and assign loads -----------------------------------------------------------
def _add_param_group(rank: int, world: int) -> None:
    def make(lr: float = 0.02) -> tuple[nn.Module, mf.MatrixOptimizer]:
        torch.manual_seed(0)
        model = mf.fully_shard_matrix(TinyTransformer())
        return model, mf.MatrixOptimizer(model, "muon", lr=lr, tail_lr=1e-2, **MUON)

    extra = nn.Parameter(torch.linspace(-1, 1, 5))
    extra_ref = nn.Parameter(extra.detach().clone())
    model, opt = make()
    opt.add_param_group({"params": [extra], "lr": 0.1})
    assert opt.param_groups[-1]["kind"] == "tail" and opt.param_groups[-1]["betas"] == (0.9, 0.999)
    reference, ref_opt = make()
    ref_extra = torch.optim.AdamW([extra_ref], lr=0.1, weight_decay=0.0)
    for step in range(3):  # the tail steps once per step; the added tensor moves like AdamW's
        tokens = local_batch(global_batch(step), rank, world)
        for m, x in ((model, extra), (reference, extra_ref)):
            (lm_loss(m, tokens) + (x ** 2).sum()).backward()
        for o in (opt, ref_opt, ref_extra):
            o.step()
            o.zero_grad()
    _assert_equal_values(model, reference, "tail group added")
    assert torch.equal(extra, extra_ref) and not torch.equal(extra, torch.linspace(-1, 1, 5))

    # a matrix moved to its own group with another learning rate
    fqn = "layers.1.up.weight"
    model, opt = make()
    state = mf.get_state(model)
    moved = state.params[fqn].sharded
    first = opt.param_groups[0]["params"]
    del first[next(i for i, p in enumerate(first) if p is moved)]
    opt.add_param_group({"params": [moved], "lr": 0.05, "momentum": 0.9})
    group = opt.param_groups[-1]
    assert group["kind"] == "matrix" and group["matrix_kwargs"]["momentum"] == 0.9
    slow, slow_opt = make(lr=0.02)
    fast, fast_opt = make(lr=0.05)
    fast_opt.param_groups[0]["matrix_kwargs"]["momentum"] = 0.9
    tokens = local_batch(global_batch(0), rank, world)
    for m, o in ((model, opt), (slow, slow_opt), (fast, fast_opt)):
        lm_loss(m, tokens).backward()
        o.step()
    got, want_slow, want_fast = full_values(model), full_values(slow), full_values(fast)
    for name in got:
        want = want_fast if name == fqn else want_slow
        assert torch.equal(got[name], want[name]), name
    if state.params[fqn].is_owner:
        assert "momentum_buffer" in opt.state[moved], "no state for the moved matrix"
    with pytest.raises(ValueError, match="mixes matrices"):
        opt.add_param_group({"params": [state.params["layers.0.attn.q.weight"].sharded,
                                        nn.Parameter(torch.zeros(2))]})


def _assign_load(rank: int, world: int) -> None:
    torch.manual_seed(0)
    source = mf.fully_shard_matrix(TinyTransformer())
    torch.manual_seed(1)
    model = mf.fully_shard_matrix(TinyTransformer())
    state = mf.get_state(model)
    # The owner view (whole matrices on owners, placeholders elsewhere), so that assign=True
    # can adopt the owner's tensors without a copy (state_dict() gives matrix DTensors).
    with owner_view(mf.get_state(source)):
        sd = {k: v.detach().clone() for k, v in source.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    named = dict(model.named_parameters())
    for fqn, mp in state.params.items():
        assert named[fqn] is mp.sharded, fqn
        if mp.is_owner:
            assert mp.sharded.data_ptr() == sd[fqn].data_ptr()  # assigned, not copied
            assert mp.unsharded.data_ptr() == mp.sharded.data_ptr(), f"{fqn} not re-pinned"
    _assert_equal_values(model, source, "assign load")
    assert _train_losses(model, rank, world) == _train_losses(source, rank, world)
    _assert_equal_values(model, source, "after 3 steps")
    # a tensor of the wrong shape put in a matrix's place is refused, naming the matrix
    mp = state.params["layers.0.attn.q.weight"]
    mp.module.weight = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q\.weight.*\(3, 3\)"):
        model.float()


SUBTESTS = {  # world sizes each runs at (meta init at every size, the rest where it matters)
    "meta_init": (1, 2, 3, 4),
    "reductions_bounded": (2, 4),
    "no_collective_across_mutation": (1, 2, 4),
    "add_param_group": (1, 2),
    "assign_load": (1, 2),
}


def _world(rank: int, world: int) -> None:
    run_subtests(rank, {
        name: functools.partial(globals()[f"_{name}"], rank, world)
        for name, worlds in SUBTESTS.items() if world in worlds
    })


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_memory_world(world: int) -> None:
    run_world(world, _world)


# -- the tracker ----------------------------------------------------------------------------------
# -- gradient accumulation: the held gradients are in the plan's bytes ------------------------
def _accumulated_bytes(rank: int, world: int) -> None:
    """``MatrixMemory.accumulated``: the gradients each rank holds between no-sync backwards
    (fp32 accumulators under bf16 compute with ``reduce_dtype=fp32``; the leaves' own without
    mixed precision), measured on the runtime's matrices and by the live-bytes tracker."""
    policies = {"bf16": (MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32), 2, 4),
                "fp32": (None, 4, 4)}
    for name, (policy, compute, reduce) in policies.items():
        torch.manual_seed(0)
        model = TinyTransformer(dim=32, hidden=64, layers=2)
        mf.fully_shard_matrix(model, **({"mp_policy": policy} if policy else {}))
        state = mf.get_state(model)
        mm = matrix_memory(state.plan, rank, gloo=True, reduce_itemsize=reduce,
                           compute_itemsize=compute)
        mf.set_requires_gradient_sync(model, False)
        tracker = LiveBytesTracker()
        with tracker:
            lm_loss(model, local_batch(global_batch(0), rank, world)).backward()
        held = sum(_local_bytes(mp.accumulated_grad if mp.accumulated_grad is not None
                                else mp.unsharded.grad) for mp in state.params.values())
        matrices = sum(mp.unsharded.numel() for mp in state.params.values())
        unused = sum(mp.unsharded.numel() for f, mp in state.params.items() if ".unused." in f)
        # every matrix that got a gradient, full size, in the reduce dtype (``unused`` get none:
        # the plan's figure assumes every matrix trainable and used)
        assert held == (matrices - unused) * reduce > 0, name
        assert mm.accumulated() == matrices * reduce, (name, mm.accumulated(), held)
        assert mm.transient(accumulating=True) == mm.transient() + mm.accumulated()
        # the tracker sees them too: what outlives the backward is at least the held gradients
        assert tracker.current >= held, (name, tracker.current, held)


def test_accumulated_gradients_counted() -> None:
    run_world(2, _accumulated_bytes)


def test_live_bytes_tracker_counts_allocations_frees_and_resizes() -> None:
    w = torch.randn(64, 32, requires_grad=True)
    tracker = LiveBytesTracker().track([w])
    assert tracker.current == 64 * 32 * 4
    original_resize = torch.UntypedStorage.resize_
    with tracker:
        with tracker.phase("forward"):
            x = torch.randn(16, 64)
            y = (x @ w).relu().sum()  # x, x@w and relu(x@w) alive at once; x@w dies after relu
        assert tracker.phases["forward"].peak == (64 * 32 + 16 * 64 + 2 * 16 * 32) * 4
        with tracker.phase("backward"):
            y.backward()
        assert tracker.current == (2 * 64 * 32 + 16 * 64) * 4 + 4  # w, its grad, x, y (graph freed)
        storage = torch.empty(100).untyped_storage()
        before = tracker.current
        storage.resize_(0)  # how FSDP2 and matrixfsdp free unsharded parameters
        assert tracker.current == before - 400
        storage.resize_(800)
        assert tracker.current == before + 400
        del x, y, storage
        w.grad = None
        assert tracker.current == 64 * 32 * 4
    assert torch.UntypedStorage.resize_ is original_resize
    assert tracker.peak >= tracker.phases["backward"].peak >= tracker.phases["forward"].peak
