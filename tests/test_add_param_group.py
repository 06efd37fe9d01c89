"""``MatrixOptimizer.add_param_group`` takes ``split`` as the constructor does, at world 2.

A matrix group added with ``split`` (a number of blocks, a ``RowLayout``, row index lists, a
callable) steps bit for bit as the constructor's ``split`` steps it, and stores the same split;
without ``split`` it keeps the first group's entries for its matrices. Every value the
constructor refuses is refused with the constructor's message (prefixed with the group's
matrices). It was stored raw: the first step failed on an ``int``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import matrixfsdp as mf
from matrixfsdp.optim import RowLayout

from .checks import full_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, train_steps

UP, Q = "layers.1.up.weight", "layers.0.attn.q.weight"  # (40, 16) and (16, 16)
EVEN_ODD = RowLayout((tuple(range(0, 16, 2)), tuple(range(1, 16, 2))))
MUON = {"ns_dtype": "float32"}


def _make(optimizer: object = "muon", **kwargs: object) -> tuple[nn.Module, mf.MatrixOptimizer]:
    torch.manual_seed(0)
    model = mf.fully_shard_matrix(TinyTransformer())
    extra = MUON if optimizer == "muon" else {}
    return model, mf.MatrixOptimizer(model, optimizer, lr=0.02, tail_lr=1e-2, **extra, **kwargs)


def _take(model: nn.Module, opt: mf.MatrixOptimizer, fqn: str) -> torch.Tensor:
    """Remove matrix ``fqn`` from the first group and return its parameter."""
    moved = mf.get_state(model).params[fqn].sharded
    first = opt.param_groups[0]["params"]
    del first[next(i for i, p in enumerate(first) if p is moved)]
    return moved


def _same_as_constructor(rank: int, world: int) -> None:
    forms = {
        "int": ({UP: 2}, {UP: 2}),
        "row layout": ({Q: EVEN_ODD}, {"*.0.attn.q.weight": EVEN_ODD}),
        "row lists": ({Q: [list(b) for b in EVEN_ODD.blocks]}, {Q: [list(b) for b in EVEN_ODD.blocks]}),
        "sizes": ({UP: [24, 16]}, lambda fqn, shape: [24, 16] if shape == (40, 16) else None),
    }
    for name, (ctor_split, group_split) in forms.items():
        want, want_opt = _make(split=ctor_split)
        model, opt = _make()
        fqns = [UP] if UP in ctor_split else [Q]
        moved = [_take(model, opt, f) for f in fqns]
        opt.add_param_group({"params": moved, "split": group_split})
        stored = opt.param_groups[-1]["split"]
        assert stored == {f: want_opt.param_groups[0]["split"][f] for f in fqns}, (name, stored)
        train_steps(want, want_opt, range(2), rank, world)
        train_steps(model, opt, range(2), rank, world)
        got, expected = full_values(model), full_values(want)
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{name}: {key} differs"


def _inherits_first_group(rank: int, world: int) -> None:
    model, opt = _make(split={UP: 2, Q: EVEN_ODD})
    opt.add_param_group({"params": [_take(model, opt, UP)], "lr": 0.01})
    assert opt.param_groups[-1]["split"] == {UP: [20, 20]}
    model, opt = _make(split={UP: 2})
    opt.add_param_group({"params": [_take(model, opt, UP)], "split": None})
    assert opt.param_groups[-1]["split"] == {}


def _constructor_message(split: object, optimizer: object = "muon") -> str:
    with pytest.raises((ValueError, NotImplementedError)) as info:
        _make(optimizer, split=split)
    return str(info.value)


def _refused_alike(rank: int, world: int) -> None:
    bad = [{UP: 3}, {UP: [20, 21]}, {Q: RowLayout(((0, 1), (2, 3)))}, {Q: [[0, 1], [1, 2]]},
           {Q: "two"}, 2, {3: 2}]
    for split in bad:
        want = _constructor_message(split)
        model, opt = _make()
        with pytest.raises(ValueError) as info:
            opt.add_param_group({"params": [_take(model, opt, UP if UP in str(split) else Q)],
                                 "split": split})
        assert want in str(info.value), (split, want, str(info.value))
        assert "MatrixOptimizer.add_param_group (matrices [" in str(info.value)
    model, opt = _make()  # a pattern over matrices outside the group
    with pytest.raises(ValueError, match=r"'\*\.up\.weight' matches no matrix of this param group "
                       r"\(1 matrices\).*'layers\.0\.attn\.q\.weight'"):
        opt.add_param_group({"params": [_take(model, opt, Q)], "split": {"*.up.weight": 2}})
    want = _constructor_message({Q: 2}, torch.optim.SGD)  # a torch.optim class steps whole
    model, opt = _make(torch.optim.SGD, momentum=0.9)
    with pytest.raises(NotImplementedError) as info:
        opt.add_param_group({"params": [_take(model, opt, Q)], "split": {Q: 2}})
    assert str(info.value) == want
    model, opt = _make()
    with pytest.raises(ValueError, match=r"MatrixOptimizer\.lr must be a finite number >= 0"):
        opt.add_param_group({"params": [_take(model, opt, Q)], "lr": -1.0})


def _world(rank: int, world: int) -> None:
    at = functools.partial
    run_subtests(rank, {
        "same_as_constructor": at(_same_as_constructor, rank, world),
        "inherits_first_group": at(_inherits_first_group, rank, world),
        "refused_alike": at(_refused_alike, rank, world),
    })


def test_add_param_group_split() -> None:
    run_world(2, _world, timeout=300.0)
