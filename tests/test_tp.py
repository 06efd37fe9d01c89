"""Tensor parallelism composed with owner sharding, against a single-process reference.

A ``TinyTransformer`` whose MLPs are ``parallelize_module``'d on ``mesh["tp"]`` (``up``:
``ColwiseParallel``, ``down``: ``RowwiseParallel``; attention whole, as many TP plans leave it),
then ``fully_shard_matrix(model, mesh["dp"])``: dp 2 x tp 2 and HSDP 1 x 2 x 2 at world 4, gloo.
Checked: each owner row's TP-shard gradients and the tail's (<= 1e-6 relative), the global
gradient norm, 3 SGD-momentum steps through ``get_model_state_dict`` (<= 1e-5), torch's state-dict
API (full get/set, sharded ``dcp.save``/``dcp.load``, optimizer state of Muon and SGD), the
training patterns of ``test_patterns`` that touch the TP view (checkpointing both ways, two
forwards, no-grad forwards, freezing after wrapping), a Hugging Face Llama parallelized as
torchtitan does with Muon, that a non-owner row holds no bytes of a TP matrix, and the errors for
layouts that are not supported. Each optimizer's whole-matrix step: ``tests/test_tp_step.py``.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import matrixfsdp as mf

from .checks import assert_close_dicts, reference_values
from .dist_utils import device_type, run_subtests, run_world, test_device
from .models import TinyTransformer, global_batch, lm_loss, local_batch
from .test_tp_step import E2E, _e2e_reference

FULL = StateDictOptions(full_state_dict=True)
MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


TpMesh = DeviceMesh | Callable[[], DeviceMesh]  # one tp mesh, or a fresh mesh["tp"] per block


def _meshes(hsdp: bool, per_block: bool = False) -> tuple[DeviceMesh, TpMesh]:
    """(dp mesh, tp mesh); ``per_block``: a function giving each block its own ``mesh["tp"]``
    call, an equal but distinct DeviceMesh each time (as torchtitan-style per-block plans do)."""
    if hsdp:
        mesh = init_device_mesh(device_type(), (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
    return dp, (lambda: mesh["tp"]) if per_block else mesh["tp"]


def _tp_model(ref: nn.Module, dp: DeviceMesh, tp: TpMesh, **wrap_kwargs: Any) -> nn.Module:
    """A copy of ``ref`` with its MLPs parallelized on ``tp``, wrapped on ``dp``."""
    model = copy.deepcopy(ref)
    for block in model.layers:
        parallelize_module(block, tp() if callable(tp) else tp, MLP_PLAN)
    if callable(tp):
        meshes = [block.up.weight.device_mesh for block in model.layers]
        assert meshes[0] is not meshes[1] and meshes[0] == meshes[1], "want distinct equal meshes"
    return mf.fully_shard_matrix(model, dp, **wrap_kwargs)


def _reference_model(heterogeneous: bool = False) -> nn.Module:
    """The 2-block test transformer; ``heterogeneous``: the second block's MLP is narrower (24),
    so DTensor's sharding cache, keyed by shape, cannot hand the first block's mesh object to the
    second block's parameters (equal shapes would share one mesh object after all)."""
    torch.manual_seed(0)
    ref = TinyTransformer(dim=16, hidden=40, layers=2)
    if heterogeneous:
        ref.layers[1].up, ref.layers[1].down = nn.Linear(16, 24), nn.Linear(24, 16, bias=False)
    return ref


def _dp_coords(dp: DeviceMesh) -> tuple[int, int]:
    """This rank's data-parallel batch index and the number of batches."""
    flat = dp.mesh.flatten().tolist()
    from torch.distributed import get_rank

    return flat.index(get_rank()), len(flat)


def _reference_backward(ref: nn.Module, tokens: torch.Tensor, batches: int) -> None:
    loss = sum(lm_loss(ref, local_batch(tokens, i, batches)) for i in range(batches)) / batches
    loss.backward()


def _check_grads(model: nn.Module, ref: nn.Module) -> None:
    state = mf.get_state(model)
    want = reference_values(ref, "grad")
    for fqn, p in model.named_parameters():
        if fqn in state.params:
            mp = state.params[fqn]
            if not mp.is_owner:
                assert p.numel() == 0 and mp.resident_bytes() == 0, f"{fqn} holds bytes off-owner"
                continue
            expected = want[fqn]
            if mp.tp is not None and expected is not None:
                expected = mp.tp.slice_of(expected, mp.tp.tp_rank)
            got = {fqn: p.grad}
        else:
            got, expected = {fqn: p.grad.full_tensor() if p.grad is not None else None}, want[fqn]
        assert_close_dicts(got, {fqn: expected}, 1e-6, "gradient")


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    values = get_model_state_dict(model, options=FULL)
    assert not any(isinstance(v, DTensor) for v in values.values())
    return {k: v.detach().cpu() for k, v in values.items()}


def _training(rank: int, world: int, hsdp: bool, per_block: bool = False) -> None:
    dp, tp = _meshes(hsdp, per_block)
    ref = _reference_model(per_block)
    model = _tp_model(ref, dp, tp)
    state = mf.get_state(model)
    tp_matrices = sorted(f for f, mp in state.params.items() if mp.tp is not None)
    assert tp_matrices == [f"layers.{i}.{m}.weight" for i in range(2) for m in ("down", "up")]
    me, batches = _dp_coords(dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        tokens = global_batch(step)
        lm_loss(model, local_batch(tokens, me, batches)).backward()
        _reference_backward(ref, tokens, batches)
        if step == 0:
            _check_grads(model, ref)
            want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in ref.parameters()
                                 if p.grad is not None))
            got = mf.global_grad_norm(model).item()
            assert abs(got - want) <= 1e-6 * want, f"global norm {got} != {want}"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_close_dicts(_full_params(model), reference_values(ref), 1e-5, f"step {step + 1}")


def _state_dict_api(rank: int, world: int, hsdp: bool, path: str) -> None:
    dp, tp = _meshes(hsdp)
    torch.manual_seed(0)
    ref = TinyTransformer(dim=16, hidden=40, layers=2)
    model = _tp_model(ref, dp, tp)
    assert_close_dicts(_full_params(model), reference_values(ref), 0.0, "full state dict")
    shifted = {k: v + 1.0 for k, v in ref.state_dict().items()}
    set_model_state_dict(model, dict(shifted), options=FULL)
    assert_close_dicts(_full_params(model), shifted, 0.0, "after set (full)")
    sharded = get_model_state_dict(model)
    layout = sharded["layers.0.up.weight"]
    assert isinstance(layout, DTensor) and "tp" in (layout.device_mesh.mesh_dim_names or ())
    dcp.save(sharded, checkpoint_id=path)
    set_model_state_dict(model, dict(ref.state_dict()), options=FULL)
    loaded = get_model_state_dict(model)
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(model, loaded)
    assert_close_dicts(_full_params(model), shifted, 0.0, "after dcp.save -> dcp.load")
    # A forward after loading computes with the loaded values.
    tokens = local_batch(global_batch(0), *_dp_coords(dp))
    ref.load_state_dict(shifted)
    assert torch.allclose(lm_loss(model, tokens), lm_loss(ref, tokens), rtol=1e-6, atol=0)


# A Hugging Face Llama decoder layer parallelized as torchtitan parallelizes its own: norms
# SequenceParallel (sequence-sharded activations, replicated weights in the tail), attention and
# MLP Colwise in / Rowwise out to sequence shards; the layer takes and returns the full sequence.
HF_LLAMA_PLAN = {
    "": PrepareModuleInputOutput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=False,
        output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True),
    "input_layernorm": SequenceParallel(),
    "self_attn": PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True),
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    "post_attention_layernorm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                              use_local_output=True),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
}


def _hf_llama(rank: int, world: int) -> None:
    transformers = pytest.importorskip("transformers")
    dp, tp = _meshes(hsdp=False)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=24, max_position_embeddings=64,
        attention_dropout=0.0)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).train().to(test_device())
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        parallelize_module(layer, tp, HF_LLAMA_PLAN)
    mf.fully_shard_matrix(model, dp)
    assert sum(mp.tp is not None for mp in mf.get_state(model).params.values()) == 14
    me, batches = _dp_coords(dp)
    # Muon on every matrix (whole on its step owner), AdamW on the tail; the reference steps
    # each whole matrix with the same registered Muon in one process.
    opt = mf.MatrixOptimizer(model, "muon", **E2E, ns_dtype="float32")
    reference = _e2e_reference(ref, set(mf.get_state(model).params), "muon")
    for step in range(3):
        tokens = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(step))
        tokens = tokens.to(test_device())
        _hf_loss(model, tokens.chunk(batches)[me]).backward()
        (sum(_hf_loss(ref, t) for t in tokens.chunk(batches)) / batches).backward()
        if step == 0:
            _check_grads(model, ref)
        opt.step()
        reference.step()
        opt.zero_grad()
        assert_close_dicts(_full_params(model), reference_values(ref), 1e-5, f"HF step {step + 1}")


def _hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, dp: DeviceMesh) -> None:
    lm_loss(model, local_batch(global_batch(step), *_dp_coords(dp))).backward()
    opt.step()
    opt.zero_grad()


def _optimizer_round_trip(rank: int, world: int, path: str, make_opt: str) -> None:
    """torchtitan's checkpointer: ``dcp.save(get_state_dict(model, opt))``, one more step, then
    ``dcp.load`` + ``set_state_dict`` and the same step again gives the same parameters."""
    dp, tp = _meshes(hsdp=False)
    torch.manual_seed(0)
    model = _tp_model(TinyTransformer(dim=16, hidden=40, layers=2), dp, tp)
    opt = (mf.MatrixOptimizer(model, optimizer="muon", ns_dtype="float32")
           if make_opt == "muon" else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _train_step(model, opt, 0, dp)
    full = get_optimizer_state_dict(model, opt, options=FULL)["state"]
    momentum = [v for k, v in full.items() if k == "layers.0.up.weight"]
    assert momentum and all(tuple(t.shape) == (40, 16) for e in momentum
                            for t in e.values() if isinstance(t, torch.Tensor) and t.ndim)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _train_step(model, opt, 1, dp)
    after = _full_params(model)
    _train_step(model, opt, 2, dp)  # move away, then come back through the checkpoint
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # strict=False: the unused block weights never got state (torch's own check, on one process
    # too, refuses parameters that require grad and have none).
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(strict=False))
    _train_step(model, opt, 1, dp)
    assert_close_dicts(_full_params(model), after, 0.0, f"{make_opt}: step after dcp.load")


def _two_forwards_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    half = tokens.shape[0] // 2
    return lm_loss(model, tokens[:half]) + lm_loss(model, tokens[half:])


PATTERN_LOSSES = {"two forwards, one backward": _two_forwards_loss}


def _pattern(rank: int, world: int, name: str) -> None:
    """A training pattern on TP matrices, 2 SGD steps against one process (see test_patterns)."""
    dp, tp = _meshes(hsdp=False)
    torch.manual_seed(0)
    ref = TinyTransformer(dim=16, hidden=40, layers=2)
    model = _tp_model(ref, dp, tp, reshard_after_forward=name != "reshard_after_forward=False")
    if name.endswith("reentrant checkpointing"):
        for m in (model, ref):
            m.checkpointing, m.reentrant = True, not name.startswith("non-")
    if name == "frozen after wrapping":
        for m in (model, ref):
            m.layers[0].up.weight.requires_grad_(False)
            m.layers[1].down.weight.requires_grad_(False)
    loss_fn = PATTERN_LOSSES.get(name, lm_loss)
    me, batches = _dp_coords(dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    micro = 2 if name == "accumulation, sync off then on" else 1
    for step in range(2):
        for k in range(micro):  # micro-batches: tokens of step + 10 k
            tokens = global_batch(step + 10 * k)
            if micro > 1:
                mf.set_requires_gradient_sync(model, k == micro - 1)
            loss_fn(model, local_batch(tokens, me, batches)).backward()
            (sum(loss_fn(ref, local_batch(tokens, i, batches)) for i in range(batches))
             / batches).backward()
        if step == 0:
            _check_grads(model, ref)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if name == "no_grad and eval forwards between steps":
            with torch.no_grad():
                model.eval()
                lm_loss(model, local_batch(tokens, me, batches))
                model.train()
        assert_close_dicts(_full_params(model), reference_values(ref), 1e-5,
                           f"{name}, step {step + 1}")


PATTERNS = ("reentrant checkpointing", "non-reentrant checkpointing",
            "two forwards, one backward", "no_grad and eval forwards between steps",
            "frozen after wrapping", "accumulation, sync off then on",
            "reshard_after_forward=False")


def _mixed_precision(rank: int, world: int) -> None:
    """bf16 compute, fp32 reduction and master weights: each TP shard's gradient lands in fp32
    on its owner row within bf16 rounding of the fp32 reference (a misplaced shard is O(1))."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dp, tp = _meshes(hsdp=False)
    torch.manual_seed(0)
    ref = TinyTransformer(dim=16, hidden=40, layers=2)
    model = _tp_model(ref, dp, tp, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    me, batches = _dp_coords(dp)
    tokens = global_batch(0)
    lm_loss(model, local_batch(tokens, me, batches)).backward()
    _reference_backward(ref, tokens, batches)
    want = reference_values(ref, "grad")
    for fqn, mp in mf.get_state(model).params.items():
        if mp.tp is None or not mp.is_owner or want[fqn] is None:
            continue
        assert mp.sharded.dtype == mp.sharded.grad.dtype == torch.float32, fqn
        assert_close_dicts({fqn: mp.sharded.grad},
                           {fqn: mp.tp.slice_of(want[fqn], mp.tp.tp_rank)}, 5e-2, "bf16 grad")


def _meta_init_warns(rank: int, world: int) -> None:
    """TP matrices materialized from meta are outside the per-matrix init streams: one warning."""
    import logging

    from matrixfsdp.runtime import init_rng

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    init_rng.logger.addHandler(handler)
    init_rng._warned_tp.clear()
    try:
        dp, tp = _meshes(hsdp=False)
        with torch.device("meta"):
            model = TinyTransformer(dim=16, hidden=40, layers=2)
        for block in model.layers:
            parallelize_module(block, tp, MLP_PLAN)
        mf.fully_shard_matrix(model, dp)
        model.to_empty(device=test_device())
    finally:
        init_rng.logger.removeHandler(handler)
    warned = [r for r in records if "TP matrices were materialized from meta" in r.getMessage()]
    assert len(warned) == 1 and "layers.0.up.weight" in warned[0].getMessage()
    assert all(mp.init_rng is None for mp in mf.get_state(model).params.values()
               if mp.tp is not None)


def _errors(rank: int, world: int) -> None:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    replicated = TinyTransformer(dim=16, hidden=40, layers=2)
    weight = replicated.layers[0].up.weight
    replicated.layers[0].up.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh["tp"],
                                                                    [Replicate()]))
    with pytest.raises(NotImplementedError, match=r"layers\.0\.up\.weight.*replicated over the tp"):
        mf.fully_shard_matrix(replicated, mesh["dp"])
    # tp outermost: the TP shards would span nodes.
    outer = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("tp", "dp"))
    model = TinyTransformer(dim=16, hidden=40, layers=2)
    for block in model.layers:
        parallelize_module(block, outer["tp"], MLP_PLAN)
    with pytest.raises(NotImplementedError, match=r"layers\.0\.(up|down)\.weight.*innermost"):
        mf.fully_shard_matrix(model, outer["dp"])


def _cases(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    run_subtests(rank, {
        "dp2 x tp2 training": lambda: _training(rank, world, hsdp=False),
        "hsdp 1x2 x tp2 training": lambda: _training(rank, world, hsdp=True),
        "state-dict api": lambda: _state_dict_api(rank, world, False, path + "/flat"),
        "state-dict api hsdp": lambda: _state_dict_api(rank, world, True, path + "/hsdp"),
        "optimizer state round trip (muon)": lambda: _optimizer_round_trip(
            rank, world, path + "/muon", "muon"),
        "optimizer state round trip (sgd)": lambda: _optimizer_round_trip(
            rank, world, path + "/sgd", "sgd"),
        "hf llama, torchtitan-style plan with sequence parallel": lambda: _hf_llama(rank, world),
        **{f"pattern: {name}": functools.partial(_pattern, rank, world, name)
           for name in PATTERNS},
        "mixed precision": lambda: _mixed_precision(rank, world),
        "meta init of TP matrices warns": lambda: _meta_init_warns(rank, world),
        "errors": lambda: _errors(rank, world),
    })


def test_tp_matches_single_process(tmp_path) -> None:
    run_world(4, _cases, str(tmp_path))


def _per_block_muon(rank: int, world: int) -> None:
    """Muon's whole-matrix TP step on a model whose blocks each got their own ``mesh["tp"]``."""
    dp, tp = _meshes(hsdp=False, per_block=True)
    ref = _reference_model(heterogeneous=True)
    model = _tp_model(ref, dp, tp)
    opt = mf.MatrixOptimizer(model, "muon", **E2E, ns_dtype="float32")
    reference = _e2e_reference(ref, set(mf.get_state(model).params), "muon")
    me, batches = _dp_coords(dp)
    for step in range(2):
        tokens = global_batch(step)
        lm_loss(model, local_batch(tokens, me, batches)).backward()
        _reference_backward(ref, tokens, batches)
        opt.step()
        reference.step()
        opt.zero_grad()
        assert_close_dicts(_full_params(model), reference_values(ref), 1e-5, f"step {step + 1}")


def _per_block_cases(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    run_subtests(rank, {
        "dp2 x tp2, a mesh['tp'] per block": lambda: _training(rank, world, False, True),
        "hsdp 1x2 x tp2, a mesh['tp'] per block": lambda: _training(rank, world, True, True),
        "muon, a mesh['tp'] per block": lambda: _per_block_muon(rank, world),
    })


def test_tp_blocks_on_their_own_mesh_slices() -> None:
    """Meshes are compared by value: each block parallelized with its own ``mesh["tp"]`` call
    (equal, distinct DeviceMesh objects) wraps as one tp mesh and trains exactly."""
    run_world(4, _per_block_cases)


@pytest.mark.gpu
def test_tp_on_cuda(tmp_path) -> None:
    """The same cases on NCCL (4 GPUs)."""
    run_world(4, _cases, str(tmp_path), device="cuda")
