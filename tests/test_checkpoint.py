"""Checkpoints: save at world size W, load at W', atomicity, corrupt inputs, export and interop.

One gloo world per saving world size (1, 2, 4) trains, saves and records reference values; one
world per loading world size (1, 2, 3, 4) resumes every saved checkpoint and compares.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import fully_shard

import matrixfsdp as mf
from matrixfsdp import checkpoint as ck
from matrixfsdp.checkpoint.layout import decode_hyperparams, encode_hyperparams
from matrixfsdp.checkpoint.storage import read_metadata

from .checks import assert_close_dicts, full_optimizer_state, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, train_steps

OPTIMIZERS = ("muon", "okls")
SAVE_WORLDS = (1, 2, 4)
LOAD_WORLDS = (1, 2, 3, 4)
SAVE_AT = 2  # training steps before the checkpoint
RESUME_STEPS = 3
LR = 0.02
KWARGS = {"muon": {"ns_dtype": "float32"}, "okls": {}}
CROSS_WORLD_RTOL = 1e-5


def _probe() -> torch.Tensor:
    return global_batch(99)[:, :-1]


def _make(name: str, seed: int = 0, lr: float = LR, **wrap_kwargs) -> tuple[nn.Module, mf.MatrixOptimizer]:
    torch.manual_seed(seed)
    model = TinyTransformer()
    mf.fully_shard_matrix(model, **wrap_kwargs)
    opt = mf.MatrixOptimizer(model, optimizer=name, lr=lr, weight_decay=0.1, tail_lr=1e-2,
                             tail_weight_decay=0.1, **KWARGS[name])
    return model, opt



def _ckpt_root(root: str, world: int, name: str) -> Path:
    return Path(root) / f"w{world}" / name


def _ref_file(root: str, world: int, name: str) -> Path:
    return Path(root) / f"w{world}" / f"{name}_ref.pt"


def _rng_file(root: str, world: int, name: str, rank: int) -> Path:
    return Path(root) / f"w{world}" / f"{name}_rng{rank}.pt"


def _assert_state_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: FQNs differ"
    for fqn, entry in want.items():
        assert got[fqn].keys() == entry.keys(), f"{what} {fqn}: {got[fqn].keys()} != {entry.keys()}"
        for key, value in entry.items():
            assert torch.equal(got[fqn][key], value), f"{what} {fqn}[{key!r}] differs"


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters, copied (at world size 1 ``full_tensor()`` may alias the live shard)."""
    return {k: v.clone() for k, v in full_values(model).items()}


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {f: {k: v.clone() for k, v in e.items()} for f, e in full_optimizer_state(model, opt).items()}


def _dir_digest(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


# -- saving worlds ---------------------------------------------------------------------------------
def _train_and_save(rank: int, world: int, root: str, name: str) -> None:
    model, opt = _make(name)
    train_steps(model, opt, range(SAVE_AT), rank, world)
    torch.manual_seed(1234 + rank)  # a per-rank RNG state worth restoring
    torch.rand(3)
    torch.save(torch.get_rng_state(), _rng_file(root, world, name, rank))
    path = ck.step_dir(_ckpt_root(root, world, name), SAVE_AT)
    assert ck.save(path, model, opt, step=SAVE_AT, extra={"world": world, "opt": name}) is None
    values, state = _values(model), _state(model, opt)
    with torch.no_grad():
        logits = model(_probe())
    train_steps(model, opt, range(SAVE_AT, SAVE_AT + RESUME_STEPS), rank, world)
    final = _values(model)
    if rank == 0:
        torch.save({"values": values, "state": state, "logits": logits.cpu(), "final": final},
                   _ref_file(root, world, name))


def _crash_mid_save(rank: int, world: int, root: str) -> None:
    """A rank failing while writing, or the coordinator failing before publishing, changes nothing."""
    base = Path(root) / "crash"
    model, opt = _make("muon")
    train_steps(model, opt, range(2), rank, world)
    ck.save(ck.step_dir(base, 2), model, opt, step=2)
    values = _values(model)
    train_steps(model, opt, range(2, 3), rank, world)
    tmp = base / ".step_00000003.tmp"

    def fail_on_rank1(self, plan, planner):
        raise RuntimeError("simulated crash of rank 1 while writing")

    patch = mock.patch.object(FileSystemWriter, "write_data", fail_on_rank1)
    with patch if rank == 1 else contextlib.nullcontext(), pytest.raises(
        ck.CheckpointError, match=r"failed on rank\(s\) \[1\]: RuntimeError: simulated crash"
    ):
        ck.save(ck.step_dir(base, 3), model, opt, step=3)
    dist.barrier()
    assert (tmp / "__0_0.distcp").exists() and not (tmp / ".metadata").exists()
    assert ck.latest(base) == ck.step_dir(base, 2) and not ck.step_dir(base, 3).exists()

    def fail_publish(tmp_dir, path, layout):
        (tmp_dir / "matrixfsdp_layout.json").write_text(layout.model_dump_json())
        raise RuntimeError("simulated crash before publishing")

    with mock.patch("matrixfsdp.checkpoint.core.publish", fail_publish), pytest.raises(
        (RuntimeError, ck.CheckpointError), match=r"simulated|publishing"
    ):
        ck.save(ck.step_dir(base, 3), model, opt, step=3)
    assert (tmp / ".metadata").exists() and ck.latest(base) == ck.step_dir(base, 2)
    fresh, fresh_opt = _make("muon", seed=1)
    assert ck.load(ck.latest(base), fresh, fresh_opt)["step"] == 2
    assert_close_dicts(_values(fresh), values, 0.0, "after crashed saves")
    ck.save(ck.step_dir(base, 3), model, opt, step=3)  # cleans the leftovers
    assert ck.latest(base) == ck.step_dir(base, 3) and not tmp.exists()


def _async_save(rank: int, world: int, root: str) -> None:
    base = Path(root) / "async"
    model, opt = _make("okls")
    train_steps(model, opt, range(2), rank, world)
    handle = ck.save(ck.step_dir(base, 2), model, opt, step=2, async_save=True)
    assert isinstance(handle, ck.AsyncSave)
    values, state = _values(model), _state(model, opt)
    train_steps(model, opt, range(2, 3), rank, world)  # the staged copy must not see this step
    assert ck.latest(base) is None, "published before wait()"
    dist.barrier()
    assert handle.wait() == ck.step_dir(base, 2) and ck.latest(base) == ck.step_dir(base, 2)
    fresh, fresh_opt = _make("okls", seed=1)
    ck.load(ck.latest(base), fresh, fresh_opt)
    assert_close_dicts(_values(fresh), values, 0.0, "async values")
    _assert_state_equal(_state(fresh, fresh_opt), state, "async state")


def _save_errors(rank: int, world: int, root: str) -> None:
    model, opt = _make("muon")
    target = Path(root) / "errors" / "step_00000001"
    with pytest.raises(ValueError, match="JSON"):
        ck.save(target, model, opt, step=1, extra={"bad": object()})
    assert not target.exists() and not target.parent.exists()
    dist.barrier()
    occupied = Path(root) / "errors" / "occupied"
    if rank == 0:
        occupied.mkdir(parents=True)
        (occupied / "notes.txt").write_text("user data")
    dist.barrier()
    with pytest.raises(ck.CheckpointError, match=r"occupied"):
        ck.save(occupied, model, opt, step=1)
    assert (occupied / "notes.txt").read_text() == "user data"
    assert sorted(os.listdir(occupied)) == ["notes.txt"]


def _stock_fsdp2_save(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(Path(root) / "stock"))
    dist.barrier()  # and the other way: plain DCP loads a matrixfsdp checkpoint into stock FSDP2
    dcp.load({"model": model.state_dict()}, checkpoint_id=str(ck.latest(_ckpt_root(root, 2, "muon"))))
    got = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    ref = torch.load(_ref_file(root, 2, "muon"), weights_only=True)
    assert_close_dicts(got, ref["values"], 0.0, "stock FSDP2 model from a matrixfsdp checkpoint")


def _save_world(rank: int, world: int, root: str) -> None:
    subtests = {f"save_{n}": functools.partial(_train_and_save, rank, world, root, n)
                for n in OPTIMIZERS}
    if world == 2:
        subtests["crash_mid_save"] = functools.partial(_crash_mid_save, rank, world, root)
        subtests["async_save"] = functools.partial(_async_save, rank, world, root)
        subtests["save_errors"] = functools.partial(_save_errors, rank, world, root)
        subtests["stock_fsdp2_save"] = functools.partial(_stock_fsdp2_save, rank, world, root)
    run_subtests(rank, subtests)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("checkpoints")
    for world in SAVE_WORLDS:
        (root / f"w{world}").mkdir()
        run_world(world, _save_world, str(root))
    torch.manual_seed(0)
    plain = TinyTransformer().state_dict()
    torch.save(plain, root / "plain.pt")
    from safetensors.torch import save_file

    save_file(plain, str(root / "plain.safetensors"))
    return str(root)


# -- loading worlds --------------------------------------------------------------------------------
def _resume(rank: int, world: int, root: str, saved_world: int, name: str) -> None:
    """Load, compare exactly with the saved values, train 3 steps, compare with the saver's run."""
    model, opt = _make(name, seed=1, lr=0.5)  # other weights and lr: load overwrites both
    info = ck.load(ck.latest(_ckpt_root(root, saved_world, name)), model, opt)
    assert info == {"step": SAVE_AT, "extra": {"world": saved_world, "opt": name}}, info
    ref = torch.load(_ref_file(root, saved_world, name), weights_only=True)
    assert_close_dicts(_values(model), ref["values"], 0.0, "loaded values")
    _assert_state_equal(_state(model, opt), ref["state"], "loaded state")
    assert opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["initial_lr"] == LR
    if rank < saved_world:
        rng = torch.load(_rng_file(root, saved_world, name, rank), weights_only=True)
        assert torch.equal(torch.get_rng_state(), rng), "RNG state not restored"
    train_steps(model, opt, range(SAVE_AT, SAVE_AT + RESUME_STEPS), rank, world)
    rtol = 0.0 if world == saved_world else CROSS_WORLD_RTOL
    assert_close_dicts(_values(model), ref["final"], rtol, f"resumed {saved_world}->{world}")


def _damage_cases() -> dict:
    def edit_layout(change):
        def apply(d: Path) -> None:
            raw = json.loads((d / "matrixfsdp_layout.json").read_text())
            change(raw)
            (d / "matrixfsdp_layout.json").write_text(json.dumps(raw))
        return apply

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch /tmp/matrixfsdp_pwned",))

    return {
        "missing_metadata": (lambda d: (d / ".metadata").unlink(), ck.CorruptCheckpointError,
                             r"\.metadata"),
        "garbage_metadata": (lambda d: (d / ".metadata").write_bytes(b"\x80\x04garbage"),
                             ck.CorruptCheckpointError, "unreadable DCP metadata"),
        "malicious_metadata": (lambda d: (d / ".metadata").write_bytes(pickle.dumps(Evil())),
                               ck.CorruptCheckpointError, "not allowed"),
        "unknown_version": (edit_layout(lambda r: r.update(format_version=99)),
                            ck.UnsupportedFormatError, "format_version 99"),
        "unknown_field": (edit_layout(lambda r: r.update(surprise=1)), ck.CorruptCheckpointError,
                          "surprise"),
        "bad_json": (lambda d: (d / "matrixfsdp_layout.json").write_text("{"),
                     ck.CorruptCheckpointError, "not valid JSON"),
        "shape_edited": (edit_layout(lambda r: r["model"][0].update(shape=[5, 5])),
                         ck.CorruptCheckpointError, "embed.weight"),
        "missing_data_file": (lambda d: (d / "__1_0.distcp").unlink(),
                              ck.CorruptCheckpointError, r"'__1_0\.distcp' is missing"),
        "truncated_data_file": (lambda d: os.truncate(d / "__0_0.distcp", 100),
                                ck.CorruptCheckpointError, "bytes"),
        "no_marker": (lambda d: (d / "COMPLETE").unlink(), ck.CorruptCheckpointError, "COMPLETE"),
        "not_a_checkpoint": (lambda d: (d / "matrixfsdp_layout.json").unlink(),
                             ck.CheckpointNotFoundError, "load_full_state_dict"),
    }


def _corrupt_inputs(rank: int, world: int, root: str) -> None:
    good = ck.latest(_ckpt_root(root, 2, "muon"))
    model, opt = _make("muon", seed=1)
    train_steps(model, opt, range(1), rank, world)
    before, state_before = _values(model), _state(model, opt)
    base = Path(root) / f"corrupt{world}"
    for case, (damage, error, match) in _damage_cases().items():
        bad = base / case
        if rank == 0:
            shutil.copytree(good, bad)
            damage(bad)
        dist.barrier()
        digest = _dir_digest(bad)
        with pytest.raises(error, match=match):
            ck.load(bad, model, opt)
        with pytest.raises(error, match=match):
            ck.export_full(bad, base / f"{case}.safetensors")
        assert _dir_digest(bad) == digest, f"{case}: the checkpoint was modified"
        assert not (base / f"{case}.safetensors").exists()
    assert not Path("/tmp/matrixfsdp_pwned").exists(), "metadata unpickling ran code"
    with pytest.raises(ck.CheckpointNotFoundError, match="does not exist") as info:
        ck.load(base / "nowhere", model, opt)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    with pytest.raises(ck.CheckpointNotFoundError, match="is a file"):
        ck.load(Path(root) / "plain.pt", model, opt)
    assert_close_dicts(_values(model), before, 0.0, "model after failed loads")
    _assert_state_equal(_state(model, opt), state_before, "state after failed loads")


def _mismatches(rank: int, world: int, root: str) -> None:
    path = ck.latest(_ckpt_root(root, 2, "muon"))
    ref = torch.load(_ref_file(root, 2, "muon"), weights_only=True)
    torch.manual_seed(0)
    wide = TinyTransformer(hidden=48)
    mf.fully_shard_matrix(wide)
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"'layers.0.up.weight': checkpoint shape \[40, 16\], model shape \[48, 16\]"):
        ck.load(path, wide, weights_only=True)
    torch.manual_seed(0)
    small = TinyTransformer(layers=2)
    mf.fully_shard_matrix(small)
    with pytest.raises(ck.CheckpointMismatchError, match=r"entries the model lacks: \['layers\.2\."):
        ck.load(path, small, weights_only=True)
    ck.load(path, small, weights_only=True, strict=False)
    got = _values(small)
    assert_close_dicts(got, {k: ref["values"][k] for k in got}, 0.0, "strict=False")
    no_up = lambda fqn, p: p.ndim == 2 and fqn.startswith("layers.") and ".up." not in fqn  # noqa: E731
    model, opt = _make("muon", seed=1, matrix_filter=no_up)
    before = _values(model)
    with pytest.raises(ck.CheckpointMismatchError, match=r"matrix_filter.*'layers.0.up.weight'"):
        ck.load(path, model, opt)
    assert_close_dicts(_values(model), before, 0.0, "after a refused load")
    assert ck.load(path, model, opt, weights_only=True)["step"] == SAVE_AT
    assert_close_dicts(_values(model), ref["values"], 0.0, "weights-only, other filter")
    assert not opt.state, "weights_only loaded optimizer state"
    model, opt = _make("okls", seed=1)
    with pytest.raises(ck.CheckpointMismatchError, match="'muon', this one is 'okls'"):
        ck.load(path, model, opt)
    ck.load(path, model, opt, weights_only=True)
    assert_close_dicts(_values(model), ref["values"], 0.0, "weights-only, other optimizer")


AGREED_WITHIN_S = 20.0  # a failure agreed by one all-reduce takes well under a second


def _raises_everywhere(rank: int, failing: dict[int, tuple[str, BaseException]], load) -> None:
    """``load()`` raises on every rank, promptly: ``failing`` maps rank -> (patch target, error).

    A failing rank raises its own error; the others a ``CheckpointError`` naming them. Before
    the agreement the others waited in ``dcp.load`` for the failed rank (until the run timed out).
    """
    target, error = failing.get(rank, (None, None))
    patch = mock.patch(target, side_effect=error) if target else contextlib.nullcontext()
    want = re.escape(str(error)) if error else re.escape(f"failed on rank(s) {sorted(failing)}")
    start = time.monotonic()
    with patch, pytest.raises(type(error) if error else ck.CheckpointError, match=want):
        load()
    elapsed = time.monotonic() - start
    assert elapsed < AGREED_WITHIN_S, f"rank {rank} raised only after {elapsed:.1f} s"


def _failures_agreed(rank: int, world: int, root: str) -> None:
    """A load that fails on some ranks only raises on every rank, and the world stays in step."""
    good = ck.latest(_ckpt_root(root, 2, "muon"))
    ref = torch.load(_ref_file(root, 2, "muon"), weights_only=True)
    model, opt = _make("muon", seed=1)
    # A layout file that rank 1 alone reads corrupt (a stale cache, a partial sync): rank 1
    # loads a damaged copy, the others the intact checkpoint.
    damaged = Path(root) / f"agreed{world}" / "damaged"
    if rank == 0:
        shutil.copytree(good, damaged)
        (damaged / "matrixfsdp_layout.json").write_text("{")
    dist.barrier()
    for_rank = damaged if rank == 1 else good
    with pytest.raises(ck.CorruptCheckpointError if rank == 1 else ck.CheckpointError,
                       match="not valid JSON" if rank == 1 else re.escape("rank(s) [1]")):
        ck.load(for_rank, model, opt)
    mismatch = ("matrixfsdp.checkpoint.core.check_model",
                ck.CheckpointMismatchError("rank-1-only: shape mismatch 'layers.0.up.weight'"))
    plan = ("matrixfsdp.checkpoint.core.check_optimizer",
            ck.CheckpointMismatchError("rank-2-only: another plan"))
    install = ("matrixfsdp.checkpoint._statedict.install_optimizer_state",
               RuntimeError("rank-1-only: cannot install the optimizer state"))
    cases = [{1: mismatch}, {1: install}]
    if world == 3:
        cases.append({1: mismatch, 2: plan})  # two ranks, two different errors
    for failing in cases:
        _raises_everywhere(rank, failing, lambda: ck.load(good, model, opt))
    # Every rank left the failed loads at the same point: the next load is collective as usual.
    assert ck.load(good, model, opt)["step"] == SAVE_AT
    assert_close_dicts(_values(model), ref["values"], 0.0, "after the agreed failures")


def test_load_failures_are_agreed_across_ranks(saved: str) -> None:
    """One rank's failure in ``checkpoint.load`` raises on every rank, never a hang (worlds 2, 3)."""
    for world in (2, 3):
        run_world(world, _failures_agreed, saved, timeout=90)


def _interop(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    plain = TinyTransformer()
    want = reference_values(plain)
    sources = {"torch.save": Path(root) / "plain.pt", "safetensors": Path(root) / "plain.safetensors",
               "stock FSDP2 DCP": Path(root) / "stock", "dict": plain.state_dict()}
    for label, source in sources.items():
        model, _ = _make("muon", seed=1)
        ck.load_full_state_dict(model, source)
        assert_close_dicts(_values(model), want, 0.0, f"from {label}")
    model, _ = _make("muon", seed=1)
    ck.load_full_state_dict(model, ck.latest(_ckpt_root(root, 4, "okls")))
    ref = torch.load(_ref_file(root, 4, "okls"), weights_only=True)
    assert_close_dicts(_values(model), ref["values"], 0.0, "from a matrixfsdp checkpoint")
    partial = {k: v for k, v in plain.state_dict().items() if k != "layers.1.up.weight"}
    with pytest.raises(ck.CheckpointMismatchError, match=r"'layers\.1\.up\.weight'"):
        ck.load_full_state_dict(model, partial)
    result = ck.load_full_state_dict(model, partial, strict=False)
    assert result.missing_keys == ["layers.1.up.weight"] and not result.unexpected_keys
    with pytest.raises(ck.CheckpointMismatchError, match=r"source shape \[3\]"):
        ck.load_full_state_dict(model, {**plain.state_dict(), "norm.bias": torch.zeros(3)})


def _load_world(rank: int, world: int, root: str) -> None:
    subtests = {}
    for saved_world in SAVE_WORLDS:
        for name in OPTIMIZERS:
            subtests[f"resume_{name}_from_{saved_world}"] = functools.partial(
                _resume, rank, world, root, saved_world, name
            )
    if world == 2:
        subtests["corrupt_inputs"] = functools.partial(_corrupt_inputs, rank, world, root)
        subtests["mismatches"] = functools.partial(_mismatches, rank, world, root)
    if world == 3:
        subtests["interop"] = functools.partial(_interop, rank, world, root)
    run_subtests(rank, subtests)


@pytest.mark.parametrize("world", LOAD_WORLDS)
def test_save_and_load_across_world_sizes(saved: str, world: int) -> None:
    run_world(world, _load_world, saved)


def _round_trip_world(rank: int, world: int, root: str) -> None:
    """Save after training, load into fresh models on the same world, resume: exact."""
    subtests = {f"save_{n}": functools.partial(_train_and_save, rank, world, root, n)
                for n in OPTIMIZERS}
    subtests["saved_everywhere"] = dist.barrier  # rank 0 wrote the reference files
    subtests.update({f"resume_{n}": functools.partial(_resume, rank, world, root, world, n)
                     for n in OPTIMIZERS})
    run_subtests(rank, subtests)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_save_and_load_on_cuda(tmp_path: Path, world: int) -> None:
    (tmp_path / f"w{world}").mkdir()
    run_world(world, _round_trip_world, str(tmp_path), device="cuda")


# -- single process --------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_full_loads_into_plain_model(saved: str, tmp_path: Path, suffix: str) -> None:
    for world in SAVE_WORLDS:
        for name in OPTIMIZERS:
            out = ck.export_full(ck.latest(_ckpt_root(saved, world, name)), tmp_path / f"m{suffix}")
            if suffix == ".safetensors":
                from safetensors.torch import load_file

                state = load_file(str(out))
            else:
                state = torch.load(out, weights_only=True)
            plain = TinyTransformer(layers=3)
            plain.load_state_dict(state, strict=True)
            ref = torch.load(_ref_file(saved, world, name), weights_only=True)
            assert_close_dicts(reference_values(plain), ref["values"], 0.0, "exported")
            with torch.no_grad():
                torch.testing.assert_close(plain(_probe()), ref["logits"], rtol=1e-6, atol=1e-7)


def test_on_disk_format(saved: str, tmp_path: Path) -> None:
    """Each matrix (and its state) is one whole chunk in its owner's file; DCP tools read it."""
    path = ck.latest(_ckpt_root(saved, 4, "muon"))
    layout = ck.read_layout(path)
    assert layout.world_size == 4 and layout.step == SAVE_AT and layout.optimizer is not None
    metadata = read_metadata(path)
    storage = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    matrices = [e for e in layout.model if e.role == "matrix"]
    assert {e.owner_rank for e in matrices} == {0, 1, 2, 3}
    for entry in matrices:
        for key in [f"model.{entry.fqn}", f"optim.state.{entry.fqn}.momentum_buffer"]:
            if key not in metadata.state_dict_metadata:
                assert "unused" in entry.fqn and key.startswith("optim"), key
                continue
            chunks = metadata.state_dict_metadata[key].chunks
            assert len(chunks) == 1 and tuple(chunks[0].sizes) == entry.shape, key
            assert storage[key].startswith(f"__{entry.owner_rank}_"), (key, storage[key])
    assert {f"rng.cpu.{r}" for r in range(4)} <= set(metadata.state_dict_metadata)
    dcp_to_torch_save(path, tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=True)
    ref = torch.load(_ref_file(saved, 4, "muon"), weights_only=True)
    assert_close_dicts({k: converted["model"][k] for k in ref["values"]}, ref["values"], 0.0, "dcp")


def test_latest_ignores_incomplete(tmp_path: Path) -> None:
    def fake(name: str, step: int | None, files=(".metadata", "matrixfsdp_layout.json")) -> None:
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).write_bytes(b"")
        if step is not None:
            (d / "COMPLETE").write_text(json.dumps({"format_version": 1, "step": step}))

    assert ck.latest(tmp_path / "missing") is None
    assert ck.latest(tmp_path) is None
    fake("step_00000001", 1)
    fake("step_00000003", 3)
    fake("step_00000009", None)  # no marker: a crashed save that was renamed by hand
    fake(".step_00000007.tmp", 7)  # hidden: in flight
    fake("step_00000008", 8, files=("matrixfsdp_layout.json",))  # no DCP metadata
    (tmp_path / "step_00000010").write_text("a file")
    bad = tmp_path / "step_00000011"
    bad.mkdir()
    (bad / "COMPLETE").write_text("{not json")
    assert ck.latest(tmp_path) == tmp_path / "step_00000003"
    assert ck.is_complete(tmp_path / "step_00000001") and not ck.is_complete(bad)
    assert ck.step_dir(tmp_path, 42) == tmp_path / "step_00000042"


def test_hyperparameters_round_trip() -> None:
    group = {"params": [1], "lr": 0.1, "betas": (0.9, 0.95), "eps": float("inf"), "kind": "x",
             "t": torch.tensor(0.5), "nested": {"a": (1, 2), "b": [None, True]}, "fn": print}
    encoded = json.loads(json.dumps(encode_hyperparams(group)))
    assert "fn" not in encoded and "params" not in encoded
    target = copy.deepcopy({k: v for k, v in group.items() if k != "fn"})
    target.update(lr=1.0, betas=(0.0, 0.0), t=torch.tensor(9.0))
    decode_hyperparams(encoded, target)
    assert target["betas"] == (0.9, 0.95) and target["nested"] == {"a": (1, 2), "b": [None, True]}
    assert target["eps"] == float("inf") and target["lr"] == 0.1
    assert isinstance(target["t"], torch.Tensor) and target["t"].item() == 0.5
