"""Choosing groups and matrices of a model, with the validation and the report users see.

[Note: default matrix selection]
A parameter is a *matrix* (stepped by the matrix optimizer on its owner) when, with the default
``matrix_filter=None``, all of these hold:
- it lives inside a group other than the root (a block: by default every child of each outermost
  ``nn.ModuleList``, and the blocks of one class repeated in an outermost ``nn.ModuleDict`` or
  ``nn.Sequential``: see ``container_blocks``), so the LM head, the final norm and root-level
  embeddings stay in the tail;
- it has at least 2 dims and neither matrix dim has size 1 (a ``(1, n)`` tensor is a vector);
- it is not an embedding: not the weight of an ``nn.Embedding`` (or subclass) and not tied to one;
- it is not a bias (its name is ``bias`` or ends in ``_bias``: stacked expert biases are 2-D);
- it is not a convolution kernel (the weight of an ``nn.Conv*`` module) and has at most 3 dims.
That covers ``nn.Linear``, Hugging Face ``Conv1D``, fused expert stacks ``(E, out, in)`` (experts
on dim 0) and routers. Everything else is the *tail*, stepped by the tail optimizer (AdamW). Conv
kernels and tensors of more than 3 dims in blocks are listed in one INFO line; select them with a
``matrix_filter`` and they are trained flattened to ``(out, in·k)`` as Muon does for conv filters.

A user ``matrix_filter(fqn, param) -> bool`` replaces the rule. Where it disagrees with the rule,
one log line names the weights (WARNING for block weights it leaves in the tail, INFO for extra
parameters it selects) and ``Plan.notes`` records why each one's role differs.

The stored orientation of each matrix (see [Note: plan vocabulary]) is detected here: ``"in_out"``
for Hugging Face ``Conv1D`` weights and for the weights of any module whose ``is_transposed``
attribute is ``True`` (Hugging Face's flag for expert modules storing ``(E, in, out)``; set it on
your own module to declare the same), ``"flatten"`` for selected conv kernels and tensors of more
than 3 dims, ``"out_in"`` otherwise.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.conv import _ConvNd

from ..planner import ParamSpec, canonical_shape

__all__ = [
    "MatrixFilter",
    "ParamSite",
    "container_blocks",
    "default_groups",
    "default_rule",
    "orientation_of",
    "param_specs",
    "report_selection",
    "select_params",
    "summarize_fqns",
    "warn_weak_selection",
]

logger = logging.getLogger(__name__)

MatrixFilter = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class ParamSite:
    """Where a parameter lives: its FQN, owning module and attribute name, and its group.

    ``rule`` is what the default rule decides, ``why_tail`` why it leaves the parameter in the
    tail (``""`` when the rule selects it), ``is_matrix`` the decision in force (the rule's, or
    the user's ``matrix_filter``), ``orientation`` how the stored tensor maps to ``(out, in)``.
    """

    fqn: str
    module: nn.Module
    name: str
    param: nn.Parameter
    group: str
    is_matrix: bool
    rule: bool = False
    why_tail: str = ""
    orientation: str = "out_in"


def default_groups(model: nn.Module) -> list[nn.Module]:
    """The blocks of the outermost block containers (see ``container_blocks``), then the root."""
    groups: list[nn.Module] = []
    claimed: set[int] = set()
    for module in model.modules():
        if id(module) in claimed:
            continue
        for child in container_blocks(module):
            groups.append(child)
            claimed.update(id(m) for m in child.modules())
    return [*groups, model]


def container_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks ``module`` holds as a container, or ``[]``.

    - ``nn.ModuleList`` (and subclasses): every child;
    - ``nn.ModuleDict`` and ``nn.Sequential`` (and subclasses, as torchtitan's layer dict): the
      children of a class that occurs at least twice among them and that are blocks themselves
      (they hold parameters and have submodules), so ``Sequential(Linear, GELU, Linear)`` or a
      dict of heads are no blocks, while the layers of a Llama (``ModuleDict`` "0", "1", ...) or
      timm's ``blocks = Sequential(Block, ...)`` are; a ``Sequential`` root holding an
      embedding, the blocks and a head gives the blocks. A ``ModuleDict`` keyed by layer
      numbers gives every block, also one alone (a pipeline stage cut from a layer dict).
    """
    if isinstance(module, nn.ModuleList):
        return list(module)
    if not isinstance(module, (nn.ModuleDict, nn.Sequential)):
        return []
    children = list(module.children())
    candidates = [c for c in children if next(c.children(), None) is not None
                  and next(c.parameters(), None) is not None]
    if isinstance(module, nn.ModuleDict) and candidates and all(k.isdigit() for k in module):
        return candidates  # a layer dict "0", "1", ...: also a pipeline stage's single layer
    counts: dict[type, int] = {}
    for child in candidates:
        counts[type(child)] = counts.get(type(child), 0) + 1
    return [c for c in candidates if counts[type(c)] >= 2]


def warn_weak_selection(
    model: nn.Module, sites: Sequence[ParamSite], group_modules: Sequence[nn.Module],
    groups_given: bool,
) -> None:
    """Warn loudly (with the fix) when wrapping selects no matrix or finds no block."""
    matrices = sum(1 for s in sites if s.is_matrix)
    weights = sum(1 for s in sites if s.param.ndim >= 2)
    problems = []
    if not groups_given and len(group_modules) == 1:
        problems.append(
            "the default groups found no repeated blocks (children of an nn.ModuleList, or "
            "blocks of one class repeated in an nn.ModuleDict / nn.Sequential), so every tail "
            "parameter sits in the root's one FSDP2 unit, never resharded during a step "
            "(DDP-level memory)")
    if matrices == 0 and weights:
        problems.append(
            f"no matrix was selected ({weights} tensor(s) of 2+ dims all stay in the tail and "
            "are stepped by the tail optimizer (AdamW), not the matrix optimizer)")
    if problems:
        logger.warning(
            "matrixfsdp: wrapping %s: %s. Fix: pass groups=[...] (the transformer blocks, e.g. "
            "groups=list(model.layers.values()) or list(model.layers)) and, if needed, "
            "matrix_filter=...; see get_plan(model).selection()",
            type(model).__name__, "; ".join(problems),
        )


def _module_fqns(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def _group_of(fqn: str, group_names: Sequence[str]) -> str:
    """The innermost group whose FQN prefixes ``fqn`` (the root ``""`` prefixes everything)."""
    best = ""
    for name in group_names:
        if name and (fqn.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


# -- the rule --------------------------------------------------------------------------------------
def _is_hf_conv1d(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Hugging Face ``Conv1D`` (GPT-2 and kin): a linear layer storing its weight as (in, out)."""
    return (type(module).__name__ == "Conv1D" and name == "weight" and param.ndim == 2
            and tuple(param.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def orientation_of(module: nn.Module, name: str, param: nn.Parameter) -> str:
    """How ``param`` maps to the ``(out, in)`` matrix (see [Note: default matrix selection])."""
    if isinstance(module, _ConvNd) or param.ndim > 3:
        return "flatten" if param.ndim >= 3 else "out_in"
    if _is_hf_conv1d(module, name, param):
        return "in_out"
    if getattr(module, "is_transposed", False) is True and param.ndim in (2, 3):
        return "in_out"
    return "out_in"


def default_rule(
    module: nn.Module, name: str, param: nn.Parameter, group: str, embedding_ids: set[int]
) -> str:
    """``""`` if the default rule makes ``param`` a matrix, else why it stays in the tail."""
    if param.ndim < 2:
        return "fewer than 2 dims"
    if group == "":
        return "outside every block (root level)"
    if id(param) in embedding_ids:
        return "an embedding (or tied to one)"
    if name == "bias" or name.endswith("_bias"):
        return "a bias"
    if isinstance(module, _ConvNd):
        return "a convolution kernel"
    if param.ndim > 3:
        return f"{param.ndim}-D"
    if 1 in canonical_shape(tuple(param.shape), orientation_of(module, name, param))[-2:]:
        return "a vector (a matrix dim of size 1)"
    return ""


# -- selection -------------------------------------------------------------------------------------
def select_params(
    model: nn.Module,
    groups: Sequence[nn.Module],
    matrix_filter: MatrixFilter | None,
    device_type: str,
) -> list[ParamSite]:
    """Every parameter of ``model`` once, marked matrix or tail, with validation errors."""
    fqns_of_module = _module_fqns(model)
    group_names = []
    for g in groups:
        if id(g) not in fqns_of_module:
            raise ValueError(
                f"groups contains a {type(g).__name__} that is not a submodule of the model; "
                "pass modules reachable from the model being wrapped"
            )
        group_names.append(fqns_of_module[id(g)])
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    sites: list[ParamSite] = []
    first_fqn: dict[int, str] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            if id(param) in first_fqn:
                _check_shared(first_fqn[id(param)], fqn, param, sites)
                continue
            first_fqn[id(param)] = fqn
            group = _group_of(fqn, group_names)
            why_tail = default_rule(module, name, param, group, embedding_ids)
            is_matrix = not why_tail if matrix_filter is None else bool(matrix_filter(fqn, param))
            _validate_device(fqn, param, device_type)
            orientation = orientation_of(module, name, param)
            if is_matrix:
                _validate_matrix(fqn, param, orientation)
            sites.append(ParamSite(fqn, module, name, param, group, is_matrix,
                                   rule=not why_tail, why_tail=why_tail,
                                   orientation=orientation if param.ndim >= 2 else "out_in"))
    return sites


def _check_shared(
    first: str, again: str, param: nn.Parameter, sites: Sequence[ParamSite]
) -> None:
    site = next(s for s in sites if s.fqn == first)
    if site.is_matrix:
        raise ValueError(
            f"matrix {first!r} (shape {tuple(param.shape)}) is shared with {again!r}; a matrix "
            "must be used by one module. Untie the weights, or leave this parameter to the tail "
            "by excluding it in matrix_filter (FSDP2 handles shared tail parameters)"
        )


def _validate_device(fqn: str, param: nn.Parameter, device_type: str) -> None:
    if param.device.type != device_type:
        raise ValueError(
            f"parameter {fqn!r} (shape {tuple(param.shape)}) is on device {param.device}, but "
            f"the mesh is on {device_type!r}; move the whole model to {device_type!r} "
            "(materialize meta parameters first) before fully_shard_matrix"
        )


def _validate_matrix(fqn: str, param: nn.Parameter, orientation: str) -> None:
    if param.ndim < 2 or (param.ndim > 3 and orientation != "flatten"):
        raise ValueError(
            f"matrix_filter selected {fqn!r} with shape {tuple(param.shape)}: a matrix must be "
            "2-D (m, n), a 3-D stack (E, m, n) or a kernel flattened to (out, in·k); return "
            "False for it so it stays in the tail"
        )
    if param.numel() == 0:
        raise ValueError(f"matrix {fqn!r} has shape {tuple(param.shape)} with no elements")


def param_specs(sites: Sequence[ParamSite]) -> list[ParamSpec]:
    return [
        ParamSpec(
            fqn=s.fqn,
            shape=tuple(s.param.shape),
            dtype=str(s.param.dtype).removeprefix("torch."),
            role="matrix" if s.is_matrix else "tail",
            group=s.group,
            orientation=s.orientation if s.is_matrix else "out_in",  # type: ignore[arg-type]
        )
        for s in sites
    ]


# -- report ----------------------------------------------------------------------------------------
def summarize_fqns(fqns: Iterable[str]) -> str:
    """FQNs with layer indices folded: ``layers.*.mlp.up.weight (x32)``; each name once."""
    counts: dict[str, int] = {}
    for fqn in fqns:
        pattern = re.sub(r"(?<=\.)\d+(?=\.)", "*", fqn)
        counts[pattern] = counts.get(pattern, 0) + 1
    return ", ".join(p if n == 1 else f"{p} (x{n})" for p, n in counts.items())


def report_selection(sites: Sequence[ParamSite], filtered: bool) -> dict[str, str]:
    """Log how the selection differs from the default rule; return per-FQN notes for the plan.

    With the default rule, block tensors of 2+ dims it leaves out for a reason other than being
    an embedding or a bias (conv kernels, >3-D tensors, vectors) get one INFO line. With a user
    ``matrix_filter``, weights inside blocks it leaves in the tail get one WARNING line, and
    parameters it selects beyond the rule one INFO line.
    """
    if not filtered:
        skipped = [s.fqn for s in sites if s.group and s.param.ndim >= 2 and not s.rule
                   and s.why_tail not in ("an embedding (or tied to one)", "a bias")]
        if skipped:
            logger.info(
                "matrixfsdp: %d tensor(s) of 2+ dims inside blocks stay in the tail by the default "
                "rule (conv kernels, >3-D tensors, vectors): %s; select them with matrix_filter "
                "to train them flattened to (out, in*k)", len(skipped), summarize_fqns(skipped),
            )
        return {}
    left_out = [s for s in sites if s.rule and not s.is_matrix]
    added = [s for s in sites if s.is_matrix and not s.rule]
    if left_out:
        logger.warning(
            "matrixfsdp: matrix_filter leaves %d weight(s) of 2+ dims inside blocks in the tail "
            "(stepped by the tail optimizer; the default rule makes them matrices): %s",
            len(left_out), summarize_fqns(s.fqn for s in left_out),
        )
    if added:
        logger.info(
            "matrixfsdp: matrix_filter selects %d parameter(s) the default rule leaves in the "
            "tail: %s", len(added), summarize_fqns(s.fqn for s in added),
        )
    notes = {s.fqn: "left in the tail by matrix_filter (the default rule makes it a matrix)"
             for s in left_out}
    notes.update({s.fqn: f"selected by matrix_filter (the default rule leaves it in the tail: "
                         f"{s.why_tail})" for s in added})
    return notes
