"""Can ``collectives="nvshmem"`` run here? A local verdict per rank, then one agreed over the group.

Every rank must take the same path (NVSHMEM or the torch/NCCL fallback) or their collectives no
longer pair up, so each rank reduces its facts to a ``ProbeReason`` (a pure function, tested on
CPU), the group all-gathers the codes, and the largest code found on any rank decides for all.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_SYMMETRIC_SIZE",
    "LocalFacts",
    "ProbeReason",
    "agree",
    "gather_facts",
    "local_reason",
    "nvshmem_import_error",
    "parse_size",
    "probe",
]

DEFAULT_SYMMETRIC_SIZE = 1 << 30  # NVSHMEM's default NVSHMEM_SYMMETRIC_SIZE (1 GiB)


class ProbeReason(enum.IntEnum):
    """Why NVSHMEM cannot be used (``OK`` when it can); larger codes win when ranks disagree."""

    OK = 0
    NO_CUDA = 1
    NOT_CUDA_MESH = 2
    PACKAGE_MISSING = 3
    HEAP_TOO_SMALL = 4
    SPANS_NODES = 5
    NO_PEER_ACCESS = 6
    SHARED_DEVICE = 7

    def describe(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    ProbeReason.OK: "available",
    ProbeReason.NO_CUDA: "CUDA is not available",
    ProbeReason.NOT_CUDA_MESH: "the model's mesh is not on CUDA (NVSHMEM moves CUDA memory only)",
    ProbeReason.PACKAGE_MISSING: "nvshmem4py is not importable (pip install 'matrixfsdp[nvshmem]')",
    ProbeReason.HEAP_TOO_SMALL: "the symmetric heap the plan needs exceeds NVSHMEM_SYMMETRIC_SIZE",
    ProbeReason.SPANS_NODES: (
        "the ranks span several hosts (this backend puts from non-symmetric buffers, which needs "
        "NVLink/PCIe peers on one host)"
    ),
    ProbeReason.NO_PEER_ACCESS: "two GPUs of the group cannot access each other's memory",
    ProbeReason.SHARED_DEVICE: "two ranks of the group share one GPU",
}


@dataclass(frozen=True)
class LocalFacts:
    """What one rank knows about itself and (after one all-gather) where every rank runs."""

    rank: int
    cuda_available: bool
    device_type: str
    import_error: str | None
    heap_required: int
    heap_available: int
    hosts: tuple[str, ...]  # per rank: a digest of the host name
    devices: tuple[int, ...]  # per rank: its CUDA device index (-1 without CUDA)
    peer_access: bool  # this rank's GPU can access every same-host peer's GPU


def local_reason(facts: LocalFacts) -> tuple[ProbeReason, str]:
    """This rank's verdict and a one-line detail (pure: tested on CPU with made-up facts)."""
    if not facts.cuda_available:
        return ProbeReason.NO_CUDA, "torch.cuda.is_available() is False"
    if facts.device_type != "cuda":
        return ProbeReason.NOT_CUDA_MESH, f"mesh device type is {facts.device_type!r}"
    if facts.import_error is not None:
        return ProbeReason.PACKAGE_MISSING, facts.import_error
    if facts.heap_required > facts.heap_available:
        return ProbeReason.HEAP_TOO_SMALL, (
            f"needs {facts.heap_required} bytes, NVSHMEM_SYMMETRIC_SIZE is {facts.heap_available}; "
            f"set NVSHMEM_SYMMETRIC_SIZE={_round_mib(facts.heap_required)}M or more before training"
        )
    if len(set(facts.hosts)) > 1:
        return ProbeReason.SPANS_NODES, f"{len(set(facts.hosts))} hosts"
    mine = (facts.hosts[facts.rank], facts.devices[facts.rank])
    for r, where in enumerate(zip(facts.hosts, facts.devices, strict=True)):
        if r != facts.rank and where == mine:
            return ProbeReason.SHARED_DEVICE, f"ranks {facts.rank} and {r} use cuda:{mine[1]}"
    if not facts.peer_access:
        return ProbeReason.NO_PEER_ACCESS, f"cuda:{mine[1]} lacks peer access to a group peer"
    return ProbeReason.OK, ""


def agree(codes: Sequence[int]) -> tuple[ProbeReason, int]:
    """The group's verdict (the largest code) and the first rank that reported it."""
    worst = max(codes)
    return ProbeReason(worst), list(codes).index(worst)


def _round_mib(nbytes: int) -> int:
    return -(-nbytes // (1 << 20))


def parse_size(text: str | None, default: int = DEFAULT_SYMMETRIC_SIZE) -> int:
    """An NVSHMEM size setting (``"1073741824"``, ``"2G"``, ``"512m"``) in bytes."""
    if text is None or not text.strip():
        return default
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)[bB]?\s*", text)
    if match is None:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={text!r} is not a size (e.g. 2G, 512M, 1048576)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    return int(match.group(1)) * scale[match.group(2).lower()]


def nvshmem_import_error() -> str | None:
    """``None`` when nvshmem4py and cuda.core import, else the error, in one line."""
    try:
        importlib.import_module("nvshmem.core")
        importlib.import_module("nvshmem.bindings")
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_ints(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=_group_device(group))
    if world == 1:
        return [values]
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t.cpu().tolist() for t in out]


def gather_facts(group: dist.ProcessGroup | None, device_type: str, heap_required: int) -> LocalFacts:
    """Collective: every rank learns every rank's host digest and device index."""
    cuda = torch.cuda.is_available()
    index = torch.cuda.current_device() if cuda and device_type == "cuda" else -1
    digest = hashlib.sha256(socket.gethostname().encode()).digest()[:7]
    rows = _all_gather_ints([int.from_bytes(digest, "big"), index], group)
    hosts = tuple(f"{row[0]:014x}" for row in rows)
    devices = tuple(row[1] for row in rows)
    rank = dist.get_rank(group)
    peer_access = True
    if index >= 0:
        peers = {d for h, d in zip(hosts, devices, strict=True) if h == hosts[rank] and d != index}
        peer_access = all(torch.cuda.can_device_access_peer(index, d) for d in peers if d >= 0)
    return LocalFacts(
        rank=rank, cuda_available=cuda, device_type=device_type,
        import_error=nvshmem_import_error() if cuda and device_type == "cuda" else None,
        heap_required=heap_required,
        heap_available=parse_size(os.environ.get("NVSHMEM_SYMMETRIC_SIZE")),
        hosts=hosts, devices=devices, peer_access=peer_access,
    )


def probe(group: dist.ProcessGroup | None, device_type: str,
          heap_required: int) -> tuple[ProbeReason, str]:
    """Collective (two small all-gathers): the verdict every rank agrees on, with a detail."""
    facts = gather_facts(group, device_type, heap_required)
    reason, detail = local_reason(facts)
    codes = [row[0] for row in _all_gather_ints([int(reason)], group)]
    verdict, first = agree(codes)
    if verdict is ProbeReason.OK:
        return verdict, ""
    if first != facts.rank or not detail:
        detail = f"reported by rank {first}"
    else:
        detail = f"rank {first}: {detail}"
    return verdict, detail
