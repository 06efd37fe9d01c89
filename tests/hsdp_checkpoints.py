"""HSDP test helpers: named meshes, replica agreement, and the checkpoint subtests.

``tests/test_hsdp.py`` runs these in its world of 4: a run saves (``save_and_record``) on one
mesh shape and later worlds load it into another (``load_and_compare``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import matrixfsdp as mf
from matrixfsdp.checkpoint.storage import read_metadata

from .checks import assert_close_dicts
from .dist_utils import device_type
from .models import TinyTransformer, train_steps
from .test_checkpoint import _assert_state_equal, _state, _values

__all__ = [
    "CKPT_STEPS",
    "RESUME_STEPS",
    "assert_replicas_equal",
    "hsdp_mesh",
    "legacy_layout_loads",
    "load_and_compare",
    "save_and_record",
]

RESUME_RTOL = 1e-5  # a resumed run against the saving run: another reduction order


def hsdp_mesh(shape: tuple[int, int], named: bool = True):
    names = ("replicate", "shard") if named else None
    return init_device_mesh(device_type(), shape, mesh_dim_names=names)


def assert_replicas_equal(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """Every parameter (and optimizer-state tensor) is bitwise equal in every replica."""
    state = mf.get_state(model)
    group = state.dp_mesh.replicate_group
    replicas = state.mesh_shape[0]
    if group is None or replicas == 1:
        return
    for fqn, p in model.named_parameters():
        tensors = {"param": p.detach()}
        if opt is not None:
            tensors.update(opt.state.get(p, {}))
        for key, t in sorted(tensors.items()):
            local = (t.to_local() if isinstance(t, DTensor) else t).detach().reshape(-1).clone()
            gathered = [torch.empty_like(local) for _ in range(replicas)]
            dist.all_gather(gathered, local, group=group)
            for r, other in enumerate(gathered[1:], start=1):
                assert torch.equal(other, gathered[0]), f"{fqn}[{key}] differs in replica {r}"


# -- checkpoints -----------------------------------------------------------------------------------
CKPT_STEPS, RESUME_STEPS = 2, 3


def _ckpt_mesh(shape: tuple[int, int] | None, world: int):
    return init_device_mesh("cpu", (world,)) if shape is None else hsdp_mesh(shape)


def _ckpt_model(mesh, seed: int = 0, lr: float = 0.02) -> tuple[nn.Module, mf.MatrixOptimizer]:
    torch.manual_seed(seed)
    model = mf.fully_shard_matrix(TinyTransformer(), mesh)
    opt = mf.MatrixOptimizer(model, optimizer="muon", lr=lr, weight_decay=0.1, tail_lr=1e-2,
                             tail_weight_decay=0.1, ns_dtype="float32")
    return model, opt



def save_and_record(rank: int, world: int, root: str, label: str,
               shape: tuple[int, int] | None) -> None:
    """Train, save, record the values and state, train on (the resumed runs compare to it)."""
    model, opt = _ckpt_model(_ckpt_mesh(shape, world))
    train_steps(model, opt, range(CKPT_STEPS), rank, world)
    path = Path(root) / label
    mf.checkpoint.save(path, model, opt, step=CKPT_STEPS)
    values, state = _values(model), _state(model, opt)
    train_steps(model, opt, range(CKPT_STEPS, CKPT_STEPS + RESUME_STEPS), rank, world)
    final = _values(model)
    if rank == 0:
        torch.save({"values": values, "state": state, "final": final}, Path(root) / f"{label}.pt")
    layout = mf.checkpoint.read_layout(path)
    saved_shape = shape or (1, world)
    assert layout.mesh_shape == saved_shape and layout.plan.mesh_shape == saved_shape
    assert layout.world_size == saved_shape[1]
    # Written once: each matrix (and its state) by one rank of replica 0 (ranks 0..S-1).
    metadata = read_metadata(path)
    writers: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        writers.setdefault(index.fqn, set()).add(info.relative_path)
    replica0 = {f"__{r}_0.distcp" for r in range(saved_shape[1])}
    for p in layout.plan.matrices:
        for key in [f"model.{p.fqn}", *(k for k in writers if k.startswith(f"optim.state.{p.fqn}."))]:
            assert len(writers[key]) == 1 and writers[key] <= replica0, (key, writers[key])
            assert len(metadata.state_dict_metadata[key].chunks) == 1, key


def load_and_compare(rank: int, world: int, root: str, label: str,
               shape: tuple[int, int] | None) -> None:
    """Load into another mesh shape: values and optimizer state exact; 3 more steps as the
    saving run's (1e-5: another reduction order); replicas bitwise equal."""
    model, opt = _ckpt_model(_ckpt_mesh(shape, world), seed=1, lr=0.5)
    assert mf.checkpoint.load(Path(root) / label, model, opt)["step"] == CKPT_STEPS
    ref = torch.load(Path(root) / f"{label}.pt", weights_only=True)
    assert_close_dicts(_values(model), ref["values"], 0.0, f"{label} values")
    _assert_state_equal(_state(model, opt), ref["state"], f"{label} state")
    assert_replicas_equal(model, opt)
    train_steps(model, opt, range(CKPT_STEPS, CKPT_STEPS + RESUME_STEPS), rank, world)
    assert_close_dicts(_values(model), ref["final"], RESUME_RTOL, f"{label} -> {shape or world}")
    assert_replicas_equal(model, opt)


def legacy_layout_loads(rank: int, world: int, root: str) -> None:
    """A layout written before the mesh shape existed (no mesh_shape anywhere) still loads."""
    legacy = Path(root) / "legacy"
    if rank == 0:
        shutil.copytree(Path(root) / "flat4", legacy)
        raw = json.loads((legacy / "matrixfsdp_layout.json").read_text())
        raw.pop("mesh_shape")
        raw["plan"].pop("mesh_shape")
        raw["plan"].pop("expert_grid", None)  # the fields after the first 7 are newer too
        raw["plan"]["params"] = [r[:7] for r in raw["plan"]["params"]]
        old_form = raw["plan"]
        digest = json.dumps(old_form, sort_keys=True, separators=(",", ":")).encode()
        raw["plan_hash"] = hashlib.sha256(digest).hexdigest()
        (legacy / "matrixfsdp_layout.json").write_text(json.dumps(raw))
    dist.barrier()
    layout = mf.checkpoint.read_layout(legacy)
    assert layout.mesh_shape is None and layout.saved_mesh_shape == (1, 4)
    model, opt = _ckpt_model(hsdp_mesh((2, 2)), seed=1)
    mf.checkpoint.load(legacy, model, opt)
    ref = torch.load(Path(root) / "flat4.pt", weights_only=True)
    assert_close_dicts(_values(model), ref["values"], 0.0, "legacy layout")
