"""``torch.compile`` on the blocks of a wrapped model (see ``_eager`` in ``runtime/state.py``).

Per-block compilation (``block.compile()``, the in-place form that keeps parameter names) gives
the eager numbers over 3 optimizer steps, and a compiled block traces its body in as many graphs as
the same block under stock FSDP2 (the runtime's hooks run eagerly between graphs, as FSDP2's do).
``backend="aot_eager"`` traces forward and backward graphs without a C++ toolchain; the compiled
step time against FSDP2-compiled is a benchmark (BENCHMARKS §15).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import fully_shard

import matrixfsdp as mf

from .checks import assert_close_dicts, full_values, reference_values
from .dist_utils import run_subtests, run_world
from .models import TinyTransformer, global_batch, lm_loss, local_batch

PARAM_RTOL = 1e-5

torch_dynamo = pytest.importorskip("torch._dynamo")


def _compiled_matches_eager(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = TinyTransformer()
    eager, compiled = (mf.fully_shard_matrix(copy.deepcopy(ref)) for _ in range(2))
    for block in compiled.layers:
        block.compile(backend="aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ref, eager, compiled)]
    for step in range(3):
        tokens = global_batch(step)
        lm_loss(ref, tokens).backward()
        for m in (eager, compiled):
            lm_loss(m, local_batch(tokens, rank, world)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    got = full_values(compiled)
    assert_close_dicts(got, full_values(eager), PARAM_RTOL, "compiled vs eager")
    assert_close_dicts(got, reference_values(ref), PARAM_RTOL, "compiled vs one process")


def _graph_breaks(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, int, list[str]]:
    torch_dynamo.reset()
    explained = torch_dynamo.explain(module)(x)
    return (explained.graph_count, explained.graph_break_count,
            [str(r.reason).splitlines()[0] for r in explained.break_reasons])


def _no_more_breaks_than_fsdp2(rank: int, world: int) -> None:
    """The whole model, and one block called on its own (under no_grad: a block whose norms live
    in the root's unit runs alone only without grad, see [Note: tail units])."""
    torch.manual_seed(0)
    ref = TinyTransformer()
    stock = copy.deepcopy(ref)
    for layer in stock.layers:
        fully_shard(layer)
    fully_shard(stock)
    tokens = local_batch(global_batch(0), rank, world)[:, :-1]
    x = torch.randn(2, 8, 16)
    for tail_units in ("auto", "groups"):
        ours = mf.fully_shard_matrix(copy.deepcopy(ref), tail_units=tail_units)
        for what, stock_part, part, arg in (("model", stock, ours, tokens),
                                            ("block", stock.layers[1], ours.layers[1], x)):
            with torch.set_grad_enabled(what == "model"):
                want = _graph_breaks(stock_part, arg)
                got = _graph_breaks(part, arg)
            assert got[:2] <= want[:2], (
                f"{what} ({tail_units=}): {got[1]} graph breaks ({got[0]} graphs), stock FSDP2 "
                f"{want[1]} ({want[0]}): {got[2]}")
    torch_dynamo.reset()


def _world(rank: int, world: int) -> None:
    run_subtests(rank, {
        "compiled_matches_eager": functools.partial(_compiled_matches_eager, rank, world),
        "no_more_breaks_than_fsdp2": functools.partial(_no_more_breaks_than_fsdp2, rank, world),
    })


def test_compile() -> None:
    run_world(2, _world)
