"""Training configuration: one pydantic model, loadable from YAML/JSON, overridable by flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "load_config"]

OptimizerName = Literal["muon", "shampoo", "soap", "okls", "emagram", "adamw"]


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
    optimizer_kwargs: dict[str, Any] = Field(default_factory=dict)
    lr: float = Field(0.02, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    tail_lr: float = Field(3e-3, gt=0)
    tail_weight_decay: float = Field(0.0, ge=0)
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

    @model_validator(mode="after")
    def _sane(self) -> TrainConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps})")
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
    """Defaults ← file ← overrides (``None`` overrides are ignored); errors name the field."""
    data: dict[str, Any] = _read(path) if path is not None else {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key.startswith("model."):
            data.setdefault("model", {})[key.removeprefix("model.")] = value
        else:
            data[key] = value
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid training config: {problems}") from None
