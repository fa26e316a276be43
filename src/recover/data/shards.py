"""Shards: write one split's token stream into shard files as it grows.

Job: ``SplitWriter.append(tokens)`` adds tokens to the end of a split's stream; the stream is cut
every ``shard_tokens`` tokens into ``<split>_000.bin``, ``<split>_001.bin``, ... (raw arrays of one
dtype, no header, ``np.memmap``-able). A shard is flushed and fsynced when it is full or at
``close()``; memory holds no more than the tokens being appended.

Invariants: the files depend only on the stream and ``shard_tokens`` (the same cut points however
the tokens arrive); a shard's sha256 is computed over exactly the bytes written. The tokens hash
of a dataset is a sha256 over, for each shard in order (train, then val), its file name, its
token count (8 bytes, little-endian) and the sha256 of its bytes: it can be computed while
writing both splits at once, and it identifies the tokens whatever produced them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:03d}.bin"


def _open_shard(path: Path) -> BinaryIO:
    return open(path, "xb")


class SplitWriter:
    """The shards of one split of a dataset being written into ``folder``."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []  # {"file", "tokens"} of closed shards
        self.digests: list[bytes] = []  # sha256 of each closed shard
        self.tokens = 0
        self._file: BinaryIO | None = None
        self._hash: Any = None
        self._count = 0

    def append(self, tokens: np.ndarray) -> None:
        """Add ``tokens`` (already of this writer's dtype) to the end of the split's stream."""
        assert tokens.dtype == self.dtype, (tokens.dtype, self.dtype)
        while tokens.size:
            if self._file is None:
                name = shard_name(self.split, len(self.shards))
                self._file = _open_shard(self.folder / name)
                self._hash, self._count = hashlib.sha256(), 0
            part = tokens[: self.shard_tokens - self._count]
            data = memoryview(np.ascontiguousarray(part)).cast("B")
            self._file.write(data)
            self._hash.update(data)
            self._count += part.size
            self.tokens += part.size
            tokens = tokens[part.size :]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards.append(
            {"file": shard_name(self.split, len(self.shards)), "tokens": self._count}
        )
        self.digests.append(self._hash.digest())
        self._file = None

    def close(self) -> None:
        """Flush the last, partial shard."""
        if self._file is not None:
            self._close_shard()

    def abort(self) -> None:
        """Close an open shard without caring for its content (the folder is being removed)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def compute_tokens_hash(entries: list[tuple[str, int, bytes]]) -> str:
    """sha256 over (file name, token count, sha256 of the bytes) of each shard, in order."""
    h = hashlib.sha256()
    for name, tokens, digest in entries:
        encoded = name.encode("utf-8")
        h.update(len(encoded).to_bytes(8, "little") + encoded)
        h.update(int(tokens).to_bytes(8, "little"))
        h.update(digest)
    return "sha256:" + h.hexdigest()
