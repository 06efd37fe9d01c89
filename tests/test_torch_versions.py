"""The project runs on torch 2.11 (the GPU machines' release) as well as the 2.13 CI installs.

CI cannot install 2.11, so this test reads the sources: no module of the library, the
benchmarks or the tests names a public torch API that 2.11 lacks, except through
``getattr(module, name, None)`` with a fallback (a string, which this test does not flag).
``NEWER_THAN_2_11`` is what ``dir()`` of these torch modules holds on 2.13.0 and not on 2.11.0
(measured 2026-12-02 on both wheels), leaving out private names (the private ones the project
uses, such as ``_coalescing_manager``, exist in both): ``torch.distributed`` (and ``distributed_c10d``), ``torch.distributed.fsdp``,
``torch.nn``, ``torch.nn.functional``, ``torch.autograd``, ``torch.autograd.graph``,
``torch.cuda``, ``torch._dynamo`` and ``torch``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEWER_THAN_2_11 = frozenset({
    "all_gather_single", "reduce_scatter_single", "record_comm",  # torch.distributed
    "DataParallelMeshDims",  # torch.distributed.fsdp
    "LinearCrossEntropyLoss", "LinearCrossEntropyOptions", "linear_cross_entropy",  # torch.nn
    "enforce_grad_layout_policy", "region_activation_memory_budget",  # torch.autograd
    "set_override_stale_capture_stream",
    "caching_allocator_disabled", "current_solver_handle",  # torch.cuda
    "allow_c_slot", "bytecode_debugger", "comprehension_graph_break",  # torch._dynamo
    "override_cudagraphs", "override_optimization_hint",
    "thread_safe_generator",  # torch
})


def _newer_names(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line name`` for each attribute access or import of a name in NEWER_THAN_2_11."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
        found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                  if n in NEWER_THAN_2_11]
    return found


def test_no_torch_api_newer_than_2_11() -> None:
    sources = [p for folder in ("matrixfsdp", "benchmarks", "tests")
               for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(sources) > 50, "the sources were not found"
    found = [hit for path in sources for hit in _newer_names(path)]
    assert not found, (
        "torch 2.11 lacks these (use getattr(module, name, None) with a fallback):\n"
        + "\n".join(found)
    )


def test_the_scan_finds_a_direct_call(tmp_path: Path) -> None:
    """The check can fail: the call this project once made in a benchmark is flagged."""
    source = tmp_path / "sample.py"
    source.write_text("import torch.distributed as dist\n"
                      "work = dist.all_gather_single(out, inp, async_op=True)\n"
                      "from torch.nn.functional import linear_cross_entropy\n"
                      "fn = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor\n")
    assert sorted(_newer_names(source, tmp_path)) == ["sample.py:2 all_gather_single", "sample.py:3 linear_cross_entropy"]

