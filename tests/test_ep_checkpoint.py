"""Expert-parallel checkpoints: saved at one (efsdp, ep) shape, loaded at another or without EP.

``matrixfsdp.checkpoint.save`` at efsdp 2 x ep 2 after two OKLS steps, then ``load`` at
efsdp 2 x ep 2, efsdp 1 x ep 4, and on 3 dense ranks without EP (the stacks then become expert
slices of FSDP2): every parameter and every optimizer state tensor (per expert) equals what was
saved, bit for bit, and training continues exactly as it would have.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import matrixfsdp as mf

from .checks import assert_close_dicts, full_optimizer_state, full_values
from .dist_utils import run_world
from .ep_models import TinyEPMoE, distribute_experts
from .models import global_batch, lm_loss, local_batch
from .test_ep import ep_meshes


def _model(layout: str | None, world: int) -> nn.Module:
    torch.manual_seed(1)
    model = TinyEPMoE()
    if layout is None:
        return mf.fully_shard_matrix(model)
    dense, experts, ep = ep_meshes(layout)
    return mf.fully_shard_matrix(distribute_experts(model, ep), dense, expert_mesh=experts)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> None:
    for step in steps:
        lm_loss(model, local_batch(global_batch(step), rank, world)).backward()
        opt.step()
        opt.zero_grad()


def _phase(rank: int, world: int, root: str, layout: str | None, phase: str) -> None:
    model = _model(layout, world)
    opt = mf.MatrixOptimizer(model, "okls", lr=0.01, tail_lr=1e-2)
    if phase == "save":
        _train(model, opt, range(2), rank, world)
        mf.checkpoint.save(f"{root}/ckpt", model, opt, step=2)
        saved = {"params": full_values(model), "state": full_optimizer_state(model, opt)}
        _train(model, opt, range(2, 3), rank, world)
        saved["after"] = full_values(model)
        if rank == 0:
            torch.save(saved, f"{root}/saved.pt")
        return
    assert mf.checkpoint.load(f"{root}/ckpt", model, opt)["step"] == 2
    saved = torch.load(f"{root}/saved.pt", weights_only=True)
    assert_close_dicts(full_values(model), saved["params"], 0.0, "loaded params")
    state = full_optimizer_state(model, opt)
    for fqn in ("layers.0.experts.w_in", "layers.1.experts.w_out", "layers.0.gate.weight"):
        assert saved["state"][fqn], fqn
        for key, value in saved["state"][fqn].items():
            assert torch.equal(state[fqn][key], value), (fqn, key)
    _train(model, opt, range(2, 3), rank, world)
    assert_close_dicts(full_values(model), saved["after"], 1e-5, "a step after loading")


@pytest.mark.parametrize("load_layout,load_world", [
    ("efsdp2_ep2", 4), ("efsdp1_ep4", 4), (None, 3),
])
def test_ep_checkpoint_reshards(tmp_path, load_layout: str | None, load_world: int) -> None:
    run_world(4, _phase, str(tmp_path), "efsdp2_ep2", "save")
    run_world(load_world, _phase, str(tmp_path), load_layout, "load")


def test_dense_checkpoint_loads_under_ep(tmp_path) -> None:
    """A checkpoint written without EP (2 dense ranks) loads at efsdp 1 x ep 4."""
    run_world(2, _phase, str(tmp_path), None, "save")
    run_world(4, _phase, str(tmp_path), "efsdp1_ep4", "load")


def _torch_api(rank: int, world: int, root: str, layout: str) -> None:
    """torch's state-dict API: full and sharded (DCP) round trips of model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    model = _model(layout, world)
    opt = mf.MatrixOptimizer(model, "okls", lr=0.01, tail_lr=1e-2)
    _train(model, opt, range(2), rank, world)
    want = {"params": full_values(model), "state": full_optimizer_state(model, opt)}
    full = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=full)
    assert_close_dicts({k: v for k, v in model_sd.items()}, want["params"], 0.0, "full sd")
    sharded_model, sharded_optim = get_state_dict(model, opt)
    dcp.save({"model": sharded_model, "optim": sharded_optim}, checkpoint_id=f"{root}/dcp")
    for source in ("full", "dcp"):
        fresh = _model(layout, world)
        fresh_opt = mf.MatrixOptimizer(fresh, "okls", lr=0.01, tail_lr=1e-2)
        if source == "full":
            set_state_dict(fresh, fresh_opt, model_state_dict=model_sd,
                           optim_state_dict=optim_sd, options=full)
        else:
            sd_model, sd_optim = get_state_dict(fresh, fresh_opt)
            loaded = {"model": sd_model, "optim": sd_optim}
            dcp.load(loaded, checkpoint_id=f"{root}/dcp")
            set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])
        assert_close_dicts(full_values(fresh), want["params"], 0.0, f"{source}: params")
        state = full_optimizer_state(fresh, fresh_opt)
        for fqn in ("layers.0.experts.w_in", "layers.1.experts.w_out", "layers.1.gate.weight"):
            for key, value in want["state"][fqn].items():
                assert torch.equal(state[fqn][key].cpu(), value), (source, fqn, key)


@pytest.mark.parametrize("layout", ["efsdp2_ep2", "hsdp2_efsdp1_ep2"])
def test_ep_torch_state_dict_api(tmp_path, layout: str) -> None:
    run_world(4, _torch_api, str(tmp_path), layout)


def _load_full(rank: int, world: int, layout: str) -> None:
    """load_full_state_dict: each ep rank's owner reads its own experts of the whole stacks."""
    torch.manual_seed(7)
    source = TinyEPMoE()
    model = _model(layout, world)
    mf.checkpoint.load_full_state_dict(model, source.state_dict())
    assert_close_dicts(full_values(model), {k: v.detach() for k, v in source.state_dict().items()},
                       0.0, "loaded full state dict")


@pytest.mark.parametrize("layout", ["efsdp2_ep2", "efsdp1_ep4"])
def test_ep_load_full_state_dict(layout: str) -> None:
    run_world(4, _load_full, layout)
