"""One verdict per optimizer step: a failure on one owner is a failure on every rank.

[Note: step agreement]
- Each matrix's step runs on its owner alone, with no collective. An exception there, or a
  NaN/inf gradient, would stop that rank only, and its peers would block in their next
  collective until the process-group timeout. Two mechanisms keep every rank in step:
- **By default, at no communication cost**, the failures an owner can meet are decided from
  data every holder of that matrix has alike, so no rank raises alone:
  * a NaN/inf gradient reaching an owner (``skip_nonfinite=False``) skips *that matrix* on its
    owner before anything of it changes (parameter, state and its step count stay as they
    were), with a warning naming its FQN and the optimizer step; the other matrices step. Under
    HSDP every replica's owner holds the same all-reduced gradient and skips alike; a TP step
    owner skips the whole matrix and hands the unchanged rows back. Every rank continues.
    Cost: one finiteness pass over the owned gradients and one host read per step.
    ``MatrixOptimizer.nonfinite_matrices`` lists ``(step, fqn)`` of what this rank skipped.
  * an eigensolver that does not converge on an ill-conditioned factor (Shampoo, SOAP,
    EMA-Gram, OKLS's eigh root) is retried in float64 with a small diagonal shift
    (``functional._linalg.robust_eigh``) instead of raising.
- **Opt-in, one 4-byte all-reduce per step**: ``MatrixOptimizer(agree_on_error=True)`` also
  turns *any* exception of the owner-local step, and any NaN/inf gradient, into the same
  ``MatrixStepError`` on every rank, naming each failing matrix's FQN, the step and the cause
  (the failing rank chains its own exception). Only on that failure path does a second, small
  collective (an ``all_gather_object`` of the messages) run. Without it an unforeseen exception
  (a bug, an out-of-memory) still stops its rank alone.
- Checks whose outcome could differ by rank run on every rank at construction, from the plan
  (e.g. a ``torch.optim`` class probed on each planned matrix shape).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MatrixStepError", "StepFailures", "agree_on_step", "all_finite", "finite_flags", "is_all_zero",
    "probe_torch_class",
]

logger = logging.getLogger(__name__)


class MatrixStepError(RuntimeError):
    """An optimizer step failed on some rank; raised alike on every rank."""


class StepFailures:
    """What went wrong in this rank's owner-local step: messages plus a device flag."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.messages: list[str] = []
        self.first: BaseException | None = None
        self._nonfinite: list[tuple[list[str], list[torch.Tensor]]] = []

    def record(self, fqns: Sequence[str], exc: BaseException,
               grads: Sequence[torch.Tensor] = (), step: int | None = None) -> None:
        """Remember that stepping ``fqns`` raised ``exc`` (naming NaN/inf in ``grads``)."""
        bad = [f for f, g in zip(fqns, grads, strict=False) if not bool(all_finite(g))]
        cause = f"{type(exc).__name__}: {exc}".strip()
        if bad:
            cause += f" (the gradient of {bad} holds NaN/inf)"
        where = f"matrix {fqns[0]!r}" if len(fqns) == 1 else f"matrices {list(fqns)}"
        self.messages.append(f"{where} at step {self.step if step is None else step}: {cause}")
        if self.first is None:
            self.first = exc
        logger.error("matrixfsdp: the optimizer step of %s failed: %s", list(fqns), cause)

    def watch(self, fqns: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """Check ``grads`` for NaN/inf at the verdict (one device-side flag, no host read now)."""
        if grads:
            self._nonfinite.append((list(fqns), list(grads)))

    def local_flag(self, device: torch.device) -> torch.Tensor:
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        flag += bool(self.messages)
        finite = [all_finite(g) for _, gs in self._nonfinite for g in gs]
        if finite:
            flag += (~torch.stack(finite).all()).to(device=device, dtype=torch.int32)
        return flag

    def describe_nonfinite(self) -> None:
        """Failure path: add a message per matrix whose gradient holds NaN/inf."""
        for fqns, grads in self._nonfinite:
            for fqn, g in zip(fqns, grads, strict=True):
                if not bool(all_finite(g)):
                    self.messages.append(
                        f"matrix {fqn!r} at step {self.step}: its gradient holds NaN/inf "
                        "(skip_nonfinite=False); pass skip_nonfinite=True to skip such steps "
                        "on every rank, or restore from a checkpoint"
                    )


def all_finite(grad: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: is ``grad`` free of NaN/inf? Its minimum and maximum are finite
    exactly when every entry is (both propagate NaN), so no tensor of its size is made (an
    ``isfinite`` mask would be a quarter of an fp32 matrix, at the optimizer step's peak)."""
    if grad.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=grad.device)
    low, high = torch.aminmax(grad)
    return torch.isfinite(low) & torch.isfinite(high)


def is_all_zero(grad: torch.Tensor) -> bool:
    """Is every entry of ``grad`` zero? (One host read; no tensor of its size is made.)"""
    if grad.numel() == 0:
        return True
    low, high = torch.aminmax(grad)
    return bool((low == 0) & (high == 0))


def finite_flags(grads: Sequence[torch.Tensor]) -> list[bool]:
    """Is each gradient free of NaN/inf? One host read for all of them."""
    if not grads:
        return []
    return [bool(f) for f in torch.stack([all_finite(g) for g in grads]).tolist()]


def probe_torch_class(cls: type[torch.optim.Optimizer], group: dict[str, Any],
                       rows: Iterable[Any], fqns: set[str]) -> None:
    """Build ``cls`` on a meta tensor of each planned matrix shape, on every rank alike: the
    checks its constructor makes (e.g. torch.optim.Muon's 2-D only) then fail on every rank,
    from the plan, not on the matrix's owner alone when it is first stepped."""
    seen: set[tuple[int, ...]] = set()
    for row in rows:
        shape = tuple(row.shape)
        if row.fqn not in fqns or shape in seen:
            continue
        seen.add(shape)
        probe = torch.empty(shape, device="meta", requires_grad=True)
        try:
            cls([probe], **group["matrix_kwargs"], lr=group["lr"],
                weight_decay=group["weight_decay"])
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(
                f"MatrixOptimizer(optimizer={cls.__name__}) rejects matrix {row.fqn!r} of shape "
                f"{shape}: {exc}. Use a registered name (e.g. optimizer='muon', which steps a "
                "3-D stack as a batch of matrices) or leave it out with matrix_filter"
            ) from exc


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_step(runtime: Any, failures: StepFailures) -> None:
    """Collective: raise ``MatrixStepError`` on every rank if any rank's step failed."""
    if not (dist.is_available() and dist.is_initialized()):
        _raise_local(failures)
        return
    group = runtime.dp_mesh.all_ranks_group()
    tp_group = runtime.tp_mesh.get_group(0) if runtime.tp_mesh is not None else None
    flag = failures.local_flag(_device(group))
    flag = runtime.comm.all_reduce_scalar(flag, op="sum") if group is runtime.comm.group else \
        _all_reduce(flag, group)
    if tp_group is not None:
        dist.all_reduce(flag, group=tp_group)
    if not int(flag.item()):
        return
    failures.describe_nonfinite()
    # Over the ranks that reduced the flag (this model's dp x tp ranks), never the whole world:
    # under pipelining the other stages' ranks do not enter this exchange.
    every = _gather_messages([(dist.get_rank(), failures.messages)], group)
    if tp_group is not None:
        every = [entry for row in _gather_messages([every], tp_group) for entry in row]
    lines = [f"rank {rank}: {m}" for rank, msgs in every for m in msgs]
    ranks = sorted({rank for rank, msgs in every if msgs})
    error = MatrixStepError(
        f"the optimizer step {failures.step} failed on rank(s) {ranks}; every rank raises "
        "this error (see [Note: step agreement] in matrixfsdp.optim.agreement):\n  "
        + "\n  ".join(lines)
    )
    raise error from failures.first


def _gather_messages(mine: list[Any], group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``mine`` over ``group``, concatenated in group-rank order (run only on
    the failure path)."""
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, mine, group=group)
    return [entry for row in rows for entry in row]


def _all_reduce(flag: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flag, group=group)
    return flag


def _raise_local(failures: StepFailures) -> None:
    flag = failures.local_flag(torch.device("cpu"))
    if not int(flag.item()):
        return
    failures.describe_nonfinite()
    raise MatrixStepError(
        f"the optimizer step {failures.step} failed:\n  " + "\n  ".join(failures.messages)
    ) from failures.first
