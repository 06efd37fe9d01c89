"""Expert parallelism composed with owner sharding, against a single-process reference.

``TinyEPMoE`` (top-2 routing, all-to-all token dispatch over ep; ``tests/ep_models.py``) with its
expert stacks distributed ``Shard(0)`` over ``mesh["ep"]`` and wrapped with
``fully_shard_matrix(model, dense_mesh, expert_mesh=mesh["efsdp"])`` at world 4 on gloo, as
efsdp 2 x ep 2, efsdp 1 x ep 4 and HSDP (replicate 2 x efsdp 1 x ep 2). Checked against one process
on the same global batch: every gradient (<= 1e-6 relative), the global gradient norm, and 3 steps of
SGD and of every matrix optimizer (<= 1e-5).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import matrixfsdp as mf

from .checks import (
    FREE_RUNNING_KWARGS,
    assert_close_dicts,
    count_collectives,
    float64_rtols,
    full_optimizer_state,
    full_values,
    reference_values,
)
from .dist_utils import device_type, run_subtests, run_world
from .ep_models import EXPERT_FQNS, MoEBlock, TinyEPMoE, distribute_experts
from .models import global_batch, lm_loss, local_batch
from .test_optim_dist import LR, ReferenceStepper

OPTIMIZERS = ("muon", "shampoo", "soap", "okls", "emagram", "adamw")

LAYOUTS = {"efsdp2_ep2": (1, 2, 2), "efsdp1_ep4": (1, 1, 4), "hsdp2_efsdp1_ep2": (2, 1, 2)}


def ep_meshes(layout: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dense mesh, expert mesh, ep mesh) of ``layout`` over 4 ranks, rank = dense index."""
    replicate, efsdp, ep = LAYOUTS[layout]
    if replicate == 1:
        mesh = init_device_mesh(device_type(), (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
        dense = init_device_mesh(device_type(), (efsdp * ep,), mesh_dim_names=("dp",))
        return dense, mesh["efsdp"], mesh["ep"]
    mesh = init_device_mesh(device_type(), (replicate, efsdp, ep),
                            mesh_dim_names=("replicate", "efsdp", "ep"))
    dense = init_device_mesh(device_type(), (replicate, efsdp * ep),
                             mesh_dim_names=("replicate", "shard"))
    return dense, mesh["replicate", "efsdp"], mesh["ep"]


def ep_pair(layout: str, **wrap_kwargs) -> tuple[nn.Module, nn.Module]:
    """A reference model and its EP copy, wrapped on ``layout``'s meshes."""
    dense, experts, ep = ep_meshes(layout)
    torch.manual_seed(0)
    ref = TinyEPMoE()
    model = distribute_experts(copy.deepcopy(ref), ep)
    mf.fully_shard_matrix(model, dense, expert_mesh=experts, **wrap_kwargs)
    return ref, model


def _reference_backward(ref: nn.Module, tokens: torch.Tensor, world: int) -> None:
    (sum(lm_loss(ref, local_batch(tokens, r, world)) for r in range(world)) / world).backward()


def _sgd(rank: int, world: int, layout: str) -> None:
    ref, model = ep_pair(layout)
    plan = mf.get_plan(model)
    assert {p.fqn for p in plan.matrices if p.mesh == "expert"} == set(EXPERT_FQNS)
    opts = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        tokens = global_batch(step)
        _reference_backward(ref, tokens, world)
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        if step == 0:
            rtols = float64_rtols(ref, lambda m, t=tokens: _reference_backward(m, t, world))
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), rtols,
                               "grad")
            want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in ref.parameters()))
            got = mf.global_grad_norm(model).item()
            assert abs(got - want) <= 1e-6 * want, f"global norm {got} != {want}"
            clipped = mf.clip_grad_norm_(model, 0.5 * want).item()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5 * want)
            assert abs(clipped - want) <= 1e-6 * want, f"clip_grad_norm_ {clipped} != {want}"
            assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), 1e-6,
                               "clipped grad")
        for o in opts:
            o.step()
            o.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, "param")


def _reference(ref: nn.Module, model: nn.Module, name: str, kwargs: dict, library: dict):
    """The float64 per-matrix formulas (per expert for stacks) and AdamW for the tail; for
    ``"adamw"``, torch's AdamW everywhere."""
    if name == "adamw":
        return torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    matrix_fqns = {p.fqn for p in mf.get_plan(model).matrices}
    return ReferenceStepper(ref, matrix_fqns, name, LR[name], kwargs, library_state=library.copy)


def _optimizer(rank: int, world: int, layout: str, name: str) -> None:
    """3 steps of a matrix optimizer == one process; the step moves no byte and sends nothing."""
    ref, model = ep_pair(layout)
    if name == "soap":
        ref, model = ref.double(), model.double()
    state = mf.get_state(model)
    kwargs = FREE_RUNNING_KWARGS.get(name, {})
    lr = 1e-2 if name == "adamw" else LR[name]
    opt = mf.MatrixOptimizer(model, optimizer=name, lr=lr, weight_decay=0.1, tail_lr=1e-2,
                             tail_weight_decay=0.1, **kwargs)
    library: dict = {}
    stepper = _reference(ref, model, name, kwargs, library)
    for step in range(3):
        tokens = global_batch(step)
        _reference_backward(ref, tokens, world)
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        for group in state.groups:
            group.comm.counter.reset()
        assert count_collectives(opt.step) == 0, "the optimizer step communicated"
        assert all(g.comm.counter.snapshot()["optimizer"]["calls"] == 0 for g in state.groups)
        _check_no_foreign_bytes(model)
        if name == "soap" and step == 0:
            library.update(full_optimizer_state(model, opt))
        stepper.step()
        stepper.zero_grad()
        opt.zero_grad()
    assert_close_dicts(full_values(model), reference_values(ref), 1e-5, f"{name} after 3 steps")


def _check_no_foreign_bytes(model: nn.Module) -> None:
    """Outside forward/backward a rank holds bytes of the expert stacks it owns only."""
    for mp in mf.get_state(model).params.values():
        if not mp.is_owner:
            assert mp.resident_bytes() == 0, f"{mp.fqn}: {mp.resident_bytes()} bytes off-owner"
            assert mp.sharded.numel() == 0


def _world(rank: int, world: int, layout: str, optimizers: tuple[str, ...]) -> None:
    subtests = {"sgd": functools.partial(_sgd, rank, world, layout)}
    for name in optimizers:
        subtests[name] = functools.partial(_optimizer, rank, world, layout, name)
    run_subtests(rank, subtests)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ep_training(layout: str) -> None:
    """SGD and the six matrix optimizers at every layout (HSDP: Muon and SOAP, the
    replicated path's math is the same for the others)."""
    optimizers = OPTIMIZERS if not layout.startswith("hsdp") else ("muon", "soap")
    run_world(4, _world, layout, optimizers)


def _expect(error: type[Exception], match: str, fn) -> None:
    with pytest.raises(error, match=match):
        fn()


def _errors(rank: int, world: int) -> None:
    """Each wrong layout raises the same error on every rank, naming the FQN and the fix."""
    dense, experts, ep = ep_meshes("efsdp2_ep2")
    torch.manual_seed(0)

    def distributed(**kwargs):
        return distribute_experts(TinyEPMoE(), ep)

    cases = {
        "no expert_mesh": (ValueError, r"layers\.0\.experts\.w_in.*no expert_mesh was given.*efsdp",
                           lambda: mf.fully_shard_matrix(distributed(), dense)),
        "expert_mesh without experts": (ValueError, "no parameter of the model is a DTensor",
                                        lambda: mf.fully_shard_matrix(TinyEPMoE(), dense,
                                                                      expert_mesh=experts)),
        "expert_mesh is the dense mesh": (ValueError, r"does not tile the data-parallel mesh",
                                          lambda: mf.fully_shard_matrix(distributed(), dense,
                                                                        expert_mesh=dense)),
        "expert_mesh is the ep mesh": (ValueError, r"expert_mesh: mesh .* has model-parallel",
                                       lambda: mf.fully_shard_matrix(distributed(), dense,
                                                                     expert_mesh=ep)),
        "expert_mesh over the ep ranks": (ValueError, r"do not tile.*coordinates .* repeat",
                                          lambda: mf.fully_shard_matrix(
                                              distributed(), dense,
                                              expert_mesh=_inner_dim_mesh())),
        "tp and ep": (NotImplementedError, "tensor and expert parallelism together",
                      lambda: _tp_and_ep(dense, experts, ep)),
        "expert left in the tail": (NotImplementedError, r"layers\.\d\.experts\.w_\w+.*must be matrices",
                                    lambda: mf.fully_shard_matrix(
                                        distributed(), dense, expert_mesh=experts,
                                        matrix_filter=lambda fqn, p: p.ndim == 2
                                        and "head" not in fqn and "embed" not in fqn)),
    }
    subtests = {name: functools.partial(_expect, *case) for name, case in cases.items()}
    subtests["Shard(1) over ep"] = functools.partial(_wrong_placement, dense, experts, ep)
    run_subtests(rank, subtests)


def _inner_dim_mesh() -> DeviceMesh:
    """A 1-D data-parallel mesh over the same ranks as ep (the wrong dim for expert_mesh)."""
    return init_device_mesh(device_type(), (2, 2), mesh_dim_names=("outer", "inner"))["inner"]


def _tp_and_ep(dense: DeviceMesh, experts: DeviceMesh, ep: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    model = distribute_experts(TinyEPMoE(), ep)
    parallelize_module(model.layers[0], tp, {"gate": ColwiseParallel()})
    mf.fully_shard_matrix(model, dense, expert_mesh=experts)


def _wrong_placement(dense: DeviceMesh, experts: DeviceMesh, ep: DeviceMesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    model = TinyEPMoE()
    distribute_experts(model, ep)
    w = model.layers[1].experts.w_out
    full = w.detach().full_tensor()
    model.layers[1].experts.w_out = nn.Parameter(distribute_tensor(full, ep, [Shard(1)]))
    _expect(ValueError, r"layers\.1\.experts\.w_out.*must be a 3-D stack .* placed Shard\(0\)",
            lambda: mf.fully_shard_matrix(model, dense, expert_mesh=experts))


def test_ep_errors() -> None:
    run_world(4, _errors)


def test_joint_plan_balances_dense_and_expert_owners(caplog) -> None:
    """One LPT over both: an expert stack lands on every rank of its expert-mesh index, dense
    matrices fill the least-loaded ranks; max/mean is over both; idle ranks are warned about."""
    from matrixfsdp._build import warn_idle_ranks
    from matrixfsdp.planner import ParamSpec, make_plan

    grid = (0, 0, 1, 1)  # efsdp 2 x ep 2: dense shard ranks 0, 1 hold expert index 0
    experts = [ParamSpec(f"layers.{i}.experts.w", (2, 8, 8), role="matrix", mesh="expert")
               for i in range(2)]
    dense = [ParamSpec(f"layers.{i}.gate.weight", (4, 8), role="matrix") for i in range(4)]
    plan = make_plan([*experts, *dense], 4, expert_grid=grid)
    assert sorted(p.owner_rank for p in plan.matrices if p.mesh == "expert") == [0, 1]
    loads = [lo.nbytes for lo in plan.rank_loads()]
    assert loads == [2 * 8 * 8 * 4 + 4 * 8 * 4] * 4  # each rank: one local stack + one gate
    assert plan.imbalance("bytes") == 1.0
    assert plan.holders(plan["layers.0.experts.w"]) in ((0, 1), (2, 3))
    assert mf.Plan.from_json(plan.to_json()).plan_hash() == plan.plan_hash()
    with caplog.at_level("WARNING"):
        idle = warn_idle_ranks(make_plan(experts[:1], 4, expert_grid=grid))
    assert len(idle) == 2 and "own no matrix" in caplog.text
    with pytest.raises(NotImplementedError, match="memory_cap_bytes"):
        make_plan(experts, 4, mf.LPTPlanner(memory_cap_bytes=10**6), expert_grid=grid)
    with pytest.raises(NotImplementedError, match="cannot place expert stacks"):
        make_plan(experts, 4, lambda specs, world: None, expert_grid=grid)


def _per_layer_ep(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Each layer's experts on its own ``mesh["ep"]`` call: equal, distinct DeviceMesh objects.
    The layers' expert widths differ (see ``_dense_mesh_forms``): DTensor's sharding cache, keyed
    by shape, would otherwise hand the first layer's mesh object to the second layer."""
    for layer in model.layers:
        distribute_experts(layer, mesh["ep"])
    meshes = [layer.experts.w_in.device_mesh for layer in model.layers]
    assert meshes[0] is not meshes[1] and meshes[0] == meshes[1], "want distinct equal meshes"
    return model


def _dense_mesh_forms(rank: int, world: int) -> None:
    """The dense mesh as the default group (mesh=None) or as the world mesh flattened, and each
    layer's experts on its own ``mesh["ep"]`` (meshes compared by value): the same exact
    gradients."""
    for form in ("default", "flattened", "a mesh['ep'] per layer"):
        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("efsdp", "ep"))
        experts, ep = mesh["efsdp"], mesh["ep"]
        torch.manual_seed(0)
        ref = TinyEPMoE()
        if form.endswith("per layer"):
            ref.layers[1] = MoEBlock(16, hidden=20)
        model = (_per_layer_ep(copy.deepcopy(ref), mesh) if form.endswith("per layer")
                 else distribute_experts(copy.deepcopy(ref), ep))
        dense = None if form == "default" else mesh["efsdp", "ep"]._flatten("dp_flat")
        mf.fully_shard_matrix(model, dense, expert_mesh=experts)
        tokens = global_batch(0)
        _reference_backward(ref, tokens, world)
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        rtols = float64_rtols(ref, lambda m, t=tokens: _reference_backward(m, t, world))
        assert_close_dicts(full_values(model, "grad"), reference_values(ref, "grad"), rtols, form)


def _divide_factor(rank: int, world: int) -> None:
    """torchtitan's ``set_gradient_divide_factor(1.0)`` on every FSDPModule of an EP model: dense
    and expert gradients alike are sums over the whole data-parallel world (an expert's sum over
    its efsdp group already holds every ep peer's tokens); another factor divides that sum."""
    from torch.distributed.fsdp import FSDPModule

    ref, model = ep_pair("efsdp2_ep2")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert units, "the wrapped EP model is an FSDPModule"
    tokens = global_batch(0)
    _reference_backward(ref, tokens, world)
    reference = reference_values(ref, "grad")
    expert_groups = {g.name for g in mf.get_state(model).groups
                     if any(mp.fqn in EXPERT_FQNS for mp in g.params)}
    assert expert_groups, "the expert stacks sit in matrix groups"
    for factor in (1.0, 3.0):
        for m in units:
            m.set_gradient_divide_factor(factor)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        factors = {g.name: g.gradient_divide_factor for g in mf.get_state(model).groups}
        assert set(factors.values()) == {factor}, factors
        for p in model.parameters():
            p.grad = None
        lm_loss(model, local_batch(tokens, rank, world)).backward()
        want = {k: None if v is None else v * world / factor for k, v in reference.items()}
        assert_close_dicts(full_values(model, "grad"), want, 1e-6, f"factor {factor}")


def _mesh_forms_and_divide_factor(rank: int, world: int) -> None:
    run_subtests(rank, {"dense mesh forms": functools.partial(_dense_mesh_forms, rank, world),
                        "divide factor": functools.partial(_divide_factor, rank, world)})


def test_ep_dense_mesh_forms() -> None:
    run_world(4, _mesh_forms_and_divide_factor)
