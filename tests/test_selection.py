"""The default matrix selection, the selection report in the log, orientation and split inputs.

Rule checks need no process group. The log checks wrap models in this process on a one-rank gloo
group (``caplog`` sees only this process), created and destroyed by a module fixture.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import matrixfsdp as mf
from matrixfsdp.optim import get_matrix_optimizer
from matrixfsdp.planner import ParamPlacement, Plan, make_plan, matrix_cost
from matrixfsdp.runtime.selection import default_groups, param_specs, select_params

from .models import TinyTransformer, global_batch, lm_loss


class _Experts(nn.Module):
    """Expert weights stored (E, in, out), flagged as Hugging Face does."""

    is_transposed = True

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(3, 8, 12))
        self.up_bias = nn.Parameter(torch.zeros(3, 12))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.stack = nn.Parameter(torch.randn(4, 6, 8))
        self.router = nn.Parameter(torch.randn(4, 8))
        self.pos = nn.Embedding(5, 8)
        self.conv = nn.Conv1d(8, 8, 3)
        self.kernel = nn.Parameter(torch.randn(2, 3, 4, 5))
        self.row = nn.Parameter(torch.randn(1, 8))
        self.experts = _Experts()
        self.norm = nn.LayerNorm(8)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def test_default_rule_selects_every_block_matrix_and_nothing_else() -> None:
    model = _Model()
    sites = {s.fqn: s for s in select_params(model, default_groups(model), None, "cpu")}
    for i in range(2):
        b = f"layers.{i}"
        assert {f for f, s in sites.items() if s.is_matrix and f.startswith(b + ".")} == {
            f"{b}.proj.weight", f"{b}.stack", f"{b}.router", f"{b}.experts.up"}
        assert sites[f"{b}.experts.up"].orientation == "in_out"
        assert sites[f"{b}.proj.weight"].orientation == "out_in"
        reasons = {f"{b}.pos.weight": "an embedding (or tied to one)",
                   f"{b}.experts.up_bias": "a bias", f"{b}.conv.weight": "a convolution kernel",
                   f"{b}.kernel": "4-D", f"{b}.row": "a vector (a matrix dim of size 1)",
                   f"{b}.proj.bias": "fewer than 2 dims"}
        for fqn, why in reasons.items():
            assert not sites[fqn].is_matrix and sites[fqn].why_tail == why, fqn
    for fqn in ("embed.weight", "head.weight"):
        assert not sites[fqn].is_matrix and sites[fqn].why_tail in (
            "outside every block (root level)", "an embedding (or tied to one)")
    # Conv kernels and >3-D tensors would be flattened to (out, in*k) if a filter selects them.
    assert sites["layers.0.conv.weight"].orientation == "flatten"
    assert sites["layers.0.kernel"].orientation == "flatten"


def test_weight_tied_to_an_embedding_stays_in_the_tail() -> None:
    model = _Model()
    model.layers[0].router = model.embed.weight  # (10, 8) 2-D inside a block, tied to the embedding
    sites = {s.fqn: s for s in select_params(model, default_groups(model), None, "cpu")}
    assert "layers.0.router" not in sites  # a shared parameter is listed once, at its first FQN
    assert not sites["embed.weight"].is_matrix


def test_plans_of_the_existing_models_are_unchanged() -> None:
    """The CLI and benchmark GPTs: the new rule selects exactly their block nn.Linear weights."""
    from benchmarks.config import ModelConfig as BenchModelConfig
    from benchmarks.model import build_gpt
    from matrixfsdp.launch.config import ModelConfig
    from matrixfsdp.launch.model import GPT

    for model in (GPT(ModelConfig(dim=16, layers=2, heads=2, hidden=24, seq_len=8)),
                  build_gpt(BenchModelConfig(dim=16, layers=2, heads=2, mlp_hidden=24)),
                  TinyTransformer(tie=True)):
        sites = select_params(model, default_groups(model), None, "cpu")
        old = {s.fqn for s in sites if s.group and isinstance(s.module, nn.Linear)
               and s.name == "weight"}
        assert {s.fqn for s in sites if s.is_matrix} == old, type(model).__name__


def test_plan_rows_of_older_layouts_validate_and_hash_as_before() -> None:
    """A plan written before ``orientation`` existed (7-item rows) loads; its hash is unchanged."""
    old = {"format_version": 1, "world_size": 2, "planner": "lpt-bytes", "notes": {},
           "params": [["a.weight", [4, 8], "float32", "matrix", "a", 1, 32.0],
                      ["b", [8], "float32", "tail", "", None, 0.0]]}
    old_hash = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode())
    plan = Plan.from_json(json.dumps(old))
    assert plan["a.weight"].orientation == "out_in" and plan["a.weight"].matrix_shape == (4, 8)
    assert plan.plan_hash() == old_hash.hexdigest()
    turned = plan.model_copy(update={"params": (plan.params[0]._replace(orientation="in_out"),
                                                plan.params[1])})
    again = Plan.from_json(turned.to_json())
    assert again["a.weight"].matrix_shape == (8, 4) and again.plan_hash() != plan.plan_hash()
    with pytest.raises(ValueError, match="cannot have orientation 'flatten'"):
        Plan(world_size=1, params=(ParamPlacement("w", (4, 4), "float32", "matrix", "", 0, 0.0,
                                                  "flatten"),))


def test_planner_costs_use_the_out_in_orientation() -> None:
    model = _Model()
    specs = param_specs(select_params(model, default_groups(model), None, "cpu"))
    spec = next(s for s in specs if s.fqn == "layers.0.experts.up")
    assert spec.matrix_shape == (3, 12, 8)
    plan = make_plan(specs, 2, "okls")
    assert plan["layers.0.experts.up"].cost == matrix_cost((3, 12, 8), "okls")


# -- in-process wrapping: the log ------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_wrap_logs_one_selection_line(one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    model = _Model()
    with caplog.at_level(logging.INFO, logger="matrixfsdp"):
        mf.fully_shard_matrix(model)
    info = _messages(caplog, logging.INFO)
    summary = [m for m in info if "go to owners" in m]
    assert len(summary) == 1, info
    # per block: proj + router (2-D), stack + experts.up (3-D); tail: everything else, once
    tail = len(mf.get_plan(model).params) - 8
    assert "4 matrices and 4 expert stacks (0 as expert slices) go to owners, " \
           f"{tail} tensors stay in the tail" in summary[0]
    skipped = [m for m in info if "stay in the tail by the default rule" in m]
    assert len(skipped) == 1 and "layers.*.conv.weight (x2)" in skipped[0], skipped
    assert "layers.*.kernel (x2)" in skipped[0] and "layers.*.row (x2)" in skipped[0]
    assert not _messages(caplog, logging.WARNING)
    selection = mf.get_plan(model).selection()
    assert set(selection.stacks) == {f"layers.{i}.{n}" for i in range(2) for n in ("stack", "experts.up")}
    assert set(selection.matrices) == {f"layers.{i}.{n}" for i in range(2)
                                       for n in ("proj.weight", "router")}
    assert "head.weight" in selection.tail and not mf.get_plan(model).notes


def test_filter_that_leaves_block_weights_out_is_named_once(
    one_rank: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The pre-0.2 default (nn.Linear weights only), given as a filter, plus the LM head."""
    model = _Model()
    linear_only = {f"layers.{i}.proj.weight" for i in range(2)} | {"head.weight"}
    with caplog.at_level(logging.INFO, logger="matrixfsdp"):
        mf.fully_shard_matrix(model, matrix_filter=lambda fqn, p: fqn in linear_only)
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "leaves 6 weight(s)" in warnings[0]
    for name in ("layers.*.stack (x2)", "layers.*.router (x2)", "layers.*.experts.up (x2)"):
        assert warnings[0].count(name) == 1, warnings[0]
    added = [m for m in _messages(caplog, logging.INFO) if "beyond" in m or "selects 1" in m]
    assert len(added) == 1 and "head.weight" in added[0]
    notes = mf.get_plan(model).notes
    assert set(notes) == {f"layers.{i}.{n}" for i in range(2)
                          for n in ("stack", "router", "experts.up")} | {"head.weight"}
    assert "left in the tail by matrix_filter" in notes["layers.0.router"]
    assert "root level" in notes["head.weight"]


def test_optimizer_warns_on_zero_matrices(one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    model = TinyTransformer()
    mf.fully_shard_matrix(model, matrix_filter=lambda fqn, p: False)
    with caplog.at_level(logging.WARNING, logger="matrixfsdp"):
        mf.MatrixOptimizer(model, "muon")
    zero = [m for m in _messages(caplog, logging.WARNING) if "zero matrices" in m]
    assert len(zero) == 1, caplog.records


def test_torch_optimizer_class_and_split(one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    model = _Model()
    mf.fully_shard_matrix(model, matrix_filter=lambda fqn, p: fqn.endswith(("proj.weight",
                                                                            "experts.up")))
    with caplog.at_level(logging.WARNING, logger="matrixfsdp"):
        mf.MatrixOptimizer(model, torch.optim.SGD, lr=0.1)
    stored = [m for m in _messages(caplog, logging.WARNING) if "stored orientation" in m]
    assert len(stored) == 1 and "layers.0.experts.up" in stored[0]
    with pytest.raises(NotImplementedError, match="cannot split"):
        mf.MatrixOptimizer(model, torch.optim.SGD, lr=0.1, split={"*.proj.weight": 2})


@pytest.mark.parametrize("split,match", [
    ({"*.qkv.weight": 3}, r"matches no matrix of the model; .*'layers.0.proj.weight'"),
    ({"head.weight": 2}, r"matches only tail parameters \(\['head.weight'\]\)"),
    ({"layers.0.proj.weight": [4, 4]}, r"layers.0.proj.weight.*\(6, 8\).*summing to 6"),
    ({"*.proj.weight": 4}, r"4 equal blocks do not divide 6 rows"),
    ({"*.proj.weight": [3, 3], "layers.1.*": [2, 4]}, r"matches '\*.proj.weight'.*make the patterns"),
    ({"*.proj.weight": [3.5, 2.5]}, r"must be positive integers"),
    (["*.proj.weight"], r"must be a mapping"),
])
def test_split_errors_name_the_parameter(one_rank: None, split: object, match: str) -> None:
    model = _Model()
    mf.fully_shard_matrix(model, matrix_filter=lambda fqn, p: fqn.endswith("proj.weight"))
    with pytest.raises(ValueError, match=match):
        mf.MatrixOptimizer(model, "muon", split=split)


def test_selected_conv_kernel_is_stepped_flattened(one_rank: None) -> None:
    """A conv kernel chosen by matrix_filter trains as its (out, in*k) matrix (Muon's rule)."""

    class ConvBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(4, 6, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x).tanh()

    class ConvNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([ConvBlock(), nn.Sequential(nn.Conv1d(6, 4, 1))])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[1](self.layers[0](x))

    torch.manual_seed(0)
    ref = ConvNet()
    model = copy.deepcopy(ref)
    mf.fully_shard_matrix(model, matrix_filter=lambda fqn, p: fqn == "layers.0.conv.weight")
    assert mf.get_plan(model)["layers.0.conv.weight"].matrix_shape == (6, 12)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.05, ns_dtype="float32")
    spec = get_matrix_optimizer("muon")
    config = spec.make_config({"ns_dtype": "float32"})
    w = ref.layers[0].conv.weight
    state = spec.init_state_fn(w.detach().reshape(6, 12), config)
    tail = torch.optim.AdamW([p for p in ref.parameters() if p is not w], lr=3e-4, weight_decay=0.0)
    for step in range(3):
        x = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(step))
        ref(x).square().mean().backward()
        model(x).square().mean().backward()
        with torch.no_grad():
            flat = w.detach().reshape(6, 12).clone()
            spec.step_fn(flat, w.grad.reshape(6, 12), state, lr=0.05, weight_decay=0.0,
                         step=step + 1, initial_lr=0.05, config=config)
            w.copy_(flat.view_as(w))
        tail.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    got = dict(model.named_parameters())["layers.0.conv.weight"]
    torch.testing.assert_close(got.detach(), w.detach(), rtol=1e-5, atol=1e-6)
    assert opt.state[got]["momentum_buffer"].shape == (6, 12)


def test_hf_models_default_selection(one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    """100% of the non-embedding block weights of 2+ dims; GPT-2's Conv1D weights transposed."""
    pytest.importorskip("transformers")
    from benchmarks.hf_selection import MODELS, build, selection_row

    rows = {name: selection_row(name, build(name)) for name in MODELS}
    for row in rows.values():
        assert row["selected"] == row["block_weights"] - row["embeddings"] > 0, row
    assert rows["gpt2"]["previous_rule"] == 0 and rows["gpt2"]["transposed"] == 8
    assert rows["qwen3_moe"]["stacks"] == rows["mixtral"]["stacks"] == 4
    assert rows["t5"]["embeddings"] == 2  # relative_attention_bias in block 0 of each stack
    gpt2 = build("gpt2")
    with caplog.at_level(logging.INFO, logger="matrixfsdp"):
        mf.fully_shard_matrix(gpt2, matrix_filter=lambda fqn, p: False)
    warning = " ".join(_messages(caplog, logging.WARNING))
    assert "transformer.h.*.attn.c_attn.weight (x2)" in warning and "leaves 8 weight(s)" in warning


def test_split_state_round_trips_a_checkpoint(one_rank: None, tmp_path: Path) -> None:
    """Split state survives a checkpoint round trip; another split is refused on load."""
    model = TinyTransformer()
    mf.fully_shard_matrix(model)
    split = {"*.attn.q.weight": 2}
    opt = mf.MatrixOptimizer(model, "muon", split=split)
    lm_loss(model, global_batch(0)).backward()
    opt.step()
    q = dict(model.named_parameters())["layers.0.attn.q.weight"]
    assert {"momentum_buffer@0", "momentum_buffer@1"} <= set(opt.state[q])
    mf.checkpoint.save(tmp_path / "ck", model, opt, step=1)
    fresh = TinyTransformer()
    mf.fully_shard_matrix(fresh)
    fresh_opt = mf.MatrixOptimizer(fresh, "muon", split=split)
    mf.checkpoint.load(tmp_path / "ck", fresh, fresh_opt)
    fq = dict(fresh.named_parameters())["layers.0.attn.q.weight"]
    for key, value in opt.state[q].items():
        assert torch.equal(fresh_opt.state[fq][key], value), key
    other = mf.MatrixOptimizer(fresh, "muon")
    with pytest.raises(mf.checkpoint.CheckpointMismatchError, match="split="):
        mf.checkpoint.load(tmp_path / "ck", fresh, other)


@pytest.mark.parametrize("optimizer,variant", [("muon", "batched"), ("shampoo", "batched"),
                                               ("shampoo", "offload")])
def test_batched_step_of_views_and_blocks(one_rank: None, optimizer: str, variant: str) -> None:
    """Same-shape batching (the CUDA default) or host-offloaded state over transposed views and
    split blocks: the same step as one block at a time on device (offload: bitwise)."""
    models = [_Model() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before = {k: v.clone() for k, v in models[0].state_dict().items()}
    opts = []
    for model, other in zip(models, (False, True), strict=True):
        mf.fully_shard_matrix(model)
        extra = ({"batch_same_shape": other} if variant == "batched"
                 else {"offload_state": "cpu" if other else None})
        opts.append(mf.MatrixOptimizer(model, optimizer, **extra,
                                       split={"*.proj.weight": [3, 3], "*.experts.up": 2}))
    matrices = list(mf.get_state(models[0]).params)
    for step in range(2):
        for model in models:
            g = torch.Generator().manual_seed(step)
            named = dict(model.named_parameters())
            for fqn in matrices:
                named[fqn].grad = torch.randn(named[fqn].shape, generator=g)
        for opt in opts:
            opt.step()
    a, b = (dict(m.named_parameters()) for m in models)
    for fqn in matrices:
        if variant == "offload":
            assert torch.equal(a[fqn], b[fqn]), fqn
        torch.testing.assert_close(a[fqn].detach(), b[fqn].detach(), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a[fqn].detach(), before[fqn]), fqn


def test_orientation_change_is_refused_on_load(one_rank: None, tmp_path: Path) -> None:
    """Matrix state is saved in (out, in) of the saving plan: a turned matrix cannot take it."""
    model = _Model()
    mf.fully_shard_matrix(model)
    opt = mf.MatrixOptimizer(model, "muon")
    mf.checkpoint.save(tmp_path / "ck", model, opt, step=0)
    turned = _Model()
    for block in turned.layers:
        block.experts.is_transposed = False  # now stored (E, out, in)
    mf.fully_shard_matrix(turned)
    assert mf.get_plan(turned)["layers.0.experts.up"].orientation == "out_in"
    with pytest.raises(mf.checkpoint.CheckpointMismatchError,
                       match=r"orientation changed.*'layers.0.experts.up' \(in_out -> out_in\)"):
        mf.checkpoint.load(tmp_path / "ck", turned, mf.MatrixOptimizer(turned, "muon"))
    mf.checkpoint.load(tmp_path / "ck", turned, weights_only=True)  # the weights alone still load


# -- default groups for real layouts: ModuleDict (torchtitan), Sequential (timm) ---------------------
class _LayerDict(nn.ModuleDict):
    """torchtitan keeps its layers in a subclass of nn.ModuleDict keyed "0", "1", ..."""


class _DictLM(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 8)
        self.layers = _LayerDict({str(i): _TitanBlock() for i in range(layers)})
        self.norm = nn.RMSNorm(8)
        self.output = nn.Linear(8, 10, bias=False)


class _TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.ModuleDict({"wqkv": nn.Linear(8, 24, bias=False),
                                        "wo": nn.Linear(8, 8, bias=False)})
        self.feed_forward = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))
        self.attention_norm = nn.RMSNorm(8)


def test_default_groups_follow_module_dict_and_sequential_blocks() -> None:
    model = _DictLM()
    groups = default_groups(model)
    assert groups == [*model.layers.values(), model]
    sites = select_params(model, groups, None, "cpu")
    block_weights = {s.fqn for s in sites if s.fqn.startswith("layers.") and s.param.ndim == 2}
    assert len(block_weights) == 12
    assert {s.fqn for s in sites if s.is_matrix} == block_weights
    # timm: blocks = Sequential(Block, ...); a Sequential root: its blocks, not the head.
    timm = nn.Module()
    timm.patch = nn.Linear(4, 8)
    timm.blocks = nn.Sequential(*(_TitanBlock() for _ in range(2)))
    timm.head = nn.Linear(8, 3)
    assert default_groups(timm) == [*timm.blocks, timm]
    seq = nn.Sequential(nn.Embedding(10, 8), _TitanBlock(), _TitanBlock(), nn.Linear(8, 10))
    assert default_groups(seq) == [seq[1], seq[2], seq]
    # Not blocks: a Sequential of layers, a dict of distinct parts.
    mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    assert default_groups(mlp) == [mlp]
    parts = nn.ModuleDict({"enc": _DictLM(), "head": nn.Linear(8, 2)})
    assert default_groups(parts) == [*parts["enc"].layers.values(), parts]


def test_wrap_without_blocks_warns_with_the_fix(one_rank: None,
                                                caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    with caplog.at_level(logging.INFO, logger="matrixfsdp"):
        mf.fully_shard_matrix(model)
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 1 and "groups=" in warnings[0], warnings
    assert "found no repeated blocks" in warnings[0] and "no matrix was selected" in warnings[0]
    caplog.clear()
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    with caplog.at_level(logging.INFO, logger="matrixfsdp"):
        mf.fully_shard_matrix(model, groups=[model[0], model[2]])
    assert not _messages(caplog, logging.WARNING)
    assert len(mf.get_plan(model).selection().matrices) == 2


def test_module_dict_model_wraps_by_default(one_rank: None,
                                            caplog: pytest.LogCaptureFixture) -> None:
    model = _DictLM()
    with caplog.at_level(logging.INFO, logger="matrixfsdp"):
        mf.fully_shard_matrix(model)
    assert not _messages(caplog, logging.WARNING)
    assert len(mf.get_plan(model).selection().matrices) == 12
