"""torchtitan 0.3.0's own MoE (DeepSeek-V3 classes) with expert parallelism through
``matrixfsdp.integrations.torchtitan``, exact against one process.

The model (``tests/titan_moe.py``) is built with torchtitan's sharding declarations for EP
(``update_from_config``), and ``parallelize_fn`` with the defaults runs the model's own
``parallelize`` (torchtitan's EP: expert stacks ``Shard(0)`` on ``ep``, the
``AllToAllTokenDispatcher`` wired to the ep mesh, its variable-split all-to-all on gloo) and
then ``fully_shard_matrix`` over ``fsdp`` with ``efsdp`` as ``expert_mesh``. The optimizer is
``MatrixOptimizersContainer`` (Muon + AdamW) with torchtitan's load-balancing pre-hook
registered on it, the loss the trainer's (local token sum over the global token count).

Checked at world 2 = ep 2 (efsdp 1), world 4 = fsdp 4 = efsdp 2 x ep 2 and world 4 under HSDP
(dp_replicate 2 x fsdp 2; experts (dp_replicate 2, efsdp 1) x ep 2), 3 free-running steps
against one process on the same global batch (see [Note: fp32 experts] in
``titan_moe.py`` for the one patch, the experts' bf16 casts):
gradients of step 1 within 1e-6 relative, ``mf.global_grad_norm`` and the trainer's clip
stand-in within 1e-6 after every backward, parameters within 1e-5 and the load-balancing bias
equal after every step; every expert stack is a matrix owned over ``efsdp``; the container's
step issues no collective but torchtitan's bias hook's all-reduce, the matrix optimizer none.
Meta-device init as torchtitan's trainer does it (``_meta_init``) at the first two shapes;
torchtitan's selective and full activation checkpointing at ep 2. Opt-in
(``MATRIXFSDP_TITAN_DEBUGMODEL=1``, minutes): torchtitan's registry ``debugmodel`` itself at ep 2.
"""

from __future__ import annotations

import copy
import functools
import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import matrixfsdp as mf

from .checks import full_values, reference_values
from .dist_utils import run_subtests, run_world

pytest.importorskip("torchtitan")
from torch.profiler import ProfilerActivity, profile
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from matrixfsdp.integrations.torchtitan import (
    MatrixOptimizersContainer,
    data_parallel_meshes,
    parallelize_fn,
)
from matrixfsdp.integrations.torchtitan_configs import matrix_clip_grad_norm
from matrixfsdp.runtime.init_rng import matrix_init_generator

from .titan_models import (
    LR,
    MUON,
    TAIL,
    TAIL_LR,
    WD,
    batch,
    cpu_attention,
    cpu_parallel_dims,
    shard,
    sharded_config,
    token_loss,
)
from .titan_moe import (
    EXPERT_NAMES,
    MATRIX_NAMES,
    MoEReference,
    build_moe,
    fp32_experts,
    tiny_moe_config,
)

# Measured (largest relative error over all parameters after steps 1 / 2 / 3): ep 2:
# 3.0e-6 / 5.5e-6 / 7.0e-6; efsdp 2 x ep 2: 3.5e-6 / 6.5e-6 / 8.6e-6; HSDP: 3.4e-6 / 6.1e-6 /
# 7.8e-6; step-1 gradients 2.3e-7 / 2.4e-7. The worst is always a router gate: its gradient is ill-conditioned (8 rows,
# condition number ~8e6), and Muon's Newton–Schulz (slope 3.44 per iteration at small singular
# values) amplifies fp32 noise there: a one-process step whose gradient is perturbed by 3e-7
# relative noise moves the gate by 4-5e-6 (every other matrix: <= 2.2e-6). So the gates get
# 3e-5, the rest 1e-5: a lost token or a wrong divisor moves a parameter by 1e-3 or more.
GRAD_RTOL = 1e-6
NORM_RTOL = 1e-6
PARAM_RTOL = 1e-5
GATE_PARAM_RTOL = 3e-5
DISPLACEMENT_RTOL = 1e-4  # |p - p_ref| / |p_ref - p_0|, the held-out check's measure
FP32 = TrainingConfig(mixed_precision_param="float32")
ROWS, VOCAB = 8, 256
SEED = 7


def _parallelize(model: nn.Module, parallelism, dims, ac=None) -> nn.Module:
    return parallelize_fn(model, parallel_dims=dims, training=FP32, parallelism=parallelism,
                          compile_config=CompileConfig(), ac_config=ac, dump_folder="/tmp")


def _pair(world: int, fp32: bool = True, replicate: int = 1, ac=None, config=tiny_moe_config):
    """The one-process model and the wrapped one, from one seed; ``config()`` builds the
    model config (toy size, or torchtitan's registry ``debugmodel``)."""
    parallelism, dims = cpu_parallel_dims(world, dp_replicate=replicate,
                                          dp_shard=world // replicate, ep=2)
    ref = build_moe(config(), fp32=fp32)
    model = build_moe(sharded_config(config(), parallelism), fp32=fp32)
    _parallelize(model, parallelism, dims, ac)
    return ref, model, dims


def _relative(got: dict, want: dict, start: dict | None = None) -> dict[str, float]:
    """``|got - want| / |want|`` per tensor, or ``/ |want - start|`` (the displacement)."""
    got = {canonical_fqn(k): v for k, v in got.items()}
    assert got.keys() == want.keys(), set(got) ^ set(want)
    out = {}
    for fqn, w in want.items():
        g = got[fqn]
        assert (g is None) == (w is None), fqn
        if w is not None:
            scale = w.double() if start is None else w.double() - start[fqn].double()
            out[fqn] = ((g.double() - w.double()).norm() / scale.norm()).item()
    return out


def _worst(errors: dict[str, float]) -> tuple[float, str]:
    fqn = max(errors, key=errors.get)
    return errors[fqn], fqn


def _param_budget(errors: dict[str, float]) -> tuple[float, str]:
    """The largest parameter error as a fraction of its tolerance (the gates': see above)."""
    return _worst({f: e / (GATE_PARAM_RTOL if ".router.gate." in f else PARAM_RTOL)
                   for f, e in errors.items()})


def _matrices(ref: nn.Module) -> set[str]:
    return {f for f, _ in ref.named_parameters() if MATRIX_NAMES.fullmatch(f)}


# -- selection and ownership ---------------------------------------------------------------------
def _selected(world: int, replicate: int = 1) -> None:
    """Defaults select every block matrix and every expert stack; stacks are owned over efsdp,
    distributed by torchtitan's EP as Shard(0) over ep."""
    ref, model, dims = _pair(world, replicate=replicate)
    plan = mf.get_plan(model)
    selected = {canonical_fqn(p.fqn) for p in plan.matrices}
    assert selected == _matrices(ref), selected ^ _matrices(ref)
    experts = {canonical_fqn(p.fqn) for p in plan.matrices if p.mesh == "expert"}
    assert experts == {f for f in selected if EXPERT_NAMES.fullmatch(f)}, experts
    assert len(experts) == 6
    _, expert_mesh = data_parallel_meshes(dims)
    efsdp = dist.get_process_group_ranks(expert_mesh.get_group("efsdp"))
    assert expert_mesh.mesh_dim_names == (("dp_replicate",) if replicate > 1 else ()) + ("efsdp",)
    ep = dims.get_mesh("ep")
    state = mf.get_state(model)
    for group in state.groups:
        for mp in group.params:
            if not EXPERT_NAMES.fullmatch(canonical_fqn(mp.fqn)):
                assert mp.ep is None, mp.fqn
                continue
            assert dist.get_process_group_ranks(group.comm.group) == efsdp, mp.fqn
            assert mp.ep is not None and mp.shape[0] == 8 // ep.size(), (mp.fqn, mp.shape)


# -- training --------------------------------------------------------------------------------------
def _container(model: nn.Module, dims) -> MatrixOptimizersContainer:
    optimizers = MatrixOptimizersContainer.Config(
        lr=LR, weight_decay=WD, kwargs=dict(MUON), tail_lr=TAIL_LR, tail_weight_decay=WD,
        tail_kwargs=dict(TAIL), implementation="for-loop").build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], dims)  # the ModelSpec's own hook
    return optimizers


def _norm_checks(ref: nn.Module, model: nn.Module, step: int) -> None:
    # in float64: torch's fp32 CPU norm of the debugmodel's lm_head gradient (2048 x 256)
    # errs 2e-4 relative (get_total_norm: 6e-5 off the whole norm)
    want = sum(p.grad.double().pow(2).sum() for p in ref.parameters()).sqrt()
    got = mf.global_grad_norm(model).double()
    assert abs(got - want) <= NORM_RTOL * want, f"step {step}: global norm {got} != {want}"
    clip = matrix_clip_grad_norm([model])(list(model.parameters()), 1e9, foreach=True,
                                          pp_mesh=None, ep_enabled=True).double()
    assert abs(clip - want) <= NORM_RTOL * want, f"step {step}: clip norm {clip} != {want}"


def _step_collectives(optimizers: MatrixOptimizersContainer) -> list[str]:
    state = mf.get_state(optimizers.model_parts[0])
    for group in state.groups:
        group.comm.counter.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizers.step()
    assert all(g.comm.counter.snapshot()["optimizer"]["calls"] == 0 for g in state.groups)
    for mp in state.params.values():  # no bytes of another owner's expert stack stay resident
        if not mp.is_owner:
            assert mp.resident_bytes() == 0, f"{mp.fqn}: {mp.resident_bytes()} bytes off-owner"
    return [e.name for e in prof.events() if e.name.startswith(("gloo:", "nccl:"))]


def _buffers(model: nn.Module, every: bool = False) -> dict[str, torch.Tensor]:
    """The load-balancing biases (``every``: all buffers), whole."""
    out = {}
    for name, buf in model.named_buffers():
        if every or name.endswith("expert_bias_E"):
            local = buf.full_tensor() if hasattr(buf, "full_tensor") else buf
            out[canonical_fqn(name)] = local.detach().clone()
    return out


def _train(world: int, steps: int = 3, fp32: bool = True, pair=None, replicate: int = 1,
           ac=None, config=tiny_moe_config) -> list[float]:
    ref, model, dims = _pair(world, fp32, replicate, ac, config) if pair is None else pair
    moe_layers = sum(1 for block in ref.layers.values() if block.moe_enabled)
    wrapped = any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    assert wrapped == (ac is not None), "activation checkpointing was not applied"
    rank = dims.get_mesh("batch").get_local_rank()  # the data-parallel rank
    reference = MoEReference(ref, {canonical_fqn(p.fqn) for p in mf.get_plan(model).matrices})
    optimizers = _container(model, dims)
    dispatcher = ref.layers["1"].moe.routed_experts.token_dispatcher
    assert dispatcher.ep_mesh is None and type(dispatcher).__name__ == "AllToAllTokenDispatcher"
    ep = model.layers["1"].moe.routed_experts.token_dispatcher.ep_mesh
    assert ep is not None and ep.size() == 2  # torchtitan's all-to-all over ep runs
    start = reference_values(ref)
    errors = []
    for step in range(steps):
        tokens = batch(step, VOCAB, rows=ROWS)
        token_loss(ref, tokens).backward()
        token_loss(model, shard(tokens, rank, world), tokens[:, 1:].numel()).backward()
        grads = _relative(full_values(model, "grad"), reference_values(ref, "grad"))
        if step == 0:
            worst, fqn = _worst(grads)
            assert worst <= GRAD_RTOL, f"grads of step 1: {worst:.2e} at {fqn}"
        _norm_checks(ref, model, step)
        reference.step()
        names = _step_collectives(optimizers)
        assert names == ["gloo:all_reduce"], names  # torchtitan's bias hook, over 'loss'
        optimizers.zero_grad()
        budget, fqn = _param_budget(_relative(full_values(model), reference_values(ref)))
        errors.append(budget)
        moved = _relative(full_values(model), reference_values(ref), start)
        assert _worst(moved)[0] <= DISPLACEMENT_RTOL, f"step {step + 1}: {_worst(moved)}"
        assert budget <= 1.0, f"params after step {step + 1}: {budget:.2f} of the tolerance at {fqn}"
        got, want = _buffers(model), _buffers(ref)
        assert got.keys() == want.keys() and len(want) == moe_layers, got.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), f"{name} after step {step + 1}"
        assert any(v.abs().sum() > 0 for v in want.values())  # the bias did move
    return errors


# -- meta-device init, as torchtitan's trainer does it ------------------------------------------
def _expected_matrix(model: nn.Module, fqn: str, shape: tuple[int, ...], ep: int) -> torch.Tensor:
    """The documented single-process rule ([Note: matrix init RNG]): the matrix's torchtitan
    ``param_init`` drawn from ``matrix_init_generator``; an expert stack per ep rank's experts."""
    module_name, name = fqn.rsplit(".", 1)
    init = model.get_submodule(module_name)._param_init[name]
    if not EXPERT_NAMES.fullmatch(fqn):
        value = torch.empty(shape)
        init(value, generator=matrix_init_generator(fqn, SEED))
        return value
    local = shape[0] // ep
    chunks = []
    for first in range(0, shape[0], local):
        chunk = torch.empty(local, *shape[1:])
        init(chunk, generator=matrix_init_generator(f"{fqn}[{first}:{first + local}]", SEED))
        chunks.append(chunk)
    return torch.cat(chunks)


def _meta_init(world: int) -> None:
    """Build on meta, ``parallelize_fn``, ``to_empty``, torchtitan's ``init_weights``: nothing
    stays on meta, the buffers are torchtitan's, every matrix (the ep ranks' experts distinct)
    follows the per-matrix stream rule bit for bit, and 3 steps from that init equal one process
    started from the same values."""
    parallelism, dims = cpu_parallel_dims(world, ep=2)
    with torch.device("meta"):
        model = sharded_config(tiny_moe_config(), parallelism).build()
    model.verify_module_protocol()
    fp32_experts(cpu_attention(model))
    _parallelize(model, parallelism, dims)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not on_meta, on_meta
    ref = build_moe(tiny_moe_config())
    assert _buffers(model, every=True).keys() == _buffers(ref, every=True).keys()
    for name, value in _buffers(ref, every=True).items():
        assert torch.equal(_buffers(model, every=True)[name], value), name
    values = {canonical_fqn(k): v for k, v in full_values(model).items()}
    for fqn in _matrices(ref):
        if EXPERT_NAMES.fullmatch(fqn):
            flat = values[fqn].flatten(1)
            assert torch.cdist(flat, flat).add(torch.eye(len(flat))).min() > 0, \
                f"{fqn}: two experts drew the same values"
        want = _expected_matrix(ref, fqn, tuple(values[fqn].shape), 2)
        assert torch.equal(values[fqn], want), f"{fqn}: not its init stream's values"
    missing, unexpected = ref.load_state_dict(values, strict=False)  # buffers: checked equal
    assert not unexpected and all(k.endswith("expert_bias_E") for k in missing), missing
    errors = _train(world, pair=(ref, model, dims))
    assert max(errors) <= 1.0, errors  # fractions of the parameter tolerances


def _bf16_experts(world: int) -> float:
    """torchtitan's experts as written (bf16 casts, bf16 grouped mm) run through EP and the wrap.
    From identical parameters the bf16 roundings agree, so step-1 gradients match one process
    (measured 2.1e-7); after a step the parameters differ by fp32 noise, bf16 rounds some of
    them apart, and the gradients part (measured 2.0e-5 at step 2, 3.0e-4 at step 3): hence the
    fp32 experts for the 3-step check."""
    ref, model, _ = _pair(world, fp32=False)
    tokens = batch(0, VOCAB, rows=ROWS)
    token_loss(ref, tokens).backward()
    token_loss(model, shard(tokens, dist.get_rank(), world), tokens[:, 1:].numel()).backward()
    worst, fqn = _worst(_relative(full_values(model, "grad"), reference_values(ref, "grad")))
    assert worst <= 1e-5, f"bf16 experts: grads {worst:.2e} at {fqn}"
    return worst


def _refuses_ep_with_tp(world: int) -> None:
    """EP with TP (torchtitan's ep borrows the tp ranks) is refused, naming the settings."""
    parallelism, dims = cpu_parallel_dims(world, ep=2)
    bad = copy.copy(dims)
    object.__setattr__(bad, "tp", 2)
    with torch.device("meta"):
        model = tiny_moe_config().build()
    with pytest.raises(NotImplementedError, match="tensor_parallel_degree=1"):
        _parallelize(model, parallelism, bad)


def _world(rank: int, world: int, replicate: int = 1) -> None:
    checks = {"selected": functools.partial(_selected, world, replicate),
              "train": functools.partial(_train, world, replicate=replicate)}
    if replicate == 1:
        checks["meta_init"] = functools.partial(_meta_init, world)
    if world == 2:
        checks["bf16_experts"] = functools.partial(_bf16_experts, world)
        checks["refuses_ep_with_tp"] = functools.partial(_refuses_ep_with_tp, world)
        # torchtitan's AC (the debugmodel's selective AC, and full AC): the all-to-all and the
        # routing recompute in backward; the bias hook halves the recomputed counts
        checks["selective_ac"] = functools.partial(_train, world, ac=SelectiveAC.Config())
        checks["full_ac"] = functools.partial(_train, world, ac=FullAC.Config())
    run_subtests(rank, checks)


def test_ep2() -> None:
    """world 2 = ep 2 (efsdp 1)."""
    run_world(2, _world)


def test_efsdp2_ep2() -> None:
    """world 4 = fsdp 4 = efsdp 2 x ep 2."""
    run_world(4, _world)


def test_hsdp_ep2() -> None:
    """world 4 = dp_replicate 2 x fsdp 2, the experts (dp_replicate 2, efsdp 1) x ep 2."""
    run_world(4, _world, 2)


def test_benchmark_smoke() -> None:
    """``benchmarks/titan_moe_step.py`` runs, and torchtitan's own FSDP2-EP path gives the loss
    ours gives (same parameters, same batch)."""
    from benchmarks.titan_moe_step import measure

    out = measure(2, reps=1, warmup=0, dim=64, layers=2, rows=4, seq=17)
    assert out["loss_rel_diff"] <= 1e-6, out["loss"]
    assert out["median_s"]["matrixfsdp"] > 0 and out["median_s"]["fsdp2"] > 0


@pytest.mark.skipif(not os.environ.get("MATRIXFSDP_TITAN_DEBUGMODEL"),
                    reason="torchtitan's full DeepSeek-V3 debugmodel: MATRIXFSDP_TITAN_DEBUGMODEL=1")
def test_debugmodel_ep2() -> None:
    """torchtitan's registry ``debugmodel`` itself (6 layers, (8, 256, 256) expert stacks) at
    ep 2, 3 steps against one process (opt-in: 96 s on a loaded CPU; measured parameter errors
    2.6e-6 / 4.6e-6 / 6.5e-6)."""
    run_world(2, _debugmodel)


def _debugmodel(rank: int, world: int) -> None:
    from torchtitan.models.deepseek_v3 import model_registry

    errors = _train(world, config=lambda: model_registry("debugmodel").model)
    logging.getLogger(__name__).warning("debugmodel at ep 2: parameter errors (fractions of their tolerances) %s", errors)
