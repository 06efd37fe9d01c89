"""The owner step's transient bytes are bounded by bytes (issue 30, item 7).

[Note: owner step transients] in ``matrixfsdp.optim.owner_step``: one Muon matrix with bf16
Newton–Schulz stays within 1.5× its fp32 bytes + one 1 MiB chunk (it was 2.5×); with fp32
Newton–Schulz, iterated in place a block of columns at a time, within ``|X| + max(2k², k² + k c)``
elements (it was ``2|X| + k²``); batched
same-shape matrices are cut by stacked bytes (``StepBatching``), not by count, and the cut
batches step exactly as the uncut ones and as one matrix at a time.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

import matrixfsdp as mf
from benchmarks.step_memory import owner_step_transient, owner_step_transients
from matrixfsdp.memory import LiveBytesTracker
from matrixfsdp.optim.functional import MuonConfig, muon
from matrixfsdp.optim.layouts import MatrixLayout
from matrixfsdp.optim.owner_step import (
    DEFAULT_BATCH_BYTES,
    OwnedMatrix,
    StepBatching,
    batch_owned,
    init_owned_state,
    owned_blocks,
    stacked_bytes,
    step_owned,
    write_back_rows,
)
from matrixfsdp.optim.registry import get_matrix_optimizer

from .checks import full_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

MiB = 1 << 20
CHUNK = 1 * MiB  # muon._CHUNK_BYTES: rows of the fp32 direction alive at once


def _bound(matrix_bytes: int) -> int:
    """The stated bound of one matrix's owner step with bf16 Newton–Schulz."""
    return int(1.5 * matrix_bytes) + CHUNK


# -- one matrix -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(384, 1536), (1536, 384), (768, 768)])
def test_one_matrix_bf16_transient_within_bound(shape: tuple[int, int]) -> None:
    matrix = 4 * shape[0] * shape[1]
    got = owner_step_transient(shape, 1, StepBatching(), "bfloat16")
    assert got <= _bound(matrix), f"{shape}: {got / matrix:.2f}x the matrix ({got} bytes)"
    # 2|X| + min(m, n)^2 bf16 elements (+ a chunk while X is built): what the note states
    small = min(shape) ** 2
    assert got <= 2 * (2 * shape[0] * shape[1] + small) + CHUNK


def _in_place_bound(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The note's bound of one matrix's Newton–Schulz iterated in place, in bytes:
    ``|X| + max(2 k², k² + k c)`` elements of ``dtype`` (``c`` the block's columns)."""
    k, n = min(shape[-2:]), max(shape[-2:])
    columns = muon._ns_columns(torch.empty(k, n, dtype=dtype))
    assert columns is not None, shape
    size = torch.empty((), dtype=dtype).element_size()
    return size * (k * n + max(2 * k * k, k * k + k * columns))


@pytest.mark.parametrize("shape", [(512, 2048), (2048, 512), (768, 1536), (1536, 768)])
def test_one_matrix_fp32_transient_in_place(shape: tuple[int, int]) -> None:
    """fp32 Newton–Schulz: the Nesterov direction is the iterate, iterated in place a block of
    columns at a time; 1.5× a 1:4 matrix, 2× a 1:2 one (were 2.25× and 2.5×: ``2|X| + k²``)."""
    matrix = 4 * shape[0] * shape[1]
    got = owner_step_transient(shape, 1, StepBatching(), "float32")
    assert got <= (1.5 if max(shape) == 4 * min(shape) else 2.0) * matrix, got / matrix
    assert got <= _in_place_bound(shape, torch.float32), f"{shape}: {got / matrix:.3f}x"


@pytest.mark.parametrize("shape", [(512, 2048), (768, 1536)])
def test_one_matrix_bf16_wide_transient_in_place(shape: tuple[int, int]) -> None:
    """bf16, rows contiguous (wide): in place too (tall bf16 matrices make the first iterate
    anew, to keep ``torch.optim.Muon``'s bits; ``_same_bits_in_place``)."""
    got = owner_step_transient(shape, 1, StepBatching(), "bfloat16")
    assert got <= _in_place_bound(shape, torch.bfloat16), got / (4 * shape[0] * shape[1])


_NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, transposed", [((512, 2048), False), ((2048, 512), False),
                                               ((768, 1536), True), ((3, 256, 1024), False),
                                               ((2, 2, 128, 2048), False)])
def test_in_place_iterate_matches_whole(shape: tuple[int, ...], transposed: bool,
                                        dtype: torch.dtype) -> None:
    """Column blocks of ``B X`` against the whole product (the step before): fp32 within 1e-7
    (bit for bit on the CPUs of BENCHMARKS §20), bf16 bit for bit (a column-major bf16 ``X``
    is not iterated in place)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    if transposed:
        x = x.mT.contiguous().mT
    wide = x.mT if x.size(-2) > x.size(-1) else x
    assert muon._ns_columns(wide.to(dtype)) is not None or dtype == torch.bfloat16
    got = muon._newton_schulz_(x.to(dtype, copy=True), *_NS)
    with mock.patch.object(muon, "_ns_columns", lambda X: None):
        want = muon._newton_schulz_(x.to(dtype, copy=True), *_NS)
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= (1e-7 if dtype == torch.float32 else 0.0), diff


@pytest.mark.parametrize("shape", [(512, 2048), (2048, 512)])
def test_in_place_muon_bitwise_matches_torch_muon(shape: tuple[int, int]) -> None:
    """bf16 Newton–Schulz iterated in place still replays ``torch.optim.Muon`` bit for bit."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(2)]
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, momentum=0.95)
    w, state = w0.clone(), {"momentum_buffer": torch.zeros_like(w0)}
    for step, g in enumerate(grads, 1):
        ref.grad = g.clone()
        opt.step()
        muon.muon_step(w, g, state, lr=0.02, weight_decay=0.1, step=step, initial_lr=0.02,
                       config=MuonConfig())
    assert torch.equal(w, ref.detach())


def test_chunked_newton_schulz_input_is_bitwise() -> None:
    gen = torch.Generator().manual_seed(0)
    with mock.patch.object(muon, "_CHUNK_BYTES", 1):  # 64 rows per chunk
        for shape, transposed in [((300, 129), False), ((300, 129), True), ((3, 130, 70), False)]:
            g = torch.randn(shape, generator=gen)
            b = torch.randn(shape, generator=gen)
            if transposed:
                g, b = g.mT, b.mT.contiguous()
            want = g.lerp(b, 0.95).to(torch.bfloat16)
            got = muon.newton_schulz_input(g, b, 0.95, True, torch.bfloat16)
            assert torch.equal(got, want) and got.stride() == want.stride(), (shape, transposed)
            assert torch.equal(muon.newton_schulz_input(g, b, 0.95, False, torch.bfloat16),
                               b.to(torch.bfloat16))


# -- batches cut by bytes ---------------------------------------------------------------------
def _items(shape: tuple[int, ...], count: int, seed: int = 0) -> list[OwnedMatrix]:
    gen = torch.Generator().manual_seed(seed)
    return [OwnedMatrix(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen),
                        {"momentum_buffer": torch.randn(shape, generator=gen)}, 2)
            for _ in range(count)]


def test_batches_cut_by_stacked_bytes() -> None:
    items = _items((32, 48), 10) + _items((48, 32), 3)
    per = stacked_bytes(items[0])
    assert per == 3 * 32 * 48 * 4
    sizes = [len(b) for b in batch_owned(items, StepBatching(True, max_bytes=4 * per + 1))]
    assert sizes == [4, 4, 2, 3]
    assert [len(b) for b in batch_owned(items, True)] == [10, 3]  # all below the default cap
    assert [len(b) for b in batch_owned(items, StepBatching(True, max_bytes=1))] == [1] * 13
    assert [len(b) for b in batch_owned(items, False)] == [1] * 13
    big = _items((1024, 1024), 2)  # 12 MiB stacked each: the default cap is 16 MiB
    assert StepBatching(True).cap(big) == DEFAULT_BATCH_BYTES
    assert [len(b) for b in batch_owned(big, True)] == [1, 1]
    huge = _items((1280, 1280), 1) + _items((640, 640), 8)  # largest item: 18.75 MiB stacked
    assert StepBatching(True).cap(huge) == stacked_bytes(huge[0])
    assert [len(b) for b in batch_owned(huge, True)] == [1, 4, 4]


@pytest.mark.parametrize("kwargs", [{"same_shape": 1}, {"max_bytes": 0}, {"max_bytes": 2.0},
                                    {"max_bytes": True}])
def test_step_batching_validates(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="StepBatching"):
        StepBatching(**kwargs)


def _stepped(items: list[OwnedMatrix], batching: StepBatching | bool, ns_dtype: str) -> list:
    spec = get_matrix_optimizer("muon")
    hyper = {"lr": 0.02, "weight_decay": 0.1, "initial_lr": 0.02,
             "config": MuonConfig(ns_dtype=ns_dtype)}
    for batch in batch_owned(items, batching):
        step_owned(spec, batch, hyper)
    return [(it.param, it.state["momentum_buffer"]) for it in items]


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_capped_batches_step_as_uncapped_and_unbatched(ns_dtype: str) -> None:
    shape, count = (48, 80), 7
    per = stacked_bytes(_items(shape, 1)[0])
    runs = {name: _stepped(_items(shape, count), batching, ns_dtype) for name, batching in {
        "uncapped": StepBatching(True, max_bytes=count * per),
        "capped": StepBatching(True, max_bytes=3 * per),
        "unbatched": StepBatching(False)}.items()}
    for i in range(count):
        for j, what in enumerate(("param", "momentum")):
            assert torch.equal(runs["capped"][i][j], runs["uncapped"][i][j]), (i, what)
            diff = (runs["capped"][i][j] - runs["unbatched"][i][j]).abs().max().item()
            assert diff <= (0.0 if ns_dtype == "float32" else 1e-6), (i, what, diff)


def test_capped_batch_transient_is_bounded_by_bytes() -> None:
    shape, count = (256, 512), 12  # 0.5 MiB fp32 each; 1.5 MiB stacked
    per = stacked_bytes(_items(shape, 1)[0])
    cap = 3 * per
    capped = owner_step_transient(shape, count, StepBatching(True, max_bytes=cap), "bfloat16")
    uncapped = owner_step_transient(shape, count, StepBatching(True, max_bytes=count * per),
                                    "bfloat16")
    assert capped <= 1.5 * cap + CHUNK, capped / cap
    assert uncapped > 1.5 * cap + CHUNK  # the cap is what bounds it


# -- MatrixOptimizer on owners, per rank ------------------------------------------------------
def _owner_step(rank: int, world: int, ns_dtype: str) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(dim=384, hidden=1536, layers=1)
    mf.fully_shard_matrix(model)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.02, ns_dtype=ns_dtype)
    largest = 384 * 1536 * 4
    for step in range(2):
        lm_loss(model, local_batch(global_batch(step, batch=4, seq=5), rank, world)).backward()
        tracker = LiveBytesTracker()
        with tracker, owner_step_transients(tracker) as calls:
            opt.step()
        opt.zero_grad(set_to_none=True)
        most = max(c["transient"] for c in calls) if calls else 0
        if ns_dtype == "bfloat16":
            assert most <= _bound(largest), f"rank {rank}: {most / largest:.2f}x the largest"
        else:  # fp32 Newton–Schulz in place: |X| + max(2k², k² + k c) fp32 elements
            bound = _in_place_bound((384, 1536), torch.float32)
            assert most <= bound, f"rank {rank}: {most / largest:.2f}x"


def _capped_optimizer(rank: int, world: int) -> None:
    """``MatrixOptimizer(batch_same_shape=StepBatching(...))``: batches within the cap, the
    same values as one matrix at a time (fp32 Newton–Schulz: bit for bit)."""
    models, calls = [], []
    cap = 2 * 3 * 32 * 64 * 4  # two (32, 64) matrices' parameter, gradient and momentum
    for batching in (StepBatching(True, max_bytes=cap), False):
        torch.manual_seed(0)
        model = TinyTransformer(dim=32, hidden=64, layers=4)
        mf.fully_shard_matrix(model)
        opt = mf.MatrixOptimizer(model, "muon", lr=0.02, ns_dtype="float32",
                                 batch_same_shape=batching)
        assert opt.batch_same_shape is bool(batching)
        for step in range(2):
            lm_loss(model, local_batch(global_batch(step, batch=4, seq=5), rank, world)).backward()
            tracker = LiveBytesTracker()
            with tracker, owner_step_transients(tracker) as stepped:
                opt.step()
            opt.zero_grad(set_to_none=True)
            calls += stepped if batching else []
        models.append(model)
    assert calls and all(c["batch"] * 3 * c["param_bytes"] <= cap for c in calls)
    assert any(c["batch"] == 2 for c in calls), [c["batch"] for c in calls]
    got, want = full_values(models[0]), full_values(models[1])
    for fqn, value in want.items():
        assert torch.equal(got[fqn], value), fqn


def _world(rank: int, world: int) -> None:
    subtests = {f"owner step, {dt}": functools.partial(_owner_step, rank, world, dt)
                for dt in ("bfloat16", "float32")}
    subtests["capped optimizer"] = functools.partial(_capped_optimizer, rank, world)
    run_subtests(rank, subtests)


def test_owner_step_transient_per_rank() -> None:
    run_world(2, _world)


def test_live_bytes_tracker_nested_phases() -> None:
    tracker = LiveBytesTracker()
    with tracker, tracker.phase("outer"):
        a = torch.empty(100)
        with tracker.phase("inner"):
            b = torch.empty(50)
            del b
        c = torch.empty(10)
        del a, c
    assert tracker.phases["inner"] == (400, 600)
    assert tracker.phases["outer"] == (0, 600)


# -- row layouts: one batch's gathered copies at a time ----------------------------------------
def _row_items(count: int, orientation: str = "out_in") -> tuple[list, list, MatrixLayout]:
    layout = MatrixLayout(orientation, rows=(tuple(range(0, 192, 2)), tuple(range(1, 192, 2))))
    gen = torch.Generator().manual_seed(3)
    params, states = [], []
    for _ in range(count):
        shape = (192, 128) if orientation == "out_in" else (128, 192)
        p = torch.randn(shape, generator=gen)
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
        states.append(init_owned_state(p, get_matrix_optimizer("muon"), MuonConfig(), layout))
    return params, states, layout


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("orientation", ["out_in", "in_out"])
def test_row_layout_blocks_gathered_per_batch(orientation: str, batched: bool) -> None:
    spec, hyper = get_matrix_optimizer("muon"), {"lr": 0.02, "weight_decay": 0.1,
                                                 "initial_lr": 0.02, "config": MuonConfig()}
    params, states, layout = _row_items(6, orientation)
    want = [p.detach().clone() for p in params]
    want_states = [{k: v.clone() for k, v in s.items()} for s in states]
    for w, p, st in zip(want, params, want_states, strict=True):  # every block gathered by hand
        view = w if orientation == "out_in" else w.mT
        gview = p.grad if orientation == "out_in" else p.grad.mT
        for i, rows in enumerate(layout.rows):
            index = torch.tensor(rows)
            block = view.index_select(0, index)
            muon.muon_step(block, gview.index_select(0, index),
                           {"momentum_buffer": st[f"momentum_buffer@{i}"]}, step=1, **hyper)
            view.index_copy_(0, index, block)
    tracker = LiveBytesTracker().track([t for p in params for t in (p, p.grad)],
                                       [t for s in states for t in s.values()])
    start = tracker.current
    with tracker:
        items = [it for p, s in zip(params, states, strict=True)
                 for it in owned_blocks(p, s, layout)]
        assert tracker.current - start < 4096  # placeholders and row indices, no copies
        for batch in batch_owned(items, batched):
            step_owned(spec, [it._replace(step=1) for it in batch], hyper)
        write_back_rows(items)  # what callers still do: placeholders are skipped
    per_matrix = 192 * 128 * 4
    if not batched:  # one block's copies (half a matrix each) and its step; were all 6 at once
        assert tracker.peak - start < 2 * per_matrix, (tracker.peak - start) / per_matrix
    for w, p, ws, s in zip(want, params, want_states, states, strict=True):
        tol = 1e-6 if batched else 0.0  # bf16 Newton–Schulz batched: rounding
        assert (p.detach() - w).abs().max() <= tol
        assert all(torch.equal(s[k], ws[k]) for k in ws if k != "step")
