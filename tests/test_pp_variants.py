"""Pipeline parallelism, variants: the other matrix optimizers, activation checkpointing, bf16
mixed precision and ``reshard_after_forward=False`` (see ``tests/test_pp.py``)."""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from .dist_utils import run_world
from .test_pp import _grads, _steps, _world

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _cases_optimizers() -> dict:
    schedules = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleGPipe", "ScheduleLoopedBFS",
                 "Schedule1F1B")
    return {f"{name}_{s}": functools.partial(_steps, schedule=s, name=name)
            for name, s in zip(("shampoo", "soap", "okls", "emagram", "adamw"), schedules,
                               strict=True)}


def _cases_variants() -> dict:
    return {
        "checkpointing_1f1b": functools.partial(_grads, schedule="Schedule1F1B",
                                                checkpointing=True),
        "checkpointing_interleaved": functools.partial(
            _grads, schedule="ScheduleInterleaved1F1B", checkpointing=True),
        # bf16 compute: FSDP2 on the same stages is the reference (both accumulate the
        # microbatches' gradients in reduce_dtype).
        "bf16_gpipe": functools.partial(_grads, schedule="ScheduleGPipe", reference="fsdp2",
                                        mp_policy=BF16),
        "bf16_interleaved": functools.partial(_grads, schedule="ScheduleInterleaved1F1B",
                                              reference="fsdp2", mp_policy=BF16),
        "keep_after_forward": functools.partial(_grads, schedule="ScheduleInterleaved1F1B",
                                                reshard_after_forward=False),
    }


def test_pp_optimizers() -> None:
    """Shampoo, SOAP, OKLS, EMA-Gram and AdamW for 3 steps equal one process."""
    run_world(4, _world, 2, (2,), _cases_optimizers())


def test_pp_variants() -> None:
    """Activation checkpointing, bf16, keeping gathers after forward."""
    run_world(4, _world, 2, (2,), _cases_variants())
