"""torch's state-dict API (``torch.distributed.checkpoint.state_dict``) on wrapped models.

One gloo world per world size (2 and 4) runs every subtest on a flat mesh, and at world 4 those
that depend on the mesh also on an HSDP 2x2 mesh. References are single-process models built from
the same seed: full state dicts must equal them exactly; a DCP round trip must restore parameters
and optimizer state exactly and continue as the uninterrupted run does.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import matrixfsdp as mf

from .checks import (
    FREE_RUNNING_KWARGS,
    assert_close_dicts,
    full_optimizer_state,
    full_values,
    reference_values,
)
from .dist_utils import device_type, run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch, train_steps

FULL = StateDictOptions(full_state_dict=True)
FULL_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
GRAD_RTOL = 1e-6
ROUND_TRIP_OPTIMIZERS = ("muon", "shampoo", "torch_adamw")
MESHES = {2: ("flat",), 4: ("flat", "hsdp")}


# -- helpers ---------------------------------------------------------------------------------------
def _mesh(kind: str, world: int) -> DeviceMesh:
    if kind == "hsdp":
        return mf.init_hsdp_mesh(replicate=2)
    return init_device_mesh(device_type(), (world,))


def _reference(seed: int) -> nn.Module:
    """Every parameter takes part in the loss: torch's API first steps a fresh optimizer with
    zero gradients for all of them (``_init_optim_state``), so a parameter that never had a
    gradient before the save would lack the state the load asks for (stock torch does that too)."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    for layer in model.layers:
        layer.use_unused = True
    return model


def _wrapped(seed: int, mesh: DeviceMesh) -> nn.Module:
    return mf.fully_shard_matrix(_reference(seed), mesh)


def _optimizer(model: nn.Module, name: str, lr: float = 0.02) -> torch.optim.Optimizer:
    """A MatrixOptimizer, or a plain torch optimizer over every parameter of the wrapped model."""
    if name == "torch_adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    if name == "torch_sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return mf.MatrixOptimizer(model, name, lr=lr, weight_decay=0.1, tail_lr=1e-2,
                              tail_weight_decay=0.1, **FREE_RUNNING_KWARGS.get(name, {}))



def _values(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {k: None if v is None else v.clone() for k, v in full_values(model).items()}


def _assert_equal_tensors(got: object, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor) and not isinstance(got, DTensor), \
        f"{what}: got {type(got).__name__}, want a plain tensor"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got.cpu(), want.cpu()), f"{what}: values differ"


def _assert_states_equal(got: dict, want: dict, what: str) -> None:
    """Optimizer states by FQN (``full_optimizer_state``), tensors equal bit for bit."""
    assert got.keys() == want.keys(), f"{what}: FQNs differ: {set(got) ^ set(want)}"
    for fqn, entry in want.items():
        assert got[fqn].keys() == entry.keys(), f"{what} {fqn}: {got[fqn].keys()} != {entry.keys()}"
        for key, value in entry.items():
            _assert_equal_tensors(got[fqn][key], value, f"{what} {fqn}[{key!r}]")


def _expected_placements(model: nn.Module) -> tuple:
    return (Replicate(), Shard(0)) if mf.get_state(model).mesh.ndim == 2 else (Shard(0),)


# -- model state dicts -----------------------------------------------------------------------------
def _full_model_state_dict(rank: int, world: int, mesh: DeviceMesh) -> None:
    """Every rank gets every tensor whole (rank 0 only, on the CPU, with cpu_offload)."""
    want = _reference(0).state_dict()
    model = _wrapped(0, mesh)
    got = get_model_state_dict(model, options=FULL)
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for key, value in want.items():
        _assert_equal_tensors(got[key], value, f"full {key}")
    offloaded = get_model_state_dict(model, options=FULL_CPU)
    if rank != 0:
        assert offloaded == {}, f"rank {rank} got {len(offloaded)} entries with cpu_offload"
        return
    assert offloaded.keys() == want.keys()
    for key, value in want.items():
        assert offloaded[key].device.type == "cpu", key
        _assert_equal_tensors(offloaded[key], value, f"cpu_offload {key}")


def _module_state_dict(rank: int, world: int, mesh: DeviceMesh) -> None:
    """``model.state_dict()`` holds every matrix as a full-shaped DTensor; ``load_state_dict``
    takes it back, and takes a plain single-process state dict (full tensors)."""
    reference = _reference(0)
    model = _wrapped(0, mesh)
    state = mf.get_state(model)
    sd = model.state_dict()
    for fqn, mp in state.params.items():
        value = sd[fqn]
        assert isinstance(value, DTensor), f"{fqn}: {type(value).__name__} (owner {mp.owner_rank})"
        assert tuple(value.shape) == tuple(mp.shape) and value.numel() > 0, (fqn, value.shape)
        assert tuple(value.placements) == _expected_placements(model), value.placements
        _assert_equal_tensors(value.full_tensor(), reference.state_dict()[fqn], fqn)
    other = _wrapped(1, mesh)
    other.load_state_dict(sd)
    assert_close_dicts(_values(other), reference_values(reference), 0.0, "load of state_dict()")
    assigned = _wrapped(1, mesh)
    assigned.load_state_dict(sd, assign=True)  # owners adopt the gathered matrices
    assert_close_dicts(_values(assigned), reference_values(reference), 0.0, "assign=True load")
    plain = _wrapped(1, mesh)
    plain.load_state_dict(reference.state_dict())
    assert_close_dicts(_values(plain), reference_values(reference), 0.0, "load of a plain dict")
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.0\.attn\.q\.weight"):
        bad = dict(reference.state_dict())
        bad["layers.0.attn.q.weight"] = torch.zeros(3, 16)
        plain.load_state_dict(bad)


def _set_full_model_state_dict(rank: int, world: int, mesh: DeviceMesh) -> None:
    """``set_model_state_dict(full)`` from a single-process dict, then forward/backward."""
    reference = _reference(0)
    model = _wrapped(1, mesh)
    set_model_state_dict(model, reference.state_dict(), options=FULL)
    assert_close_dicts(_values(model), reference_values(reference), 0.0, "loaded parameters")
    tokens = global_batch(3)
    lm_loss(model, local_batch(tokens, rank, world)).backward()
    lm_loss(reference, tokens).backward()
    assert_close_dicts(full_values(model, "grad"), reference_values(reference, "grad"), GRAD_RTOL,
                       "gradients after a full load")
    from_rank0 = _wrapped(1, mesh)
    set_model_state_dict(from_rank0, reference.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_close_dicts(_values(from_rank0), reference_values(reference), 0.0, "broadcast_from_rank0")


# -- optimizer state dicts -------------------------------------------------------------------------
def _dcp_round_trip(rank: int, world: int, mesh: DeviceMesh, root: str, name: str) -> None:
    """dcp.save(get_state_dict) -> dcp.load + set_state_dict restores everything exactly."""
    model, opt = (m := _wrapped(0, mesh)), _optimizer(m, name)
    train_steps(model, opt, range(2), rank, world)
    path = str(Path(root) / name)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    resumed = _wrapped(1, mesh)
    resumed_opt = _optimizer(resumed, name, lr=0.5)  # other values and lr: the load sets both
    msd, osd = get_state_dict(resumed, resumed_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=msd, optim_state_dict=osd)
    assert_close_dicts(_values(resumed), _values(model), 0.0, f"{name}: parameters after load")
    _assert_states_equal(full_optimizer_state(resumed, resumed_opt),
                         full_optimizer_state(model, opt), f"{name}: optimizer state after load")
    assert [g["lr"] for g in resumed_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    if name == "muon":  # the model part is a stock FSDP2 sharded checkpoint
        _stock_fsdp2_loads(mesh, path, _values(model))
    for m, o in ((model, opt), (resumed, resumed_opt)):
        train_steps(m, o, range(2, 4), rank, world)
    assert_close_dicts(_values(resumed), _values(model), 0.0, f"{name}: 2 steps after load")


def _stock_fsdp2_loads(mesh: DeviceMesh, path: str, want: dict[str, torch.Tensor | None]) -> None:
    stock = _reference(2)
    for layer in stock.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(stock, mesh=mesh)
    sd = stock.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path)  # in place: FSDP2's DTensors are its parameters
    got = {fqn: p.full_tensor().cpu() for fqn, p in stock.named_parameters()}
    assert_close_dicts(got, want, 0.0, "stock FSDP2 model loading the model part")


def _full_optimizer_state_dict(rank: int, world: int, mesh: DeviceMesh, name: str) -> None:
    """Full optimizer state equals the owners' state on every rank, and loads back in full."""
    model, opt = (m := _wrapped(0, mesh)), _optimizer(m, name)
    train_steps(model, opt, range(2), rank, world)
    want = full_optimizer_state(model, opt)
    full = get_optimizer_state_dict(model, opt, options=FULL)
    assert set(full["state"]) == {f for f, e in want.items() if e}, set(full["state"])
    for fqn, entry in full["state"].items():
        assert entry.keys() == want[fqn].keys(), (fqn, entry.keys(), want[fqn].keys())
        for key, value in entry.items():
            _assert_equal_tensors(value, want[fqn][key], f"full optimizer state {fqn}[{key!r}]")
    offloaded = get_optimizer_state_dict(model, opt, options=FULL_CPU)
    assert (offloaded == {}) if rank else (offloaded["state"].keys() == full["state"].keys())
    resumed = _wrapped(1, mesh)
    resumed_opt = _optimizer(resumed, name, lr=0.5)
    full_model = get_model_state_dict(model, options=FULL)
    # A copy: torch's load keeps the given `step` tensors, which are `opt`'s own in one process.
    set_state_dict(resumed, resumed_opt, model_state_dict=full_model,
                   optim_state_dict=copy.deepcopy(full), options=FULL)
    _assert_states_equal(full_optimizer_state(resumed, resumed_opt), want,
                         f"{name}: optimizer state after a full load")
    for m, o in ((model, opt), (resumed, resumed_opt)):
        train_steps(m, o, range(2, 4), rank, world)
    assert_close_dicts(_values(resumed), _values(model), 0.0, f"{name}: 2 steps after full load")


def _state_dtypes_kept(rank: int, world: int, mesh: DeviceMesh) -> None:
    """MatrixOptimizer state keeps its own dtypes through state_dict()/load_state_dict()
    (torch's Optimizer.load_state_dict would cast floating state to the parameter's dtype)."""
    model, opt = (m := _wrapped(0, mesh)), _optimizer(m, "shampoo")
    train_steps(model, opt, range(1), rank, world)
    for p in opt.param_groups[0]["params"]:
        if p in opt.state:
            opt.state[p]["L"] = opt.state[p]["L"].double()
    other, other_opt = (m := _wrapped(0, mesh)), _optimizer(m, "shampoo")
    other.load_state_dict(model.state_dict())
    other_opt.load_state_dict(opt.state_dict())
    _assert_states_equal(full_optimizer_state(other, other_opt), full_optimizer_state(model, opt),
                         "state after load_state_dict")
    # State the view cannot describe raises on every rank, not only on the owner (no hang).
    mp = mf.get_state(model).params["layers.1.up.weight"]
    if mp.is_owner:
        opt.state[mp.sharded]["nested"] = {"x": torch.zeros(2)}
    with pytest.raises(NotImplementedError, match=r"layers\.1\.up\.weight.*'nested'"):
        opt.state_dict()


# -- worlds ----------------------------------------------------------------------------------------
def _world(rank: int, world: int, root: str) -> None:
    subtests = {}
    for kind in MESHES[world]:
        mesh = _mesh(kind, world)
        at = functools.partial
        subtests[f"{kind}_full_model"] = at(_full_model_state_dict, rank, world, mesh)
        subtests[f"{kind}_module_state_dict"] = at(_module_state_dict, rank, world, mesh)
        subtests[f"{kind}_set_full_model"] = at(_set_full_model_state_dict, rank, world, mesh)
        for name in ROUND_TRIP_OPTIMIZERS:
            subtests[f"{kind}_dcp_round_trip_{name}"] = at(
                _dcp_round_trip, rank, world, mesh, str(Path(root) / kind), name)
        for name in ("muon", "torch_sgd") if kind == "flat" else ("muon",):
            subtests[f"{kind}_full_optimizer_{name}"] = at(
                _full_optimizer_state_dict, rank, world, mesh, name)
        if kind == "flat":  # the dtype rule does not depend on the mesh
            subtests[f"{kind}_state_dtypes_kept"] = at(_state_dtypes_kept, rank, world, mesh)
    run_subtests(rank, subtests)
    dist.barrier()


@pytest.mark.parametrize("world", sorted(MESHES))
def test_torch_state_dict_api(world: int, tmp_path: Path) -> None:
    run_world(world, _world, str(tmp_path))
