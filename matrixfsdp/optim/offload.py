"""Where owner optimizer state lives between steps: on the device, or in host memory.

[Note: optimizer state offload]
With ``MatrixOptimizer(..., offload_state="cpu")`` every owned matrix's state tensors live in host
memory (page-locked on CUDA) between steps; ``optimizer.state``, ``state_dict()`` and checkpoints
see those host tensors. The step functions never notice: ``HostOffload.staged`` hands them items
whose state dict points at *staging* copies on the parameter's device, in a pipeline of depth two:
- side stream: copy-in of item ``i + 1`` (issued before item ``i`` computes, so it overlaps it);
- compute (caller's) stream: waits for item ``i``'s copy-in event, then runs the step function;
- side stream: waits for the compute stream, copies item ``i``'s staging back into its host
  tensors and drops the staging (``record_stream`` keeps its memory until that copy is done).
Copy-in of ``i + 1`` is issued before write-back of ``i`` releases its staging, so at most two
items are staged at any moment (``peak_resident`` counts them by construction). The host blocks
once per step, at the end, until the last write-back has landed, because the host tensors may be
read on the host next (``state_dict()``, a checkpoint). Copies are exact, so results equal those
of on-device state bit for bit. On CPU (``HostOps``) the same code runs synchronously and the
"device" staging is a host-to-host copy. State that arrives on the device (fresh state, a loaded
checkpoint) moves to the host when its matrix next steps (``adopt``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..devices import DeviceOps, device_ops
from .owner_step import OwnedMatrix

__all__ = ["HostOffload", "OnDevice", "StatePlacement", "make_state_placement"]


class StatePlacement:
    """Interface: where state tensors live and how step functions get to see them."""

    offloaded = False

    def adopt(self, state: dict[str, Any]) -> None:
        """Move ``state``'s tensors to where this placement keeps them (in place of the dict)."""

    def staged(self, batches: Iterable[Sequence[OwnedMatrix]]) -> Iterator[Sequence[OwnedMatrix]]:
        """Yield the batches ready to compute; work done by the caller in between is kept."""
        yield from batches


class OnDevice(StatePlacement):
    """State stays beside its parameter (the default)."""


class HostOffload(StatePlacement):
    """State in host memory, staged onto the device two batches at a time.

    See [Note: optimizer state offload]. ``resident``/``peak_resident`` count staged batches
    (matrices, with batching off) and ``peak_resident_bytes`` their state bytes.
    """

    offloaded = True

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self.stream = ops.new_stream()
        self.resident = 0
        self.peak_resident = 0
        self.resident_bytes = 0
        self.peak_resident_bytes = 0

    def reset_peaks(self) -> None:
        self.peak_resident, self.peak_resident_bytes = self.resident, self.resident_bytes

    def adopt(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                continue
            if not self.ops.is_host_resident(value):
                host = self.ops.host_copy_target(value)
                host.copy_(value)
                state[key] = host

    def staged(self, batches: Iterable[Sequence[OwnedMatrix]]) -> Iterator[Sequence[OwnedMatrix]]:
        pending = list(batches)
        if not pending:
            return
        ops = self.ops
        ready = self._copy_in(pending[0])
        for i, batch in enumerate(pending):
            nxt = self._copy_in(pending[i + 1]) if i + 1 < len(pending) else None
            staged, event = ready
            ops.current_waits(event)
            yield staged
            self._write_back(batch, staged)
            if nxt is not None:
                ready = nxt
        ops.synchronize(self.stream)  # host tensors are read on the host next (once per step)

    def _copy_in(self, batch: Sequence[OwnedMatrix]) -> tuple[list[OwnedMatrix], Any]:
        ops = self.ops
        staged, nbytes = [], 0
        # Staging is allocated on the side stream: its frees, after the write-back (which waits
        # for the compute stream), are ordered behind every use.
        with ops.on_stream(self.stream):
            for item in batch:
                device_state = {}
                for key, host in item.state.items():
                    dev = torch.empty_like(host, device=item.param.device)
                    dev.copy_(host, non_blocking=True)
                    device_state[key] = dev
                    nbytes += dev.numel() * dev.element_size()
                staged.append(item._replace(state=device_state))
        self.resident += 1
        self.resident_bytes += nbytes
        self.peak_resident = max(self.peak_resident, self.resident)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        return staged, ops.record_event(self.stream)

    def _write_back(self, batch: Sequence[OwnedMatrix], staged: Sequence[OwnedMatrix]) -> None:
        ops = self.ops
        ops.stream_waits_current(self.stream)  # the step that updated the staging is done
        nbytes = 0
        with ops.on_stream(self.stream):
            for item, on_device in zip(batch, staged, strict=True):
                for key, host in item.state.items():
                    dev = on_device.state[key]
                    host.copy_(dev, non_blocking=True)
                    nbytes += dev.numel() * dev.element_size()
        self.resident -= 1
        self.resident_bytes -= nbytes


def make_state_placement(offload_state: str | None, device: torch.device) -> StatePlacement:
    """``OnDevice()`` for ``None``, ``HostOffload`` for ``"cpu"`` (``ValueError`` otherwise)."""
    if offload_state is None:
        return OnDevice()
    if offload_state != "cpu":
        raise ValueError(
            f"MatrixOptimizer.offload_state must be None or 'cpu', got {offload_state!r}"
        )
    return HostOffload(device_ops(device))
