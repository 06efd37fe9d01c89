"""Full-weight sources read lazily: tensors by key, whole or as a slice, one at a time.

[Note: lazy tensor sources]
- A source first describes every tensor it holds (``infos``: key -> shape, dtype, file) from
  metadata alone: safetensors headers, the index JSON of a sharded Hugging Face directory, or a
  ``torch.load(mmap=True)`` that maps a ``torch.save`` file without touching its data. The caller
  validates the whole load against that before any tensor is read.
- ``read(key, index)`` then returns one tensor, or the slice ``index`` of it (the rows of a
  rank's FSDP2 shard): safetensors ``get_tensor``/``get_slice`` and mmap'd torch tensors only
  touch the pages of what is read.
- Pages read through a memory-mapped file stay resident until the mapping closes, so a file
  handle is reopened once the bytes read through it pass ``MAPPED_BYTES_BUDGET``: the extra
  memory of a load is about one tensor (or the budget), never the file.

Sources: an in-memory mapping, a ``.safetensors`` file, a ``torch.save`` file (loaded with
``weights_only=True``), and a Hugging Face model directory (``model.safetensors``,
``model.safetensors.index.json`` + shards, or the ``pytorch_model.bin`` equivalents). The index
JSON is untrusted: parsed with ``json``, validated by ``ShardIndex``, shard names confined to the
directory.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ._compat import names
from .errors import CheckpointMismatchError, CheckpointNotFoundError, CorruptCheckpointError

__all__ = [
    "HF_FILES",
    "MAPPED_BYTES_BUDGET",
    "MAX_INDEX_BYTES",
    "MappingSource",
    "SafetensorsFile",
    "ShardIndex",
    "ShardedSource",
    "TensorInfo",
    "TensorSource",
    "TorchFile",
    "open_file",
    "open_hf_dir",
]

logger = logging.getLogger(__name__)

MAPPED_BYTES_BUDGET = 8 << 20
"""Bytes read through one open memory-mapped handle before it is reopened (see the Note)."""

MAX_INDEX_BYTES = 64 << 20
"""Largest index JSON read (the largest public ones are a few MB)."""

# Checked in this order (Hugging Face's own preference): single file, then index + shards.
HF_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}

Index = tuple[slice, ...]


class TensorInfo(NamedTuple):
    """What a source says about one tensor before reading it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str  # where it is stored, for error messages

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class TensorSource:
    """Tensors by key, described up front and read one at a time (see the Note)."""

    name: str

    def infos(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        """The tensor ``key``, whole (``index=None``) or the slice ``index`` of it."""
        raise NotImplementedError

    def close(self) -> None:
        """Release open file handles (reads reopen them)."""

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MappingSource(TensorSource):
    """A full state dict already in memory (or mmap'd by the caller)."""

    def __init__(self, tensors: Mapping[str, Any], name: str = "the given state dict") -> None:
        bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointMismatchError(f"{name}: non-tensor entries {names(bad)}")
        self.name, self._tensors = name, tensors

    def infos(self) -> dict[str, TensorInfo]:
        return {k: TensorInfo(tuple(v.shape), v.dtype, self.name) for k, v in self._tensors.items()}

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        value = self._tensors[key]
        return value if index is None else value[index]


class _Reopening:
    """A handle opened on first use and reopened once reads through it pass ``budget`` bytes."""

    def __init__(self, opener: Callable[[], Any], close: Callable[[Any], None],
                 budget: int = MAPPED_BYTES_BUDGET) -> None:
        self._opener, self._close, self._budget = opener, close, budget
        self._handle: Any = None
        self._read_bytes = 0

    def get(self, nbytes: int) -> Any:
        if self._handle is not None and self._read_bytes + nbytes > self._budget:
            self.close()
        if self._handle is None:
            self._handle = self._opener()
        self._read_bytes += nbytes
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle, self._read_bytes = self._handle, None, 0
            self._close(handle)


def _nbytes(info: TensorInfo, index: Index | None) -> int:
    if index is None:
        return info.nbytes
    shape = [len(range(*s.indices(n))) for s, n in zip(index, info.shape, strict=False)]
    return math.prod(shape) * math.prod(info.shape[len(index):]) * info.dtype.itemsize


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError as exc:
        raise ImportError("reading .safetensors files needs `pip install safetensors`") from exc
    return safetensors


def _safetensors_dtype(name: str, path: Path, key: str) -> torch.dtype:
    dtype = getattr(torch, _SAFETENSORS_DTYPES.get(name, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointMismatchError(
            f"{path}: tensor {key!r} has dtype {name!r}, which this torch cannot hold"
        )
    return dtype


class SafetensorsFile(TensorSource):
    """One ``.safetensors`` file, read through ``safe_open`` (headers first, data on demand)."""

    def __init__(self, path: Path) -> None:
        self.name, self._path = str(path), path
        self._handle = _Reopening(self._open, lambda h: h.__exit__(None, None, None))
        self._infos: dict[str, TensorInfo] | None = None

    def _open(self) -> Any:
        safe_open = _safetensors().safe_open
        try:
            return safe_open(str(self._path), framework="pt", device="cpu").__enter__()
        except Exception as exc:  # SafetensorError derives from Exception only
            raise CorruptCheckpointError(
                f"{self._path}: not a readable safetensors file ({type(exc).__name__}: {exc})"
            ) from exc

    def infos(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            handle = self._handle.get(0)
            out, keys = {}, handle.keys()  # safe_open handles are not iterable
            for key in keys:
                view = handle.get_slice(key)
                dtype = _safetensors_dtype(view.get_dtype(), self._path, key)
                out[key] = TensorInfo(tuple(view.get_shape()), dtype, self.name)
            self._infos = out
        return self._infos

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        handle = self._handle.get(_nbytes(self.infos()[key], index))
        if index is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]

    def close(self) -> None:
        self._handle.close()


def _load_torch(path: Path) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{path}: not a readable torch.save file of tensors ({type(exc).__name__}: {exc})"
        ) from exc
    for key in ("model", "state_dict"):  # {"model": state_dict} wrappers
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
    if not isinstance(loaded, dict):
        raise CorruptCheckpointError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    bad = [k for k, v in loaded.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointMismatchError(f"{path}: non-tensor entries {names(map(str, bad))}")
    return loaded


class TorchFile(TensorSource):
    """A ``torch.save`` state dict, memory-mapped (``weights_only=True``, ``mmap=True``)."""

    def __init__(self, path: Path) -> None:
        self.name, self._path = str(path), path
        self._handle = _Reopening(lambda: _load_torch(path), lambda h: None)
        self._infos: dict[str, TensorInfo] | None = None

    def infos(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            self._infos = {k: TensorInfo(tuple(v.shape), v.dtype, self.name)
                           for k, v in self._handle.get(0).items()}
        return self._infos

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        value = self._handle.get(_nbytes(self.infos()[key], index))[key]
        return value if index is None else value[index]

    def close(self) -> None:
        self._handle.close()


def open_file(path: Path) -> TensorSource:
    """A ``.safetensors`` file by its suffix, anything else as a ``torch.save`` file."""
    return SafetensorsFile(path) if path.suffix == ".safetensors" else TorchFile(path)


# -- sharded Hugging Face directories -------------------------------------------------------------
def _check_shard_name(name: str) -> str:
    parts = PurePosixPath(name).parts
    if (not name or "\\" in name or "\x00" in name or name.startswith("/")
            or any(p in ("..", ".") for p in parts) or ":" in parts[0]):
        raise ValueError(f"shard file {name!r} is not a plain path inside the directory")
    return name


class ShardIndex(BaseModel):
    """``model.safetensors.index.json``: ``weight_map`` (tensor key -> shard file).

    Other top-level fields (Hugging Face writes ``metadata``) are allowed and ignored. Shard
    names must be relative paths without ``..``: the index cannot point outside its directory.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    weight_map: dict[str, str]
    metadata: dict[str, Any] | None = None

    @field_validator("weight_map")
    @classmethod
    def _shard_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key, shard in value.items():
            try:
                _check_shard_name(shard)
            except ValueError as exc:
                raise ValueError(f"tensor {key!r}: {exc}") from None
        return value


def read_index(path: Path) -> ShardIndex:
    """Parse and validate an index JSON; ``CorruptCheckpointError`` names what is wrong."""
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(
            f"{path}: {size} bytes, more than an index of tensor names needs "
            f"(MAX_INDEX_BYTES = {MAX_INDEX_BYTES})"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({exc})") from exc
    try:
        return ShardIndex.model_validate(raw)
    except ValidationError as exc:
        raise CorruptCheckpointError(f"{path}: not a valid shard index:\n{exc}") from exc


class ShardedSource(TensorSource):
    """Tensors spread over shard files by an index (``weight_map``); files open on demand."""

    def __init__(self, index_path: Path, index: ShardIndex) -> None:
        self.name, self._index_path = str(index_path.parent), index_path
        self._where = dict(index.weight_map)
        root = index_path.parent
        shards = sorted(set(self._where.values()))
        self._files = {shard: open_file(root / shard) for shard in shards}
        self._check_files_exist(root)
        self._infos: dict[str, TensorInfo] | None = None
        self._current: str | None = None

    def _check_files_exist(self, root: Path) -> None:
        for shard in self._files:
            if not (root / shard).is_file():
                keys = [k for k, s in self._where.items() if s == shard]
                raise CheckpointNotFoundError(
                    f"{self._index_path}: shard file {str(root / shard)!r} does not exist (the "
                    f"index maps {len(keys)} tensors to it: {names(keys, 4)})"
                )

    def infos(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            per_file = {shard: source.infos() for shard, source in self._files.items()}
            out = {}
            for key, shard in self._where.items():
                info = per_file[shard].get(key)
                if info is None:
                    raise CheckpointMismatchError(
                        f"{self._index_path}: the index maps {key!r} to "
                        f"{self._files[shard].name}, which holds no tensor {key!r}"
                    )
                out[key] = info
            self._infos = out
        return self._infos

    def read(self, key: str, index: Index | None = None) -> torch.Tensor:
        shard = self._where[key]
        if self._current not in (None, shard):  # one mapped file at a time
            self._files[self._current].close()
        self._current = shard
        return self._files[shard].read(key, index)

    def close(self) -> None:
        for source in self._files.values():
            source.close()
        self._current = None


def open_hf_dir(path: Path) -> TensorSource | None:
    """The Hugging Face weights of a model directory (see ``HF_FILES``), or None."""
    for name in HF_FILES:
        candidate = path / name
        if candidate.is_file():
            if name.endswith(".index.json"):
                return ShardedSource(candidate, read_index(candidate))
            return open_file(candidate)
    return None
