"""Public entry points: wrap a model, inspect its plan, control gradient sync, clip gradients."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from ._build import apply_fully_shard as _apply_fully_shard
from ._build import build_expert_groups as _build_expert_groups
from ._build import build_groups as _build_groups
from ._build import check_tp_with_experts as _check_tp_with_experts
from ._build import nvshmem_comm as _nvshmem_comm
from ._build import torch_comms as _torch_comms
from ._build import warn_idle_ranks as _warn_idle_ranks
from .collectives import (
    Phase,
    comm_phase,
)
from .nonfinite import record_global_norm
from .planner import Plan, make_plan
from .runtime import MatrixFSDPState, MatrixParam, in_backward
from .runtime.experts import (
    expert_layouts,
    resolve_expert_mesh,
    with_expert_rows,
)
from .runtime.fsdp_methods import install_fsdp_methods
from .runtime.mesh import DataParallelMesh, backend_device_type, init_hsdp_mesh, resolve_mesh
from .runtime.selection import (
    MatrixFilter,
    default_groups,
    param_specs,
    report_selection,
    select_params,
    warn_weak_selection,
)
from .runtime.state_dict_view import install_state_dict_view
from .runtime.tp import model_tp_mesh, tp_layout_of, tp_norm_weight

__all__ = [
    "clip_grad_norm_",
    "fully_shard_matrix",
    "get_plan",
    "get_state",
    "global_grad_norm",
    "init_hsdp_mesh",
    "is_matrix_wrapped",
    "quiesce",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
]

logger = logging.getLogger(__name__)

_STATE_ATTR = "_matrixfsdp_state"


def fully_shard_matrix(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    expert_mesh: DeviceMesh | None = None,
    groups: Sequence[nn.Module] | None = None,
    matrix_filter: MatrixFilter | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    planner: object = None,
    collectives: Literal["auto", "alltoall", "p2p", "nvshmem"] = "auto",
    replicate_presence_flags: bool = True,
    tail_units: Literal["auto", "groups", "root"] = "auto",
) -> nn.Module:
    """Shard ``model`` owner-style: each selected matrix whole on one rank, the tail in FSDP2.

    Args:
        model: the plain (unwrapped) model, on the mesh's device type or wholly on ``meta``
            (then call ``model.to_empty(device=...)`` and initialize after wrapping: each rank
            allocates only its owned matrices and tail shards). Initialize on every rank with
            one seed (``torch.manual_seed(s)``, then ``reset_parameters()``, ``init_weights()``,
            ``nn.init.*(w)``, ``w.data.normal_()``, ...) before the first forward: each owner
            draws each of its matrices whole from the matrix's own stream, seeded from ``s`` and
            the matrix's FQN, so no two matrices are equal and every matrix gets the same values
            at every world size (see [Note: matrix init RNG] in ``runtime/init_rng.py``).
        mesh: a 1-D ``DeviceMesh`` (flat owner sharding over all its ranks) or a 2-D one for
            HSDP, as FSDP2 takes it: dim 0 replicates, dim 1 shards (build it with
            ``init_device_mesh(device, (replicas, ranks_per_replica), mesh_dim_names=
            ("replicate", "shard"))`` or ``init_hsdp_mesh``). Matrices are then owner-sharded
            inside each shard group with the same plan in every replica, their gradients
            averaged over the replicas by one all-reduce per group, and the tail is FSDP2 HSDP
            (see [Note: HSDP mesh]). ``None`` builds a 1-D mesh over the default process group
            on the device type of the model's parameters (CPU parameters mean a gloo CPU mesh),
            or, for a model on ``meta``, on the default process group's device type (nccl:
            cuda, gloo: cpu).
        expert_mesh: the data-parallel mesh of the expert parameters (torchtitan's ``efsdp``):
            the ranks that hold the same experts, 1-D or 2-D ``(replicate, efsdp)`` under HSDP.
            Expert parameters are 3-D stacks ``(E, ...)`` distributed before wrapping as DTensors
            ``Shard(0)`` over a mesh dim named ``ep`` (torchtitan's ``ExpertParallel``, or
            ``distribute_tensor(stack, mesh["ep"], [Shard(0)])``); each ep rank's local stack
            is owned over ``expert_mesh`` while dense matrices are owned over ``mesh``, in one
            plan, and the model's own token dispatch is untouched (see [Note: expert
            parallelism] in ``runtime/experts.py``). Needed exactly when the model has expert
            parameters; with ``mesh = (efsdp, ep)`` ranks of one mesh, pass ``mesh["efsdp"]``.
        groups: communication units (one gather and one reduction each); ``None`` means the
            blocks: every child of each outermost ``nn.ModuleList``, and the blocks of one class
            repeated in an outermost ``nn.ModuleDict`` / ``nn.Sequential`` (torchtitan's layer
            dict, timm's blocks), then the root. Wrapping that finds no block or selects no
            matrix logs a WARNING naming this fix.
        matrix_filter: ``(fqn, param) -> bool`` choosing the matrices; ``None`` applies the
            default rule (see [Note: default matrix selection] in ``runtime/selection.py``): every
            parameter of 2+ dims inside a group other than the root (``nn.Linear``, Hugging Face
            ``Conv1D``, 3-D expert stacks, routers), except embeddings (and weights tied to
            them), biases and conv kernels. Where a filter disagrees with the rule, the log names
            the weights and ``get_plan(model).notes`` says why.
        reshard_after_forward: free non-owned matrices after forward (regather in backward).
        mp_policy: FSDP2 ``MixedPrecisionPolicy``; matrices compute in ``param_dtype`` and reduce
            in ``reduce_dtype`` (default: the parameter's own dtype), in which no-sync
            micro-batches also accumulate (as FSDP2's do); owners keep the master.
        planner: an ``LPTPlanner``, a cost-model name (``"bytes"``, ``"muon"``, ``"okls"``, ...)
            or a callable ``(specs, world_size) -> Plan``; ``None`` balances resident bytes.
        collectives: how owner segments move: one exchange of point-to-point sends per group,
            the traffic of an uneven all-to-all (``"alltoall"``), one broadcast per matrix and
            one reduce per owner segment (``"p2p"``), or ``"auto"``: the forms that hold the
            fewest buffers and run fastest on the backend: on NCCL, gathers exchange while a group's
            owners cover about half the ranks or more, else broadcast, and gradients reduce
            per segment in place; on gloo, broadcasts, and reductions in rounds (each owner
            receives its peers' copies one after another into one buffer), a form for gloo
            only: with every send posted and one receive at a time it could deadlock on NCCL
            (see ``TorchOwnerComm`` and [Note: rounds need gloo]). ``"nvshmem"``: one-sided
            put-with-signal transfers through nvshmem4py (``pip install
            'matrixfsdp[nvshmem]'``; CUDA, ranks on one host); where it cannot run, one warning
            names the reason and the ``"auto"`` path is used (``"auto"`` never picks NVSHMEM by
            itself).
        replicate_presence_flags: HSDP only (ignored on a 1-D mesh). ``True``: each owner's
            all-reduce over the replicas carries one 4-byte presence flag per matrix with the
            gradients, so a matrix used on some ranks, some replicas or none gets exactly the
            single-device ``.grad`` (``None`` where nothing used it). ``False``: only the
            gradients cross replicas, the bytes of FSDP2's HSDP all-reduce, and the result is
            the same: presence travels in the sign of a zero (a replica without a gradient for
            a matrix sends its first element as ``-0.0``), so it never raises, also for a matrix
            absent from a whole replica (see [Note: presence flags] in ``runtime/group.py``).
        tail_units: which groups' tails (their parameters that are not matrices: norms, biases,
            expert stacks) get an FSDP2 unit of their own. ``"auto"``: a group whose tail holds
            more than ``TAIL_UNIT_MIN_BYTES`` (1 MiB; e.g. sliced 3-D expert stacks); smaller ones
            (a block's norms and biases) join the root's unit, gathered once per step, so each
            block moves with the runtime's own collectives alone. ``"groups"``: every group, as
            ``fully_shard`` on each block would; ``"root"``: none (see [Note: tail units] in
            ``runtime/tail.py``).

    Returns the same module, changed in place.
    """
    _check_not_wrapped(model)
    _check_options(collectives, tail_units, replicate_presence_flags)
    dp = resolve_mesh(_default_mesh(model) if mesh is None else mesh)
    experts = resolve_expert_mesh(model, dp, expert_mesh)
    group_modules = _resolve_groups(model, groups)
    device_type = "meta" if _all_meta(model) else dp.mesh.device_type
    sites = select_params(model, group_modules, matrix_filter, device_type)
    selection_notes = report_selection(sites, filtered=matrix_filter is not None)
    warn_weak_selection(model, sites, group_modules, groups_given=groups is not None)
    ep_layouts = expert_layouts(sites, experts)
    specs = with_expert_rows(param_specs(sites), ep_layouts)
    plan = make_plan(specs, dp.shard_size, planner,
                     expert_grid=experts.grid if experts else None).with_mesh_shape(*dp.shape)
    for fqn, note in plan.notes.items():
        logger.warning("matrixfsdp: %s: %s", fqn, note)
    _warn_idle_ranks(plan)
    if selection_notes:
        plan = plan.model_copy(update={"notes": {**selection_notes, **plan.notes}})
    comm, replicate = _torch_comms(dp, collectives)
    _check_plan_agrees(plan, dp)
    _check_tp_with_experts(model, ep_layouts)
    tp_mesh = model_tp_mesh(model, dp.mesh)
    tp_layouts = {s.fqn: tp_layout_of(s.fqn, s.param, dp.mesh) for s in sites
                  if s.is_matrix and s.fqn not in ep_layouts}
    matrix_groups = _build_groups(model, group_modules, sites, plan, comm, replicate, mp_policy,
                                  tp_layouts, replicate_presence_flags=replicate_presence_flags)
    matrix_groups += _build_expert_groups(model, group_modules, sites, plan, experts, ep_layouts,
                                          collectives, mp_policy, dp.world_size,
                                          replicate_presence_flags)
    if collectives == "nvshmem":
        comm = _nvshmem_comm(comm, [g for g in matrix_groups if g.comm is comm], dp.mesh)
    ignored = {t for g in matrix_groups for p in g.params for t in (p.sharded, p.unsharded)}
    _apply_fully_shard(model, group_modules, ignored, dp.mesh, reshard_after_forward, mp_policy,
                       tail_units)
    state = MatrixFSDPState(
        root=model,
        plan=plan,
        groups=matrix_groups,
        comm=comm,
        mesh=dp,
        reshard_after_forward=reshard_after_forward,
        tp_mesh=tp_mesh,
    )
    state.experts = experts
    state.register_hooks()
    install_fsdp_methods(state)  # FSDPModule methods drive the matrices too
    _register_refresh_hooks(model, state)
    model.__dict__[_STATE_ATTR] = state
    _log_summary(plan, len(matrix_groups))
    return model


def _check_options(collectives: str, tail_units: str, replicate_presence_flags: object) -> None:
    """Raise ``ValueError`` naming the keyword of ``fully_shard_matrix`` that got a bad value."""
    if collectives not in ("auto", "alltoall", "p2p", "nvshmem"):
        raise ValueError(
            f"collectives must be 'auto', 'alltoall', 'p2p' or 'nvshmem', got {collectives!r}"
        )
    if tail_units not in ("auto", "groups", "root"):
        raise ValueError(f"tail_units must be 'auto', 'groups' or 'root', got {tail_units!r}")
    if not isinstance(replicate_presence_flags, bool):
        raise ValueError(f"replicate_presence_flags must be True or False, got "
                         f"{replicate_presence_flags!r}")


def _log_summary(plan: Plan, num_groups: int) -> None:
    """One INFO line: what goes to owners, what stays in the tail, and the plan's balance."""
    selection = plan.selection()
    logger.info(
        "matrixfsdp: %d matrices and %d expert stacks (%d as expert slices) go to owners, "
        "%d tensors stay in the tail; %d groups over %d ranks x %d replicas (plan %s, max/mean "
        "bytes %.3f)",
        len(selection.matrices), len(selection.stacks), len(plan.sharded_stacks),
        len(selection.tail), num_groups, plan.world_size, plan.replicate_size,
        plan.plan_hash()[:12], plan.imbalance("bytes"),
    )


def get_state(model: nn.Module) -> MatrixFSDPState:
    """The runtime state of a wrapped model (``ValueError`` if it was never wrapped)."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        raise ValueError(
            f"{type(model).__name__} is not wrapped by matrixfsdp; call fully_shard_matrix(model)"
        )
    return state


def is_matrix_wrapped(model: nn.Module) -> bool:
    return _STATE_ATTR in model.__dict__


def get_plan(model: nn.Module) -> Plan:
    """The owner plan the model was wrapped with (a pydantic ``Plan``).

    Its ``world_size`` is the shard size and ``mesh_shape`` the mesh's ``(replicate, shard)``.
    ``get_plan(model).selection()`` lists the FQNs of the owner matrices, the 3-D expert stacks
    and the tail; ``.notes`` says why a parameter's role differs from the default rule.
    """
    return get_state(model).plan


def quiesce(model: nn.Module) -> None:
    """Complete or discard every collective the runtime has in flight (local, no collective).

    Call it before changing parameters by hand (``with torch.no_grad(): p.mul_(...)``) after a
    forward that may have stopped early. ``MatrixOptimizer.step``, ``model.load_state_dict`` and
    the ``matrixfsdp.checkpoint`` load paths call it themselves. See ``MatrixFSDPState.quiesce``.
    """
    get_state(model).quiesce()


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction off for accumulation micro-batches (like FSDP2's method).

    With sync off, every rank keeps its local full-size matrix gradients between backwards and
    nothing is communicated (under HSDP neither the reductions nor the all-reduce over the
    replicas); the next backward with sync on reduces the accumulated sum to the owners and
    all-reduces it. As FSDP2 does, the sum is kept in the reduction dtype (``reduce_dtype``, else
    the parameter's dtype): under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
    each no-sync backward's bf16 gradient is added into an fp32 accumulator, not summed in bf16
    (see [Note: accumulation in reduce_dtype] in ``runtime/group.py``). The tail follows FSDP2's
    own flags (reduce-scatter and HSDP all-reduce).
    """
    flag = bool(requires_gradient_sync)
    state = get_state(model)
    state.requires_grad_sync = flag
    state.requires_all_reduce = flag
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(flag, recurse=True)
        model.set_requires_all_reduce(flag, recurse=True)  # FSDP2 < 2.6 left it to the caller


def set_requires_all_reduce(model: nn.Module, requires_all_reduce: bool) -> None:
    """HSDP accumulation with reductions but no all-reduce over the replicas (FSDP2's method).

    With it off, each backward still reduces gradients to their owners inside the shard group;
    owners keep the sums and the next backward with it on adds them in before its all-reduce.
    The tail follows FSDP2's ``set_requires_all_reduce``. A no-op on a flat mesh.
    """
    flag = bool(requires_all_reduce)
    get_state(model).requires_all_reduce = flag
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(flag, recurse=True)


@torch.no_grad()
def global_grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient over all ranks (one scalar all-reduce).

    Every rank gets the same value. See [Note: skipping non-finite steps] for its use.
    """
    state = get_state(model)
    grads, weights = _local_grads(state, model.parameters())
    return _global_norm(state, grads, weights, float(norm_type))


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the global gradient norm over owned matrices and tail shards; return the norm.

    Each element of the model's gradient lives on exactly one rank of a shard group (matrices on
    their owner, the tail in FSDP2 shards), so the global norm costs one scalar all-reduce over
    the shard group. Under HSDP every replica holds the same averaged gradients: the norm is one
    replica's, reduced inside the shard group only, and identical on every rank.
    The norm is recorded for the next ``MatrixOptimizer.step(...)`` with
    ``skip_nonfinite=True``, which then needs no collective of its own (see
    [Note: skipping non-finite steps]). No host synchronisation (the clip coefficient stays on
    the device), except the one check ``error_if_nonfinite=True`` asks for.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be non-negative, got {max_norm}")
    state = get_state(model)
    grads, weights = _local_grads(state, model.parameters())
    total = _global_norm(state, grads, weights, float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of gradients is non-finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    record_global_norm(state, total, float(norm_type), grads)
    return total


def _global_norm(state: MatrixFSDPState, grads: list[torch.Tensor], weights: list[float],
                 p: float) -> torch.Tensor:
    """Over the shard group, then the tp group; ``weights`` count a tensor that every tp rank
    holds alike once (see ``tp_norm_weight``)."""
    device = _group_device(state.comm.group)  # gloo reduces CPU tensors, NCCL CUDA ones
    tp_group = state.tp_mesh.get_group(0) if state.tp_mesh is not None else None
    if math.isinf(p):
        # One tensor max, not Python's max() (which reads each comparison on the host).
        maxes = [g.abs().max().float().to(device) for g in grads if g.numel()]
        total = (torch.stack(maxes).max() if maxes else torch.zeros((), device=device)).reshape(1)
        with comm_phase(Phase.OPTIMIZER):
            total = state.comm.all_reduce_scalar(total.clone(), op="max")
            if tp_group is not None:
                with record_function("matrixfsdp::tp_norm_all_reduce"):
                    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=tp_group)
    else:
        local = torch.zeros(1, dtype=torch.float32, device=device)
        for g, weight in zip(grads, weights, strict=True):
            local += g.float().abs().pow(p).sum().to(device) * weight
        with comm_phase(Phase.OPTIMIZER):
            total = state.comm.all_reduce_scalar(local, op="sum")
            if tp_group is not None:
                with record_function("matrixfsdp::tp_norm_all_reduce"):
                    dist.all_reduce(total, group=tp_group)
        total = total.pow(1.0 / p)
    return total.reshape(())


# -- helpers ---------------------------------------------------------------------------------------
def _local_grads(state: MatrixFSDPState,
                 params: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[float]]:
    """Each gradient's local tensor, with its weight in a norm summed over the tp group."""
    matrices = {id(mp.sharded): mp for mp in state.params.values()}
    grads, weights = [], []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
        weights.append(tp_norm_weight(state, param, matrices.get(id(param))))
    return grads, weights


def _check_not_wrapped(model: nn.Module) -> None:
    if is_matrix_wrapped(model):
        raise ValueError(
            f"{type(model).__name__} is already wrapped by fully_shard_matrix; wrap a model once"
        )
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise ValueError(
                f"module {name or '<root>'!r} was already wrapped by fully_shard; apply "
                "fully_shard_matrix to the plain model instead (it calls fully_shard itself)"
            )


def _default_mesh(model: nn.Module) -> DeviceMesh:
    """A 1-D mesh over the default process group, on the parameters' device type."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "fully_shard_matrix needs torch.distributed: launch with torchrun and call "
            "torch.distributed.init_process_group() first, or pass a mesh"
        )
    param = next(model.parameters(), None)
    device_type = param.device.type if param is not None else "cpu"
    if device_type == "meta":
        device_type = backend_device_type()
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _all_meta(model: nn.Module) -> bool:
    params = list(model.parameters())
    return bool(params) and all(p.is_meta for p in params)


def _register_refresh_hooks(model: nn.Module, state: MatrixFSDPState) -> None:
    """Keep the runtime valid across ``to_empty``/``_apply`` and ``load_state_dict``.

    As FSDP2 does, the runtime refreshes what it caches right after ``nn.Module._apply`` (which
    may replace a module's parameter objects, e.g. ``to_empty`` from ``meta``) and after
    ``load_state_dict`` (``assign=True`` replaces them); both first retire pending collectives.
    An ``_apply`` that materializes an owner's matrix from ``meta`` opens its init window (see
    [Note: matrix init RNG] in ``runtime/init_rng.py``).

    ``state_dict()`` shows matrices as FSDP2-style ``Shard(0)`` DTensors scattered from their
    owners (so it is collective), and ``load_state_dict`` takes those, full tensors or owner-view
    dicts (see [Note: state-dict view] in ``runtime/state_dict_view.py``).
    """
    by_module: dict[int, tuple[nn.Module, list[MatrixParam]]] = {}
    for mp in state.params.values():
        by_module.setdefault(id(mp.module), (mp.module, []))[1].append(mp)
    for module, params in by_module.values():
        original = module._apply
        module._apply = functools.partial(_apply_and_refresh, state, original, params)
        module.register_load_state_dict_post_hook(
            functools.partial(_refresh_after_load, params)
        )
    # As FSDP2 reshards before state_dict()/load_state_dict(): whoever gets the parameters to
    # read or fill (checkpoint save/load, load_full_state_dict, ...) finds nothing in flight.
    model.register_state_dict_pre_hook(lambda *args, **kwargs: _quiesce_outside_backward(state))
    model._register_load_state_dict_pre_hook(
        lambda *args, **kwargs: _quiesce_outside_backward(state)
    )
    # Matrices as FSDP2-style Shard(0) DTensors in state_dict()/load_state_dict(), for torch's
    # state-dict API and DCP (see [Note: state-dict view]); registered after the quiesce hooks.
    install_state_dict_view(model, state)


def _quiesce_outside_backward(state: MatrixFSDPState) -> None:
    if not in_backward():
        state.quiesce()


def _apply_and_refresh(state: MatrixFSDPState, original: Callable[..., nn.Module],
                       params: Sequence[MatrixParam], fn: Callable, *args: object,
                       **kwargs: object) -> nn.Module:
    from .runtime.init_rng import init_window_across_apply

    state.retire_pending()  # FSDP2's own _apply reshards the tail
    with init_window_across_apply(params):  # to_empty from meta opens the init window
        out = original(fn, *args, **kwargs)
        for mp in params:
            mp.refresh()
    return out


def _refresh_after_load(params: Sequence[MatrixParam], module: nn.Module, incompatible: object) -> None:
    for mp in params:
        mp.refresh()


def _resolve_groups(model: nn.Module, groups: Sequence[nn.Module] | None) -> list[nn.Module]:
    if groups is None:
        return default_groups(model)
    modules = list(groups)
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"groups must hold nn.Module objects, got {type(m).__name__}")
    return [m for m in modules if m is not model] + [model]


def _check_plan_agrees(plan: Plan, dp: DataParallelMesh) -> None:
    """Every rank must compute the same plan: compare SHA-256 digests over the shard group,
    then over the replicate group (together they connect every rank of the mesh)."""
    _check_digests(plan, dp.shard_group)
    if dp.replicate_group is not None:
        _check_digests(plan, dp.replicate_group)


def _check_digests(plan: Plan, group: dist.ProcessGroup | None) -> None:
    world = dist.get_world_size(group)
    if world == 1:
        return
    digest = bytes.fromhex(plan.plan_hash())
    device = _group_device(group)
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    hashes = [bytes(t.cpu().tolist()).hex()[:16] for t in everyone]
    if len(set(hashes)) != 1:
        raise ValueError(
            f"ranks computed different owner plans (plan hash prefix per rank: {hashes}); the plan "
            "must be a pure function of the model: build the same model with the same "
            "matrix_filter, groups and planner on every rank"
        )


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
