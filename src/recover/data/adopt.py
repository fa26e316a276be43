"""adopt: make a dataset folder of a nanoGPT-style token file, without copying it.

Job: ``adopt_token_files(out, train_bin=..., vocab_size=N, val_bin=None, dtype="uint16")`` checks
the file(s) (whole tokens of ``dtype``, every id below ``vocab_size``), hashes them, and publishes
a dataset folder whose shards are *links* to them plus a meta.json saying what they are:

* a hard link when the file is on the same file system (the folder then holds the tokens itself:
  moving or deleting the original does not break it), else a symbolic link to its absolute path;
  ``meta.json`` records which (``adopted``). Nothing is copied either way.
* ``--val-bin`` gives the validation tokens. Without it, the last ``val_fraction`` of the train
  file's tokens (at least one window's worth is the caller's business) is validation: both splits
  are ranges (``offset`` and ``tokens``) of the one file. Such a cut is by position, not by
  document: an adopted file has no document boundaries that we know of.

Invariants: the content hash covers the bytes (sha256 over length-prefixed (role, bytes) of
``train.bin`` then ``val.bin``, the corpus hash with the files as documents), so a run records
what it trained on; publishing is atomic and idempotent as in ``prepare``.

Limits: the folder does not guard against the original being rewritten in place later (nanoGPT's
prepare.py does so); prepare again after changing the file, and the new hash tells runs apart.
Costs: one read of the file(s) to hash and check them (about 1 GB/s).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recover.data.corpus import DataError
from recover.data.folder import (
    FORMAT_VERSION,
    SPLITS,
    check_out_dir_early,
    make_temporary_folder,
    publish,
    reuse_existing,
    write_meta,
)
from recover.data.prepare import PrepareResult, result_of
from recover.data.shards import compute_tokens_hash

ADOPT_DTYPES = ("uint16", "uint32")
_BLOCK_BYTES = 16 << 20


@dataclass(frozen=True)
class _Range:
    split: str
    file: str  # the link's name in the dataset folder
    offset: int | None  # tokens; None for a whole file
    tokens: int
    digest: bytes = b""


def _check_file(path: Path, itemsize: int, flag: str) -> int:
    """Tokens in ``path``; DataError naming it when it is not a whole-token regular file."""
    if not path.is_file():
        raise DataError(f"{flag} {path} does not exist or is not a file")
    size = path.stat().st_size
    if size % itemsize or size < 2 * itemsize:
        raise DataError(
            f"{flag} {path} holds {size} bytes: not a whole number (>= 2) of {itemsize}-byte tokens"
        )
    return size // itemsize


def _hash_file(
    path: Path, role: str, dtype: np.dtype, vocab_size: int, cuts: list[int], content: Any
) -> list[bytes]:
    """Feed ``path`` into the content hash (as document ``role``); sha256 of each token range
    between ``cuts`` (token offsets); DataError on an id >= vocab_size."""
    size = path.stat().st_size
    name = role.encode()
    content.update(len(name).to_bytes(8, "little") + name + size.to_bytes(8, "little"))
    bounds = [c * dtype.itemsize for c in cuts]
    digests, h, pos, i = [], hashlib.sha256(), 0, 1
    with open(path, "rb") as f:
        while block := f.read(_BLOCK_BYTES):
            content.update(block)
            tokens = np.frombuffer(block, dtype=dtype)
            if tokens.size and int(tokens.max()) >= vocab_size:
                at = pos // dtype.itemsize + int(np.argmax(tokens >= vocab_size))
                raise DataError(
                    f"{path} holds token id {int(tokens.max())} at token {at}, "
                    f">= --vocab-size {vocab_size}"
                )
            start = 0
            while i < len(bounds) and bounds[i] <= pos + len(block):
                h.update(block[start : bounds[i] - pos])
                digests.append(h.digest())
                h, start, i = hashlib.sha256(), bounds[i] - pos, i + 1
            h.update(block[start:])
            pos += len(block)
    return digests


def _link(src: Path, dst: Path) -> str:
    try:
        os.link(src, dst)
        return "hardlink"
    except OSError:  # another file system, or links not allowed there
        os.symlink(src, dst)
        return "symlink"


def adopt_token_files(
    out_dir: Path | str,
    *,
    train_bin: Path | str,
    vocab_size: int,
    val_bin: Path | str | None = None,
    dtype: str = "uint16",
    val_fraction: float = 0.05,
) -> PrepareResult:
    """Publish (or reuse) a dataset folder over nanoGPT-style token files; see the module doc."""
    t0 = time.perf_counter()
    if dtype not in ADOPT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(ADOPT_DTYPES)}, got {dtype!r}")
    np_dtype = np.dtype(dtype)
    limit = 1 << (8 * np_dtype.itemsize)
    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int)
        or not 2 <= vocab_size <= limit
    ):
        raise ValueError(
            f"vocab_size must be an int in [2, {limit}] for {dtype}, got {vocab_size!r}"
        )
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    out_dir = Path(os.path.abspath(out_dir))
    check_out_dir_early(out_dir)
    train_path = Path(os.path.abspath(train_bin))
    n_train = _check_file(train_path, np_dtype.itemsize, "--from-bin")
    content = hashlib.sha256()
    if val_bin is None:
        cut = n_train - min(n_train - 1, max(1, round(n_train * val_fraction)))
        ranges = [
            _Range("train", "train.bin", 0, cut),
            _Range("val", "train.bin", cut, n_train - cut),
        ]
        digests = _hash_file(
            train_path, "train.bin", np_dtype, vocab_size, [0, cut, n_train], content
        )
        sources = {"train.bin": train_path}
    else:
        val_path = Path(os.path.abspath(val_bin))
        n_val = _check_file(val_path, np_dtype.itemsize, "--val-bin")
        ranges = [
            _Range("train", "train.bin", None, n_train),
            _Range("val", "val.bin", None, n_val),
        ]
        digests = _hash_file(train_path, "train.bin", np_dtype, vocab_size, [0, n_train], content)
        digests += _hash_file(val_path, "val.bin", np_dtype, vocab_size, [0, n_val], content)
        sources = {"train.bin": train_path, "val.bin": val_path}
    content_hash = "sha256:" + content.hexdigest()
    settings = {
        "adopted": True,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "val_fraction": None if val_bin is not None else float(val_fraction),
    }
    source_bytes = sum(p.stat().st_size for p in sources.values())
    meta = reuse_existing(out_dir, settings, content_hash)
    if meta is not None:
        return result_of(out_dir, meta, reused=True, source_bytes=source_bytes, t0=t0)
    tmp = make_temporary_folder(out_dir)
    try:
        adopted = {
            name: {"path": str(src), "link": _link(src, tmp / name)}
            for name, src in sources.items()
        }
        shards: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        for r in ranges:
            entry: dict[str, Any] = {"file": r.file, "tokens": r.tokens}
            if r.offset is not None:
                entry["offset"] = r.offset
            shards[r.split].append(entry)
        entries = [(r.file, r.tokens, d) for r, d in zip(ranges, digests, strict=True)]
        meta = {
            "format_version": FORMAT_VERSION,
            "source": str(train_path),
            "source_format": "bin",
            "python_version": None,
            "tokenizer": {"kind": "none", "vocab_size": vocab_size, "eod_id": None, "file": None},
            "vocab_size": vocab_size,
            "dtype": dtype,
            "val_fraction": settings["val_fraction"],
            "shard_tokens": None,
            "settings": settings,
            "shards": shards,
            **{
                s: {"tokens": sum(e["tokens"] for e in shards[s]), "documents": None}
                for s in SPLITS
            },
            "documents_file": None,
            "adopted": adopted,
            "skipped_files": [],
            "skipped_count": 0,
            "content_hash": content_hash,
            "tokens_hash": compute_tokens_hash(entries),
        }
        write_meta(tmp, meta)
        if not publish(tmp, out_dir, lambda: reuse_existing(out_dir, settings, content_hash)):
            return result_of(out_dir, meta, reused=True, source_bytes=source_bytes, t0=t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result_of(out_dir, meta, reused=False, source_bytes=source_bytes, t0=t0)


__all__ = ["ADOPT_DTYPES", "adopt_token_files"]
