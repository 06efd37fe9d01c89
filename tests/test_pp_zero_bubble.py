"""Zero-bubble schedules (split input / weight backward) on wrapped stages, exact.

``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` compute
weight gradients from the accumulators that ``submod.parameters()`` names (see [Note:
zero-bubble schedules] in ``matrixfsdp/runtime/pipelining.py``); before the wrapped model exposed
its leaves there, every matrix of every stage but the first got no gradient. World 4 = pp 2 x dp
2, two chunks per rank, against one process on the global batch.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import FSDPModule

import matrixfsdp as mf

from .dist_utils import run_world
from .pp_models import ZERO_BUBBLE, PPMeshes
from .test_pp import _one_reduction_per_step, _steps, _world


def _leaves_hidden(meshes: PPMeshes, schedule: str, **wrap_kwargs) -> None:
    """After the step every module shows its sharded parameters again (matrices and tail)."""
    from .pp_models import PPTransformer, build_pipeline
    from .test_pp import _tokens

    torch.manual_seed(0)
    pipe = build_pipeline(PPTransformer(), meshes, schedule, 4, **wrap_kwargs)
    pipe.step(_tokens(0, meshes)[1])
    for module in pipe.modules:
        state = mf.get_state(module)
        for mp in state.params.values():
            assert mp.module._parameters[mp.name] is mp.sharded, mp.fqn
        for unit in module.modules():
            if not isinstance(unit, FSDPModule):
                continue
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    assert fp._module_info.module._parameters[fp._module_info.param_name] \
                        is fp.sharded_param, fp._param_fqn


def _cases() -> dict:
    cases: dict = {}
    for schedule in ZERO_BUBBLE:
        cases[f"muon_{schedule}"] = functools.partial(_steps, schedule=schedule, name="muon")
    cases["keep_after_forward_zbv"] = functools.partial(
        _steps, schedule="ScheduleZBVZeroBubble", name="muon", steps=1,
        wrap_kwargs={"reshard_after_forward": False})
    cases["tail_units_groups_dualpipev"] = functools.partial(
        _steps, schedule="ScheduleDualPipeV", name="muon", steps=1,
        wrap_kwargs={"tail_units": "groups"})
    cases["one_reduction_zbv"] = functools.partial(_one_reduction_per_step,
                                                   schedule="ScheduleZBVZeroBubble")
    cases["leaves_hidden_interleaved_zb"] = functools.partial(
        _leaves_hidden, schedule="ScheduleInterleavedZeroBubble", tail_units="groups")
    return cases


def test_pp_zero_bubble_exact() -> None:
    """Every zero-bubble schedule: step-0 gradients and 3 Muon steps equal one process."""
    run_world(4, _world, 2, (2,), _cases())
