"""prepare: turn a corpus into a token dataset folder (shards, meta.json, tokenizer.json).

Job: read the corpus, split it into train and validation *by document*, tokenize, and write

    train_000.bin, train_001.bin, ...   raw token arrays (np.memmap-able), dtype by vocab size
    val_000.bin, ...
    tokenizer.json                      only for bpe
    meta.json                           format version, source, tokenizer, dtype, shards and counts,
                                        documents and their split, skipped files, content hash of
                                        the input, hash of the produced tokens

Each document's tokens are followed by the end-of-document separator (byte 0, or
``<|endoftext|>`` for bpe). Shards hold at most ``shard_tokens`` tokens of one split's stream.

Invariants:

* Deterministic: no timestamps, no dict-order or thread-order effects; two runs on the same input
  and settings give byte-identical folders.
* Disjoint splits by construction: a document goes to validation when a hash of its relative
  path falls under ``val_fraction``; if that leaves a split empty, the document with the lowest
  (or highest) hash moves over. Fewer than two documents is an error.
* Atomic: everything is written into a hidden temporary sibling folder that is renamed into place
  at the end; on any error (or interrupt) the temporary folder is removed. A reader never sees a
  half-written dataset.
* Idempotent: an existing folder holding the same complete dataset (same content hash and
  settings) is returned unchanged; any other existing content is a DataError naming the path.

Costs and limits: the corpus and its tokens are held in memory (tens of MB by design). Checking
idempotency re-reads and hashes the source (well under a second for the stdlib).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recover.data.corpus import (
    STDLIB_SOURCE,
    Corpus,
    DataError,
    list_corpus_files,
    read_corpus,
)
from recover.data.tokenizer import (
    BPE_FILE,
    ByteTokenizer,
    Tokenizer,
    train_bpe,
    validate_vocab_size,
)

FORMAT_VERSION = 1
META_FILE = "meta.json"
DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_DATASET_NAME = "stdlib-byte"
SPLITS = ("train", "val")


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What to prepare; validated on construction (ValueError naming the field)."""

    source: Path | None = None  # None: the embedded python-stdlib corpus
    tokenizer: str = "byte"  # "byte" or "bpe"
    vocab_size: int | None = None  # bpe only: requested size, >= 257
    val_fraction: float = 0.05  # expected share of documents in validation, in (0, 1)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # most tokens per shard file

    def __post_init__(self) -> None:
        validate_vocab_size(self.tokenizer, self.vocab_size)
        if not isinstance(self.val_fraction, int | float) or not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if isinstance(self.shard_tokens, bool) or not isinstance(self.shard_tokens, int):
            raise ValueError(f"shard_tokens must be an int >= 2, got {self.shard_tokens!r}")
        if self.shard_tokens < 2:
            raise ValueError(f"shard_tokens must be >= 2, got {self.shard_tokens}")

    def settings(self) -> dict[str, Any]:
        """The settings an existing dataset must match to be reused."""
        return {
            "tokenizer": self.tokenizer,
            "requested_vocab_size": self.vocab_size,
            "val_fraction": float(self.val_fraction),
            "shard_tokens": self.shard_tokens,
        }


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id below ``vocab_size``."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def _split_key(relpath: str) -> float:
    digest = hashlib.sha256(b"recover.split\0" + relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64


def assign_splits(relpaths: list[str], val_fraction: float) -> list[str]:
    """Pure: "train" or "val" for each document path; both splits non-empty.

    A document is "val" when its path's hash, mapped to [0, 1), is below ``val_fraction``.
    """
    if len(relpaths) < 2:
        raise DataError(
            f"need at least 2 documents to split train and validation, got {len(relpaths)}"
        )
    keys = [_split_key(p) for p in relpaths]
    splits = ["val" if k < val_fraction else "train" for k in keys]
    if "val" not in splits:
        splits[min(range(len(keys)), key=keys.__getitem__)] = "val"
    if "train" not in splits:
        splits[max(range(len(keys)), key=keys.__getitem__)] = "train"
    return splits


class _Progress:
    """A rich progress bar over files on stderr, or nothing when disabled.

    The bar starts with its first task, so an early error prints nothing but the error.
    """

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._progress: Any = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def task(self, description: str, total: int) -> Callable[[], None] | None:
        if not self._enabled:
            return None
        if self._progress is None:
            from rich.console import Console
            from rich.progress import Progress

            self._progress = Progress(console=Console(stderr=True))
            self._progress.start()
        progress = self._progress
        task_id = progress.add_task(description, total=total)
        return lambda: progress.advance(task_id)


def _build_tokenizer(config: PrepareConfig, corpus: Corpus, splits: list[str]) -> Tokenizer:
    if config.tokenizer == "byte":
        return ByteTokenizer()
    # Train on the train split only, so validation text never shapes the vocabulary.
    texts = [d.text for d, s in zip(corpus.documents, splits, strict=True) if s == "train"]
    return train_bpe(texts, vocab_size=config.vocab_size)  # type: ignore[arg-type]


def _tokenize(
    tokenizer: Tokenizer, corpus: Corpus, dtype: np.dtype, advance: Callable[[], None] | None
) -> list[np.ndarray]:
    """The tokens of each document followed by the separator, as arrays of ``dtype``."""
    out = []
    for doc in corpus.documents:
        if isinstance(tokenizer, ByteTokenizer):
            ids = np.frombuffer(doc.data, dtype=np.uint8)
        else:
            ids = np.asarray(tokenizer.encode(doc.text), dtype=np.int64)
        arr = np.empty(len(ids) + 1, dtype=dtype)
        arr[:-1] = ids
        arr[-1] = tokenizer.eod_id
        out.append(arr)
        if advance is not None:
            advance()
    return out


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_dataset(
    tmp: Path,
    config: PrepareConfig,
    corpus: Corpus,
    splits: list[str],
    tokenizer: Tokenizer,
    advance: Callable[[], None] | None,
) -> None:
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    doc_tokens = _tokenize(tokenizer, corpus, dtype, advance)
    tokens_hash = hashlib.sha256()
    shards: dict[str, list[dict[str, Any]]] = {}
    counts: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        parts = [t for t, s in zip(doc_tokens, splits, strict=True) if s == split]
        stream = np.concatenate(parts)
        counts[split] = {"tokens": int(stream.size), "documents": len(parts)}
        shards[split] = []
        for index, start in enumerate(range(0, stream.size, config.shard_tokens)):
            name = f"{split}_{index:03d}.bin"
            chunk = np.ascontiguousarray(stream[start : start + config.shard_tokens])
            data = chunk.tobytes()
            _write_file(tmp / name, data)
            tokens_hash.update(name.encode() + len(data).to_bytes(8, "little") + data)
            shards[split].append({"file": name, "tokens": int(chunk.size)})
    if not isinstance(tokenizer, ByteTokenizer):
        _write_file(tmp / BPE_FILE, tokenizer.to_json().encode("utf-8"))
    meta = {
        "format_version": FORMAT_VERSION,
        "source": corpus.label,
        "python_version": corpus.python_version,
        "tokenizer": {
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "requested_vocab_size": config.vocab_size,
            "eod_id": tokenizer.eod_id,
            "file": None if isinstance(tokenizer, ByteTokenizer) else BPE_FILE,
        },
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "val_fraction": float(config.val_fraction),
        "shard_tokens": config.shard_tokens,
        "shards": shards,
        "train": counts["train"],
        "val": counts["val"],
        "documents": [
            {"path": d.relpath, "split": s, "tokens": int(t.size - 1)}
            for d, s, t in zip(corpus.documents, splits, doc_tokens, strict=True)
        ],
        "skipped_files": list(corpus.skipped),
        "skipped_count": len(corpus.skipped),
        "content_hash": corpus.content_hash,
        "tokens_hash": "sha256:" + tokens_hash.hexdigest(),
    }
    _write_file(tmp / META_FILE, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())


def _expected_files(meta: dict[str, Any]) -> set[str]:
    names = {META_FILE}
    for split in SPLITS:
        names.update(s["file"] for s in meta["shards"][split])
    if meta["tokenizer"]["kind"] == "bpe":
        names.add(BPE_FILE)
    return names


def _read_complete_meta(out_dir: Path) -> dict[str, Any] | None:
    """meta.json of out_dir if it holds exactly one complete dataset, else None."""
    try:
        meta = json.loads((out_dir / META_FILE).read_text(encoding="utf-8"))
        if meta.get("format_version") != FORMAT_VERSION:
            return None
        expected = _expected_files(meta)
        if set(os.listdir(out_dir)) != expected:
            return None
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in SPLITS:
            for shard in meta["shards"][split]:
                if (out_dir / shard["file"]).stat().st_size != shard["tokens"] * itemsize:
                    return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta


def _check_out_dir_early(out_dir: Path) -> None:
    """Fail before any work when out_dir cannot possibly be reused or created."""
    if not os.path.lexists(out_dir):
        return
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise DataError(f"output {out_dir} exists and is not a folder")
    entries = os.listdir(out_dir)
    if entries and META_FILE not in entries:
        raise DataError(f"output {out_dir} exists and holds other files; choose another --out")


def _reuse_existing(out_dir: Path, config: PrepareConfig, corpus: Corpus) -> bool:
    """True when out_dir already holds this dataset; DataError when it holds something else."""
    if not os.path.lexists(out_dir):
        return False
    _check_out_dir_early(out_dir)
    if not os.listdir(out_dir):
        return False  # an empty folder is replaced by the rename
    meta = _read_complete_meta(out_dir)
    if meta is None:
        raise DataError(f"output {out_dir} holds an incomplete or unknown dataset; remove it")
    found = {
        "tokenizer": meta["tokenizer"]["kind"],
        "requested_vocab_size": meta["tokenizer"].get("requested_vocab_size"),
        "val_fraction": meta.get("val_fraction"),
        "shard_tokens": meta.get("shard_tokens"),
    }
    if meta.get("content_hash") != corpus.content_hash or found != config.settings():
        raise DataError(
            f"output {out_dir} holds another dataset (content {meta.get('content_hash')}, "
            f"settings {found}); remove it or choose another --out"
        )
    return True


def prepare_dataset(
    out_dir: Path | str,
    *,
    source: Path | str | None = None,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    val_fraction: float = 0.05,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    show_progress: bool = True,
) -> Path:
    """Prepare (or reuse) the token dataset of ``source`` in ``out_dir``; returns its path.

    Raises ValueError for bad settings and DataError (a ValueError) for a bad source or an
    ``out_dir`` that holds anything other than this very dataset.
    """
    config = PrepareConfig(
        source=None if source is None else Path(source),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        shard_tokens=shard_tokens,
    )
    out_dir = Path(os.path.abspath(out_dir))
    _check_out_dir_early(out_dir)
    with _Progress(show_progress) as progress:
        listing = list_corpus_files(config.source)
        corpus = read_corpus(listing, advance=progress.task("reading", len(listing.files)))
        if _reuse_existing(out_dir, config, corpus):
            return out_dir
        splits = assign_splits([d.relpath for d in corpus.documents], config.val_fraction)
        tok = _build_tokenizer(config, corpus, splits)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            os.chmod(tmp, 0o755)
            advance = progress.task("tokenizing", len(corpus.documents))
            _write_dataset(tmp, config, corpus, splits, tok, advance)
            try:
                os.rename(tmp, out_dir)
            except OSError:
                # Someone else created out_dir meanwhile: reuse it if it is this dataset.
                if _reuse_existing(out_dir, config, corpus):
                    shutil.rmtree(tmp, ignore_errors=True)
                    return out_dir
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def default_dataset_name(
    source: Path | str | None = None, tokenizer: str = "byte", vocab_size: int | None = None
) -> str:
    """Folder name like ``stdlib-byte``, ``stdlib-bpe4096`` or ``<source stem>-byte``."""
    stem = "stdlib" if source is None else (Path(source).stem or "corpus")
    return f"{stem}-byte" if tokenizer == "byte" else f"{stem}-bpe{vocab_size}"


def ensure_dataset(root: Path | str, *, show_progress: bool = True) -> Path:
    """The default dataset (byte tokens of the python stdlib) under ``root``, prepared on first use."""
    return prepare_dataset(Path(root) / DEFAULT_DATASET_NAME, show_progress=show_progress)


__all__ = [
    "DEFAULT_DATASET_NAME",
    "DEFAULT_SHARD_TOKENS",
    "FORMAT_VERSION",
    "PrepareConfig",
    "STDLIB_SOURCE",
    "assign_splits",
    "default_dataset_name",
    "dtype_for_vocab",
    "ensure_dataset",
    "prepare_dataset",
]
