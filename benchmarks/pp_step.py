"""Pipeline parallelism: a pipeline step and its matrix bytes, matrixfsdp vs FSDP2 (issue 28).

``python -m benchmarks.pp_step`` (``--help``); ``--projection-only`` prints the 70B projection.

[Note: PP step benchmark]
- World 4 = pp 2 x dp 2 on forked gloo ranks, one thread each. A decoder of ``--layers`` MLP +
  attention-projection blocks (q, k, v, o as ``d x d``, up ``4d x d``, down ``d x 4d``; layer
  dict, norms) cut into 2 stages as torchtitan cuts them; stage 0 holds the embedding, stage 1
  the norm and head. ``ScheduleGPipe`` with 1, 4 and 8 microbatches of one global batch.
- Strategies, on the same stages: ``matrixfsdp`` (``fully_shard_matrix`` over the dp mesh) and
  ``fsdp2`` (``fully_shard`` on each layer, then the stage root), both
  ``reshard_after_forward=True`` (``--keep`` adds ``False``).
- Step time: ``schedule.step`` (forward, backward, the end-of-step reduction, gradient scaling),
  between two barriers, the slowest rank's; median over ``--reps`` after one warm-up step. Each
  rep steps both strategies, in alternating order, so both see the same machine load; the ratio
  column is the median of the reps' FSDP2 / matrixfsdp ratios.
- Matrix bytes per step and rank, sent + received: matrixfsdp's counter (owner gathers and
  reductions of the matrices); FSDP2's layer units (all-gathers of their shards, reduce-scatters
  of their gradients; a unit's norms and biases are < 1 % of it), ring volumes ``(n-1)/n`` of
  the unit per direction. The root units (embedding, head) are left out on both sides. On
  gloo, ``collectives="auto"`` reduces a group whose padded buffer is at most 1 MiB with one
  all-reduce, counted as its payload sent and received (at dp 2 twice the bytes of a
  reduce-scatter); ``--collectives alltoall`` (one exchange per group) moves FSDP2's bytes.
- The optimizer step is not timed here: matrixfsdp's Muon step is local on owners, FSDP2 +
  Muon needs every matrix whole (reconstruction, §4/§5); the projection adds it.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.pipelining import PipelineStage

import matrixfsdp as mf

from .launch import run_world
from .pp_projection import render_projection

__all__ = ["main"]

logger = logging.getLogger(__name__)

VOCAB = 512


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        y = F.scaled_dot_product_attention(*(t(h).unsqueeze(1) for t in (self.q, self.k, self.v)),
                                           is_causal=True).squeeze(1)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Layers(nn.ModuleDict):
    pass


class _Decoder(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = _Layers({str(i): _Block(d) for i in range(layers)})
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(self.norm(x))


def _stage(full: nn.Module, stage: int, n_layers: int) -> nn.Module:
    module = copy.deepcopy(full)
    mine = range(stage * n_layers // 2, (stage + 1) * n_layers // 2)
    for key in list(module.layers.keys()):
        if int(key) not in mine:
            del module.layers[key]
    if stage != 0:
        module.embed = None
    if stage != 1:
        module.norm = module.head = None
    return module


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _meshes() -> tuple[dist.ProcessGroup, DeviceMesh, int, int]:
    rank = dist.get_rank()
    mine = {}
    for name, grids in (("pp", [[0, 2], [1, 3]]), ("dp", [[0, 1], [2, 3]])):
        for members in grids:
            group = dist.new_group(members)
            if rank in members:
                mine[name] = group
    return mine["pp"], DeviceMesh.from_group(mine["dp"], "cpu", mesh_dim_names=("dp",)), \
        rank // 2, rank % 2


class _Fsdp2Bytes:
    """FSDP2's layer units: all-gather and reduce-scatter ring volumes, sent + received."""

    def __init__(self) -> None:
        self.bytes = 0
        self._saved: list[tuple[str, Any]] = []

    def __enter__(self) -> _Fsdp2Bytes:
        for name in ("foreach_all_gather", "foreach_reduce"):
            original = getattr(_fsdp_param_group, name)
            self._saved.append((name, original))
            setattr(_fsdp_param_group, name, functools.partial(self._counted, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved:
            setattr(_fsdp_param_group, name, original)

    def _counted(self, original: Any, fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
        if fsdp_params and fsdp_params[0]._param_fqn.startswith("layers."):
            n = fsdp_params[0].mesh_info.shard_mesh_size
            numel = sum(p.sharded_size.numel() for p in fsdp_params) * n  # the unit, padded
            itemsize = fsdp_params[0].sharded_param.element_size()
            self.bytes += 2 * (n - 1) * numel * itemsize // n
        return original(fsdp_params, *args, **kwargs)


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    pp_group, dp_mesh, pp_rank, dp_rank = _meshes()
    torch.manual_seed(0)
    full = _Decoder(args.dim, args.layers)
    rows = []
    for raf in (True, False) if args.keep else (True,):
        for micro in args.micro:
            steps = {s: _Stepper(full, s, micro, raf, pp_group, dp_mesh, pp_rank, dp_rank, args)
                     for s in STRATEGIES}
            samples: dict[str, tuple[list[float], list[int]]] = {s: ([], []) for s in steps}
            for rep in range(args.reps):  # both strategies each rep, the order alternating
                for strategy in STRATEGIES[::1 if rep % 2 == 0 else -1]:
                    elapsed, nbytes = steps[strategy].timed()
                    samples[strategy][0].append(elapsed)
                    samples[strategy][1].append(nbytes)
            ours, theirs = samples["matrixfsdp"][0], samples["fsdp2"][0]
            ratio = statistics.median(f / m for m, f in zip(ours, theirs, strict=True))
            for strategy, (times, nbytes) in samples.items():
                rows.append({"strategy": strategy, "micro": micro, "reshard_after_forward": raf,
                             "pp_rank": pp_rank, "step_ms": 1e3 * statistics.median(times),
                             "matrix_bytes": statistics.median(nbytes),
                             "fsdp2_over_ours": ratio, "reps": args.reps})
    return rows


STRATEGIES = ("matrixfsdp", "fsdp2")


class _Stepper:
    """One strategy's stage and schedule; ``timed()``: one step, the slowest rank's seconds and
    this rank's matrix bytes."""

    def __init__(self, full: nn.Module, strategy: str, micro: int, raf: bool,
                 pp_group: dist.ProcessGroup, dp_mesh: DeviceMesh, pp_rank: int, dp_rank: int,
                 args: argparse.Namespace) -> None:
        module = _stage(full, pp_rank, args.layers)
        if strategy == "matrixfsdp":
            mf.fully_shard_matrix(module, dp_mesh, reshard_after_forward=raf,
                                  collectives=args.collectives)
        else:
            for block in module.layers.values():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=raf)
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=raf)
        stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pp_group)
        self.schedule = pipelining.ScheduleGPipe(stage, micro, loss_fn=_loss)
        self.module, self.strategy, self.pp_rank = module, strategy, pp_rank
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (2 * args.rows, args.seq + 1), generator=g)
        self.local = tokens[dp_rank * args.rows:(dp_rank + 1) * args.rows]
        self._step()  # warm-up (and the schedule's shape inference)

    def _step(self) -> None:
        if self.pp_rank == 0:
            self.schedule.step(self.local[:, :-1])
        else:
            self.schedule.step(target=self.local[:, 1:])
        for p in self.module.parameters():
            p.grad = None

    def timed(self) -> tuple[float, int]:
        counter = mf.get_state(self.module).comm.counter if self.strategy == "matrixfsdp" else None
        if counter is not None:
            counter.reset()
        with _Fsdp2Bytes() as fsdp2_bytes:
            dist.barrier()
            start = time.perf_counter()
            self._step()
            elapsed = time.perf_counter() - start
            dist.barrier()
        if counter is not None:
            ops = ("all_gather_v", "reduce_to_owners")
            nbytes = sum(counter.by_op[o].bytes_sent + counter.by_op[o].bytes_received
                         for o in ops if o in counter.by_op)
        else:
            nbytes = fsdp2_bytes.bytes
        slowest = [0.0] * dist.get_world_size()
        dist.all_gather_object(slowest, elapsed)
        return max(slowest), nbytes


def _table(rows: list[dict[str, Any]]) -> str:
    out = ["| reshard_after_forward | microbatches | matrixfsdp step (ms) | FSDP2 step (ms) | "
           "FSDP2 / matrixfsdp (median of paired reps) | "
           "matrixfsdp matrix bytes / step / rank (MiB) | FSDP2 layer-unit bytes (MiB) |",
           "|---|---|---|---|---|---|---|"]
    keyed = {(r["strategy"], r["micro"], r["reshard_after_forward"]): r for r in rows}
    for (strategy, micro, raf), r in keyed.items():
        if strategy != "matrixfsdp":
            continue
        f = keyed[("fsdp2", micro, raf)]
        out.append(f"| {raf} | {micro} | {r['step_ms']:.1f} | {f['step_ms']:.1f} | "
                   f"{r['fsdp2_over_ours']:.2f} | "
                   f"{r['matrix_bytes'] / 2**20:.2f} | {f['matrix_bytes'] / 2**20:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rows", type=int, default=8, help="rows per dp rank and step")
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="also reshard_after_forward=False")
    parser.add_argument("--collectives", default="auto", choices=("auto", "alltoall", "p2p"),
                        help="fully_shard_matrix(collectives=...)")
    parser.add_argument("--projection-only", action="store_true")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not args.projection_only:
        per_rank = run_world(4, _measure, args)
        rows = [r for r in per_rank[0]]  # rank 0 (stage 0): times are the slowest rank's
        stage1 = {(r["strategy"], r["micro"], r["reshard_after_forward"]): r["matrix_bytes"]
                  for r in per_rank[2]}
        for r in rows:  # bytes: the busier stage's
            key = (r["strategy"], r["micro"], r["reshard_after_forward"])
            r["matrix_bytes"] = max(r["matrix_bytes"], stage1[key])
        print(_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(render_projection())


if __name__ == "__main__":
    main()
