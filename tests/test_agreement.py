"""A failure on one rank is a failure on every rank: each rank raises within 10 s under a 30 s
process-group timeout, with the same message (see [Note: step agreement])."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import matrixfsdp as mf

from .fault_utils import start_world, wait_exit
from .models import TinyTransformer, global_batch, lm_loss, local_batch

DEADLINE_S = 10.0
PG_TIMEOUT_S = 30
_T0 = [0.0]  # when the failing call starts (each rank's own clock)


def _poison_owned(model: torch.nn.Module, value: float) -> str:
    state = mf.get_state(model)
    for fqn, mp in state.params.items():
        grad = mp.sharded.grad
        grad = grad.to_local() if isinstance(grad, DTensor) else grad
        if grad is not None and grad.numel():
            grad.view(-1)[0] = value
            return fqn
    raise AssertionError("this rank owns no matrix")


def _nan_case(optimizer: str, agree: bool) -> str:
    torch.manual_seed(0)
    model = TinyTransformer()
    mf.fully_shard_matrix(model)
    kwargs = {"ns_dtype": "float32"} if optimizer == "muon" else {}
    opt = mf.MatrixOptimizer(model, optimizer, lr=0.01, agree_on_error=agree, **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    lm_loss(model, local_batch(global_batch(0), rank, world)).backward()
    opt.step()
    opt.zero_grad()
    lm_loss(model, local_batch(global_batch(1), rank, world)).backward()
    poisoned = _poison_owned(model, float("nan")) if rank == 1 else None
    before = {fqn: mp.sharded.detach().clone() for fqn, mp in mf.get_state(model).params.items()
              if mp.sharded.grad is not None}
    _T0[0] = time.monotonic()
    opt.step()
    after = {fqn: mp.sharded.detach() for fqn, mp in mf.get_state(model).params.items()}
    unchanged = sorted(f for f in before if after[f].numel() and torch.equal(before[f], after[f]))
    if poisoned is not None:  # the skipped matrix is untouched, its state's step not advanced
        assert unchanged == [poisoned], (unchanged, poisoned)
        assert opt.nonfinite_matrices == [(2, poisoned)], opt.nonfinite_matrices
    else:
        assert unchanged == [] and opt.nonfinite_matrices == [], unchanged
    opt.zero_grad()  # training goes on: the next step steps it again
    lm_loss(model, local_batch(global_batch(2), rank, world)).backward()
    opt.step()
    return "continued"


def _raise_on_rank1(agree: bool) -> str:
    torch.manual_seed(0)
    model = TinyTransformer()
    mf.fully_shard_matrix(model)
    opt = mf.MatrixOptimizer(model, "soap", lr=0.01, agree_on_error=agree)
    rank, world = dist.get_rank(), dist.get_world_size()
    lm_loss(model, local_batch(global_batch(0), rank, world)).backward()
    if rank == 1:  # an unforeseen owner-local failure (a bug, an out-of-memory)
        def broken(*args, **kwargs):
            raise RuntimeError("simulated owner-local failure")
        opt._spec = dataclasses.replace(opt._spec, step_fn=broken)
    _T0[0] = time.monotonic()
    opt.step()
    return "no error"


def _torch_muon_on_stack() -> str:
    from .test_experts import TinyMoE, _stacks_and_gates

    torch.manual_seed(0)
    model = TinyMoE()
    mf.fully_shard_matrix(model, matrix_filter=_stacks_and_gates,
                          planner=mf.LPTPlanner(stacks="whole"))
    _T0[0] = time.monotonic()
    mf.MatrixOptimizer(model, optimizer=torch.optim.Muon, lr=0.02)
    return "no error"


def _corrupt_file_on_rank1() -> str:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    plain = TinyTransformer()
    model = TinyTransformer()
    mf.fully_shard_matrix(model)
    good, bad = Path(_OUT[0], "good.safetensors"), Path(_OUT[0], "bad.safetensors")
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(good))
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header" + bytes(64))
    dist.barrier()
    _T0[0] = time.monotonic()
    mf.checkpoint.load_full_state_dict(model, bad if dist.get_rank() == 1 else good)
    return "no error"


def _launcher_case(what: str) -> str:
    """Rank 0's file operations in the launcher (pruning checkpoints, the report) fail there."""
    import types

    from matrixfsdp.launch import report, train

    torch.manual_seed(0)
    model = TinyTransformer()
    mf.fully_shard_matrix(model)
    opt = mf.MatrixOptimizer(model, "muon", lr=0.01)
    root = Path(_OUT[0], "ckpt")
    cfg = types.SimpleNamespace(keep_checkpoints=1, model_dump=lambda: {})
    ctx = types.SimpleNamespace(checkpoint_root=root, cfg=cfg, optimizer=opt, model=model,
                                rank=dist.get_rank(), out=Path(_OUT[0]), metrics=[],
                                corpus=types.SimpleNamespace(unigram_loss=lambda: 0.0))

    def broken(*args, **kwargs):
        raise OSError("simulated file-system failure on rank 0")
    if what == "prune":
        train._save(ctx, 1)
        mf.checkpoint.remove_checkpoint = broken
        _T0[0] = time.monotonic()
        train._save(ctx, 2)  # prunes step 1 on rank 0
    else:
        report.write_report = broken
        _T0[0] = time.monotonic()
        train._finish(ctx)
    return "no error"


CASES = {
    "nan_shampoo": lambda: _nan_case("shampoo", False),
    "nan_muon": lambda: _nan_case("muon", False),
    "nan_shampoo_agreed": lambda: _nan_case("shampoo", True),
    "raise_agreed": lambda: _raise_on_rank1(True),
    "torch_muon_stack": _torch_muon_on_stack,
    "load_full_corrupt": _corrupt_file_on_rank1,
    "launcher_prune": lambda: _launcher_case("prune"),
    "launcher_report": lambda: _launcher_case("report"),
}
_OUT = [""]


def _rank(rank: int, world: int, case: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    _OUT[0] = out
    try:
        result = CASES[case]()
        kind = "ok"
    except Exception as exc:  # the verdict this test checks
        result, kind = str(exc), type(exc).__name__
    elapsed = time.monotonic() - _T0[0]
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"kind": kind, "message": result, "elapsed": elapsed}))
    os._exit(0)  # no barrier/destroy: a rank left behind must not hold this one


@pytest.mark.parametrize("case", sorted(CASES))
def test_owner_local_failure_same_on_every_rank(case: str, tmp_path: Path) -> None:
    """Each rank ends within the deadline, with the same outcome: all continue or all raise."""
    world = 2
    procs = start_world(world, _rank, case, str(tmp_path), log_dir=tmp_path / "logs")
    codes = wait_exit(procs, timeout=120)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert codes == [0] * world, (codes, logs[-3000:])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    kinds = {r["kind"] for r in results}
    messages = {r["message"] for r in results}
    if case == "load_full_corrupt":  # the failing rank raises its own error, the others name it
        assert "ok" not in kinds and "bad.safetensors" in results[1]["message"], results
        assert "rank(s) [1]" in results[0]["message"], results
        assert max(r["elapsed"] for r in results) < DEADLINE_S, results
        return
    if case.startswith("launcher"):
        assert results[0]["kind"] == "OSError" and "rank 0" in results[0]["message"], results
        assert results[1]["kind"] == "CheckpointError" and "rank(s) [0]" in results[1]["message"]
        assert max(r["elapsed"] for r in results) < DEADLINE_S, results
        return
    assert len(kinds) == 1 and len(messages) == 1, results  # the same outcome on every rank
    message = messages.pop()
    if case in ("nan_shampoo", "nan_muon"):  # skipped on the owner, with a warning naming it
        assert kinds == {"ok"} and message == "continued", results
        assert "optimizer step 2 skipped matrix" in logs and "NaN/inf" in logs, logs[-3000:]
    elif case == "nan_shampoo_agreed":
        assert kinds == {"MatrixStepError"} and "at step 2" in message and "NaN/inf" in message
        assert "rank 1:" in message and "matrix '" in message, message
    elif case == "raise_agreed":
        assert kinds == {"MatrixStepError"} and "simulated owner-local failure" in message
        assert "rank 1:" in message and "at step 1" in message, message
    else:
        assert kinds == {"ValueError"} and "layers.0.w_in" in message and "(4, 16, 24)" in message
    assert max(r["elapsed"] for r in results) < DEADLINE_S, results


def test_eigh_that_does_not_converge_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ill-conditioned factor must not raise on its owner alone: float64 with a tiny shift."""
    from matrixfsdp.optim.functional import _linalg

    real = torch.linalg.eigh
    calls = []

    def flaky(x: torch.Tensor, *args, **kwargs):
        calls.append(x.dtype)
        if x.dtype != torch.float64:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real(x, *args, **kwargs)

    torch.manual_seed(0)
    a = torch.randn(6, 6)
    a = a @ a.T
    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    evals, evecs = _linalg.robust_eigh(a)
    assert calls == [torch.float32, torch.float64]
    assert evals.dtype == evecs.dtype == torch.float32
    torch.testing.assert_close(evecs @ torch.diag(evals) @ evecs.T, a, rtol=1e-5, atol=1e-5)
    root = _linalg.inverse_root_eigh(a, 4, eps=1e-6)  # through the Shampoo root as well
    monkeypatch.setattr(torch.linalg, "eigh", real)
    torch.testing.assert_close(root, _linalg.inverse_root_eigh(a, 4, eps=1e-6), rtol=1e-4,
                               atol=1e-5)


def test_all_finite_is_exact_and_allocates_no_mask() -> None:
    """NaN, inf and -inf anywhere are found in every dtype, without a tensor of the gradient's
    size (an ``isfinite`` mask raised the optimizer phase's peak by 2.5 MiB on a 48 MiB model)."""
    from matrixfsdp.memory import LiveBytesTracker
    from matrixfsdp.optim.agreement import all_finite

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert bool(all_finite(torch.randn(64, 128).to(dtype)))
        assert bool(all_finite(torch.empty(0, 8, dtype=dtype)))
        for value in (float("nan"), float("inf"), -float("inf")):
            for where in ((0, 0), (63, 127), (17, 5)):
                grad = torch.randn(64, 128).to(dtype)
                grad[where] = value
                assert not bool(all_finite(grad)), (dtype, value, where)
    grad = torch.randn(512, 1024)
    tracker = LiveBytesTracker()
    with tracker:
        all_finite(grad)
    assert tracker.peak < 1024, f"all_finite allocated {tracker.peak} bytes"
