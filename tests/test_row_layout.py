"""Row-layout splits (``RowLayout``, ``qkv_row_layout``) against one process stepping each block.

The reference keeps every matrix whole in one process and steps each block as its own matrix:
it gathers the block's rows (``W[rows]``), calls the registered step function on them and
scatters the result back (``W[rows] = block``), with one state per block. The wrapped model at
world 2 (and the TP step at tp 2) must give the same parameters and per-block state, bit for bit
where no batching changes the rounding. The layout of torchtitan's fused ``wqkv`` is derived
here independently of ``qkv_row_layout``: a ``(n_kv_heads, n_heads // n_kv_heads + 2,
head_dim)`` view of the row indices, split as torchtitan's state-dict hook splits ``wqkv``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp as mf
from matrixfsdp.optim import RowLayout, get_matrix_optimizer, qkv_row_layout
from matrixfsdp.optim.layouts import MatrixLayout
from matrixfsdp.optim.offload import make_state_placement
from matrixfsdp.optim.tp_step import TpMatrix, WholeStepper, step_tp_matrices
from matrixfsdp.runtime.tp import tp_layout_of

from .checks import FREE_RUNNING_KWARGS, full_optimizer_state, full_values
from .dist_utils import run_subtests, run_world

H, KV, HD, D = 4, 2, 2, 8  # n_heads, n_kv_heads, head_dim, model dim: wqkv is (16, 8)
ROWS = (H + 2 * KV) * HD
LR, WD, STEPS = 0.02, 0.01, 3
PATTERN = "*.wqkv.weight"
E, FF = 4, 3  # experts, and each one's gate (and up) rows
GATE_UP = [list(range(0, 2 * FF, 2)), list(range(1, 2 * FF, 2))]  # interleaved: gate | up


def _titan_blocks(per: str) -> list[list[int]]:
    """torchtitan's wq / wk / wv rows of ``wqkv`` (its ``_split_qkv_on_save``), or its heads."""
    hpk = H // KV
    idx = torch.arange(ROWS).reshape(KV, hpk + 2, HD)
    if per == "head":
        return [head.tolist() for head in idx.reshape(-1, HD)]
    return [idx[:, :hpk].reshape(-1).tolist(), idx[:, hpk].reshape(-1).tolist(),
            idx[:, hpk + 1].reshape(-1).tolist()]


# A layout no contiguous split gives: blocks out of order, rows within a block not increasing.
SHUFFLED = [[5, 0, 9, 14], [1, 2, 3, 4, 6, 7, 8], [15, 10, 11, 12, 13]]


# -- layouts without a process group ---------------------------------------------------------------
@pytest.mark.parametrize("per", ["qkv", "head"])
def test_qkv_row_layout_is_torchtitans_wqkv(per: str) -> None:
    layout = qkv_row_layout(H, KV, HD, per=per)
    assert [list(b) for b in layout.blocks] == _titan_blocks(per)
    assert layout.rows == ROWS
    if per == "head":  # one head per block, in storage order: a plain contiguous split
        assert layout.contiguous_sizes() == (HD,) * (ROWS // HD)
    else:
        assert layout.contiguous_sizes() is None


def test_qkv_row_layout_matches_torchtitan_module() -> None:
    """The q/k/v blocks are the rows torchtitan's own FusedQKVLinear hook writes as wq/wk/wv."""
    attention = pytest.importorskip("torchtitan.models.common.attention")
    weight = torch.arange(ROWS, dtype=torch.float32)[:, None].expand(ROWS, D).contiguous()
    module = type("M", (), {"head_dim": HD, "heads_per_kv": H // KV, "r_dim": H // KV + 2})
    sd = {"wqkv.weight": weight}
    attention.FusedQKVLinear._split_qkv_on_save(module, sd, "", None)
    layout = qkv_row_layout(H, KV, HD)
    for block, name in zip(layout.blocks, ("wq", "wk", "wv"), strict=True):
        assert sd[f"{name}.weight"][:, 0].long().tolist() == list(block), name


@pytest.mark.parametrize("per", ["qkv", "head"])
def test_fused_qkv_split_on_torchtitan_llama3(per: str) -> None:
    """On torchtitan's Llama3 (GQA: 4 heads, 2 KV groups), every wqkv gets its layout, whose
    q/k/v blocks hold exactly the rows torchtitan's state dict writes as wq/wk/wv."""
    pytest.importorskip("torchtitan")
    from matrixfsdp.optim import fused_qkv_split

    from .titan_models import build_llama3, tiny_llama3_config

    model = build_llama3(config=tiny_llama3_config(n_heads=4, n_kv_heads=2))
    split = fused_qkv_split(model, per=per)
    fused = {f for f, _ in model.named_parameters() if f.endswith(".wqkv.weight")}
    assert set(split) == fused and len(fused) == 2
    state = model.state_dict()  # torchtitan's hook: wq / wk / wv in place of wqkv
    params = dict(model.named_parameters())
    for fqn, layout in split.items():
        weight = params[fqn].detach()
        assert layout.rows == weight.shape[0] == (4 + 2 * 2) * 16
        if per == "head":
            assert layout.contiguous_sizes() == (16,) * 8
            continue
        prefix = fqn.removesuffix("wqkv.weight")
        for rows, name in zip(layout.blocks, ("wq", "wk", "wv"), strict=True):
            assert torch.equal(weight[list(rows)], state[f"{prefix}{name}.weight"]), (fqn, name)
    assert fused_qkv_split(nn.Linear(2, 2)) == {}


@pytest.mark.parametrize("blocks,match", [
    ([[0, 1], [1, 2]], r"RowLayout.blocks: block 1 holds row 1 and block 0 holds it too"),
    ([[0, 0, 1]], r"RowLayout.blocks: block 0 holds row 0 twice"),
    ([[0, 1], [3]], r"RowLayout.blocks: block 1 holds row 3, out of range for 3 rows"),
    ([[0], []], r"RowLayout.blocks: blocks \[1\] are empty"),
    ([], r"RowLayout.blocks: no blocks"),
    ([[0, 1.0]], r"RowLayout.blocks\[0\]\[1\] = 1.0 is not an int row index"),
    ([[0, True]], r"RowLayout.blocks\[0\]\[1\] = True is not an int"),
    ("01", r"RowLayout.blocks must be a sequence"),
])
def test_row_layout_validates_its_blocks(blocks: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RowLayout(blocks)


def test_row_layout_constructors() -> None:
    layout = RowLayout.from_permutation([2, 0, 3, 1], [1, 3])
    assert layout.blocks == ((2,), (0, 3, 1)) and layout == RowLayout([[2], [0, 3, 1]])
    assert RowLayout([[0, 1], [2]]).contiguous_sizes() == (2, 1)
    with pytest.raises(ValueError, match=r"from_permutation sizes: .* sum to len"):
        RowLayout.from_permutation([0, 1, 2], [1, 1])
    with pytest.raises(ValueError, match="per must be 'qkv' or 'head'"):
        qkv_row_layout(H, KV, HD, per="kv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_heads=3 is not a multiple of n_kv_heads=2"):
        qkv_row_layout(3, 2, HD)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        qkv_row_layout(H, KV, 0)


# -- the wrapped model at world 2 ------------------------------------------------------------------
class _Experts(nn.Module):
    """A fused gate/up expert stack stored ``(E, in, out)`` (Hugging Face's flag), its gate and
    up rows alternating: a row layout of a transposed 3-D view."""

    is_transposed = True

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(E, D, 2 * FF))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(D, ROWS, bias=False)
        self.wo = nn.Linear(H * HD, D, bias=False)
        self.experts = _Experts()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attention() for _ in range(2)])


def _grad(fqn: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    seed = 1000 * step + sum(map(ord, fqn))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _kwargs(name: str) -> dict[str, Any]:
    return FREE_RUNNING_KWARGS.get(name, {})


class _BlockReference:
    """One process: every block of every matrix stepped as its own matrix (gather, step,
    scatter), with the registered step function. Weights are kept in their ``(*, out, in)``
    view (``transposed``: stored ``(*, in, out)``); an expert stack's block is that block of
    every expert, one ``(E, rows, in)`` batch."""

    def __init__(self, weights: dict[str, torch.Tensor], blocks: dict[str, list[list[int]]],
                 name: str, transposed: frozenset[str] = frozenset()) -> None:
        self.spec = get_matrix_optimizer(name)
        self.config = self.spec.make_config(_kwargs(name))
        self.transposed = transposed
        self.weights = {f: self._view(f, w).clone() for f, w in weights.items()}
        self.blocks = {f: blocks.get(f, [list(range(w.shape[-2]))])
                       for f, w in self.weights.items()}
        self.state = {f: [self.spec.init_state_fn(w[..., rows, :].clone(), self.config)
                          for rows in self.blocks[f]] for f, w in self.weights.items()}

    def _view(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return t.mT if fqn in self.transposed else t

    def step(self, grads: dict[str, torch.Tensor], step: int) -> None:
        for fqn, weight in self.weights.items():
            grad = self._view(fqn, grads[fqn])
            for rows, state in zip(self.blocks[fqn], self.state[fqn], strict=True):
                block = weight[..., rows, :].clone()
                self.spec.step_fn(block, grad[..., rows, :].clone(), state, step=step, lr=LR,
                                  weight_decay=WD, initial_lr=LR, config=self.config)
                weight[..., rows, :] = block

    def stored(self, fqn: str) -> torch.Tensor:
        """A weight as the model stores it."""
        return self._view(fqn, self.weights[fqn])


def _build(stacks: str = "auto") -> _Model:
    torch.manual_seed(3)
    model = _Model()
    mf.fully_shard_matrix(model, planner=mf.LPTPlanner(stacks=stacks))
    return model


def _train(model: _Model, opt: mf.MatrixOptimizer, start: int = 0) -> None:
    """``STEPS`` steps on the same full gradients as the reference's: set on owners, and as
    ``Shard(0)`` DTensors on the expert slices of sharded stacks."""
    named = dict(model.named_parameters())
    params = mf.get_state(model).params
    sliced = {p.fqn for p in mf.get_plan(model).sharded_stacks}
    for step in range(start, start + STEPS):
        for fqn, p in named.items():
            if fqn in sliced:
                p.grad = distribute_tensor(_grad(fqn, step, tuple(p.shape)), p.device_mesh,
                                           p.placements)
            elif fqn in params and params[fqn].is_owner:
                p.grad = _grad(fqn, step, tuple(params[fqn].shape))
        opt.step()
        opt.zero_grad()


def _exact(name: str, split: Any, blocks: list[list[int]], variant: str = "") -> None:
    """wqkv (``split``, whose rows are ``blocks``) and the gate/up stack (``GATE_UP``) against
    the reference; ``variant``: batched, offloaded state, or stacks owned whole."""
    model = _build("whole" if variant in ("whole stacks", "offload") else "auto")
    weights = {f: w for f, w in full_values(model).items() if w is not None}
    extra = {"batch_same_shape": True} if variant == "batched" else (
        {"offload_state": "cpu"} if variant == "offload" else {})
    opt = mf.MatrixOptimizer(model, name, lr=LR, weight_decay=WD, **extra, **_kwargs(name),
                             split={PATTERN: split, "*.gate_up": GATE_UP})
    stacks = frozenset(f for f in weights if f.endswith("gate_up"))
    sliced = {p.fqn for p in mf.get_plan(model).sharded_stacks}
    assert sliced == (set() if "whole" in variant or variant == "offload" else stacks), sliced
    want = {f: blocks for f in weights if f.endswith("wqkv.weight")} | dict.fromkeys(stacks,
                                                                                       GATE_UP)
    ref = _BlockReference(weights, want, name, transposed=stacks)
    for step in range(STEPS):
        ref.step({f: _grad(f, step, tuple(w.shape)) for f, w in weights.items()}, step + 1)
    _train(model, opt)
    got = full_values(model)
    state = full_optimizer_state(model, opt)
    # Batching (and an expert slice's smaller batch) may round differently: else bit for bit.
    loose = variant == "batched" or (bool(stacks) and not variant)
    for fqn in ref.weights:
        tol = ({"rtol": 1e-6, "atol": 1e-7} if loose and (variant or fqn in stacks)
               else {"rtol": 0, "atol": 0})
        torch.testing.assert_close(got[fqn], ref.stored(fqn), **tol,
                                   msg=lambda m, f=fqn: f"{f}: {m}")
        n = len(ref.blocks[fqn])
        for i, block_state in enumerate(ref.state[fqn]):
            for key, value in block_state.items():
                saved = state[fqn][key if n == 1 else f"{key}@{i}"]
                torch.testing.assert_close(saved, value, **tol)


def _errors_name_the_parameter() -> None:
    """Bad row layouts: ValueError naming the FQN, its shape and the fix, on every rank."""
    model = _build()
    fqn = "layers.0.wqkv.weight"
    where = rf"split\['{fqn}'\] for the \(out, in\) matrix of shape \(16, 8\) \(16 output rows\)"
    cases = [
        (qkv_row_layout(H, KV, 1), r"RowLayout covers 8 rows; build it for this matrix's 16"),
        ([[0, 1, 2], [2, *range(3, 16)]], r"block 1 holds row 2 and block 0 holds it too"),
        ([list(range(15))], r"rows \[15\] \(1 of 16\) are in no block.*Give each of rows"),
        ([list(range(15)), [16]], r"block 1 holds row 16, out of range for 16 rows"),
        ([[0, 1], ["a"]], r"each block must list int row indices"),
        ([10, 5], r"sizes \[10, 5\] must be positive integers summing to 16"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=where + ".*" + match):
            mf.MatrixOptimizer(model, "muon", split={fqn: bad})
    with pytest.raises(ValueError, match=r"\(RowLayout\(.*\) and .*make the patterns disjoint"):
        mf.MatrixOptimizer(model, "muon", split={PATTERN: qkv_row_layout(H, KV, HD),
                                                 fqn: qkv_row_layout(H, KV, HD, per="head")})


def _trained(split: Any) -> tuple[_Model, mf.MatrixOptimizer]:
    model = _build()
    opt = mf.MatrixOptimizer(model, "muon", lr=LR, weight_decay=WD, split={PATTERN: split},
                             **_kwargs("muon"))
    _train(model, opt)
    return model, opt


def _fresh(split: Any) -> tuple[_Model, mf.MatrixOptimizer]:
    torch.manual_seed(11)
    model = _Model()
    mf.fully_shard_matrix(model)
    opt = mf.MatrixOptimizer(model, "muon", lr=LR, weight_decay=WD,
                             split=None if split is None else {PATTERN: split}, **_kwargs("muon"))
    return model, opt


def _checkpoint_round_trip(root: str) -> None:
    """The layout is recorded: per-block state round-trips bitwise and training continues as
    if never stopped; another layout is refused naming the matrix; sizes equal to the layout
    (what releases before row layouts wrote) load."""
    qkv = qkv_row_layout(H, KV, HD)
    model, opt = _trained(qkv)
    path = f"{root}/qkv"
    mf.checkpoint.save(path, model, opt, step=STEPS)
    saved_values, saved_state = full_values(model), full_optimizer_state(model, opt)
    fresh, fresh_opt = _fresh(qkv)
    mf.checkpoint.load(path, fresh, fresh_opt)
    loaded = full_optimizer_state(fresh, fresh_opt)
    assert loaded.keys() == saved_state.keys()
    for fqn, entry in saved_state.items():
        assert loaded[fqn].keys() == entry.keys(), fqn
        for key, value in entry.items():
            assert torch.equal(loaded[fqn][key], value), (fqn, key)
    assert sum("momentum_buffer@2" in e for e in loaded.values()) == 2  # both wqkv, 3 blocks
    loaded_values = full_values(fresh)
    assert all(torch.equal(loaded_values[f], v) for f, v in saved_values.items())
    _train(model, opt, start=STEPS)
    _train(fresh, fresh_opt, start=STEPS)
    got, want = full_values(fresh), full_values(model)
    assert all(torch.equal(got[f], want[f]) for f in want), "training after the load differs"
    for other, match in [
        (qkv_row_layout(H, KV, HD, per="head"), r"'layers.0.wqkv.weight': checkpoint row layout "
         r"of 3 blocks of \[8, 4, 4\] rows \(not contiguous\), now contiguous blocks of "
         r"\[2, 2, 2, 2, 2, 2, 2, 2\] rows"),
        (None, r"now whole \(no split\).*pass MatrixOptimizer the checkpoint's split"),
    ]:
        bad_model, bad_opt = _fresh(other)
        with pytest.raises(mf.checkpoint.CheckpointMismatchError, match=match):
            mf.checkpoint.load(path, bad_model, bad_opt)
    sizes_model, sizes_opt = _trained([8, 4, 4])
    mf.checkpoint.save(f"{root}/sizes", sizes_model, sizes_opt, step=STEPS)
    as_layout = _fresh(RowLayout.from_permutation(range(ROWS), [8, 4, 4]))
    mf.checkpoint.load(f"{root}/sizes", *as_layout)


def _torch_state_dict_refuses_another_layout() -> None:
    """torch's load_state_dict would adopt the saved groups' split: refused, on every rank."""
    _, opt = _trained(qkv_row_layout(H, KV, HD))
    state_dict = opt.state_dict()
    _, same = _fresh(qkv_row_layout(H, KV, HD))
    same.load_state_dict(state_dict)
    _, other = _fresh(SHUFFLED)
    with pytest.raises(ValueError, match=r"load_state_dict: param group 0's state was stepped "
                       r"with another split= \('layers.0.wqkv.weight': checkpoint row layout"):
        other.load_state_dict(state_dict)


def _titan_container_round_trip() -> None:
    """torchtitan's checkpointer path (MatrixOptimizersContainer's flat, FQN-keyed state dict,
    after its zero-gradient init step): a row layout's per-block state comes back bitwise."""
    from matrixfsdp.integrations.torchtitan import MatrixOptimizersContainer

    config = MatrixOptimizersContainer.Config(
        lr=LR, weight_decay=WD, kwargs=_kwargs("muon"), split={PATTERN: qkv_row_layout(H, KV, HD)})
    model = _build()
    container = MatrixOptimizersContainer(config, model_parts=[model])
    _train(model, container.optimizers[0])
    flat = container.state_dict()
    assert any(k.endswith("wqkv.weight.momentum_buffer@2") for k in flat), sorted(flat)[:8]
    fresh = _build()
    fresh_container = MatrixOptimizersContainer(config, model_parts=[fresh])
    fresh_container.load_state_dict(flat)
    saved = full_optimizer_state(model, container.optimizers[0])
    loaded = full_optimizer_state(fresh, fresh_container.optimizers[0])
    for fqn, entry in saved.items():
        assert loaded[fqn].keys() == entry.keys(), fqn
        for key, value in entry.items():
            assert torch.equal(loaded[fqn][key], value), (fqn, key)


def _world(rank: int, world: int, root: str) -> None:
    qkv, head = qkv_row_layout(H, KV, HD), qkv_row_layout(H, KV, HD, per="head")
    subtests: dict[str, Callable[[], None]] = {
        "muon qkv": functools.partial(_exact, "muon", qkv, _titan_blocks("qkv")),
        "muon head": functools.partial(_exact, "muon", head, _titan_blocks("head")),
        "muon shuffled lists": functools.partial(_exact, "muon", SHUFFLED, SHUFFLED),
        "muon qkv batched": functools.partial(_exact, "muon", qkv, _titan_blocks("qkv"),
                                              "batched"),
        "muon qkv offload": functools.partial(_exact, "muon", qkv, _titan_blocks("qkv"),
                                              "offload"),
        "muon whole stacks": functools.partial(_exact, "muon", qkv, _titan_blocks("qkv"),
                                               "whole stacks"),
        "shampoo qkv": functools.partial(_exact, "shampoo", qkv, _titan_blocks("qkv")),
        "soap shuffled": functools.partial(_exact, "soap", RowLayout(SHUFFLED), SHUFFLED),
        "errors": _errors_name_the_parameter,
        "tp": _tp_step_exact,
        "tp model": _tp_model_exact,
        "checkpoint": functools.partial(_checkpoint_round_trip, root),
        "torch state dict": _torch_state_dict_refuses_another_layout,
    }
    if importlib.util.find_spec("torchtitan") is not None:  # the optional extra
        subtests["torchtitan container"] = _titan_container_round_trip
    run_subtests(rank, subtests)
    dist.barrier()


# -- the TP step: the whole matrix on its step owner -----------------------------------------------
def _tp_step_exact() -> None:
    """TP shards of wqkv (Shard(0), as torchtitan's ColwiseParallel; and Shard(1)) made whole on
    the step owner and stepped per block: the reference's gathered-block step, bit for bit."""
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    layout = MatrixLayout("out_in", rows=qkv_row_layout(H, KV, HD).blocks)
    for name in ("muon", "shampoo"):
        spec = get_matrix_optimizer(name)
        hyper = {"lr": LR, "weight_decay": WD, "initial_lr": LR,
                 "config": spec.make_config(_kwargs(name))}
        weights, matrices = {}, []
        for i, dim in enumerate((0, 1)):
            full = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(i))
            tensor = distribute_tensor(full, mesh["tp"], [Shard(dim)], src_data_rank=None)
            tp = tp_layout_of(f"m{i}", tensor, mesh["dp"])
            weights[f"m{i}"] = full
            matrices.append(TpMatrix(f"m{i}", nn.Parameter(tensor.to_local().clone()), tp,
                                     step_owner=i % mesh["tp"].size(), layout=layout))
        ref = _BlockReference(weights, {f: _titan_blocks("qkv") for f in weights}, name)
        stepper = WholeStepper(spec, hyper, {}, make_state_placement(None, torch.device("cpu")))
        for step in range(STEPS):
            grads = {f: _grad(f, step, (ROWS, D)) for f in weights}
            for m in matrices:
                m.param.grad = m.tp.slice_of(grads[m.fqn], m.tp.tp_rank).clone()
            step_tp_matrices(matrices, stepper)
            ref.step(grads, step + 1)
        for m in matrices:
            want = m.tp.slice_of(ref.weights[m.fqn], m.tp.tp_rank)
            assert torch.equal(m.param.detach(), want), (name, m.fqn)
            if m.step_owner == m.tp.tp_rank:
                for i, block_state in enumerate(ref.state[m.fqn]):
                    for key, value in block_state.items():
                        assert torch.equal(stepper.state[m.param][f"{key}@{i}"], value), key


class _TpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(D, ROWS, bias=False)
        self.wo = nn.Linear(H * HD, D, bias=False)


def _tp_model_exact() -> None:
    """MatrixOptimizer over a parallelize_module'd model (wqkv Colwise, as torchtitan shards
    it; wo Rowwise) at dp 1 x tp 2: the row layout reaches the TP step; bit for bit."""
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(5)
    model = nn.Module()
    model.layers = nn.ModuleList([_TpBlock() for _ in range(2)])
    weights = {f: w.detach().clone() for f, w in model.named_parameters()}
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"wqkv": ColwiseParallel(),
                                               "wo": RowwiseParallel()})
    mf.fully_shard_matrix(model, mesh["dp"])
    params = mf.get_state(model).params
    assert all(params[f].tp is not None for f in weights)
    opt = mf.MatrixOptimizer(model, "muon", lr=LR, weight_decay=WD, **_kwargs("muon"),
                             split={PATTERN: qkv_row_layout(H, KV, HD)})
    fused = {f: _titan_blocks("qkv") for f in weights if f.endswith("wqkv.weight")}
    ref = _BlockReference(weights, fused, "muon")
    named = dict(model.named_parameters())
    for step in range(STEPS):
        grads = {f: _grad(f, step, tuple(w.shape)) for f, w in weights.items()}
        for fqn, mp in params.items():
            named[fqn].grad = mp.tp.slice_of(grads[fqn], mp.tp.tp_rank).clone()
        opt.step()
        opt.zero_grad()
        ref.step(grads, step + 1)
    got = full_values(model)
    for fqn, want in ref.weights.items():
        assert torch.equal(got[fqn], want), fqn


def test_row_layouts_exact_at_world_2(tmp_path: Path) -> None:
    """Muon, Shampoo, SOAP over row layouts at world 2 (and the TP step at tp 2) equal one
    process stepping each block separately; bad layouts name the parameter on every rank."""
    run_world(2, _world, str(tmp_path))


def test_checkpoint_layout_validates_the_recorded_split() -> None:
    """A layout's matrix group records the stored split; a malformed one does not parse."""
    from pydantic import ValidationError

    from matrixfsdp.checkpoint.layout import GroupLayout

    runs = {"rows": [[[0, 4], [8, 12]], [[4, 6], [12, 14]], [[6, 8], [14, 16]]]}
    for split in ({}, {"a": [8, 4, 4]}, {"a": runs}):  # sizes: what older releases wrote
        GroupLayout(kind="matrix", params=("a",), hyperparams={"split": split})
    for split, match in [
        ({"a": {"rows": [[[0, 2]], [[1, 3]]]}}, r"split\['a'\].*block 1 holds row 1"),
        ({"a": {"rows": [[[0, 2]], [[3, 4]]]}}, r"block 1 holds row 3, out of range for 3 rows"),
        ({"a": {"blocks": [[[0, 2]]]}}, r"not block sizes or \{'rows': runs\}"),
        ({"a": [4, 0]}, r"not block sizes"),
        ([1, 2], r"split must map matrix FQNs to blocks"),
    ]:
        with pytest.raises(ValidationError, match=match):
            GroupLayout(kind="matrix", params=("a",), hyperparams={"split": split})
