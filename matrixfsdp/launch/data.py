"""The embedded corpus: Python's own standard library source, as bytes (no download).

Every rank builds the same corpus (sorted file list, fixed byte budget) and draws the same
global batch for a step from a generator seeded by ``(seed, step)``, then keeps its slice, so a
resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import math
import sysconfig
from collections import Counter
from pathlib import Path

import torch

__all__ = ["ByteCorpus"]


class ByteCorpus:
    """Byte-level (vocabulary 256) train/validation split of the stdlib sources."""

    def __init__(self, max_bytes: int, val_fraction: float) -> None:
        data = self._read_stdlib(max_bytes)
        if len(data) < 10_000:
            raise RuntimeError(
                f"found only {len(data)} bytes of Python standard library source under "
                f"{sysconfig.get_paths()['stdlib']}; this interpreter ships no .py sources"
            )
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]

    @staticmethod
    def _read_stdlib(max_bytes: int) -> bytes:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.parts or "test" in path.parts:
                continue
            try:
                chunk = path.read_bytes()
            except OSError:
                continue
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                break
        return b"".join(chunks)[:max_bytes]

    def batch(self, split: str, step: int, global_batch: int, seq_len: int, seed: int) -> torch.Tensor:
        """The global batch ``(global_batch, seq_len + 1)`` for ``step`` (identical on all ranks)."""
        source = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(0, len(source) - seq_len - 1, (global_batch,), generator=g)
        return torch.stack([source[s : s + seq_len + 1] for s in starts.tolist()])

    def unigram_loss(self) -> float:
        """Cross-entropy (nats/byte) of the train unigram distribution on validation data."""
        counts = Counter(self.train.tolist())
        total = sum(counts.values())
        val = Counter(self.val.tolist())
        return -sum(n * math.log((counts.get(b, 0) + 1) / (total + 256)) for b, n in val.items()) / sum(
            val.values()
        )
