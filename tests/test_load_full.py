"""Streaming full-weight loads: Hugging Face directories, lazily, each rank reading what it keeps.

Sources are written once (single process); one gloo world per size 1-4 loads them into wrapped
models and compares every parameter with the eager model exactly, counts every tensor read
through ``safetensors.safe_open`` per rank, and (world 2) feeds every kind of bad input.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import matrixfsdp as mf
from matrixfsdp import checkpoint as ck
from matrixfsdp.checkpoint import sources as sources_module
from matrixfsdp.checkpoint._streaming import local_index

from .checks import assert_close_dicts, count_collectives, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss
from .test_experts import TinyMoE, _stacks_and_gates

safetensors_torch = pytest.importorskip("safetensors.torch")

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# GPT-2: Conv1D weights (in, out) and an lm_head tied to the embedding, absent from the files.
# (MoE models are left out: transformers 5 saves their fused 3-D expert stacks per expert.)
HF_MODELS = ("llama", "gpt2")
SHARD_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _plain(seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def _moe(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyMoE()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _write_index_dir(path: Path, tensors: dict[str, torch.Tensor], bin_files: bool = False,
                     **extra) -> None:
    """An HF sharded directory: the first half of the keys in shard 1, the rest in shard 2."""
    path.mkdir(parents=True, exist_ok=True)
    keys = list(tensors)
    shards = [n.replace(".safetensors", ".bin") if bin_files else n for n in SHARD_NAMES]
    split = {shards[0]: keys[: len(keys) // 2], shards[1]: keys[len(keys) // 2 :]}
    for shard, names in split.items():
        part = {k: tensors[k] for k in names}
        if bin_files:
            torch.save(part, path / shard)
        else:
            safetensors_torch.save_file(part, str(path / shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {k: s for s, names in split.items() for k in names}, **extra}
    name = "pytorch_model.bin.index.json" if bin_files else "model.safetensors.index.json"
    (path / name).write_text(json.dumps(index))


def _edit_index(path: Path, change) -> None:
    index_file = path / "model.safetensors.index.json"
    raw = json.loads(index_file.read_text())
    change(raw)
    index_file.write_text(json.dumps(raw))


def _bad_sources(root: Path, good: dict[str, torch.Tensor]) -> None:
    """One directory per bad input; ``_BAD_CASES`` says what each must raise."""
    _write_index_dir(root / "missing_shard", good)
    (root / "missing_shard" / SHARD_NAMES[1]).unlink()
    _write_index_dir(root / "index_names_absent_key", good)
    _edit_index(root / "index_names_absent_key",
                lambda r: r["weight_map"].update({"norm.weight": SHARD_NAMES[0]}))
    _write_index_dir(root / "shape", {**good, "layers.1.down.weight": torch.zeros(16, 41)})
    _write_index_dir(root / "dtype", {**good, "norm.bias": torch.zeros(16, dtype=torch.int64)})
    _write_index_dir(root / "missing_key", {k: v for k, v in good.items()
                                            if k != "layers.2.attn.k.weight"})
    _write_index_dir(root / "unexpected_key", {**good, "rotary.inv_freq": torch.zeros(4)})
    for case, shard in (("traversal", "../model-00001-of-00002.safetensors"),
                        ("absolute", "/etc/passwd")):
        _write_index_dir(root / case, good)
        _edit_index(root / case, lambda r, s=shard: r["weight_map"].update({"embed.weight": s}))
    _write_index_dir(root / "no_weight_map", good)
    _edit_index(root / "no_weight_map", lambda r: r.pop("weight_map"))
    _write_index_dir(root / "bad_json", good)
    (root / "bad_json" / "model.safetensors.index.json").write_text("{\"weight_map\": ")
    _write_index_dir(root / "truncated", good)
    os.truncate(root / "truncated" / SHARD_NAMES[1], 200)
    (root / "empty").mkdir()


_BAD_CASES = {  # case -> (error, regex the message must match)
    "missing_shard": (ck.CheckpointNotFoundError,
                      r"model-00002-of-00002\.safetensors.*does not exist.*'layers\."),
    "index_names_absent_key": (ck.CheckpointMismatchError,
                               r"maps 'norm\.weight' to \S*model-00001-of-00002"),
    "shape": (ck.CheckpointMismatchError,
              r"'layers\.1\.down\.weight' \(\S*model-0000\d-of-00002\.safetensors\): source shape "
              r"\[16, 41\], model shape \[16, 40\]"),
    "dtype": (ck.CheckpointMismatchError,
              r"'norm\.bias' \(\S*model-00002-of-00002\.safetensors\): source dtype torch\.int64"),
    "missing_key": (ck.CheckpointMismatchError, r"lacks 1 entries.*'layers\.2\.attn\.k\.weight'"),
    "unexpected_key": (ck.CheckpointMismatchError,
                       r"'rotary\.inv_freq' \(\S*model-00002-of-00002\.safetensors\)"),
    "traversal": (ck.CorruptCheckpointError,
                  r"'embed\.weight': shard file '\.\./model-00001-of-00002\.safetensors' is not"),
    "absolute": (ck.CorruptCheckpointError, r"'/etc/passwd' is not a plain path"),
    "no_weight_map": (ck.CorruptCheckpointError, r"weight_map"),
    "bad_json": (ck.CorruptCheckpointError, r"not valid JSON"),
    "truncated": (ck.CorruptCheckpointError,
                  r"model-00002-of-00002\.safetensors: not a readable safetensors file"),
    "empty": (ck.CheckpointNotFoundError, r"model\.safetensors\.index\.json"),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("hf")
    state = _state(_plain())
    # Hugging Face naming: the backbone under "model.", the head beside it.
    hf = {(k if k.startswith("head.") else "model." + k): v for k, v in state.items()}
    (root / "single").mkdir()
    safetensors_torch.save_file(hf, str(root / "single" / "model.safetensors"))
    _write_index_dir(root / "sharded", state, extra_field={"tool": "test"})
    _write_index_dir(root / "sharded_bin", state, bin_files=True)
    _write_index_dir(root / "moe", _state(_moe()))
    _write_index_dir(root / "bf16", {k: v.bfloat16() for k, v in state.items()})
    tied = _state(_plain(tie=True))
    _write_index_dir(root / "tied", {k: v for k, v in tied.items() if k != "head.weight"})
    torch.save(state, root / "plain.pt")
    _bad_sources(root / "bad", state)
    if HAVE_TRANSFORMERS:  # real Hugging Face save_pretrained directories, several shards each
        from benchmarks.hf_selection import build

        for name in HF_MODELS:
            build(name, seed=0).save_pretrained(root / f"hf_{name}", max_shard_size="20KB")
    return str(root)


# -- counting what each rank reads -----------------------------------------------------------------
class _SliceRecorder:
    def __init__(self, view, key: str, log: list) -> None:
        self._view, self._key, self._log = view, key, log

    def __getitem__(self, index):
        out = self._view[index]
        self._log.append((self._key, "slice", tuple(out.shape), out.nbytes))
        return out

    def __getattr__(self, name: str):
        return getattr(self._view, name)


class _HandleRecorder:
    """A ``safe_open`` handle that logs every tensor or slice materialized through it."""

    def __init__(self, handle, log: list) -> None:
        self._handle, self._log = handle, log

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def keys(self):
        return self._handle.keys()

    def get_slice(self, key: str):
        return _SliceRecorder(self._handle.get_slice(key), key, self._log)

    def get_tensor(self, key: str):
        out = self._handle.get_tensor(key)
        self._log.append((key, "tensor", tuple(out.shape), out.nbytes))
        return out


@contextlib.contextmanager
def _recording() -> Iterator[list]:
    import safetensors

    log: list = []
    real = safetensors.safe_open
    with mock.patch.object(safetensors, "safe_open",
                           lambda *a, **k: _HandleRecorder(real(*a, **k), log)):
        yield log


def _expected_reads(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What this rank must read: owned matrices whole, its non-empty tail shard rows."""
    state = mf.get_state(model)
    out = {}
    for key, value in model.state_dict().items():
        mp = state.params.get(key)
        if mp is not None:
            if mp.is_owner:
                out[key] = ("tensor", tuple(mp.shape))
        elif isinstance(value, DTensor):
            if value.to_local().numel():
                out[key] = ("slice", tuple(value.to_local().shape))
        else:
            out[key] = ("tensor", tuple(value.shape))
    return out


# -- subtests --------------------------------------------------------------------------------------
def _wrapped(seed: int = 1, **kwargs) -> nn.Module:
    model = _plain(seed, **kwargs)
    mf.fully_shard_matrix(model)
    return model


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in full_values(model).items()}


def _loads_exactly(rank: int, world: int, root: str) -> None:
    want = reference_values(_plain())
    cases = {"single file, model. prefix": "single", "index + 2 shards": "sharded",
             "torch.save file": "plain.pt", "pytorch_model.bin index": "sharded_bin"}
    for label, source in cases.items():
        model = _wrapped()
        result = ck.load_full_state_dict(model, Path(root) / source)
        assert result == ck.LoadResult([], []), f"{label}: {result}"
        assert_close_dicts(_values(model), want, 0.0, f"from {label}")
    model = _wrapped()
    ck.load_full_state_dict(model, Path(root) / "bf16")
    cast = {k: v.bfloat16().float() for k, v in want.items()}
    assert_close_dicts(_values(model), cast, 0.0, "bf16 source cast into fp32")


def _reads_only_what_it_keeps(rank: int, world: int, root: str, moe_stacks: str | None) -> None:
    if moe_stacks is None:
        model, source, want = _wrapped(), "sharded", reference_values(_plain())
    else:
        model, source, want = _moe(1), "moe", reference_values(_moe())
        mf.fully_shard_matrix(model, matrix_filter=_stacks_and_gates,
                              planner=mf.LPTPlanner(stacks=moe_stacks))
    expected = _expected_reads(model)
    with _recording() as log:
        collectives = count_collectives(
            lambda: ck.load_full_state_dict(model, Path(root) / source))
    # No tensor crosses ranks: the two 4-byte agreements are all (after the checks, after reading)
    agreements = 2 if world > 1 else 0
    assert collectives == agreements, f"a file load issued {collectives} collectives"
    got = {key: (kind, shape) for key, kind, shape, _ in log}
    assert len(got) == len(log), f"a tensor was read twice: {[e[0] for e in log]}"
    assert got == expected, f"rank {rank} read {got}, expected {expected}"
    total = sum(nbytes for *_, nbytes in log)
    assert total == sum(math.prod(s) * 4 for _, s in expected.values())
    assert_close_dicts(_values(model), want, 0.0, f"lazy load ({source}, {moe_stacks})")


def _local_index_matches_dtensor(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for rows in range(2 * world + 2):  # uneven and empty last shards included
        for dim in (0, 1):
            full = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
            if dim == 1:
                full = full.t().contiguous()
            dt = distribute_tensor(full, mesh, [Shard(dim)], src_data_rank=None)
            index = local_index(dt, "probe")
            assert torch.equal(full[index], dt.to_local()), (rows, dim, index)
    if world == 4:  # 2-D meshes (HSDP-style): replicate x shard, and nested shards of one dim
        mesh2 = init_device_mesh("cpu", (2, 2))
        full = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
        for placements in ([Replicate(), Shard(0)], [Shard(0), Shard(0)], [Shard(1), Shard(0)]):
            dt = distribute_tensor(full, mesh2, placements, src_data_rank=None)
            index = local_index(dt, "probe")
            assert torch.equal(full[index], dt.to_local()), (placements, index)


def _bad_inputs(rank: int, world: int, root: str) -> None:
    model = _wrapped()  # seed 1: every bad source holds other values (seed 0)
    before = _values(model)
    for case, (error, match) in _BAD_CASES.items():
        with _recording() as log, pytest.raises(error, match=match):
            ck.load_full_state_dict(model, Path(root) / "bad" / case)
        assert not log, f"{case}: tensors were read before the load was refused: {log}"
    with mock.patch.object(sources_module, "MAX_INDEX_BYTES", 100), pytest.raises(
            ck.CorruptCheckpointError, match=r"index\.json: \d+ bytes, more than"):
        ck.load_full_state_dict(model, Path(root) / "sharded")
    assert_close_dicts(_values(model), before, 0.0, "model after refused loads")
    result = ck.load_full_state_dict(model, Path(root) / "bad" / "missing_key", strict=False)
    assert result == ck.LoadResult(["layers.2.attn.k.weight"], [])
    want = reference_values(_plain())
    want["layers.2.attn.k.weight"] = before["layers.2.attn.k.weight"]
    assert_close_dicts(_values(model), want, 0.0, "non-strict load without one key")
    result = ck.load_full_state_dict(model, Path(root) / "bad" / "unexpected_key", strict=False)
    assert result == ck.LoadResult([], ["rotary.inv_freq"])
    assert_close_dicts(_values(model), reference_values(_plain()), 0.0, "non-strict, extra key")


def _names_and_ties(rank: int, world: int, root: str) -> None:
    tied = _wrapped(tie=True)
    assert ck.load_full_state_dict(tied, Path(root) / "tied") == ck.LoadResult([], [])
    assert_close_dicts(_values(tied), reference_values(_plain(tie=True)), 0.0, "tied from HF")
    model = _wrapped()
    renamed = lambda k: None if k == "head.weight" else k.removeprefix("model.")  # noqa: E731
    result = ck.load_full_state_dict(model, Path(root) / "single", key_map=renamed, strict=False)
    assert result == ck.LoadResult(["head.weight"], [])
    want = reference_values(_plain())
    got = _values(model)
    assert not torch.equal(got.pop("head.weight"), want.pop("head.weight"))
    assert_close_dicts(got, want, 0.0, "key_map")


def _load_after_early_stopped_forward(rank: int, world: int, root: str) -> None:
    """A prefetched gather in flight (a prefix evaluated) is retired before the load writes."""
    model = _wrapped()
    state = mf.get_state(model)
    tokens = global_batch(0)
    with torch.no_grad():
        for _ in range(2):  # the second forward adopts the first one's order for prefetching
            lm_loss(model, tokens)
        model.layers[0](torch.randn(2, 5, 16))
    assert len(state.queue) == 1, "expected the next block's gather to be prefetched"
    ck.load_full_state_dict(model, Path(root) / "sharded")
    assert len(state.queue) == 0
    assert_close_dicts(_values(model), reference_values(_plain()), 0.0, "load after a prefix")
    with torch.no_grad():
        got, want = lm_loss(model, tokens), lm_loss(_plain(), tokens)
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)


def _hf_models(rank: int, world: int, root: str) -> None:
    """``save_pretrained`` directories of transformers models load exactly, default selection."""
    from benchmarks.hf_selection import build

    for name in HF_MODELS:
        model = build(name, seed=1)
        mf.fully_shard_matrix(model)
        assert ck.load_full_state_dict(model, Path(root) / f"hf_{name}") == ck.LoadResult([], [])
        assert_close_dicts(_values(model), reference_values(build(name, seed=0)), 0.0, name)


def _world(rank: int, world: int, root: str) -> None:
    subtests = {
        "loads_exactly": functools.partial(_loads_exactly, rank, world, root),
        "reads_only_what_it_keeps": functools.partial(_reads_only_what_it_keeps, rank, world,
                                                      root, None),
        "local_index": functools.partial(_local_index_matches_dtensor, rank, world),
    }
    for stacks in ("whole", "slices") if world in (3, 4) else ():
        subtests[f"moe_{stacks}"] = functools.partial(_reads_only_what_it_keeps, rank, world,
                                                      root, stacks)
    if world in (2, 3) and HAVE_TRANSFORMERS:
        subtests["hf_models"] = functools.partial(_hf_models, rank, world, root)
    if world == 2:
        subtests["bad_inputs"] = functools.partial(_bad_inputs, rank, world, root)
        subtests["names_and_ties"] = functools.partial(_names_and_ties, rank, world, root)
        subtests["early_stopped_forward"] = functools.partial(
            _load_after_early_stopped_forward, rank, world, root)
    run_subtests(rank, subtests)
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_streaming_full_loads(sources: str, world: int) -> None:
    run_world(world, _world, sources)


def test_load_memory_benchmark_smoke() -> None:
    """``python -m benchmarks.load_memory`` at tiny size (the loss check across variants runs)."""
    from benchmarks.load_memory import run

    # Large enough (28 MiB) that page-granular RSS figures are not dominated by heap reuse.
    out = run(["--world", "2", "--dim", "512", "--layers", "2", "--vocab", "512", "--repeats", "1",
               "--inits", "eager", "meta", "--loads", "stream"])
    stream = out["results"]["eager+stream"]
    assert 0.4 < stream["params_ratio"] < 0.7, stream  # about half of the model on each rank
    assert stream["peak"] >= stream["params"] > 0
    meta = out["results"]["meta+stream"]
    assert meta["loss"] == stream["loss"], meta  # same weights loaded
    assert meta["peak"] < stream["peak"], (meta, stream)  # no rank built the whole model
