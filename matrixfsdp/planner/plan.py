"""The owner plan: which rank owns each matrix, as a serializable pydantic model.

[Note: plan vocabulary]
- *matrix*: a parameter of 2 dims (or a 3-D stack ``(E, m, n)`` of E matrices) that is held whole
  by exactly one data-parallel rank, its *owner* (``owner_rank``); every other rank holds an
  empty tensor for it.
- *sharded stack*: a 3-D stack ``(E, m, n)`` of expert matrices left in FSDP2 ``Shard(0)``:
  dim 0 is the expert dim, so each rank's shard is a set of whole experts and FSDP2's
  reduce-scattered gradient is their exact average; each rank is the owner of its slices and the
  matrix optimizer steps them locally (``owner_rank is None``). The planner chooses between a
  whole-stack owner and slices (``LPTPlanner.stacks``).
- *tail*: every other parameter; it stays in stock FSDP2 ``Shard(0)`` sharding
  (``owner_rank is None``).
- *group*: the FQN of the module whose forward gathers the matrix (a communication unit, like an
  FSDP2 param group); ``""`` is the root module.
- *orientation*: how the stored tensor maps to the matrix an optimizer should see, the
  ``(out, in)`` weight of the equivalent ``nn.Linear`` (per expert for a stack): ``"out_in"``
  stores it as is; ``"in_out"`` stores its transpose in the last two dims (Hugging Face
  ``Conv1D``, expert modules with ``is_transposed=True``); ``"flatten"`` is a convolution kernel
  ``(out, in, *k)`` seen as ``(out, in·prod(k))``. ``matrix_shape`` is that canonical shape:
  every shape-dependent rule (planner costs, Muon's learning-rate scale, Kronecker factor sides)
  reads it, and matrix optimizer state is kept in it.
- The plan is a pure function of (names, shapes, dtypes, roles, groups, world size, planner
  options): identical on every rank, across runs and after a restart. Checkpoints record it and
  resharding recomputes it, so nothing here may depend on process state.
- *mesh shape*: ``(replicate, shard)`` of the mesh the model was wrapped on. Owners are planned
  over the shard dim (``world_size`` = shard size) and the same plan holds in every replica
  (HSDP); a flat mesh is ``(1, world_size)``. Plans written before it existed have ``None``
  (read as flat); ``plan_hash`` covers it when set and leaves such plans' digests unchanged.
- *expert rows* (``mesh == "expert"``): an ep rank's local expert stack (its shape is the local
  one, ``E / ep`` experts, the same on every ep rank), owned on the expert mesh: ``owner_rank``
  is an expert-mesh shard index, and the stack is held on every dense shard rank whose
  ``expert_grid`` entry is that index (one per ep rank). ``expert_grid`` lists the expert-mesh
  index of each dense shard index; dense and expert owners are balanced together over the dense
  shard ranks (see [Note: expert parallelism] in ``runtime/experts.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "PLAN_FORMAT_VERSION",
    "ParamPlacement",
    "ParamSpec",
    "Plan",
    "RankLoad",
    "Selection",
    "canonical_shape",
    "dtype_itemsize",
    "stack_slices",
]

PLAN_FORMAT_VERSION = 1

Role = Literal["matrix", "sharded_stack", "tail"]
Orientation = Literal["out_in", "in_out", "flatten"]
MeshKind = Literal["dense", "expert"]
ORIENTATIONS: tuple[str, ...] = ("out_in", "in_out", "flatten")
DType = Literal[
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "float8_e4m3fn", "float8_e5m2",
]

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``str(torch.float32)`` minus the prefix."""
    name = dtype.removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_ITEMSIZE)}")
    return _ITEMSIZE[name]


def canonical_shape(shape: tuple[int, ...], orientation: str) -> tuple[int, ...]:
    """The ``(*, out, in)`` shape the optimizer sees (see [Note: plan vocabulary])."""
    if orientation == "out_in" or len(shape) < 2:
        return tuple(shape)
    if orientation == "in_out":
        return (*shape[:-2], shape[-1], shape[-2])
    if orientation == "flatten":
        return (shape[0], math.prod(shape[1:]))
    raise ValueError(f"unknown orientation {orientation!r}; choose one of {ORIENTATIONS}")


class ParamSpec(NamedTuple):
    """What the planner needs to know about one parameter (no tensors, no process group)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: DType = "float32"
    role: Role = "tail"
    group: str = ""
    orientation: Orientation = "out_in"
    mesh: MeshKind = "dense"  # "expert": an ep rank's local expert stack (shape is local)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return canonical_shape(self.shape, self.orientation)


class ParamPlacement(NamedTuple):
    """A parameter's place in the plan: its spec plus the owner rank (``None`` for the tail).

    Rows are NamedTuples (serialized as JSON arrays in field order) so a plan of 100k matrices
    validates in a fraction of a second.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: DType = "float32"
    role: Role = "tail"
    group: str = ""
    owner_rank: int | None = None
    cost: float = 0.0
    orientation: Orientation = "out_in"  # trailing: rows of older plans (7 items) still validate
    mesh: MeshKind = "dense"  # "expert": owner_rank is on the expert mesh (see the Note)

    @classmethod
    def of(cls, spec: ParamSpec, owner_rank: int | None = None, cost: float = 0.0,
           role: Role | None = None) -> ParamPlacement:
        """The row of ``spec`` (optionally with another role) placed on ``owner_rank``."""
        return cls(spec.fqn, spec.shape, spec.dtype, role or spec.role, spec.group, owner_rank,
                   cost, spec.orientation, spec.mesh)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return canonical_shape(self.shape, self.orientation)


class Selection(NamedTuple):
    """FQNs of a plan by what steps them (``Plan.selection()``)."""

    matrices: tuple[str, ...]  # 2-D (or flattened) matrices, each whole on its owner
    stacks: tuple[str, ...]  # 3-D expert stacks (whole on one owner, or expert slices)
    tail: tuple[str, ...]  # everything the tail optimizer steps


class RankLoad(BaseModel):
    """Per-rank totals of a plan, for reports."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    num_matrices: int
    nbytes: int
    cost: float


class Plan(BaseModel):
    """The owner layout of one wrapped model at one world size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = PLAN_FORMAT_VERSION
    world_size: int = Field(ge=1)
    planner: str = "lpt-bytes"
    params: tuple[ParamPlacement, ...]
    # fqn -> why its role differs from the default rule (a matrix_filter, a planner demotion)
    notes: dict[str, str] = Field(default_factory=dict)
    mesh_shape: tuple[int, int] | None = None  # (replicate, shard); None: an older, flat plan
    # expert-mesh shard index of each dense shard index; None: no expert parallelism
    expert_grid: tuple[int, ...] | None = None

    @classmethod
    def trusted(cls, **fields: object) -> Plan:
        """Build from rows the planner made itself: skip per-row re-validation, keep the checks.

        Plans read from JSON or handed in by users go through full validation instead.
        """
        plan = cls.model_construct(**fields)
        return plan._consistent()

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.mesh_shape is not None:
            replicate, shard = self.mesh_shape
            if replicate < 1 or shard != self.world_size:
                raise ValueError(
                    f"mesh_shape {tuple(self.mesh_shape)} must be (replicate >= 1, shard = "
                    f"world_size = {self.world_size}): owners are planned over the shard dim"
                )
        experts = self.expert_size
        if self.expert_grid is not None and (
                len(self.expert_grid) != self.world_size
                or sorted(set(self.expert_grid)) != list(range(experts))
                or self.world_size % experts
                or any(self.expert_grid.count(f) != self.world_size // experts
                       for f in range(experts))):
            raise ValueError(
                f"expert_grid {tuple(self.expert_grid)} must give each of the {self.world_size} "
                "shard ranks an expert-mesh index, every index on equally many ranks"
            )
        seen: set[str] = set()
        for p in self.params:
            if p.mesh == "expert" and (self.expert_grid is None or p.role != "matrix"):
                raise ValueError(
                    f"expert parameter {p.fqn!r} needs a plan with expert_grid and role 'matrix'"
                )
            limit = experts if p.mesh == "expert" else self.world_size
            if p.fqn in seen:
                raise ValueError(f"plan lists parameter {p.fqn!r} twice")
            seen.add(p.fqn)
            if p.role == "matrix" and (p.owner_rank is None or not 0 <= p.owner_rank < limit):
                raise ValueError(
                    f"matrix {p.fqn!r} has owner_rank={p.owner_rank}; it must be in "
                    f"[0, {limit}) for world_size={self.world_size} ({p.mesh} mesh)"
                )
            if p.role != "matrix" and p.owner_rank is not None:
                raise ValueError(f"{p.role} parameter {p.fqn!r} must have owner_rank=None")
            if p.role == "sharded_stack" and (len(p.shape) != 3 or p.orientation == "flatten"):
                raise ValueError(f"sharded_stack {p.fqn!r} must be 3-D (E, m, n), got {p.shape}")
            if p.orientation != "out_in" and len(p.shape) < (3 if p.orientation == "flatten" else 2):
                raise ValueError(
                    f"{p.fqn!r} of shape {p.shape} cannot have orientation {p.orientation!r}"
                )
        return self

    # -- lookup ---------------------------------------------------------------------------------
    def __getitem__(self, fqn: str) -> ParamPlacement:
        for placement in self.params:
            if placement.fqn == fqn:
                return placement
        raise KeyError(fqn)

    @property
    def expert_size(self) -> int:
        """Shard ranks of the expert mesh (1 without expert parallelism)."""
        return max(self.expert_grid) + 1 if self.expert_grid else 1

    def holders(self, placement: ParamPlacement) -> tuple[int, ...]:
        """Dense shard ranks that hold ``placement`` (a matrix) whole: its owner, or for an
        expert row one rank per ep rank (see [Note: plan vocabulary])."""
        if placement.mesh != "expert":
            return (int(placement.owner_rank),)
        return tuple(r for r, f in enumerate(self.expert_grid or ()) if f == placement.owner_rank)

    @property
    def replicate_size(self) -> int:
        """Replicas of this plan (HSDP); 1 for a flat mesh or an older plan."""
        return self.mesh_shape[0] if self.mesh_shape is not None else 1

    def with_mesh_shape(self, replicate: int, shard: int) -> Plan:
        """This plan recorded for a ``(replicate, shard)`` mesh (``shard`` must be world_size)."""
        if self.mesh_shape is not None and tuple(self.mesh_shape) != (replicate, shard):
            raise ValueError(
                f"the plan was made for mesh shape {tuple(self.mesh_shape)}, not "
                f"{(replicate, shard)}; plan for the mesh the model is wrapped on"
            )
        return Plan.trusted(**{**dict(self), "mesh_shape": (replicate, shard)})

    @property
    def matrices(self) -> tuple[ParamPlacement, ...]:
        """Matrices owned whole by one rank (``role == "matrix"``)."""
        return tuple(p for p in self.params if p.role == "matrix")

    @property
    def sharded_stacks(self) -> tuple[ParamPlacement, ...]:
        return tuple(p for p in self.params if p.role == "sharded_stack")

    @property
    def tail(self) -> tuple[ParamPlacement, ...]:
        return tuple(p for p in self.params if p.role == "tail")

    def selection(self) -> Selection:
        """FQNs by what steps them: owner matrices (2-D), expert stacks (3-D), the tail.

        ``stacks`` holds every 3-D stack stepped by the matrix optimizer, owned whole
        (``role == "matrix"``) or as expert slices (``"sharded_stack"``); ``notes`` says why a
        parameter's role differs from the default rule (a ``matrix_filter``, a planner demotion).
        """
        matrices, stacks, tail = [], [], []
        for p in self.params:
            if p.role == "tail":
                tail.append(p.fqn)
            elif p.role == "sharded_stack" or (len(p.shape) == 3 and p.orientation != "flatten"):
                stacks.append(p.fqn)
            else:
                matrices.append(p.fqn)
        return Selection(tuple(matrices), tuple(stacks), tuple(tail))

    def owned_by(self, rank: int) -> tuple[ParamPlacement, ...]:
        return tuple(p for p in self.matrices if p.owner_rank == rank)

    def groups(self) -> tuple[str, ...]:
        """Group names in first-appearance order."""
        return tuple(dict.fromkeys(p.group for p in self.matrices))

    # -- serialization ----------------------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        return cls.model_validate_json(text)

    def plan_hash(self) -> str:
        """A stable SHA-256 over the canonical JSON (sorted keys, no whitespace).

        Fields added after plans were first written are left out while they hold their
        defaults, so older plans hash as before (older checkpoints' recorded hashes still
        verify): a row's trailing ``orientation`` while it is ``"out_in"``, and ``mesh_shape``
        while it is ``None``.
        """
        data = self.model_dump(mode="json")
        data["params"] = [_trim_defaults(row) for row in data["params"]]
        for key in ("mesh_shape", "expert_grid"):
            if data.get(key) is None:
                data.pop(key, None)
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    # -- reports ----------------------------------------------------------------------------------
    def rank_loads(self) -> list[RankLoad]:
        counts = [0] * self.world_size
        nbytes = [0] * self.world_size
        costs = [0.0] * self.world_size
        for p in self.matrices:
            for rank in self.holders(p):  # owner_rank is set for every matrix (validated)
                counts[rank] += 1
                nbytes[rank] += p.nbytes
                costs[rank] += p.cost
        for p in self.sharded_stacks:  # FSDP2 chunks dim 0: ceil(E / N) whole experts per rank
            experts = p.shape[0]
            for rank, k in enumerate(stack_slices(experts, self.world_size)):
                counts[rank] += k
                nbytes[rank] += p.nbytes * k // experts
                costs[rank] += p.cost * k / experts
        return [
            RankLoad(rank=r, num_matrices=counts[r], nbytes=nbytes[r], cost=costs[r])
            for r in range(self.world_size)
        ]

    def imbalance(self, by: Literal["cost", "bytes"] = "cost") -> float:
        """max/mean of the per-rank load (1.0 is perfect)."""
        loads = [lo.cost if by == "cost" else float(lo.nbytes) for lo in self.rank_loads()]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def imbalance_bound(self, by: Literal["cost", "bytes"] = "cost") -> float:
        """A lower bound on max/mean for any whole-matrix assignment.

        max(largest item, mean, n-th + (n+1)-th largest) / mean, with n the world size.
        """
        items = sorted((p.cost if by == "cost" else float(p.nbytes) for p in self.matrices),
                       reverse=True)
        if not items:
            return 1.0
        n = self.world_size
        mean = sum(items) / n
        # Pigeonhole: of the n + 1 largest items two share a rank.
        pair = items[n - 1] + items[n] if len(items) > n else 0.0
        return max(items[0], mean, pair) / mean if mean > 0 else 1.0


# Row fields added after plans were first written, with their defaults, in row order.
_ROW_DEFAULTS = ("out_in", "dense")
_ROW_BASE = 7  # fields of the first rows


def _trim_defaults(row: list) -> list:
    """A row without the trailing added fields that hold their defaults (see ``plan_hash``)."""
    row = list(row)
    while len(row) > _ROW_BASE and row[-1] == _ROW_DEFAULTS[len(row) - _ROW_BASE - 1]:
        row.pop()
    return row


def stack_slices(experts: int, world_size: int) -> list[int]:
    """Whole experts per rank under FSDP2 ``Shard(0)`` (``torch.chunk`` sizes, zeros at the end)."""
    chunk = -(-experts // world_size)
    return [max(0, min(chunk, experts - r * chunk)) for r in range(world_size)]
