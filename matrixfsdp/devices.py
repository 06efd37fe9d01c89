"""Streams, events and pinned memory behind one small interface, with a synchronous host stand-in.

Code that overlaps copies or communication with compute (optimizer-state offload, the NVSHMEM
owner collectives) calls these methods and nothing CUDA-specific, so the same control flow runs
on a CPU-only machine, where every "stream" is the host thread, events are already complete and
"pinning" is a no-op. Only ``CudaOps`` touches ``torch.cuda``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CudaOps", "DeviceOps", "HostOps", "device_ops"]


class DeviceOps:
    """Interface; ``HostOps`` and ``CudaOps`` implement it."""

    device: torch.device
    overlaps: bool  # True when side streams really run concurrently with compute

    def new_stream(self) -> Any:
        raise NotImplementedError

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        raise NotImplementedError
        yield  # pragma: no cover

    def stream_waits_current(self, stream: Any) -> None:
        """Work issued later on ``stream`` starts after work issued so far on the current stream."""
        raise NotImplementedError

    def record_event(self, stream: Any) -> Any:
        raise NotImplementedError

    def current_waits(self, event: Any) -> None:
        """Work issued later on the current stream starts after ``event``."""
        raise NotImplementedError

    def stream_waits_event(self, stream: Any, event: Any) -> None:
        """Work issued later on ``stream`` starts after ``event`` (``None``: no wait)."""
        raise NotImplementedError

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        """Do not reuse ``tensor``'s memory before ``stream``'s work so far has finished."""
        raise NotImplementedError

    def host_copy_target(self, like: torch.Tensor) -> torch.Tensor:
        """An empty host tensor shaped like ``like`` (page-locked on CUDA: async copies)."""
        raise NotImplementedError

    def is_host_resident(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError

    def synchronize(self, stream: Any) -> None:
        """Block the host until ``stream``'s work so far has finished."""
        raise NotImplementedError


class HostOps(DeviceOps):
    """CPU: one thread, so streams are nominal and every event has already happened."""

    overlaps = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def new_stream(self) -> None:
        return None

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        yield

    def stream_waits_current(self, stream: Any) -> None:
        return None

    def record_event(self, stream: Any) -> None:
        return None

    def current_waits(self, event: Any) -> None:
        return None

    def stream_waits_event(self, stream: Any, event: Any) -> None:
        return None

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        return None

    def host_copy_target(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")

    def is_host_resident(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def synchronize(self, stream: Any) -> None:
        return None


class CudaOps(DeviceOps):  # pragma: no cover - needs a CUDA device
    """One CUDA device: real side streams, events, ``record_stream`` and pinned host memory."""

    overlaps = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    @contextlib.contextmanager
    def on_stream(self, stream: torch.cuda.Stream) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def stream_waits_current(self, stream: torch.cuda.Stream) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def record_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def current_waits(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def stream_waits_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None) -> None:
        if event is not None:
            stream.wait_event(event)

    def keep_until_done(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)

    def host_copy_target(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)

    def is_host_resident(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()


def device_ops(device: torch.device | str) -> DeviceOps:
    """``CudaOps`` for a CUDA device, else the synchronous ``HostOps``."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaOps(device)
    return HostOps(device)
