"""prepare: turn a corpus into a token dataset folder, streaming, with bounded memory.

Job: read the source one document at a time, split it into train and validation *by document*,
tokenize in batches, and write shards as they fill (format: docs/data.md):

    train_000.bin, train_001.bin, ...   raw token arrays (np.memmap-able), dtype by vocab size
    val_000.bin, ...
    tokenizer.json                      bpe (trained here) or hf (a copy of the user's file)
    documents.jsonl                     one line per document: path, split, tokens
    meta.json                           format version, source and its format, tokenizer, dtype,
                                        shards and counts, settings, skipped files, content hash
                                        of the input, hash of the produced tokens

Each document's tokens are followed by the end-of-document separator (byte 0 for byte tokens,
the tokenizer's ``eod_token`` otherwise). Shards hold at most ``shard_tokens`` tokens of one
split's stream.

Passes over the source: (1) read: validate every document, compute the content hash, count, and
settle the splits; an existing dataset with this hash and these settings is returned here. (2)
bpe only: train the tokenizer on the train documents. (3) tokenize and write; the content hash is
computed again and must match pass 1 (a source that changed meanwhile is an error).

Invariants:

* Deterministic: no timestamps, no dict-order or thread-order effects; two runs on the same input
  and settings give byte-identical folders.
* Disjoint splits by construction: a document goes to validation when a hash of its relative
  path falls under ``val_fraction``; if that leaves a split empty, the document with the lowest
  (or highest) hash moves over. Fewer than two documents is an error.
* Atomic: everything is written into a hidden temporary sibling folder that is renamed into place
  at the end; on any error (or interrupt) the temporary folder is removed. A reader never sees a
  half-written dataset. A prepare killed outright (SIGKILL, a lost machine) cannot remove its
  folder: it is named after its host and process (`.NAME.tmp-PID-HOST-XXXX`), and the next
  prepare of the same folder on that host removes it once that process is gone.
* Idempotent: an existing folder holding the same complete dataset (same content hash and
  settings) is returned unchanged; any other existing content is a DataError naming the path.

Costs and limits: memory is bounded by one batch of documents (about ``BATCH_BYTES`` of text,
or one larger document) and its tokens, whatever the corpus size (docs/data.md has the measured
figures). The source is read twice (three times for bpe); reading is cheap next to tokenizing.

Size: the three passes of a streaming prepare (check and hash, train a tokenizer, tokenize and
write), the meta they produce and the entry points; the folder's reuse check and its atomic
publish are folder.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recover.checks import is_int
from recover.data.corpus import (
    DEFAULT_TEXT_FIELD,
    SOURCE_FORMATS,
    STDLIB_SOURCE,
    ContentHasher,
    CorpusListing,
    DataError,
    Document,
    list_corpus_files,
)
from recover.data.folder import (
    FORMAT_VERSION,
    META_FILE,
    SPLITS,
    _write_file,
    check_out_dir_early,
    make_temporary_folder,
    publish,
    reuse_existing,
    write_meta,
)
from recover.data.records import iter_documents
from recover.data.shards import SplitWriter, compute_tokens_hash
from recover.data.tokenizer import (
    BPE_FILE,
    EOD_TOKEN,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer_file,
    train_bpe,
    validate_vocab_size,
)

DOCUMENTS_FILE = "documents.jsonl"
DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_DATASET_NAME = "stdlib-byte"
BATCH_BYTES = 1 << 20  # text tokenized per batch (HF tokenizers encode a batch on all cores)
_BATCH_DOCUMENTS = 1024


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """What to prepare; validated on construction (ValueError naming the field)."""

    source: Path | None = None  # None: the embedded python-stdlib corpus
    tokenizer: str = "byte"  # "byte", "bpe" (trained here) or "hf" (tokenizer_file)
    vocab_size: int | None = None  # bpe only: requested size, >= 257
    val_fraction: float = 0.05  # expected share of documents in validation, in (0, 1)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # most tokens per shard file
    tokenizer_file: Path | None = None  # hf only: the user's tokenizer.json
    eod_token: str = EOD_TOKEN  # hf only: the token that separates documents
    format: str = "auto"  # the source's format, one of SOURCE_FORMATS
    text_field: str = DEFAULT_TEXT_FIELD  # jsonl/parquet/hf-disk: the field holding the text

    def __post_init__(self) -> None:
        validate_vocab_size(self.tokenizer, self.vocab_size)
        if (self.tokenizer == "hf") != (self.tokenizer_file is not None):
            raise ValueError("tokenizer_file is needed with tokenizer 'hf' and only with it")
        if not isinstance(self.val_fraction, int | float) or not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not is_int(self.shard_tokens):
            raise ValueError(f"shard_tokens must be an int >= 2, got {self.shard_tokens!r}")
        if self.shard_tokens < 2:
            raise ValueError(f"shard_tokens must be >= 2, got {self.shard_tokens}")
        if self.format not in SOURCE_FORMATS:
            raise ValueError(
                f"format must be one of {', '.join(SOURCE_FORMATS)}, got {self.format!r}"
            )
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"text_field must be a non-empty string, got {self.text_field!r}")


@dataclass(frozen=True)
class PrepareResult:
    """Where the dataset is and what it took; ``reused`` when it was already there."""

    path: Path
    reused: bool
    documents: int
    tokens: int
    shards: int
    source_bytes: int
    seconds: float
    adopted: bool = False  # token files taken as they are (--from-bin): no documents, no tokenizer

    def summary(self) -> str:
        """One line for people: documents, tokens, shards and throughput."""
        if self.reused:
            return (
                f"reused    {self.path} already holds this dataset ({self.documents:,} documents, "
                f"{self.tokens:,} tokens, {self.shards} shards; checked in {self.seconds:.1f} s)"
            )
        secs = max(self.seconds, 1e-9)
        if self.adopted:
            return (
                f"adopted   {self.tokens:,} tokens ({self.source_bytes / 1e6:,.1f} MB) in "
                f"{self.shards} shards in {self.seconds:.1f} s"
            )
        return (
            f"prepared  {self.documents:,} documents ({self.source_bytes / 1e6:,.1f} MB) -> "
            f"{self.tokens:,} tokens in {self.shards} shards in {self.seconds:.1f} s "
            f"({self.tokens / secs / 1e6:,.2f} M tokens/s, {self.source_bytes / secs / 1e6:,.1f} MB/s)"
        )


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
    """rich progress bars on stderr when it is a terminal, or nothing.

    The first bar starts with its first task, so an early error prints nothing but the error.
    """

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._progress: Any = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def task(self, description: str, total: int) -> Callable[[int], None] | None:
        if not self._enabled:
            return None
        if self._progress is None:
            from rich.console import Console
            from rich.progress import Progress

            console = Console(stderr=True)
            if not console.is_terminal:
                self._enabled = False
                return None
            self._progress = Progress(console=console)
            self._progress.start()
        progress = self._progress
        task_id = progress.add_task(description, total=total)
        return lambda n=1: progress.advance(task_id, n)


@dataclass(frozen=True)
class _Scan:
    """What pass 1 learned about the source."""

    content_hash: str
    documents: int
    source_bytes: int
    skipped: tuple[str, ...]
    overrides: dict[str, str]  # relpath -> split, where the hash rule left a split empty


def _scan(listing: CorpusListing, val_fraction: float, advance: Any) -> _Scan:
    hasher = ContentHasher()
    skipped: list[str] = []
    count = val = nbytes = 0
    lowest: tuple[float, str] | None = None
    highest: tuple[float, str] | None = None
    for doc in iter_documents(listing, skipped=skipped, advance=advance):
        hasher.add(doc)
        count += 1
        nbytes += len(doc.data)
        key = (_split_key(doc.relpath), doc.relpath)
        val += key[0] < val_fraction
        lowest = key if lowest is None or key < lowest else lowest
        highest = key if highest is None or key > highest else highest
    if nbytes == 0:
        raise DataError(f"source {listing.root} holds no text (all files empty or skipped)")
    if count < 2:
        raise DataError(f"need at least 2 documents to split train and validation, got {count}")
    overrides = {}
    if val == 0:
        overrides[lowest[1]] = "val"  # type: ignore[index]
    elif val == count:
        overrides[highest[1]] = "train"  # type: ignore[index]
    return _Scan(hasher.hexdigest(), count, nbytes, tuple(skipped), overrides)


def _split_of(relpath: str, val_fraction: float, overrides: dict[str, str]) -> str:
    forced = overrides.get(relpath)
    if forced is not None:
        return forced
    return "val" if _split_key(relpath) < val_fraction else "train"


def _build_tokenizer(
    config: PrepareConfig, listing: CorpusListing, scan: _Scan, advance: Any
) -> Tokenizer:
    if config.tokenizer == "byte":
        return ByteTokenizer()
    if config.tokenizer == "hf":
        return load_tokenizer_file(config.tokenizer_file, eod_token=config.eod_token)  # type: ignore[arg-type]

    # Train on the train split only, so validation text never shapes the vocabulary.
    def train_texts() -> Iterator[str]:
        for doc in iter_documents(listing, advance=advance):
            if _split_of(doc.relpath, config.val_fraction, scan.overrides) == "train":
                yield doc.text

    return train_bpe(train_texts(), vocab_size=config.vocab_size)  # type: ignore[arg-type]


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.data)
        if size >= BATCH_BYTES or len(batch) >= _BATCH_DOCUMENTS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tokenizer: Tokenizer, batch: list[Document]) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):
        return [np.frombuffer(doc.data, dtype=np.uint8) for doc in batch]
    encoded = tokenizer.encode_batch([doc.text for doc in batch])
    return [np.asarray(ids, dtype=np.int64) for ids in encoded]


def _settings(config: PrepareConfig, listing: CorpusListing, tokenizer_sha: str | None) -> dict:
    """The settings an existing dataset must match to be reused."""
    records = listing.format != "text"
    return {
        "tokenizer": config.tokenizer,
        "requested_vocab_size": config.vocab_size,
        "val_fraction": float(config.val_fraction),
        "shard_tokens": config.shard_tokens,
        "source_format": listing.format,
        "text_field": listing.text_field if records else None,
        "tokenizer_sha256": tokenizer_sha,
        "eod_token": config.eod_token if config.tokenizer == "hf" else None,
    }


def _write_dataset(
    tmp: Path,
    config: PrepareConfig,
    listing: CorpusListing,
    scan: _Scan,
    tokenizer: Tokenizer,
    settings: dict[str, Any],
    tokenizer_json: bytes | None,
    advance: Any,
) -> dict[str, Any]:
    """Pass 3: tokenize and write every file of the dataset into ``tmp``; returns its meta."""
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    writers = {split: SplitWriter(tmp, split, dtype, config.shard_tokens) for split in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    hasher = ContentHasher()
    try:
        with open(tmp / DOCUMENTS_FILE, "x", encoding="utf-8") as index:
            for batch in _batches(iter_documents(listing)):
                for doc, ids in zip(batch, _encode(tokenizer, batch), strict=True):
                    hasher.add(doc)
                    if ids.size and int(ids.max()) >= tokenizer.vocab_size:
                        raise DataError(
                            f"the tokenizer gave id {int(ids.max())} >= its vocab size "
                            f"{tokenizer.vocab_size} for {doc.relpath}"
                        )
                    tokens = np.empty(ids.size + 1, dtype=dtype)
                    tokens[:-1] = ids
                    tokens[-1] = tokenizer.eod_id
                    split = _split_of(doc.relpath, config.val_fraction, scan.overrides)
                    writers[split].append(tokens)
                    documents[split] += 1
                    entry = {"path": doc.relpath, "split": split, "tokens": int(ids.size)}
                    index.write(json.dumps(entry, sort_keys=True) + "\n")
                if advance is not None:
                    advance(len(batch))
            index.flush()
            os.fsync(index.fileno())
        for writer in writers.values():
            writer.close()
    finally:
        for writer in writers.values():
            writer.abort()
    if hasher.hexdigest() != scan.content_hash:
        raise DataError(f"source {listing.root} changed while it was being prepared; run again")
    if tokenizer_json is not None:
        _write_file(tmp / BPE_FILE, tokenizer_json)
    tok_meta: dict[str, Any] = {
        "kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "requested_vocab_size": config.vocab_size,
        "eod_id": tokenizer.eod_id,
        "file": None if tokenizer_json is None else BPE_FILE,
    }
    if config.tokenizer == "hf":
        tok_meta.update(
            eod_token=config.eod_token,
            origin=str(Path(os.path.abspath(config.tokenizer_file))),  # type: ignore[arg-type]
            sha256=settings["tokenizer_sha256"],
        )
    entries = [
        (shard["file"], shard["tokens"], digest)
        for split in SPLITS
        for shard, digest in zip(writers[split].shards, writers[split].digests, strict=True)
    ]
    meta = {
        "format_version": FORMAT_VERSION,
        "source": listing.label,
        "source_format": listing.format,
        "python_version": listing.python_version,
        "tokenizer": tok_meta,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "val_fraction": float(config.val_fraction),
        "shard_tokens": config.shard_tokens,
        "settings": settings,
        "shards": {split: writers[split].shards for split in SPLITS},
        **{s: {"tokens": writers[s].tokens, "documents": documents[s]} for s in SPLITS},
        "documents_file": DOCUMENTS_FILE,
        "skipped_files": list(scan.skipped),
        "skipped_count": len(scan.skipped),
        "content_hash": scan.content_hash,
        "tokens_hash": compute_tokens_hash(entries),
    }
    write_meta(tmp, meta)
    return meta


def result_of(
    path: Path, meta: dict, *, reused: bool, source_bytes: int, t0: float
) -> PrepareResult:
    return PrepareResult(
        path=path,
        reused=reused,
        documents=sum(int(meta[s].get("documents") or 0) for s in SPLITS),
        tokens=sum(int(meta[s]["tokens"]) for s in SPLITS),
        shards=len({s["file"] for split in SPLITS for s in meta["shards"][split]}),
        source_bytes=source_bytes,
        seconds=time.perf_counter() - t0,
        adopted=meta.get("tokenizer", {}).get("kind") == "none",
    )


def prepare(
    out_dir: Path | str, config: PrepareConfig, *, show_progress: bool = True
) -> PrepareResult:
    """Prepare (or reuse) the token dataset of ``config`` in ``out_dir``."""
    t0 = time.perf_counter()
    out_dir = Path(os.path.abspath(out_dir))
    check_out_dir_early(out_dir)
    listing = list_corpus_files(config.source, format=config.format, text_field=config.text_field)
    tokenizer_json = tokenizer_sha = None
    if config.tokenizer == "hf":
        tokenizer_json = Path(config.tokenizer_file).read_bytes()  # type: ignore[arg-type]
        tokenizer_sha = "sha256:" + hashlib.sha256(tokenizer_json).hexdigest()
        load_tokenizer_file(config.tokenizer_file, eod_token=config.eod_token)  # type: ignore[arg-type]
    settings = _settings(config, listing, tokenizer_sha)
    with _Progress(show_progress) as progress:
        scan = _scan(listing, config.val_fraction, progress.task("reading", listing.total_bytes))
        meta = reuse_existing(out_dir, settings, scan.content_hash)
        if meta is not None:
            return result_of(out_dir, meta, reused=True, source_bytes=scan.source_bytes, t0=t0)
        # A bar only for the pass that reads the corpus (a byte or given tokenizer has none).
        training = config.tokenizer == "bpe"
        advance = progress.task("training bpe", listing.total_bytes) if training else None
        tok = _build_tokenizer(config, listing, scan, advance)
        if config.tokenizer == "bpe":
            tokenizer_json = tok.to_json().encode("utf-8")  # type: ignore[union-attr]
        tmp = make_temporary_folder(out_dir)
        try:
            advance = progress.task("tokenizing", scan.documents)
            meta = _write_dataset(
                tmp, config, listing, scan, tok, settings, tokenizer_json, advance
            )
            if not publish(
                tmp, out_dir, lambda: reuse_existing(out_dir, settings, scan.content_hash)
            ):
                return result_of(out_dir, meta, reused=True, source_bytes=scan.source_bytes, t0=t0)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return result_of(out_dir, meta, reused=False, source_bytes=scan.source_bytes, t0=t0)


def resolve_tokenizer(tokenizer: str | Path) -> tuple[str, Path | None]:
    """``byte``/``bpe``, or a path to a tokenizer.json -> ("hf", path)."""
    if isinstance(tokenizer, Path) or (
        isinstance(tokenizer, str)
        and tokenizer not in ("byte", "bpe")
        and tokenizer.endswith(".json")
    ):
        return "hf", Path(tokenizer)
    return tokenizer, None


def prepare_dataset(
    out_dir: Path | str,
    *,
    source: Path | str | None = None,
    tokenizer: str | Path = "byte",
    vocab_size: int | None = None,
    val_fraction: float = 0.05,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    format: str = "auto",
    text_field: str = DEFAULT_TEXT_FIELD,
    eod_token: str = EOD_TOKEN,
    show_progress: bool = True,
) -> Path:
    """Prepare (or reuse) the token dataset of ``source`` in ``out_dir``; returns its path.

    ``tokenizer`` is ``byte``, ``bpe`` (with ``vocab_size``) or the path of a ``tokenizer.json``.
    Raises ValueError for bad settings and DataError (a ValueError) for a bad source or an
    ``out_dir`` that holds anything other than this very dataset.
    """
    kind, tokenizer_file = resolve_tokenizer(tokenizer)
    config = PrepareConfig(
        source=None if source is None else Path(source),
        tokenizer=kind,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        shard_tokens=shard_tokens,
        tokenizer_file=tokenizer_file,
        eod_token=eod_token,
        format=format,
        text_field=text_field,
    )
    return prepare(out_dir, config, show_progress=show_progress).path


def read_documents(dataset_dir: Path | str) -> list[dict[str, Any]]:
    """The per-document index of a dataset (path, split, tokens), whatever its format version."""
    dataset_dir = Path(dataset_dir)
    meta = json.loads((dataset_dir / META_FILE).read_text(encoding="utf-8"))
    if "documents" in meta:  # format 1
        return list(meta["documents"])
    if not meta.get("documents_file"):
        return []  # an adopted token file: its documents are not known
    with open(dataset_dir / meta["documents_file"], encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def default_dataset_name(
    source: Path | str | None = None, tokenizer: str | Path = "byte", vocab_size: int | None = None
) -> str:
    """Folder name like ``stdlib-byte``, ``stdlib-bpe4096``, ``corpus-byte`` (a folder),
    ``docs-jsonl-byte`` (a file: its format in the name, so that ``docs.jsonl`` and
    ``docs.parquet`` get folders of their own) or ``...-hf``."""
    if source is None:
        stem = "stdlib"
    else:
        path = Path(source)
        stem = (path.stem or "corpus") + (f"-{path.suffix[1:]}" if path.suffix[1:] else "")
    kind, _ = resolve_tokenizer(tokenizer)
    if kind == "hf":
        return f"{stem}-hf"
    return f"{stem}-byte" if kind == "byte" else f"{stem}-bpe{vocab_size}"


def ensure_dataset(root: Path | str, *, show_progress: bool = True) -> Path:
    """The default dataset (byte tokens of the python stdlib) under ``root``, prepared on first use."""
    return prepare_dataset(Path(root) / DEFAULT_DATASET_NAME, show_progress=show_progress)


__all__ = [
    "DEFAULT_DATASET_NAME",
    "DEFAULT_SHARD_TOKENS",
    "DOCUMENTS_FILE",
    "PrepareConfig",
    "PrepareResult",
    "STDLIB_SOURCE",
    "assign_splits",
    "default_dataset_name",
    "dtype_for_vocab",
    "ensure_dataset",
    "prepare",
    "prepare_dataset",
    "read_documents",
]
