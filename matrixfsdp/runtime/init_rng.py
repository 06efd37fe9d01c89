"""Initial values of matrices materialized from ``meta``: independent and world-size invariant.

[Note: matrix init RNG]
With meta-device init (``with torch.device("meta")``, ``fully_shard_matrix``, ``to_empty``, then
``torch.manual_seed(s)`` and ``reset_parameters()`` / ``init_weights()`` on every rank), an owner
drawing its matrices from its own default generator would give two matrices that are the first
draw on their owners the same values, and every matrix values that change with the world size.
So each matrix draws from a stream of its own instead:

- Its seed is ``matrix_init_seed(s, fqn)``: the first 8 bytes (big-endian) of
  ``sha256(f"{s}:{fqn}")``, where ``s`` is ``initial_seed()`` of the default generator of the
  matrix's device at the draw (what ``torch.manual_seed(s)`` set) and ``fqn`` the matrix's name in
  ``model.named_parameters()``. The stream starts at the matrix's first draw after ``to_empty``,
  later draws continue it (an ``init_weights()`` after ``reset_parameters()`` gets fresh values),
  and it restarts from the new seed when ``initial_seed()`` changes (``torch.manual_seed`` with
  another seed). Single-process equivalent: one ``matrix_init_generator(fqn, s)`` per matrix,
  passed as ``generator=`` to each of its draws in order.
- An expert stack distributed over ``ep`` (the same FQN on every ep rank) draws ep rank ``r``'s
  local experts ``[a, b)`` from the stream of ``f"{fqn}[{a}:{b}]"`` (``init_stream_name``): the
  ep ranks' experts differ, and each local stack is the same at every expert-mesh (efsdp) size;
  its values change with the ep size (the stack one call draws is the local one).
- The owner draws the whole matrix from it; non-owners' empty placeholders draw nothing (under
  HSDP each replica's owner draws the same values). Matrix draws neither read nor advance the
  default generator, so on every rank the tail's init sees the default stream as if no matrix
  drew.

The *init window*: it opens when an ``nn.Module._apply`` (``to_empty``) materializes an owner's
matrix from ``meta`` (``api._apply_and_refresh``) and closes at the root's first forward and at
``quiesce()`` (``MatrixOptimizer.step``, ``state_dict()``, ``load_state_dict()``, the checkpoint
loads). Inside it the owner's sharded parameter (the same object: optimizers built meanwhile hold
it) has class ``_InitParam``, an ``nn.Parameter`` whose ``__torch_function__`` runs every torch
function given it, or given a tensor derived from it, with the device's default generator state
swapped for the matrix's stream (save the default state, set the stream's, call, save the stream
back, restore the default). Every tensor such a call returns is derived (``.data``, ``.detach()``,
views, ``new_empty``/``empty_like`` results, ...), so ``nn.init.kaiming_uniform_(w)`` (one call),
``w.data.normal_()``, ``nn.init.orthogonal_(w)`` (it draws into ``w.new_empty(...)``) and
``nn.init.trunc_normal_(w)`` (it resamples into ``empty_like`` buffers) all draw from the stream.
An ``_apply`` inside the window (``model.bfloat16()``) keeps it open and the streams continue.
When the window closes the parameter's class is ``nn.Parameter`` again and derived tensors
behave like plain tensors (copies and pickles of them are plain tensors at any time).

Not covered: TP matrices (see [Note: TP matrices]; a warning names them), values drawn into a
tensor not derived from the matrix and copied in
(``w.copy_(torch.randn(...))``), draws given an explicit ``generator=`` (used as given), init
after the window closed, one call drawing for two matrices (it uses the default generator),
devices without ``torch.<type>.default_generators`` and parameters of an ``nn.Parameter``
subclass (a warning says so for both), and the tail (FSDP2's DTensor shards, expert stacks
sharded as expert slices included): it draws as FSDP2 makes it draw (on a gloo CPU mesh its
random values change with the world size).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .matrix_param import MatrixParam

__all__ = [
    "MatrixInitRng",
    "begin_init_window",
    "default_generator",
    "end_init_window",
    "init_stream_name",
    "init_window_across_apply",
    "matrix_init_generator",
    "matrix_init_seed",
]

logger = logging.getLogger(__name__)

_RNG_ATTR = "_matrixfsdp_init_rng"  # the MatrixInitRng on a tagged tensor's __dict__
_open_windows = 0  # MatrixInitRng objects open in this process: end_init_window's fast path
_warned_devices: set[str] = set()
_warned_tp: list[bool] = []  # non-empty once the TP-from-meta warning was given


def matrix_init_seed(seed: int, fqn: str) -> int:
    """The seed of matrix ``fqn``'s init stream under default seed ``seed`` (see the Note)."""
    digest = hashlib.sha256(f"{int(seed)}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def matrix_init_generator(fqn: str, seed: int | None = None,
                          device: torch.device | str = "cpu") -> torch.Generator:
    """A generator at the start of matrix ``fqn``'s init stream on ``device``.

    ``seed`` defaults to the device's default generator's ``initial_seed()``. Passing it as
    ``generator=`` to a matrix's draws in order reproduces, in one process, the values a wrapped
    model's owner draws after ``to_empty`` (see [Note: matrix init RNG]).
    """
    device = torch.device(device)
    if seed is None:
        default = default_generator(device)
        if default is None:
            raise NotImplementedError(
                f"matrix_init_generator: device {device} has no default generator to take the "
                "seed from; pass seed="
            )
        seed = default.initial_seed()
    return torch.Generator(device=device).manual_seed(matrix_init_seed(seed, fqn))


def default_generator(device: torch.device) -> torch.Generator | None:
    """The default generator of ``device`` (CPU, or ``torch.<type>.default_generators``)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


class MatrixInitRng:
    """One matrix's init stream(s) (one per device it draws on) and its window's state."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn
        self.open = False
        self.param: nn.Parameter | None = None  # the tagged parameter while the window is open
        self._streams: dict[torch.device, tuple[int, torch.Tensor]] = {}  # seed, generator state
        self._drawing = False

    @contextlib.contextmanager
    def drawing(self, device: torch.device) -> Iterator[None]:
        """Swap ``device``'s default generator state for this matrix's stream (see the Note)."""
        generator = default_generator(device)
        if generator is None or self._drawing:
            yield
            return
        seed = generator.initial_seed()
        entry = self._streams.get(device)
        if entry is not None and entry[0] == seed:
            stream = entry[1]
        else:  # first draw, or torch.manual_seed with another seed since the last one
            stream = matrix_init_generator(self.fqn, seed, device).get_state()
        saved = generator.get_state()
        generator.set_state(stream)
        self._drawing = True
        try:
            yield
        finally:
            self._drawing = False
            self._streams[device] = (seed, generator.get_state())
            generator.set_state(saved)

    def __repr__(self) -> str:
        return f"MatrixInitRng({self.fqn!r}, open={self.open})"


# -- the tagged tensor classes -----------------------------------------------------------------
_TAGGED: tuple[type, ...] = ()  # (_InitParam, _InitTensor), set below
_NO_WRAP = torch.overrides.get_default_nowrap_functions()
# Functions that read metadata only: they run without the generator swap (property getters
# such as ``.shape`` and ``.data`` are ``__get__``).
_NEVER_DRAW = frozenset({
    "__get__", "size", "dim", "ndimension", "numel", "stride", "storage_offset", "data_ptr",
    "element_size", "is_contiguous", "untyped_storage", "__len__", "__repr__", "__format__",
})


def _init_torch_function(cls: type, func: Callable, types: tuple, args: tuple = (),
                         kwargs: dict | None = None) -> Any:
    """Run ``func`` on the stream of the one open matrix among its inputs; tag what it returns."""
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():
        rng, device = _input_matrix(args, kwargs)
        if rng is None:
            return func(*args, **kwargs)
        if getattr(func, "__name__", None) in _NEVER_DRAW:
            out = func(*args, **kwargs)
        else:
            with rng.drawing(device):
                out = func(*args, **kwargs)
    return out if func in _NO_WRAP else _tag(out, rng)


def _tensor_inputs(args: tuple, kwargs: dict) -> Iterator[Any]:
    """The arguments, and the items of list or tuple arguments (``torch.cat([...])``)."""
    for arg in itertools.chain(args, kwargs.values()):
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg


def _input_matrix(args: tuple, kwargs: dict) -> tuple[MatrixInitRng | None, torch.device | None]:
    """The open stream of the matrix the inputs derive from (None if none, or more than one)."""
    found: MatrixInitRng | None = None
    device = None
    for leaf in _tensor_inputs(args, kwargs):
        if not isinstance(leaf, _TAGGED):
            continue
        rng = leaf.__dict__.get(_RNG_ATTR)
        if rng is None or not rng.open or rng is found:
            continue
        if found is not None:
            logger.debug("matrixfsdp: a call mixes matrices %s and %s during init; it draws from "
                         "the default generator", found.fqn, rng.fqn)
            return None, None
        found, device = rng, leaf.device
    return found, device


def _tag(out: Any, rng: MatrixInitRng) -> Any:
    """Mark every plain tensor in ``out`` as derived from ``rng``'s matrix."""
    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor:  # a tagged input returned in place, or another subclass
            return out
        tagged = out.as_subclass(_InitTensor)
        tagged.__dict__[_RNG_ATTR] = rng
        return tagged
    if isinstance(out, list):
        return [_tag(x, rng) for x in out]
    if isinstance(out, tuple) and any(isinstance(x, torch.Tensor) for x in out):
        items = [_tag(x, rng) for x in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out


class _InitParam(nn.Parameter):
    """An owner's matrix parameter inside its init window (see [Note: matrix init RNG])."""

    __torch_function__ = classmethod(_init_torch_function)  # type: ignore[assignment]

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]
        with torch._C.DisableTorchFunctionSubclass():
            data = self.data.clone(memory_format=torch.preserve_format)
        copied = nn.Parameter(data, self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: Any) -> tuple:
        with torch._C.DisableTorchFunctionSubclass():
            return nn.Parameter, (self.data, self.requires_grad)


class _InitTensor(torch.Tensor):
    """A tensor derived from a matrix inside its init window (``.data``, views, ``new_empty``)."""

    __torch_function__ = classmethod(_init_torch_function)  # type: ignore[assignment]

    # Copies and pickles are plain tensors (no stream, loadable with weights_only=True).
    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        if id(self) not in memo:
            memo[id(self)] = copy.deepcopy(_plain(self), memo)
        return memo[id(self)]

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return _plain(self).__reduce_ex__(protocol)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor)


_TAGGED = (_InitParam, _InitTensor)


# -- the window ---------------------------------------------------------------------------------
def begin_init_window(params: Iterable[MatrixParam]) -> None:
    """Open the init window of each materialized owner matrix in ``params``."""
    global _open_windows
    for mp in params:
        param = mp.sharded
        if not mp.is_owner or param.is_meta or param.numel() == 0:
            continue
        if type(param) not in (nn.Parameter, _InitParam):  # its own class: left as it is
            logger.warning("matrixfsdp: matrix %r is a %s, not an nn.Parameter: its init draws "
                           "from the owner's default generator (see [Note: matrix init RNG])",
                           mp.fqn, type(param).__name__)
            continue
        if default_generator(param.device) is None:
            if param.device.type not in _warned_devices:
                _warned_devices.add(param.device.type)
                logger.warning(
                    "matrixfsdp: device type %r has no torch.%s.default_generators; matrices "
                    "initialized there draw from each owner's own generator (not world-size "
                    "invariant, see [Note: matrix init RNG])", param.device.type,
                    param.device.type)
            continue
        rng = mp.init_rng if mp.init_rng is not None else MatrixInitRng(init_stream_name(mp))
        if not rng.open:
            rng.open = True
            _open_windows += 1
        rng.param = param
        param.__class__ = _InitParam
        param.__dict__[_RNG_ATTR] = rng
        mp.init_rng = rng


def init_stream_name(mp: MatrixParam) -> str:
    """The name whose stream matrix ``mp`` draws from: its FQN, and for an expert stack under
    EP the FQN with this ep rank's global experts, ``f"{fqn}[{first}:{stop}]"`` (every ep rank
    holds a stack of the same FQN; one stream would give each ep rank the same experts)."""
    layout = getattr(mp, "ep", None)
    if layout is None:
        return mp.fqn
    experts = layout.experts_on(layout.ep_rank)
    return f"{mp.fqn}[{experts.start}:{experts.stop}]"


def _close(rng: MatrixInitRng) -> None:
    global _open_windows
    param, rng.param = rng.param, None
    if param is not None and type(param) is _InitParam:
        param.__class__ = nn.Parameter
        param.__dict__.pop(_RNG_ATTR, None)
    if rng.open:
        rng.open = False
        _open_windows -= 1


def end_init_window(params: Iterable[MatrixParam]) -> None:
    """Close the init windows of ``params`` (the root's first forward and ``quiesce()``)."""
    if _open_windows == 0:
        return
    for mp in params:
        if mp.init_rng is not None:
            _close(mp.init_rng)
            mp.init_rng = None


@contextlib.contextmanager
def init_window_across_apply(params: Iterable[MatrixParam]) -> Iterator[None]:
    """Around an ``nn.Module._apply`` and the refresh after it: windows stay open across the
    conversion (their streams continue) and open where it materialized a matrix from ``meta``."""
    params = list(params)
    carried = set()
    for mp in params:
        if mp.init_rng is not None and mp.init_rng.open:
            _close(mp.init_rng)  # mp.init_rng kept: the stream continues in the new window
            carried.add(id(mp))
    was_meta = [mp.sharded.is_meta for mp in params]
    yield
    tp_from_meta = [mp.fqn for mp, meta in zip(params, was_meta, strict=True)
                    if meta and getattr(mp, "tp", None) is not None]
    if tp_from_meta and not _warned_tp:
        _warned_tp.append(True)  # once per process: to_empty calls _apply module by module
        logger.warning(
            "matrixfsdp: TP matrices were materialized from meta (%s, ...): each tp rank's shard "
            "draws from its default generator, not from a per-matrix stream (a TP shard is not "
            "the whole matrix, and its fan-in is the shard's); initialize them before "
            "parallelize_module, or load their values (matrixfsdp.checkpoint.load, "
            "set_model_state_dict)", ", ".join(tp_from_meta[:4]))
    begin_init_window(mp for mp, meta in zip(params, was_meta, strict=True)
                      if (meta or id(mp) in carried) and getattr(mp, "tp", None) is None)
