"""Training configuration: one pydantic model, loadable from YAML/JSON, overridable by flags.

The optimizer's hyperparameters (``lr``, ``weight_decay``, ``tail_lr``, ``tail_weight_decay`` and
each ``optimizer_kwargs`` key) default to the chosen optimizer's recommended values (see
[Note: recommended hyperparameters] in ``matrixfsdp.optim.defaults``): a field left unset (or
``None``) is filled from that table when the config is validated, and its name goes into
``defaults_applied`` (``"lr"``, ``"optimizer_kwargs.beta1"``, ...). A field named there is
re-resolved on every validation, so a saved ``config.json`` reloaded with another optimizer gets
that optimizer's defaults, while values the user set stay as set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["OPTIMIZER_NAMES", "ConfigError", "ModelConfig", "TrainConfig", "load_config"]

OptimizerName = Literal["muon", "shampoo", "soap", "okls", "emagram", "adamw"]
OPTIMIZER_NAMES: tuple[str, ...] = get_args(OptimizerName)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class ModelConfig(BaseModel):
    """A small GPT-style decoder over bytes (vocabulary 256)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dim: int = Field(128, ge=8)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    hidden: int = Field(384, ge=8)
    seq_len: int = Field(128, ge=8)
    vocab: int = Field(256, ge=2)

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> ModelConfig:
        if self.dim % self.heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads})")
        return self


class TrainConfig(BaseModel):
    """Everything ``matrixfsdp train`` needs; defaults train the embedded byte-level GPT."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = ModelConfig()
    optimizer: OptimizerName = "muon"
    # Unset keys / None: the optimizer's recommended value, filled in by
    # _resolve_optimizer_defaults (after validation they are never None).
    optimizer_kwargs: dict[str, Any] = Field(default_factory=dict)
    lr: float | None = Field(None, gt=0)
    weight_decay: float | None = Field(None, ge=0)
    tail_lr: float | None = Field(None, gt=0)
    tail_weight_decay: float | None = Field(None, ge=0)
    defaults_applied: list[str] = Field(default_factory=list)  # the fields filled in that way
    warmup_steps: int = Field(20, ge=0)
    steps: int = Field(400, ge=1)
    global_batch: int = Field(16, ge=1)
    grad_clip: float | None = Field(1.0, gt=0)
    skip_nonfinite: bool = True  # skip (on every rank) a step whose global grad norm is inf/NaN
    collective_timeout_s: float = Field(300.0, gt=0)  # a rank whose peer died exits after this
    seed: int = 0
    eval_every: int = Field(50, ge=1)
    eval_batches: int = Field(4, ge=1)
    checkpoint_every: int = Field(100, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    corpus_bytes: int = Field(3_000_000, ge=10_000)
    val_fraction: float = Field(0.05, gt=0, lt=0.5)
    reshard_after_forward: bool = True
    out: str = "runs/default"
    nproc: int = Field(2, ge=1)
    replicate: int = Field(1, ge=1)  # HSDP replicas: ranks = replicate x shard size (1 = flat)
    # Tensor parallelism inside each data-parallel rank group: ranks = replicate x shard x tp;
    # the blocks' attention and MLP are parallelize_module'd (Colwise in, Rowwise out).
    tp: int = Field(1, ge=1)
    # HSDP: presence flags in the all-reduce over replicas (fully_shard_matrix's keyword).
    replicate_presence_flags: bool = True

    @model_validator(mode="before")
    @classmethod
    def _resolve_optimizer_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("optimizer", "muon") not in OPTIMIZER_NAMES:
            return data  # field validation reports the problem
        from ..optim.defaults import recommended_hyperparameters

        data = dict(data)
        rec = recommended_hyperparameters(data.get("optimizer", "muon"))
        stale = set(data.pop("defaults_applied", None) or ())  # defaults of an earlier resolution
        applied: list[str] = []
        for name in ("lr", "weight_decay"):
            if data.get(name) is None or name in stale:
                data[name] = getattr(rec, name)
                applied.append(name)
        tail_lr, tail_wd = rec.resolved_tail(data["lr"], data["weight_decay"])
        for name, value in (("tail_lr", tail_lr), ("tail_weight_decay", tail_wd)):
            if data.get(name) is None or name in stale:
                data[name] = value
                applied.append(name)
        kwargs = data.get("optimizer_kwargs") or {}
        if isinstance(kwargs, dict):
            kwargs = {k: v for k, v in kwargs.items() if f"optimizer_kwargs.{k}" not in stale}
            for key, value in rec.optimizer_kwargs.items():
                if key not in kwargs:
                    kwargs[key] = list(value) if isinstance(value, tuple) else value
                    applied.append(f"optimizer_kwargs.{key}")
            data["optimizer_kwargs"] = kwargs
        data["defaults_applied"] = applied
        return data

    @model_validator(mode="after")
    def _sane(self) -> TrainConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps})")
        for name in ("heads", "hidden"):
            if getattr(self.model, name) % self.tp:
                raise ValueError(f"model.{name} ({getattr(self.model, name)}) must be divisible "
                                 f"by tp ({self.tp}): tensor parallelism splits it over tp ranks")
        return self


def _read(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    import yaml

    is_yaml = path.suffix in (".yaml", ".yml")
    try:
        text = path.read_text()
        data = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:  # ValueError: JSON and decoding errors
        reason = " ".join(str(exc).split())  # one line: YAML errors span several
        kind = "YAML" if is_yaml else "JSON"
        raise ConfigError(f"config file {str(path)!r} is not valid {kind}: {reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Defaults ← file ← overrides (``None`` overrides are ignored); errors name the field.

    ``model.X`` and ``optimizer_kwargs.X`` overrides set one key of those mappings. An override
    of a field the file lists in ``defaults_applied`` makes it the user's value.
    """
    data: dict[str, Any] = _read(path) if path is not None else {}
    user_set: set[str] = set()
    for key, value in overrides.items():
        if value is None:
            continue
        if key.startswith(("model.", "optimizer_kwargs.")):
            section, _, name = key.partition(".")
            if not isinstance(data.get(section, {}), dict):
                raise ConfigError(f"invalid training config: {section}: must be a mapping to set {key}")
            data.setdefault(section, {})[name] = value
            user_set.add(key)
        else:
            data[key] = value
            user_set.add(key)
            if key == "optimizer_kwargs" and isinstance(value, dict):
                user_set.update(f"optimizer_kwargs.{k}" for k in value)
    if isinstance(data.get("defaults_applied"), (list, tuple)):
        data["defaults_applied"] = [k for k in data["defaults_applied"] if k not in user_set]
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid training config: {problems}") from None
    _check_optimizer_kwargs(cfg)
    return cfg


def _check_optimizer_kwargs(cfg: TrainConfig) -> None:
    """The optimizer's own config check, here so that a bad value fails before any rank starts."""
    from ..optim.registry import get_matrix_optimizer

    try:
        get_matrix_optimizer(cfg.optimizer).make_config(dict(cfg.optimizer_kwargs))
    except ValueError as exc:
        raise ConfigError(f"invalid training config: optimizer_kwargs: {exc}") from None
