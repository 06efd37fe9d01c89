"""Checkpoints of TP models (issue 22): save at one (dp, tp) shape, load at another.

A ``TinyTransformer(dim=16, hidden=40, layers=2)`` whose MLPs are ``parallelize_module``'d on
``mesh["tp"]`` (``up`` Colwise, ``down`` Rowwise) and wrapped by ``fully_shard_matrix`` on the dp
mesh, or the plain model ("tp 0"). One gloo world of 4 trains 2 steps at each saving shape and
saves (``MatrixOptimizer`` Muon, and torch's SGD, whose state is per TP shard); one world per
loading world size (4 and 2) loads every checkpoint at other shapes: tp 2 -> 1 (plain, and a
size-1 tp mesh), 2 -> 4, plain -> tp 2, into and out of HSDP. Checked after the save and after
each load, bit for bit: the whole model and every optimizer state tensor each rank holds equal
the checkpoint's whole tensors (read back in one process), and TP matrices' Muon state lives on
the step owner only; then 2 more steps equal an uninterrupted single-process run (<= 1e-5). Also:
the layout records the TP split, errors name what cannot be resharded, a failed save keeps the
previous checkpoint, ``load_full_state_dict`` and ``export_full`` with TP.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch._dynamo  # FSDP2 imports it at its first wrap (~7 s a rank on 2 cores): once here,
import torch.distributed as dist  # in the process the ranks are forked from
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp as mf
from matrixfsdp import checkpoint as ck
from matrixfsdp.checkpoint.layout import TpEntry
from matrixfsdp.checkpoint.storage import SafeFileSystemReader, read_metadata
from matrixfsdp.optim.tp_step import tp_step_owners

from .checks import RegisteredStepReference, assert_close_dicts, reference_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch, train_steps

FULL = StateDictOptions(full_state_dict=True)
MUON = {"lr": 0.02, "weight_decay": 0.01, "tail_lr": 1e-2, "tail_weight_decay": 0.1}
SGD = {"lr": 0.1, "momentum": 0.9}
SAVE_STEPS, RESUME_STEPS = 2, 2
RTOL = 1e-5


class Shape(NamedTuple):
    """``replicate x dp x tp`` ranks; ``tp=0``: the plain model (no ``parallelize_module``)."""

    dp: int
    tp: int
    replicate: int = 1

    @property
    def batches(self) -> int:
        return self.replicate * self.dp

    @property
    def name(self) -> str:
        dims = f"{self.dp}x{max(self.tp, 1)}" + (" plain" if self.tp == 0 else "")
        return f"hsdp {self.replicate}x{dims}" if self.replicate > 1 else dims


# name -> (saving shape, optimizer); every one at world 4
SAVES = {
    "muon 2x2": (Shape(2, 2), "muon"),
    "muon 4x1 plain": (Shape(4, 0), "muon"),
    "muon hsdp 2x1x2": (Shape(1, 2, replicate=2), "muon"),
    "sgd 2x2": (Shape(2, 2), "sgd"),
    "sgd 4x1 plain": (Shape(4, 0), "sgd"),
}
# world -> [(checkpoint, loading shape)]
LOADS = {
    4: [("muon 2x2", Shape(4, 0)), ("muon 2x2", Shape(4, 1)), ("muon 2x2", Shape(1, 4)),
        ("muon 4x1 plain", Shape(2, 2)), ("muon 2x2", Shape(1, 2, replicate=2)),
        ("sgd 2x2", Shape(1, 4))],
    2: [("muon 2x2", Shape(1, 2)), ("muon hsdp 2x1x2", Shape(1, 2)),
        ("sgd 4x1 plain", Shape(1, 2)), ("sgd 2x2", Shape(2, 0))],
}


# -- models ----------------------------------------------------------------------------------------
def _meshes(shape: Shape) -> tuple[DeviceMesh, DeviceMesh | None]:
    if shape.tp == 0:
        return init_device_mesh("cpu", (shape.dp,), mesh_dim_names=("dp",)), None
    if shape.replicate > 1:
        mesh = init_device_mesh("cpu", (shape.replicate, shape.dp, shape.tp),
                                mesh_dim_names=("replicate", "shard", "tp"))
        return mesh["replicate", "shard"], mesh["tp"]
    mesh = init_device_mesh("cpu", (shape.dp, shape.tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def _build(shape: Shape, optimizer: str, seed: int, hidden: int = 40
           ) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The wrapped model at ``shape`` (values from ``seed``), its optimizer, its batch index."""
    dp, tp = _meshes(shape)
    torch.manual_seed(seed)
    model = TinyTransformer(dim=16, hidden=hidden, layers=2)
    if tp is not None:
        for block in model.layers:
            parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    mf.fully_shard_matrix(model, dp)
    if optimizer == "muon":
        opt: torch.optim.Optimizer = mf.MatrixOptimizer(model, "muon", **MUON, ns_dtype="float32")
    else:
        opt = torch.optim.SGD(model.parameters(), **SGD)
    return model, opt, dp.mesh.flatten().tolist().index(dist.get_rank())



class _Reference:
    """One process, whole matrices: the registered Muon on the matrices and AdamW on the rest
    (``MatrixOptimizer``'s math), or torch's SGD on everything."""

    def __init__(self, optimizer: str, matrix_fqns: set[str]) -> None:
        torch.manual_seed(0)
        self.model = TinyTransformer(dim=16, hidden=40, layers=2)
        named = dict(self.model.named_parameters())
        matrices = {f: p for f, p in named.items() if f in matrix_fqns and optimizer == "muon"}
        rest = [p for f, p in named.items() if f not in matrices]
        tail = (torch.optim.AdamW(rest, lr=MUON["tail_lr"], weight_decay=MUON["tail_weight_decay"])
                if optimizer == "muon" else torch.optim.SGD(rest, **SGD))
        self.optimizer = RegisteredStepReference(
            matrices, tail, name="muon", lr=MUON["lr"], weight_decay=MUON["weight_decay"],
            config={"ns_dtype": "float32"})

    def train(self, steps: range, batches: int) -> None:
        for step in steps:
            tokens = global_batch(step)
            sum(lm_loss(self.model, local_batch(tokens, i, batches))
                for i in range(batches)).div(batches).backward()
            self.optimizer.step()


# -- checks ----------------------------------------------------------------------------------------
def _disk(path: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint, whole, read in this process alone."""
    metadata = read_metadata(path)
    targets = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for k, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata) and not k.startswith("rng.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no_dist means a single process
        dcp.load(targets, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
    return targets


def _full_model(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=FULL).items()}


def _assert_matches_disk(model: nn.Module, opt: torch.optim.Optimizer,
                         disk: dict[str, torch.Tensor], what: str) -> None:
    """Bit for bit: the whole model, and each optimizer state tensor this rank holds (a torch
    optimizer's TP shard: its slice), equal the checkpoint's; every saved one is held."""
    for key, value in _full_model(model).items():
        assert torch.equal(value, disk["model." + key]), f"{what}: model {key} differs"
    runtime = mf.get_state(model)
    per_shard = not isinstance(opt, mf.MatrixOptimizer)
    held = set()
    for fqn, p in model.named_parameters():  # the same order on every rank: full_tensor() below
        mp = runtime.params.get(fqn)
        for name, value in opt.state.get(p, {}).items():
            key = f"optim.state.{fqn}.{name}"
            want = disk[key]
            if isinstance(value, DTensor):
                value = value.full_tensor()
            elif per_shard and mp is not None and mp.tp is not None and value.ndim:
                want = mp.tp.slice_of(want, mp.tp.tp_rank)
            assert torch.equal(value.cpu(), want), f"{what}: {key} differs"
            held.add(key)
    everyone: list[set[str]] = [set() for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, held)  # test-only pickling
    saved = {k for k in disk if k.startswith("optim.state.")}
    held_anywhere = set().union(*everyone)
    assert held_anywhere == saved, f"{what}: state not held: {saved - held_anywhere}"


def _check_holders(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A matrix's state on its owner only; a TP matrix's Muon state on its step owner only."""
    runtime = mf.get_state(model)
    row = [mp for mp in runtime.params.values() if mp.tp is not None and mp.is_owner]
    owners = dict(zip([mp.fqn for mp in row], tp_step_owners([(mp.fqn, mp.tp) for mp in row],
                                                             "muon"), strict=True))
    for fqn, mp in runtime.params.items():
        if "unused" in fqn:
            continue
        holds = mp.is_owner
        if mp.tp is not None and isinstance(opt, mf.MatrixOptimizer):
            assert opt.tp_step_owner(mp.sharded) == owners.get(fqn, -1), fqn
            holds = holds and owners[fqn] == mp.tp.tp_rank
        assert (mp.sharded in opt.state) == holds, f"{fqn}: state held={not holds}, want {holds}"
        if holds and isinstance(opt, mf.MatrixOptimizer) and mp.tp is not None:
            assert opt.state[mp.sharded]["momentum_buffer"].shape == mp.tp.global_shape, fqn


def _check_layout(path: Path, shape: Shape, optimizer: str) -> None:
    """The layout records the TP split; a TP matrix is its TP shards as chunks of the global
    matrix; Muon's state of it is one whole chunk, SGD's per-shard state tp chunks."""
    layout = ck.read_layout(path)
    text = (path / "matrixfsdp_layout.json").read_text()
    entries = layout.entries()
    up, down = entries["layers.0.up.weight"], entries["layers.1.down.weight"]
    assert (up.shape, down.shape) == ((40, 16), (16, 40))
    assert layout.world_size == shape.dp and layout.saved_mesh_shape == (shape.replicate, shape.dp)
    if shape.tp == 0:
        assert layout.tp_size is None and layout.format_version == 1 and '"tp' not in text
        return
    assert layout.tp_size == shape.tp and layout.format_version == 2
    size = 40 // shape.tp
    assert up.tp == TpEntry(shard_dim=0, tp_size=shape.tp, local_sizes=(size,) * shape.tp)
    assert down.tp == TpEntry(shard_dim=1, tp_size=shape.tp, local_sizes=(size,) * shape.tp)
    assert entries["layers.0.attn.q.weight"].tp is None and entries["norm.weight"].tp is None
    md = read_metadata(path).state_dict_metadata
    assert len(md["model.layers.0.up.weight"].chunks) == shape.tp
    state = md["optim.state.layers.0.up.weight.momentum_buffer"]
    assert tuple(state.size) == (40, 16)
    assert len(state.chunks) == (1 if optimizer == "muon" else shape.tp)


# -- saving ----------------------------------------------------------------------------------------
def _train_and_save(rank: int, root: str, name: str) -> None:
    shape, optimizer = SAVES[name]
    model, opt, index = _build(shape, optimizer, seed=0)
    train_steps(model, opt, range(SAVE_STEPS), index, shape.batches)
    path = Path(root) / name
    assert ck.save(path, model, opt, step=SAVE_STEPS, extra={"shape": shape.name}) is None
    _check_holders(model, opt)
    _assert_matches_disk(model, opt, _disk(path), f"saved {name}")
    if rank == 0:
        _check_layout(path, shape, optimizer)
    if name == "muon 2x2":  # the same bytes through async_save's staging copy
        ck.save(Path(root) / "async", model, opt, step=SAVE_STEPS, async_save=True).wait()
        written, staged = _disk(path), _disk(Path(root) / "async")
        assert staged.keys() == written.keys()
        assert all(torch.equal(v, written[k]) for k, v in staged.items()), "async save differs"
    if name == "sgd 2x2":
        _failed_save_keeps_previous(model, opt, path)
    if name == "sgd 4x1 plain":
        _odd_state(model, opt)
        ck.save(Path(root) / "sgd 4x1 plain odd", model, opt, step=SAVE_STEPS)


def _odd_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A state tensor a TP shard cannot take (neither its shape nor 0-d), on the owner."""
    mp = mf.get_state(model).params["layers.0.up.weight"]
    if mp.is_owner:
        opt.state[mp.sharded]["odd"] = torch.zeros(3)


def _failed_save_keeps_previous(model: nn.Module, opt: torch.optim.Optimizer,
                                path: Path) -> None:
    before = sorted(p.name for p in path.iterdir())
    _odd_state(model, opt)
    owner = mf.get_state(model).params["layers.0.up.weight"].is_owner
    match = (r"TP matrix 'layers\.0\.up\.weight' \(global shape \(40, 16\), TP shard \(20, 16\).*"
             r"shape \[3\].*MatrixOptimizer" if owner else "failed on rank")
    with pytest.raises(ck.CheckpointError, match=match):
        ck.save(path, model, opt, step=SAVE_STEPS + 1)
    mp = mf.get_state(model).params["layers.0.up.weight"]
    if mp.is_owner:
        del opt.state[mp.sharded]["odd"]
    assert ck.is_complete(path) and ck.read_layout(path).step == SAVE_STEPS
    assert sorted(p.name for p in path.iterdir()) == before


def _save_world(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    run_subtests(rank, {name: functools.partial(_train_and_save, rank, root, name)
                        for name in SAVES})


# -- loading ---------------------------------------------------------------------------------------
def _resume(root: str, name: str, shape: Shape) -> None:
    """Load ``name`` at ``shape``: bit-equal to the checkpoint, then 2 steps as one process."""
    saved, optimizer = SAVES[name]
    model, opt, index = _build(shape, optimizer, seed=1)
    path = Path(root) / name
    assert ck.load(path, model, opt) == {"step": SAVE_STEPS, "extra": {"shape": saved.name}}
    _check_holders(model, opt)
    what = f"{name} loaded at {shape.name}"
    _assert_matches_disk(model, opt, _disk(path), what)
    train_steps(model, opt, range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS), index, shape.batches)
    ref = _Reference(optimizer, set(mf.get_state(model).params))
    ref.train(range(SAVE_STEPS), saved.batches)
    ref.train(range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS), shape.batches)
    assert_close_dicts(_full_model(model), reference_values(ref.model), RTOL,
                       f"{what}, {RESUME_STEPS} more steps")


def _errors(root: str) -> None:
    """What cannot be resharded raises a ValueError naming the FQN, the shapes and the fix."""
    model, opt, _ = _build(Shape(2, 2), "muon", seed=1, hidden=48)
    mismatch = (r"'layers\.0\.up\.weight': checkpoint shape \[40, 16\] \(TP Shard\(0\) over 2: "
                r"\[20, 20\]\), model shape \[48, 16\] \(TP Shard\(0\) over 2: \[24, 24\]\).*"
                r"global shape must match")
    with pytest.raises(ck.CheckpointMismatchError, match=mismatch):
        ck.load(Path(root) / "muon 2x2", model, opt)
    model, opt, _ = _build(Shape(2, 2), "sgd", seed=1)
    owner = mf.get_state(model).params["layers.0.up.weight"].is_owner
    match = (r"optimizer state 'odd' of TP matrix 'layers\.0\.up\.weight'.*shape \[3\] in the "
             r"checkpoint.*weights_only=True" if owner else "failed on rank")
    with pytest.raises(ck.CheckpointError, match=match):
        ck.load(Path(root) / "sgd 4x1 plain odd", model, opt)
    ck.load(Path(root) / "sgd 4x1 plain odd", model, opt, weights_only=True)


def _full_weights(root: str) -> None:
    """``load_full_state_dict`` into a TP model: a DCP checkpoint saved at tp 2 read at tp 4,
    and a plain full state dict; each tp rank reads its TP shards."""
    model, _, _ = _build(Shape(1, 4), "muon", seed=1)
    path = Path(root) / "muon 2x2"
    disk = _disk(path)
    ck.load_full_state_dict(model, path)
    assert_close_dicts(_full_model(model), {k[6:]: v for k, v in disk.items()
                                            if k.startswith("model.")}, 0.0, "from DCP")
    shifted = {k[6:]: v + 1.0 for k, v in disk.items() if k.startswith("model.")}
    ck.load_full_state_dict(model, shifted)
    assert_close_dicts(_full_model(model), shifted, 0.0, "from a full state dict")


def _load_world(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    subtests: dict[str, Callable[[], None]] = {
        f"{name} -> {shape.name}": functools.partial(_resume, root, name, shape)
        for name, shape in LOADS[world]
    }
    if world == 4:
        subtests["errors"] = functools.partial(_errors, root)
        subtests["load_full_state_dict"] = functools.partial(_full_weights, root)
    run_subtests(rank, subtests)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tp_checkpoints")
    run_world(4, _save_world, str(root))
    return str(root)


@pytest.mark.parametrize("world", sorted(LOADS, reverse=True))
def test_tp_checkpoint_reshards(saved: str, world: int) -> None:
    run_world(world, _load_world, saved)


def test_tp_export_full_is_the_plain_model(saved: str, tmp_path: Path) -> None:
    """``export_full`` of a tp 2 checkpoint loads into the plain model as it is."""
    out = ck.export_full(Path(saved) / "muon 2x2", tmp_path / "full.pt")
    plain = TinyTransformer(dim=16, hidden=40, layers=2)
    plain.load_state_dict(torch.load(out, weights_only=True), strict=True)
    disk = _disk(Path(saved) / "muon 2x2")
    assert_close_dicts(reference_values(plain), {k[6:]: v for k, v in disk.items()
                                                 if k.startswith("model.")}, 0.0, "exported")
