"""Choosing groups and matrices of a model, with the validation users see at wrap time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..planner import ParamSpec

__all__ = ["MatrixFilter", "ParamSite", "default_groups", "param_specs", "select_params"]

MatrixFilter = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class ParamSite:
    """Where a parameter lives: its FQN, owning module and attribute name, and its group."""

    fqn: str
    module: nn.Module
    name: str
    param: nn.Parameter
    group: str
    is_matrix: bool


def default_groups(model: nn.Module) -> list[nn.Module]:
    """Every child of each outermost ``nn.ModuleList`` (the blocks), then the root."""
    groups: list[nn.Module] = []
    claimed: set[int] = set()
    for module in model.modules():
        if id(module) in claimed:
            continue
        if isinstance(module, nn.ModuleList):
            for child in module:
                groups.append(child)
                claimed.update(id(m) for m in child.modules())
    return [*groups, model]


def _module_fqns(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def _group_of(fqn: str, group_names: Sequence[str]) -> str:
    """The innermost group whose FQN prefixes ``fqn`` (the root ``""`` prefixes everything)."""
    best = ""
    for name in group_names:
        if name and (fqn.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


def _default_filter(fqn: str, module: nn.Module, name: str, param: nn.Parameter, group: str) -> bool:
    return isinstance(module, nn.Linear) and name == "weight" and param.ndim == 2 and group != ""


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
            if matrix_filter is None:
                is_matrix = _default_filter(fqn, module, name, param, group)
            else:
                is_matrix = bool(matrix_filter(fqn, param))
            _validate_device(fqn, param, device_type)
            if is_matrix:
                _validate_matrix(fqn, param)
            sites.append(ParamSite(fqn, module, name, param, group, is_matrix))
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


def _validate_matrix(fqn: str, param: nn.Parameter) -> None:
    if param.ndim not in (2, 3):
        raise ValueError(
            f"matrix_filter selected {fqn!r} with shape {tuple(param.shape)}: a matrix must be "
            "2-D (m, n) or a 3-D stack (E, m, n); return False for it so it stays in the tail"
        )
    if param.numel() == 0:
        raise ValueError(f"matrix {fqn!r} has shape {tuple(param.shape)} with no elements")
    if isinstance(param, torch.distributed.tensor.DTensor):
        raise ValueError(
            f"matrix {fqn!r} is already a DTensor; apply fully_shard_matrix to the plain model"
        )


def param_specs(sites: Sequence[ParamSite]) -> list[ParamSpec]:
    return [
        ParamSpec(
            fqn=s.fqn,
            shape=tuple(s.param.shape),
            dtype=str(s.param.dtype).removeprefix("torch."),
            role="matrix" if s.is_matrix else "tail",
            group=s.group,
        )
        for s in sites
    ]
