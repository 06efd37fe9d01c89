"""Pipeline stages of the tiny transformer, built as torchtitan builds them.

Each stage is a copy of the whole model with the layers, embedding, norm and head it does not own
deleted (``None``): its parameter FQNs are the whole model's (``layers.2.up.weight`` on stage 1
is ``layers.2.up.weight`` of the full model), so checkpoints map back onto it.
"""

from __future__ import annotations

import copy
import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import checkpoint

import matrixfsdp as mf

from .models import TinyTransformer

__all__ = ["MULTI", "SINGLE", "V_SHAPED", "ZERO_BUBBLE", "PPMeshes", "PPTransformer", "Pipeline",
           "build_pipeline", "default_parts", "pp_loss", "pp_meshes", "split_stage", "stage_ids",
           "stage_layers"]


class _LayerDict(nn.ModuleDict):
    """torchtitan's layers: an ``nn.ModuleDict`` keyed "0", "1", ... (keys survive deletion)."""


class PPTransformer(TinyTransformer):
    """``TinyTransformer`` with its layers in a dict and every part optional (a stage)."""

    def __init__(self, layers: int = 4, **kwargs) -> None:
        super().__init__(layers=layers, **kwargs)
        blocks = list(self.layers)
        del self.layers
        self.layers = _LayerDict({str(i): b for i, b in enumerate(blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = (checkpoint(layer, x, use_reentrant=self.reentrant) if self.checkpointing
                 else layer(x))
        if self.norm is not None:
            x = self.norm(x)
        return x if self.head is None else self.head(x)


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """The layers of ``stage`` (an even split, earlier stages first)."""
    per = n_layers // n_stages
    return list(range(stage * per, (stage + 1) * per))


def split_stage(full: nn.Module, layers: list[int], *, embed: bool, head: bool) -> nn.Module:
    """A copy of ``full`` keeping only ``layers`` (and the embedding / norm + head if asked)."""
    stage = copy.deepcopy(full)
    for key in list(stage.layers.keys()):
        if int(key) not in layers:
            del stage.layers[key]
    if not embed:
        stage.embed = None
    if not head:
        stage.norm = None
        stage.head = None
    return stage


def pp_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss on one microbatch: ``lm_loss`` on the last stage's logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class PPMeshes(NamedTuple):
    pp_group: dist.ProcessGroup
    dp_mesh: DeviceMesh  # 1-D (dp) or 2-D (replicate, shard) for HSDP
    pp_rank: int
    dp_rank: int  # this rank's data slice: its index over every data-parallel rank
    dp_size: int


def pp_meshes(pp: int, dp: tuple[int, ...], timeout_s: int = 120,
              ranks: list[int] | None = None) -> PPMeshes | None:
    """A ``(pp, *dp)`` rank-major layout on fresh gloo groups: pp groups and the dp mesh.

    ``dp`` is ``(n,)`` for flat owner sharding or ``(replicate, shard)`` for HSDP; ``ranks``
    (default: the first ``pp * prod(dp)``) are laid out, every other rank gets ``None`` (all
    ranks must call: they all create every group).
    """
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    dp_size = 1
    for d in dp:
        dp_size *= d
    ranks = list(range(pp * dp_size)) if ranks is None else ranks
    layout = torch.tensor(ranks).view(pp, dp_size)
    mine: dict[str, dist.ProcessGroup] = {}
    grids = {"pp": layout.t(), "dp": layout}
    if len(dp) == 2:
        cube = layout.view(pp, *dp)
        grids["replicate"] = cube.movedim(1, -1).reshape(-1, dp[0])
        grids["shard"] = cube.reshape(-1, dp[1])
    for name, grid in grids.items():  # every rank creates every group, in one order
        for members in grid.tolist():
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                mine[name] = group
    if rank not in ranks:
        return None
    pp_rank, dp_rank = divmod(ranks.index(rank), dp_size)
    if len(dp) == 1:
        mesh = DeviceMesh.from_group(mine["dp"], "cpu", mesh_dim_names=("dp",))
    else:
        mesh = DeviceMesh.from_group(
            [mine["replicate"], mine["shard"]], "cpu",
            mesh=layout[pp_rank].view(*dp), mesh_dim_names=("replicate", "shard"))
    return PPMeshes(mine["pp"], mesh, pp_rank, dp_rank, dp_size)


# -- pipelines --------------------------------------------------------------------------------------
SINGLE = ("ScheduleGPipe", "Schedule1F1B")  # one stage per rank
MULTI = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS")  # two chunks per rank, looped
ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # rank r holds stages r and S-1-r
LAYERS = 4

# A stage's contents: (layers, embedding, norm + head).
StageParts = tuple[list[int], bool, bool]


def stage_ids(schedule: str, pp: int, pp_rank: int) -> tuple[list[int], int]:
    """The stages this pp rank runs under ``schedule`` and the number of stages."""
    if schedule in SINGLE:
        return [pp_rank], pp
    n = 2 * pp
    if schedule in V_SHAPED:
        return [pp_rank, n - 1 - pp_rank], n
    return [pp_rank + k * pp for k in range(2)], n


def default_parts(n_stages: int, stage: int) -> StageParts:
    return stage_layers(LAYERS, n_stages, stage), stage == 0, stage == n_stages - 1


class Pipeline(NamedTuple):
    modules: list[nn.Module]  # one wrapped module per local stage (chunk)
    stages: list[int]
    n_stages: int
    schedule: object

    def step(self, tokens: torch.Tensor, losses: list | None = None) -> None:
        """One schedule step on this rank's share ``tokens`` of the global batch."""
        args = (tokens[:, :-1],) if 0 in self.stages else ()
        kwargs = ({"target": tokens[:, 1:], "losses": losses if losses is not None else []}
                  if self.n_stages - 1 in self.stages else {})
        self.schedule.step(*args, **kwargs)


def build_pipeline(full: nn.Module, meshes: PPMeshes, schedule: str, micro: int, *,
                   wrap: str = "matrix", parts=default_parts, prepare=None,
                   **wrap_kwargs) -> Pipeline:
    """Cut ``full`` into this rank's stages, wrap each over the dp mesh, build ``schedule``.

    ``wrap``: ``"matrix"`` (``fully_shard_matrix``) or ``"fsdp2"`` (``fully_shard`` per layer,
    then the stage root, as torchtitan does); ``parts(n_stages, stage)`` says what a stage holds.
    """
    ids, n_stages = stage_ids(schedule, dist.get_world_size(meshes.pp_group), meshes.pp_rank)
    modules, stages = [], []
    for s in ids:
        layers, embed, head = parts(n_stages, s)
        module = split_stage(full, layers, embed=embed, head=head)
        if prepare is not None:  # e.g. tensor parallelism before wrapping
            prepare(module)
        if wrap == "matrix":
            mf.fully_shard_matrix(module, meshes.dp_mesh, **wrap_kwargs)
        else:
            for block in module.layers.values():
                fully_shard(block, mesh=meshes.dp_mesh, **wrap_kwargs)
            fully_shard(module, mesh=meshes.dp_mesh, **wrap_kwargs)
        modules.append(module)
        stages.append(PipelineStage(module, s, n_stages, torch.device("cpu"),
                                    group=meshes.pp_group))
    cls = getattr(pipelining, schedule)
    sched = cls(stages if schedule not in SINGLE else stages[0], micro, loss_fn=pp_loss)
    return Pipeline(modules, ids, n_stages, sched)
