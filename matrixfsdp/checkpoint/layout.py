"""The checkpoint's layout JSON: what was saved, at which world size, by whom, in which format.

[Note: checkpoint layout]
- ``matrixfsdp_layout.json`` sits beside DCP's ``.metadata`` and is written last (before the
  ``COMPLETE`` marker) by the coordinator. It is plain JSON validated by ``CheckpointLayout``
  (pydantic, unknown fields rejected); nothing in it is ever unpickled.
- ``model`` lists every entry of the saving model's ``state_dict()`` once: FQN, global shape,
  dtype, role (``"matrix"``, ``"tail"`` or ``"buffer"``) and, for matrices, the owner rank that
  wrote it. ``plan`` is the owner plan at save time and ``plan_hash`` its digest.
- ``world_size`` is the plan's (the shard size: the ranks matrices are owner-sharded over);
  ``mesh_shape`` is the saving mesh's ``(replicate, shard)`` (``(1, world_size)`` when flat; absent
  in layouts written before HSDP, read as flat). Under HSDP replica 0 wrote the matrices.
- ``optimizer`` records each param group's parameter FQNs and its JSON-encodable hyperparameters
  (tuples, non-finite floats and 0-d tensors are tagged so they come back as they were). The
  optimizer's *state tensors* live in the DCP data under ``optim.state.<fqn>.<key>``. A matrix
  group's ``split`` hyperparameter is the stored split ([Note: matrix views]: block sizes, or
  row runs per block of a row layout), validated on parse; a load compares it with the
  optimizer's, since per-block state (``<key>@<i>``) fits only the layout it was stepped with.
  Layouts from before row layouts hold sizes only and stay readable (same format version).
- TP matrices (see [Note: TP matrices in checkpoints] in ``_tp.py``): a matrix entry's ``shape``
  is always the global matrix's; ``tp`` records how the saving model split it (shard dim, tp
  size, per-rank sizes) and ``tp_size`` the saving tp mesh's size. Both are written only when the
  model had TP, and such a layout has ``format_version`` 2 (``TP_FORMAT_VERSION``), so a release
  that cannot read TP layouts says so instead of half-understanding one; a layout without TP
  stays at version 1, byte for byte what earlier releases wrote.
- Expert stacks (see [Note: experts in checkpoints] in ``_experts.py``): the entry's ``shape`` is
  the global stack's, ``ep_size`` the saving ep mesh's size, and the plan records the expert
  grid. Such a layout has ``format_version`` 3 (``EP_FORMAT_VERSION``).
- ``format_version`` is checked before anything else: a newer layout raises
  ``UnsupportedFormatError`` instead of being half-understood.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from ..planner import PLAN_FORMAT_VERSION, Plan
from .errors import CorruptCheckpointError, UnsupportedFormatError

__all__ = [
    "COMPLETE_FILE",
    "EP_FORMAT_VERSION",
    "FORMAT_VERSION",
    "LAYOUT_FILE",
    "READABLE_FORMAT_VERSIONS",
    "TP_FORMAT_VERSION",
    "CheckpointLayout",
    "CompleteMarker",
    "GroupLayout",
    "OptimizerLayout",
    "TensorEntry",
    "TpEntry",
    "decode_hyperparams",
    "dtype_name",
    "encode_hyperparams",
    "parse_layout",
    "parse_marker",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TP_FORMAT_VERSION = 2  # a layout recording TP matrices (see the Note)
EP_FORMAT_VERSION = 3  # a layout recording expert stacks on an ep mesh (see the Note)
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, TP_FORMAT_VERSION, EP_FORMAT_VERSION)
LAYOUT_FILE = "matrixfsdp_layout.json"
COMPLETE_FILE = "COMPLETE"

Role = Literal["matrix", "sharded_stack", "tail", "buffer"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _drop_none(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """``data`` without the ``keys`` whose value is None (fields a layout without TP omits)."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


class TpEntry(BaseModel):
    """How the saving model split a TP matrix over its tp mesh (``torch.chunk`` sizes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_dim: int = Field(ge=0, le=1)
    tp_size: int = Field(ge=1)
    local_sizes: tuple[int, ...]

    @model_validator(mode="after")
    def _sizes(self) -> TpEntry:
        if len(self.local_sizes) != self.tp_size or min(self.local_sizes, default=0) < 0:
            raise ValueError(f"local_sizes {self.local_sizes} must be tp_size={self.tp_size} "
                             "non-negative sizes")
        return self


class TensorEntry(BaseModel):
    """One entry of the saved model state dict (a matrix's ``shape`` is the global one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    owner_rank: int | None = None
    tp: TpEntry | None = None  # a TP matrix's split at save time (written only when set)

    @model_validator(mode="after")
    def _tp_fits(self) -> TensorEntry:
        if self.tp is None:
            return self
        if self.role != "matrix" or len(self.shape) != 2:
            raise ValueError(f"{self.fqn!r}: only 2-D matrices carry a TP layout")
        if sum(self.tp.local_sizes) != self.shape[self.tp.shard_dim]:
            raise ValueError(f"{self.fqn!r}: TP sizes {self.tp.local_sizes} do not add up to "
                             f"dim {self.tp.shard_dim} of shape {self.shape}")
        return self

    @model_serializer(mode="wrap")
    def _omit_tp(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_none(handler(self), ("tp",))


class GroupLayout(BaseModel):
    """One optimizer param group: its parameters (by FQN) and hyperparameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str | None = None
    optimizer: str | None = None
    params: tuple[str, ...]
    hyperparams: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _split_valid(self) -> GroupLayout:
        """A matrix group's ``split`` is its stored split ([Note: matrix views]): block sizes or
        row runs per split matrix, each a partition of the rows."""
        split = self.hyperparams.get("split")
        if self.kind == "matrix" and split:
            from ..optim.layouts import stored_split_problem  # lazily: the optimizer imports more

            problem = stored_split_problem(split)
            if problem is not None:
                raise ValueError(f"matrix param group: {problem}")
        return self


class OptimizerLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cls: str
    groups: tuple[GroupLayout, ...]


class CheckpointLayout(BaseModel):
    """Everything about a checkpoint that is not tensor data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    matrixfsdp_version: str
    torch_version: str
    step: int = Field(ge=0)
    extra: JsonValue = None
    world_size: int = Field(ge=1)
    mesh_shape: tuple[int, int] | None = None  # (replicate, shard); None: older, flat
    plan: Plan
    plan_hash: str
    model: tuple[TensorEntry, ...]
    optimizer: OptimizerLayout | None = None
    tp_size: int | None = Field(default=None, ge=1)  # the saving tp mesh; None: no TP
    ep_size: int | None = Field(default=None, ge=1)  # the saving ep mesh; None: no EP

    @model_serializer(mode="wrap")
    def _omit_tp(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_none(handler(self), ("tp_size", "ep_size"))

    @model_validator(mode="after")
    def _tp_consistent(self) -> CheckpointLayout:
        has_tp, has_ep = self.tp_size is not None, self.ep_size is not None
        want = EP_FORMAT_VERSION if has_ep else TP_FORMAT_VERSION if has_tp else FORMAT_VERSION
        if self.format_version != want or (has_tp and has_ep):
            raise ValueError(f"format_version {self.format_version} with tp_size={self.tp_size}, "
                             f"ep_size={self.ep_size}: a layout with TP has format_version "
                             f"{TP_FORMAT_VERSION}, one with EP {EP_FORMAT_VERSION}, one with "
                             f"neither {FORMAT_VERSION}")
        if has_ep != (self.plan.expert_grid is not None):
            raise ValueError(f"ep_size={self.ep_size} disagrees with the plan's expert grid")
        for e in self.model:
            if e.tp is not None and e.tp.tp_size != self.tp_size:
                raise ValueError(f"matrix {e.fqn!r}: tp_size {e.tp.tp_size} differs from the "
                                 f"layout's tp_size={self.tp_size}")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> CheckpointLayout:
        if self.plan.world_size != self.world_size:
            raise ValueError(
                f"plan.world_size={self.plan.world_size} differs from world_size={self.world_size}"
            )
        if self.mesh_shape is not None and (
            self.mesh_shape[0] < 1 or self.mesh_shape[1] != self.world_size
            or self.plan.mesh_shape not in (None, self.mesh_shape)
        ):
            raise ValueError(
                f"mesh_shape={self.mesh_shape} must be (replicate >= 1, world_size="
                f"{self.world_size}) and agree with the plan's {self.plan.mesh_shape}"
            )
        if self.plan.plan_hash() != self.plan_hash:
            raise ValueError("plan_hash does not match the plan (the layout was edited)")
        fqns = [e.fqn for e in self.model]
        if len(set(fqns)) != len(fqns):
            raise ValueError("model lists an FQN twice")
        owners = {p.fqn: p.owner_rank for p in self.plan.matrices}
        for e in self.model:
            if e.role == "matrix" and owners.get(e.fqn, -1) != e.owner_rank:
                raise ValueError(f"matrix {e.fqn!r}: owner_rank disagrees with the plan")
        return self

    def entries(self) -> dict[str, TensorEntry]:
        return {e.fqn: e for e in self.model}

    @property
    def saved_mesh_shape(self) -> tuple[int, int]:
        """``(replicate, shard)`` of the saving mesh (flat for layouts written before HSDP)."""
        return self.mesh_shape if self.mesh_shape is not None else (1, self.world_size)

    @property
    def saved_ep_size(self) -> int:
        """The saving model's ep size (1 without EP)."""
        return self.ep_size or 1

    @property
    def saved_tp_size(self) -> int:
        """The saving model's tp size (1 without TP)."""
        return self.tp_size or 1


class CompleteMarker(BaseModel):
    """Content of the ``COMPLETE`` file, written last: enough for ``latest()``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    step: int = Field(ge=0)


# -- parsing ---------------------------------------------------------------------------------------
def parse_layout(text: str | bytes, path: Path) -> CheckpointLayout:
    """Validate a layout JSON, checking the format versions before the schema."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: the layout is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{path}: the layout must be a JSON object")
    version = raw.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise UnsupportedFormatError(
            f"{path}: layout format_version {version!r} is not supported; this matrixfsdp "
            f"reads format_version {' and '.join(map(str, READABLE_FORMAT_VERSIONS))}. Load it "
            "with the matrixfsdp release that wrote it (and export_full it), or upgrade matrixfsdp"
        )
    plan = raw.get("plan")
    plan_version = plan.get("format_version") if isinstance(plan, dict) else None
    if plan_version not in (None, PLAN_FORMAT_VERSION):
        raise UnsupportedFormatError(
            f"{path}: plan format_version {plan_version!r} is not supported (this matrixfsdp "
            f"reads plan format_version {PLAN_FORMAT_VERSION})"
        )
    try:
        return CheckpointLayout.model_validate(raw)
    except ValidationError as exc:
        raise CorruptCheckpointError(f"{path}: the layout does not validate:\n{exc}") from exc


def parse_marker(text: str | bytes) -> CompleteMarker | None:
    """The ``COMPLETE`` marker, or None when it is unreadable or of another format version."""
    try:
        marker = CompleteMarker.model_validate_json(text)
    except ValidationError:
        return None
    return marker if marker.format_version == FORMAT_VERSION else None


# -- hyperparameters -------------------------------------------------------------------------------
class _Skip:
    """Marks a value JSON cannot carry; its key is left out of the layout."""


_SKIP = _Skip()


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"__tensor__": value.item(), "dtype": dtype_name(value.dtype),
                "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        items = [_encode(v) for v in value]
        if any(i is _SKIP for i in items):
            return _SKIP
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        encoded = {k: _encode(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in encoded.values()) else encoded
    return _SKIP


def encode_hyperparams(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters as JSON values (keys JSON cannot carry are dropped)."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        encoded = _encode(value)
        if encoded is _SKIP:
            logger.warning(
                "matrixfsdp.checkpoint: optimizer hyperparameter %r (%s) is not JSON-encodable; "
                "it is not saved and keeps its current value on load", key, type(value).__name__,
            )
            continue
        out[key] = encoded
    return out


def _decode(value: Any, like: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v, None) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__tuple__"}:
        return tuple(_decode(v, None) for v in value["__tuple__"])
    if set(value) == {"__float__"}:
        return float(value["__float__"])
    if set(value) == {"__tensor__", "dtype", "shape"}:
        device = like.device if isinstance(like, torch.Tensor) else "cpu"
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"hyperparameter tensor has unknown dtype {value['dtype']!r}")
        return torch.tensor(value["__tensor__"], dtype=dtype, device=device).reshape(
            value["shape"]
        )
    like_dict = like if isinstance(like, dict) else {}
    return {k: _decode(v, like_dict.get(k)) for k, v in value.items()}


def decode_hyperparams(saved: dict[str, Any], group: dict[str, Any]) -> None:
    """Write saved hyperparameters into ``group`` (in place), restoring tuples and tensors."""
    for key, value in saved.items():
        if key != "params":
            group[key] = _decode(value, group.get(key))
