"""torch's ``flatten_optimizer_state_dict=True`` on a ``MatrixOptimizer`` (see [Note: flat
optimizer state]): at world 2 on gloo, ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
with the flag round-trip the state exactly (in memory and through DCP) and training continues bit
for bit, also after torch's zero-gradient, lr=0 init step ran on a loaded model; where the names of a non-owned matrix's state cannot be known (a ``torch.optim`` class
steps the matrices), the load raises the same ``ValueError`` on every rank instead of hanging.
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
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp as mf
from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.optim.layouts import MatrixLayout
from matrixfsdp.optim.owner_step import init_owned_state, owned_blocks, step_owned

from .checks import FREE_RUNNING_KWARGS, assert_close_dicts, full_optimizer_state, full_values
from .dist_utils import device_type, run_subtests, run_world
from .models import TinyTransformer, train_steps

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
SPLIT = {"*.up.weight": 2}  # per-block state names ("momentum_buffer.0", ...)


def _build(seed: int, name: str, lr: float = 0.02, **kwargs: object
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyTransformer()
    for layer in model.layers:
        layer.use_unused = True  # every parameter has state after a step
    model = mf.fully_shard_matrix(model, init_device_mesh(device_type(), (dist.get_world_size(),)))
    extra = FREE_RUNNING_KWARGS.get(name, {}) if isinstance(name, str) else {}
    opt = mf.MatrixOptimizer(model, name, lr=lr, weight_decay=0.1, tail_lr=1e-2, **extra,
                             **kwargs)
    return model, opt


def _values(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {k: None if v is None else v.clone() for k, v in full_values(model).items()}


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: FQNs differ: {set(got) ^ set(want)}"
    for fqn, entry in want.items():
        assert got[fqn].keys() == entry.keys(), f"{what} {fqn}: {got[fqn].keys()} != {entry.keys()}"
        for key, value in entry.items():
            other = got[fqn][key]
            assert other.dtype == value.dtype and torch.equal(other, value), \
                f"{what} {fqn}[{key!r}] differs"


def _resumes_exactly(rank: int, world: int, model: nn.Module, opt: torch.optim.Optimizer,
                     resumed: nn.Module, resumed_opt: torch.optim.Optimizer, what: str) -> None:
    assert_close_dicts(_values(resumed), _values(model), 0.0, f"{what}: parameters")
    _assert_same_state(full_optimizer_state(resumed, resumed_opt), full_optimizer_state(model, opt),
                       f"{what}: optimizer state")
    assert [g["lr"] for g in resumed_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    for m, o in ((model, opt), (resumed, resumed_opt)):
        train_steps(m, o, range(2, 4), rank, world)
    assert_close_dicts(_values(resumed), _values(model), 0.0, f"{what}: 2 steps after the load")


def _in_memory(rank: int, world: int, name: str, split: dict | None) -> None:
    """get(flat) -> set(flat) into a fresh optimizer that never called state_dict()."""
    model, opt = _build(0, name, split=split)
    train_steps(model, opt, range(2), rank, world)
    osd = get_optimizer_state_dict(model, opt, options=FLAT)
    assert all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in osd)
    resumed, resumed_opt = _build(1, name, lr=0.5, split=split)
    # The model first: torch's zero-gradient, lr=0 init step (in set_optimizer_state_dict) must
    # then leave it as loaded (it made Shampoo's parameters NaN). A copy of the optimizer's
    # dict: in one process it holds ``opt``'s own tail state and ``step`` tensors.
    set_model_state_dict(resumed, get_model_state_dict(model))
    set_optimizer_state_dict(resumed, resumed_opt, copy.deepcopy(osd), options=FLAT)
    _resumes_exactly(rank, world, model, opt, resumed, resumed_opt, f"{name} flat in memory")


def _through_dcp(rank: int, world: int, root: str) -> None:
    """dcp.save(get(flat)) -> dcp.load into the template of a fresh optimizer -> set(flat)."""
    model, opt = _build(0, "muon")
    train_steps(model, opt, range(2), rank, world)
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt, options=FLAT)}, checkpoint_id=root)
    resumed, resumed_opt = _build(1, "muon", lr=0.5)
    sd = {"model": get_model_state_dict(resumed),
          "optim": get_optimizer_state_dict(resumed, resumed_opt, options=FLAT)}
    dcp.load(sd, checkpoint_id=root)
    set_model_state_dict(resumed, sd["model"])
    set_optimizer_state_dict(resumed, resumed_opt, sd["optim"], options=FLAT)
    _resumes_exactly(rank, world, model, opt, resumed, resumed_opt, "muon flat through DCP")


def _torch_class_refused(rank: int, world: int) -> None:
    """A torch.optim class keeps names the non-owner cannot know: the same error everywhere."""
    model, opt = _build(0, torch.optim.SGD, momentum=0.9)
    train_steps(model, opt, range(1), rank, world)
    osd = get_optimizer_state_dict(model, opt, options=FLAT)
    resumed, resumed_opt = _build(1, torch.optim.SGD, momentum=0.9)
    with pytest.raises(ValueError, match=r"matrix 'layers\.0\.attn\.q\.weight' \(shape \(16, 16\)"
                       r".*flatten_optimizer_state_dict=True"):
        set_optimizer_state_dict(resumed, resumed_opt, osd, options=FLAT)


def _world(rank: int, world: int, root: str) -> None:
    at = functools.partial
    run_subtests(rank, {
        "muon_in_memory": at(_in_memory, rank, world, "muon", None),
        "shampoo_in_memory": at(_in_memory, rank, world, "shampoo", None),
        "muon_split_in_memory": at(_in_memory, rank, world, "muon", SPLIT),
        "muon_through_dcp": at(_through_dcp, rank, world, str(Path(root) / "dcp")),
        "torch_class_refused": at(_torch_class_refused, rank, world),
    })
    dist.barrier()


def test_flat_optimizer_state_dict(tmp_path: Path) -> None:
    run_world(2, _world, str(tmp_path), timeout=300.0)


@pytest.mark.parametrize("root_dtype", ["float32", "float64"])
def test_zero_gradient_step_keeps_shampoo_parameter_and_state(root_dtype: str) -> None:
    """torch's init step (zero gradients, lr=0) on Shampoo changes no parameter and no state:
    the relative inverse root of an all-zero factor is the identity (it was inf in fp64, and the
    update NaN)."""
    spec = get_matrix_optimizer("shampoo")
    config = spec.make_config({"root_dtype": root_dtype})
    torch.manual_seed(0)
    param = torch.randn(8, 12)
    before, state = param.clone(), init_owned_state(param, spec, config)
    initial = {k: v.clone() for k, v in state.items()}
    state["step"] += 1
    grad = torch.zeros_like(param)
    step_owned(spec, owned_blocks(param, state, MatrixLayout(), grad),
               {"lr": 0.0, "weight_decay": 0.1, "initial_lr": 0.02, "config": config})
    assert torch.equal(param, before)
    for key, value in initial.items():
        if key != "step":
            assert torch.equal(state[key], value), key
