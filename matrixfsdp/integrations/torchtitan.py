"""torchtitan as the client: its ``parallelize_fn`` and optimizer container with matrixfsdp.

[Note: torchtitan integration]
- ``parallelize_fn`` has the signature torchtitan's trainer calls (``ModelSpec.parallelize_fn``)
  and does what torchtitan 0.3.0's ``parallelize_llama`` does on its ``partial_dtensor`` backend:
  the model's own TP / EP declarations (``model.parallelize(parallel_dims)``), activation
  checkpointing (``ac_config``), per-block ``torch.compile``, then, in place of
  ``apply_fsdp_to_decoder``, ``fully_shard_matrix`` over the dense data-parallel mesh
  (``fsdp``, or ``(dp_replicate, fsdp)`` under HSDP) with the expert mesh (``efsdp``) as
  ``expert_mesh=`` when EP is on, torchtitan's mixed precision and reshard policy, and
  torchtitan's ``disable_fsdp_gradient_division`` (the trainer divides the loss by the global
  token count; every FSDPModule, so the matrices too, then sums gradients).
- Refused with ``NotImplementedError`` naming the setting: pipeline and context parallelism,
  CPU offload and symmetric-memory FSDP (not tested through this path), EP with TP (torchtitan's
  ep borrows tp ranks, so efsdp x ep is not the fsdp mesh), and TP / EP under the
  ``spmd_types`` / ``full_dtensor`` backends (their parameters are DTensors over the dp axes
  too; set ``parallelism.spmd_backend = "partial_dtensor"``). Without TP and EP the model needs
  no distribution on any backend and is wrapped as built.
- ``MatrixOptimizersContainer`` (``.Config`` goes in ``Trainer.Config.optimizer``) holds one
  ``MatrixOptimizer`` per model part and keeps torchtitan's ``OptimizersContainer`` contract:
  every param group carries ``param_names`` (canonical FQNs, aligned with ``params``), and
  ``state_dict()`` is torchtitan's own flat ``state.{fqn}.{name}`` / ``param_groups.{fqn}.{key}``
  dict after its ``init_optim_state`` (a zero-gradient, lr=0 step: it changes no parameter, and
  leaves every state at its initial value). ``load_state_dict`` reads the same keys; it differs
  from torchtitan's ``load_flat_optim_state_dict`` in one point: the entries it loads are the
  ones ``optimizer.state_dict()`` shows (every matrix's state on every rank, see [Note:
  optimizer state-dict view]), not the ones this rank's ``optimizer.state`` holds (a matrix's
  state lives on its owner only), so every rank takes part in every matrix's collective load.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import init_optim_state
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

from ..api import fully_shard_matrix
from ..optim import MatrixOptimizer, fused_qkv_split
from .flat_optim_state import unflatten

__all__ = [
    "MatrixOptimizersContainer",
    "data_parallel_meshes",
    "make_parallelize_fn",
    "name_param_groups",
    "parallelize_fn",
]

logger = logging.getLogger(__name__)


def parallelize_fn(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: Any,
    dump_folder: str,
    **options: Any,
) -> nn.Module:
    """torchtitan's ``parallelize_fn`` with ``fully_shard_matrix`` in place of ``apply_fsdp``.

    ``options`` go to ``fully_shard_matrix`` (``groups``, ``matrix_filter``, ``planner``,
    ``collectives``, ``tail_units``, ...); bind them with ``make_parallelize_fn``. See [Note:
    torchtitan integration]. Returns the model, changed in place.
    """
    _check_supported(parallel_dims, parallelism, training)
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)  # the model's own TP / EP declarations
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    mesh, expert_mesh = data_parallel_meshes(parallel_dims)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )
    options.setdefault("reshard_after_forward", _reshard_after_forward(
        parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled))
    fully_shard_matrix(model, mesh, expert_mesh=expert_mesh, mp_policy=mp_policy, **options)
    disable_fsdp_gradient_division(model)  # torchtitan's own call: sums, matrices included
    if mesh.device_type == "cpu":  # gloo has no PREMUL_SUM; a plain sum is the same at 1.0
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def make_parallelize_fn(**options: Any) -> Callable[..., nn.Module]:
    """``parallelize_fn`` with ``fully_shard_matrix`` options bound, for a ``ModelSpec``."""
    return functools.partial(parallelize_fn, **options)


def data_parallel_meshes(parallel_dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The dense data-parallel mesh and, with EP, the expert one, as torchtitan's FSDP reads
    them: ``fsdp`` / ``efsdp``, with ``dp_replicate`` first under HSDP."""
    shard = "fsdp" if parallel_dims.spmd_backend == "partial_dtensor" else "dp_shard"
    replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
    mesh = parallel_dims.get_mesh([*replicate, shard])
    expert_mesh = parallel_dims.get_mesh([*replicate, "efsdp"]) if parallel_dims.ep_enabled else None
    return mesh, expert_mesh


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """torchtitan's ``fsdp_reshard_after_forward`` policy for the blocks."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":  # torchtitan: keep pipeline stages' parameters between microbatches
        return not pp_enabled
    raise ValueError(f"parallelism.fsdp_reshard_after_forward must be 'default', 'always' or "
                     f"'never', got {policy!r}")


def _check_supported(parallel_dims: ParallelDims, parallelism: ParallelismConfig,
                     training: TrainingConfig) -> None:
    """Refuse what this path has not been tested with, naming the setting (every rank alike)."""
    refused = {
        "parallelism.pipeline_parallel_degree > 1": parallel_dims.pp_enabled,
        "parallelism.context_parallel_degree > 1": parallel_dims.cp_enabled,
        "training.enable_cpu_offload (use MatrixOptimizer's offload_state)":
            training.enable_cpu_offload,
        "parallelism.enable_fsdp_symm_mem": parallelism.enable_fsdp_symm_mem,
    }
    for setting, on in refused.items():
        if on:
            raise NotImplementedError(
                f"matrixfsdp's torchtitan parallelize_fn does not support {setting}; turn it off "
                "or use torchtitan's own parallelize_fn with FSDP2")
    if parallel_dims.tp_enabled and parallel_dims.ep_enabled:
        raise NotImplementedError(
            f"matrixfsdp's torchtitan parallelize_fn does not support expert parallelism "
            f"together with tensor parallelism (ep={parallel_dims.ep}, tp={parallel_dims.tp}): "
            "torchtitan's ep borrows tp ranks (efsdp = fsdp * tp / ep), and matrixfsdp owns "
            "expert stacks over an efsdp that tiles the dense fsdp ranks with ep (efsdp x ep = "
            "fsdp); set parallelism.tensor_parallel_degree=1 or expert_parallel_degree=1")
    backend = parallel_dims.spmd_backend
    if backend != "partial_dtensor" and (parallel_dims.tp_enabled or parallel_dims.ep_enabled):
        raise NotImplementedError(
            f"tensor / expert parallelism under parallelism.spmd_backend={backend!r} makes "
            "parameters DTensors over the data-parallel axes too; matrixfsdp composes with TP / "
            "EP DTensors on the tp / ep mesh only: set parallelism.spmd_backend='partial_dtensor'")


class MatrixOptimizersContainer(OptimizersContainer):
    """One ``MatrixOptimizer`` per model part behind torchtitan's ``OptimizersContainer``.

    Build it from ``MatrixOptimizersContainer.Config(...)`` as ``Trainer.Config.optimizer``.
    ``name``/``lr``/``weight_decay``/``kwargs`` configure the matrix optimizer (``"muon"``,
    ``"shampoo"``, ... with its keywords), ``tail_*`` the optimizer of every other parameter,
    ``split`` is ``MatrixOptimizer``'s, ``qkv_split`` steps each fused ``wqkv`` as q / k / v or per
    head. ``implementation`` (``"fused"``/``"foreach"``) goes to
    the tail optimizer, as torchtitan's container passes it. See [Note: torchtitan integration].
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: str = "muon"
        """Matrix optimizer (``matrixfsdp.optim`` registry name)."""
        lr: float = 0.02
        weight_decay: float = 0.1
        kwargs: dict[str, Any] = field(default_factory=dict)
        """Matrix optimizer keywords, e.g. ``{"ns_dtype": "float32"}`` for Muon."""
        tail_name: str = "adamw"
        tail_lr: float = 8e-4
        tail_weight_decay: float = 0.1
        tail_kwargs: dict[str, Any] = field(
            default_factory=lambda: {"betas": (0.9, 0.95), "eps": 1e-8})
        split: dict[str, Any] | None = None
        """``MatrixOptimizer(split=...)``: FQN patterns to row blocks stepped separately."""
        qkv_split: str = "none"
        """Step each fused ``wqkv`` as its q, k and v (``"qkv"``: the matrices torchtitan's
        state dict writes as ``wq``/``wk``/``wv``) or per head (``"head"``); ``"none"``: one
        matrix, as ``torch.optim.Muon`` would. Adds to ``split`` (``fused_qkv_split``)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups:
            raise ValueError(
                "MatrixOptimizersContainer.Config.param_groups must be empty: matrices step with "
                f"{config.name!r} and every other parameter with {config.tail_name!r}; set their "
                "lr / weight_decay / kwargs fields instead")
        self.model_parts = model_parts
        self.optimizers = [_matrix_optimizer(config, part) for part in model_parts]
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        self._validate_params([p for p in params if p.requires_grad])
        self._post_init(params)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torchtitan's flat state dict (``state_dict()``'s keys); collective. A dict saved
        with another split, optimizer or parameters raises ``ValueError`` on every rank (see
        [Note: flat optimizer state of the torchtitan container])."""
        for optim in self.optimizers:
            init_optim_state(optim)
            optim.load_state_dict(unflatten(optim, state_dict))


def _matrix_optimizer(config: MatrixOptimizersContainer.Config, part: nn.Module
                      ) -> MatrixOptimizer:
    tail_kwargs = dict(config.tail_kwargs)
    if config.implementation in ("fused", "foreach"):
        tail_kwargs.setdefault(config.implementation, True)
    elif config.implementation != "for-loop":
        raise ValueError(f"MatrixOptimizersContainer: implementation {config.implementation!r} "
                         "is not supported; use 'fused', 'foreach' or 'for-loop'")
    split = dict(config.split or {})
    if config.qkv_split != "none":
        if config.qkv_split not in ("qkv", "head"):
            raise ValueError("MatrixOptimizersContainer: qkv_split must be 'none', 'qkv' or "
                             f"'head', got {config.qkv_split!r}")
        split.update(fused_qkv_split(part, per=config.qkv_split))
    optim = MatrixOptimizer(part, config.name, lr=config.lr, weight_decay=config.weight_decay,
                            tail_optimizer=config.tail_name, tail_lr=config.tail_lr,
                            tail_weight_decay=config.tail_weight_decay,
                            tail_optimizer_kwargs=tail_kwargs, split=split or None,
                            **config.kwargs)
    name_param_groups(optim, part)
    return optim


def name_param_groups(optim: Optimizer, model: nn.Module) -> None:
    """Give every param group of ``optim`` torchtitan's ``param_names``: the canonical FQN
    (checkpoint-wrapper and compile segments stripped) of each of its parameters, in order."""
    names = {id(p): canonical_fqn(n) for n, p in model.named_parameters(remove_duplicate=False)}
    for index, group in enumerate(optim.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"param group {index} of {type(optim).__name__} holds {len(missing)} tensors "
                f"(shapes {missing[:4]}) that are not parameters of the model part; build the "
                "optimizer over this model part's parameters")
        group["param_names"] = [names[id(p)] for p in group["params"]]
