"""One owner-shaped matrix: its sharded/unsharded parameter pair and storage lifecycle.

[Note: sharded and unsharded matrix parameters]
- ``sharded`` is what ``model.parameters()``, optimizers and state dicts see outside
  forward/backward: the whole matrix on its owner, an empty *placeholder* of shape
  ``(0, *shape[1:])`` on every other rank (so every rank has one parameter per matrix, optimizers
  are never empty, and fan-in based inits such as ``nn.Linear.reset_parameters()`` or
  ``nn.init.kaiming_uniform_(module.weight)`` run on every rank and compute the true fan-in).
- ``unsharded`` is the autograd leaf used in forward/backward. On the owner it *pins* the
  sharded storage: ``unsharded.data`` is ``sharded.data`` (no copy, stable ``data_ptr``), unless a
  mixed-precision ``compute_dtype`` needs a cast copy. On non-owners it is full-shaped with its own
  storage, freed with ``untyped_storage().resize_(0)`` and revived with ``resize_(nbytes)``, which
  keeps tensors that autograd saved for backward valid.
- A full-shaped tensor whose storage is freed must never be read, so the module only holds
  ``unsharded`` while the group is gathered to compute: between the group's forward-pre and
  forward-post hooks, and from its pre-backward to its post-backward (a recomputation that
  bypasses the module's hooks computes with it); at any other time ``module._parameters[name]``
  is ``sharded``.
- Incoming data is written through ``.data`` so autograd's version counter of the leaf (which
  may be saved for backward) is not bumped.
- The module's registered ``sharded`` tensor may be replaced from outside: ``model.to_empty()``
  and other ``nn.Module._apply`` conversions, ``load_state_dict(..., assign=True)``. ``refresh()``
  adopts the new tensor (checking its shape) and rebuilds ``unsharded`` on its device and dtype,
  re-pinning the owner's storage; the runtime calls it right after each such operation.
- A TP matrix (see [Note: TP matrices] in ``runtime/tp.py``) is this same pair over its TP
  shard: ``shape`` is the local shard's, ``sharded`` a plain tensor, and while the group computes
  the module holds ``tp.as_dtensor(unsharded)``, a DTensor view whose autograd leaf is
  ``unsharded``, created anew (grad enabled) each time it is swapped in so that it follows
  ``requires_grad`` and a recomputation's graph reaches the leaf.
- An expert stack (see [Note: expert parallelism] in ``runtime/experts.py``) is the same pair
  over the ep rank's local experts, swapped in as ``ep.as_dtensor(unsharded)``.
- From ``to_empty`` until the first forward or ``quiesce()``, an owner's ``sharded`` parameter is
  in its *init window*: its class is ``_InitParam`` and ``init_rng`` holds its init stream (see
  [Note: matrix init RNG] in ``runtime/init_rng.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .experts import ExpertLayout
from .init_rng import MatrixInitRng, end_init_window
from .tp import TpLayout

__all__ = ["MatrixParam"]


class MatrixParam:
    """Runtime state of one matrix (a 2-D weight or a 3-D stack) on this rank."""

    def __init__(
        self,
        *,
        fqn: str,
        module: nn.Module,
        name: str,
        param: nn.Parameter,
        owner_rank: int,
        rank: int,
        compute_dtype: torch.dtype | None = None,
        tp: TpLayout | None = None,
        ep: ExpertLayout | None = None,
    ) -> None:
        self.fqn = fqn
        self.tp = tp
        self.ep = ep
        self._view: torch.Tensor | None = None  # a TP or EP DTensor view, while swapped in
        if tp is not None or ep is not None:  # own the local shard as the matrix (see the Note)
            param = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
        self.module = module
        self.name = name
        self.owner_rank = owner_rank
        self.is_owner = owner_rank == rank
        self.shape = param.shape
        self.numel = math.prod(param.shape)
        self._mp_dtype = compute_dtype
        self.init_rng: MatrixInitRng | None = None  # set while the init window is open
        if self.is_owner:
            # The original storage becomes the owner's shard: nothing is copied.
            self.sharded = param
        else:
            self.sharded = nn.Parameter(
                torch.empty(self.placeholder_shape, dtype=param.dtype, device=param.device),
                requires_grad=param.requires_grad,
            )
        module._parameters[name] = self.sharded
        self._build_unsharded()

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape: a TP matrix's or an expert stack's global one."""
        layout = self.tp or self.ep
        return tuple(self.shape) if layout is None else layout.global_shape

    @property
    def placeholder_shape(self) -> tuple[int, ...]:
        """A non-owner's empty shard: no elements, but the true fan-in for ``nn.init``."""
        return (0, *self.shape[1:])

    def _build_unsharded(self) -> None:
        """(Re)create the unsharded leaf on the sharded tensor's device and dtype; pin or free."""
        self.dtype = self.sharded.dtype
        self.device = self.sharded.device
        self.requires_grad = self.sharded.requires_grad
        self.compute_dtype = self._mp_dtype or self.dtype
        self.unsharded = nn.Parameter(
            torch.empty(self.shape, dtype=self.compute_dtype, device=self.device),
            requires_grad=self.requires_grad,
        )
        # Gradient sync off: the micro-batches' sum in the reduction dtype (see [Note:
        # accumulation in reduce_dtype] in ``group.py``); dropped with the leaf it came from.
        self.accumulated_grad: torch.Tensor | None = None
        self._pins = self.is_owner and self.compute_dtype == self.dtype
        if self._pins:
            self.unsharded.data = self.sharded.data
        else:
            _free(self.unsharded)
        self.resident = self._pins

    def refresh(self) -> None:
        """Adopt the tensor now registered in the module (see the Note) and rebuild ``unsharded``."""
        current = self.module._parameters.get(self.name)
        if current is self.unsharded or (current is not None and current is self._view):
            return  # called mid-forward: nothing was replaced
        if not isinstance(current, nn.Parameter):
            raise ValueError(
                f"matrix {self.fqn!r} (shape {tuple(self.shape)}) was replaced by "
                f"{type(current).__name__}; matrices must stay nn.Parameters of their module"
            )
        expected = tuple(self.shape) if self.is_owner else self.placeholder_shape
        if tuple(current.shape) != expected:
            role = "its owner" if self.is_owner else f"non-owner rank (owner {self.owner_rank})"
            raise ValueError(
                f"matrix {self.fqn!r} (shape {tuple(self.shape)}) now holds a tensor of shape "
                f"{tuple(current.shape)} on this {role}, which must hold shape {expected}; "
                "load whole weights with matrixfsdp.checkpoint.load_full_state_dict or a state "
                "dict taken from the wrapped model (model.state_dict())"
            )
        replaced = current is not self.sharded
        moved = (current.device != self.unsharded.device
                 or (self._mp_dtype is None and current.dtype != self.unsharded.dtype)
                 or current.requires_grad != self.unsharded.requires_grad)
        self.sharded = current
        if replaced or moved or (self._pins and
                                 self.unsharded.data_ptr() != current.data_ptr()):
            self._build_unsharded()

    # -- storage ----------------------------------------------------------------------------------
    @property
    def pins_owner_storage(self) -> bool:
        """True when the owner's unsharded leaf aliases the sharded storage (no copy)."""
        return self._pins

    def alloc(self) -> None:
        """Make ``unsharded`` hold valid storage (its values are written by the caller)."""
        if self._pins:
            if self.unsharded.data.data_ptr() != self.sharded.data.data_ptr():
                # The sharded tensor was replaced (e.g. ``param.data = ...``): re-pin.
                self.unsharded.data = self.sharded.data
        elif not self.resident:
            _alloc(self.unsharded, self.numel)
            if self.is_owner:  # mixed precision: the owner computes on a cast copy
                self.unsharded.data.copy_(self.sharded.data)
        self.resident = True

    def free(self) -> None:
        """Release the full-size storage (a no-op for the owner's pinned storage)."""
        if not self._pins and self.resident:
            _free(self.unsharded)
        self.resident = self._pins

    def gather_target(self) -> torch.Tensor:
        """A flat view of the (resident) unsharded storage for a gather to write into; through
        ``.data``, so writing does not bump the leaf's version counter (see the Note)."""
        return self.unsharded.data.view(-1)

    def own_values(self) -> torch.Tensor:
        """The owner's resident values as a flat ``compute_dtype`` view (call after ``alloc``)."""
        return self.unsharded.detach().view(-1)

    def resident_bytes(self) -> int:
        """Bytes of full-size storage this rank holds for the matrix (sharded + unsharded)."""
        sharded = self.sharded.untyped_storage().nbytes()
        if self._pins:
            return sharded
        return sharded + self.unsharded.untyped_storage().nbytes()

    @staticmethod
    def end_init_window(params: Iterable[MatrixParam]) -> None:
        """Close the init windows of ``params`` (see [Note: matrix init RNG]); cheap when none
        is open, so the runtime calls it at every root forward."""
        end_init_window(params)

    # -- module view ------------------------------------------------------------------------------
    def use_unsharded(self) -> None:
        layout = self.tp or self.ep
        if layout is None:
            self.module._parameters[self.name] = self.unsharded
            return
        with torch.enable_grad():  # the view must reach the leaf even if swapped in under no_grad
            self._view = layout.as_dtensor(self.unsharded)
        self.module._parameters[self.name] = self._view  # type: ignore[assignment]

    def use_sharded(self) -> None:
        # Only undo our own swap: a tensor put in its place from outside is left for refresh().
        current = self.module._parameters.get(self.name)
        if current is self.unsharded or (current is not None and current is self._view):
            self.module._parameters[self.name] = self.sharded
            self._view = None

    def __repr__(self) -> str:
        return (
            f"MatrixParam({self.fqn!r}, shape={tuple(self.shape)}, owner_rank={self.owner_rank}, "
            f"resident={self.resident})"
        )


def _free(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def _alloc(t: torch.Tensor, numel: int) -> None:
    storage = t.untyped_storage()
    nbytes = numel * t.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
