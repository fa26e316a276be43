"""Corpus: the documents a dataset is made of, read one at a time in one fixed order.

Job: turn a source into a stream of documents ``(relative path, bytes)`` and a content hash,
without ever holding more than one document (or one batch of records) in memory.

Sources (``format``; ``auto`` picks by the file name, see ``detect_format``):

* the default, embedded source (``source=None``): the ``*.py`` files of the running interpreter's
  standard library (``sysconfig.get_paths()["stdlib"]``), excluding ``site-packages``, every
  ``test``/``tests`` folder (which also drops the lib2to3 test data), ``idlelib`` and hidden
  folders. A file that is not clean UTF-8 text (bad UTF-8 or a NUL byte) is skipped and listed in
  ``skipped``. About 11 MB and ~700 files on CPython 3.11.
* ``text``: one text file, or a folder whose every regular file below it is a document (hidden
  files and folders skipped, symlinked folders not followed). One text file is read in blocks and
  cut at line ends into documents of about ``FILE_CHUNK_BYTES`` (named ``<file>#00000``, ...), so
  that it can be split into train and validation like a folder.
* ``jsonl``, ``parquet``, ``hf-disk``: one record is one document; read by
  ``recover.data.records``, whose ``iter_documents`` streams any source.

A user source is strict: a missing path, no files, only empty documents, a file that cannot be
read, a special file (FIFO, socket, device) or a binary document (NUL byte or not UTF-8) raises
``DataError`` naming the path (and the line or row).

Invariants: files are taken sorted by relative path (POSIX separators; an ``hf-disk`` dataset in
its own file order), records in file order, so the order and the content hash depend only on the
files' names and bytes, never on the file system's listing order. ``content_hash`` is a sha256
over the length-prefixed (relative path, bytes) of every document in order; it identifies the
input of a dataset.

Costs and limits: memory holds one document (a whole file of a ``text`` folder; 16 KB plus the
longest line of a single text file) or one record batch. It never writes anything.

Size: reading every input format (text, JSONL, parquet, saved datasets), each with the errors that
name the file and record; one concern, one function family per format.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

STDLIB_SOURCE = "python-stdlib"
# Folder names never descended into for the default stdlib source.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})
# A single-file text source is cut into documents of about this many bytes (at line ends).
FILE_CHUNK_BYTES = 16 * 1024
_READ_BLOCK = 1 << 20
SOURCE_FORMATS = ("auto", "text", "jsonl", "parquet", "hf-disk")
DEFAULT_TEXT_FIELD = "text"

Advance = Callable[[int], None]  # called with the number of source bytes just consumed


class DataError(ValueError):
    """A dataset input or output is unusable; the message names the offending path."""


@dataclass(frozen=True)
class Document:
    """One document: its path relative to the source (POSIX separators) and its raw UTF-8 bytes."""

    relpath: str
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8")


@dataclass(frozen=True)
class CorpusListing:
    """The files of a source, found but not yet read, in corpus order.

    ``label`` is what meta.json records as the source: ``"python-stdlib"`` or an absolute path.
    ``strict`` is False only for the embedded stdlib source (bad files are skipped, not errors).
    ``format`` is resolved (never ``auto``); ``text_field`` names the records' text field.
    """

    label: str
    root: Path
    files: tuple[tuple[str, Path], ...]
    strict: bool
    python_version: str | None
    format: str = "text"
    text_field: str = DEFAULT_TEXT_FIELD

    @property
    def total_bytes(self) -> int:
        """The size of the listed files (the unit of reading progress)."""
        total = 0
        for _, path in self.files:
            try:
                total += os.stat(path).st_size
            except OSError:
                pass  # reported when the file is read
        return total


@dataclass(frozen=True)
class Corpus:
    """The documents of a source in order, the files skipped, and the content hash."""

    label: str
    documents: tuple[Document, ...]
    skipped: tuple[str, ...]
    python_version: str | None
    content_hash: str


class ContentHasher:
    """sha256 over the length-prefixed (relative path, bytes) of each document, fed in order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, doc: Document) -> None:
        name = doc.relpath.encode("utf-8")
        self._h.update(len(name).to_bytes(8, "little"))
        self._h.update(name)
        self._h.update(len(doc.data).to_bytes(8, "little"))
        self._h.update(doc.data)

    def hexdigest(self) -> str:
        return "sha256:" + self._h.hexdigest()


def compute_content_hash(documents: tuple[Document, ...] | list[Document]) -> str:
    """sha256 over the length-prefixed (relative path, bytes) of each document, in order."""
    hasher = ContentHasher()
    for doc in documents:
        hasher.add(doc)
    return hasher.hexdigest()


def _is_hidden(relparts: tuple[str, ...]) -> bool:
    return any(part.startswith(".") for part in relparts)


def _list_stdlib() -> CorpusListing:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into excluded or hidden folders.
        dirnames[:] = [
            d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and not d.startswith(".")
        ]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("."):
                path = Path(dirpath) / name
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda item: item[0])
    version = ".".join(str(v) for v in sys.version_info[:3])
    return CorpusListing(
        label=STDLIB_SOURCE, root=root, files=tuple(files), strict=False, python_version=version
    )


def _walk_files(root: Path) -> list[tuple[str, Path]]:
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            relparts = path.relative_to(root).parts
            if not _is_hidden(relparts):
                files.append(("/".join(relparts), path))
    files.sort(key=lambda item: item[0])
    return files


def list_hf_disk_files(root: Path) -> list[tuple[str, Path]]:
    """The Arrow files of a folder saved by ``datasets``, in the order its state.json lists them."""
    state_path = root / "state.json"
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{state_path}: not a datasets state file ({exc})") from exc
    files = []
    for name in names:
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise DataError(f"{state_path}: bad data file name {name!r}")
        files.append((name, root / name))
    return files


def detect_format(root: Path, files: list[tuple[str, Path]]) -> str:
    """``auto``: ``hf-disk`` for a folder saved by ``datasets``; ``jsonl``/``parquet`` when every
    file ends in ``.jsonl``/``.parquet``; else ``text``."""
    if root.is_dir() and (root / "state.json").is_file() and (root / "dataset_info.json").is_file():
        return "hf-disk"
    for suffix, fmt in ((".jsonl", "jsonl"), (".parquet", "parquet")):
        if files and all(rel.endswith(suffix) for rel, _ in files):
            return fmt
    return "text"


def _list_user_source(source: Path, fmt: str, text_field: str) -> CorpusListing:
    root = Path(os.path.abspath(source))
    if not os.path.lexists(root):
        raise DataError(f"source {root} does not exist")
    if root.is_dir() and (root / "dataset_dict.json").is_file():
        raise DataError(
            f"source {root} is a saved DatasetDict; pass the folder of one split "
            f"(e.g. {root / 'train'})"
        )
    if root.is_file():
        files = [(root.name, root)]
    elif root.is_dir():
        files = _walk_files(root)
    else:
        raise DataError(f"source {root} is neither a regular file nor a folder")
    if fmt == "auto":
        fmt = detect_format(root, files)
    if fmt == "hf-disk":
        files = list_hf_disk_files(root)
    if not files:
        raise DataError(f"source {root} holds no files")
    return CorpusListing(
        label=str(root),
        root=root,
        files=tuple(files),
        strict=True,
        python_version=None,
        format=fmt,
        text_field=text_field,
    )


def list_corpus_files(
    source: Path | str | None = None,
    *,
    format: str = "auto",
    text_field: str = DEFAULT_TEXT_FIELD,
) -> CorpusListing:
    """Find the files of ``source`` (None: the embedded stdlib source) in corpus order.

    Raises ValueError for an unknown ``format`` and DataError for a missing user source or a
    folder without files.
    """
    if format not in SOURCE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(SOURCE_FORMATS)}, got {format!r}")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
    if source is None:
        if format not in ("auto", "text"):
            raise ValueError(f"format {format!r} needs a source; the default source is text")
        return _list_stdlib()
    return _list_user_source(Path(source), format, text_field)


def open_source_file(path: Path) -> object:
    """Open one regular file for binary reading; DataError naming the path otherwise."""
    try:
        st = os.stat(path)  # follows symlinks; a dangling one raises here
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path} is not a regular file")
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _read_file(path: Path) -> bytes:
    """Read one regular file; DataError naming the path for special files and I/O errors."""
    with open_source_file(path) as f:  # type: ignore[attr-defined]
        try:
            return f.read()
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


def binary_reason(data: bytes, offset: int = 0) -> str | None:
    """Why ``data`` is not a text document (NUL byte, bad UTF-8 at a byte offset), or None."""
    if b"\x00" in data:
        return "contains a NUL byte"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text (byte offset {offset + exc.start})"
    return None


def _chunk_at_lines(relpath: str, data: bytes, chunk_bytes: int) -> list[Document]:
    """Cut one file into documents of about chunk_bytes, at line ends (a long line stays whole)."""
    docs: list[Document] = []
    start = 0
    while start < len(data):
        end = start + chunk_bytes
        if end < len(data):
            newline = data.find(b"\n", end - 1)
            end = len(data) if newline < 0 else newline + 1
        else:
            end = len(data)
        docs.append(Document(relpath=f"{relpath}#{len(docs):05d}", data=data[start:end]))
        start = end
    return docs


def _stream_line_chunks(f, chunk_bytes: int) -> Iterator[bytes]:
    """The chunks of ``_chunk_at_lines`` read from a file in blocks (equal output, bounded memory)."""
    buf = b""
    searched = 0  # buf[:searched] holds no newline at or after chunk_bytes - 1
    eof = False
    while True:
        if len(buf) > chunk_bytes:
            newline = buf.find(b"\n", max(chunk_bytes - 1, searched))
            if newline >= 0:
                yield buf[: newline + 1]
                buf, searched = buf[newline + 1 :], 0
                continue
            searched = len(buf)
        if eof:
            if buf:
                yield buf
            return
        block = f.read(_READ_BLOCK)
        eof = not block
        buf += block


def _iter_text_file_chunks(relpath: str, path: Path, advance: Advance | None) -> Iterator[Document]:
    with open_source_file(path) as f:  # type: ignore[attr-defined]
        offset = 0
        for index, chunk in enumerate(_stream_line_chunks(f, FILE_CHUNK_BYTES)):
            reason = binary_reason(chunk, offset)
            if reason is not None:
                raise DataError(f"{path} {reason}; only text files can be used as a source")
            offset += len(chunk)
            if advance is not None:
                advance(len(chunk))
            yield Document(relpath=f"{relpath}#{index:05d}", data=chunk)


def _iter_text(
    listing: CorpusListing, skipped: list[str] | None, advance: Advance | None
) -> Iterator[Document]:
    if listing.strict and listing.root.is_file():
        relpath, path = listing.files[0]
        yield from _iter_text_file_chunks(relpath, path, advance)
        return
    for relpath, path in listing.files:
        try:
            data = _read_file(path)
        except DataError:
            if listing.strict:
                raise
            data = None
        reason = "unreadable" if data is None else binary_reason(data)
        if advance is not None:
            advance(0 if data is None else len(data))
        if reason is None:
            yield Document(relpath=relpath, data=data)  # type: ignore[arg-type]
        elif listing.strict:
            raise DataError(f"{path} {reason}; only text files can be used as a source")
        elif skipped is not None:
            skipped.append(relpath)


def iter_text_documents(
    listing: CorpusListing,
    *,
    skipped: list[str] | None = None,
    advance: Advance | None = None,
) -> Iterator[Document]:
    """The documents of a ``text`` listing, one at a time, in corpus order.

    Strict listings raise DataError naming the first bad file; the stdlib listing appends a bad
    file's path to ``skipped`` instead. ``advance(n)`` is told the source bytes consumed.
    Other formats: ``recover.data.records.iter_documents``.
    """
    if listing.format != "text":
        raise ValueError(f"not a text listing: {listing.format!r}")
    return _iter_text(listing, skipped, advance)


def read_corpus(listing: CorpusListing, *, advance: Callable[[], None] | None = None) -> Corpus:
    """Read a whole (small) text source into memory: the documents, the skipped files, the hash.

    ``prepare`` streams instead; this is for tests and tools that want the documents in hand.
    """
    skipped: list[str] = []
    documents = tuple(iter_text_documents(listing, skipped=skipped))
    if advance is not None:
        for _ in listing.files:
            advance()
    if not any(doc.data for doc in documents):
        raise DataError(f"source {listing.root} holds no text (all files empty or skipped)")
    return Corpus(
        label=listing.label,
        documents=documents,
        skipped=tuple(skipped),
        python_version=listing.python_version,
        content_hash=compute_content_hash(documents),
    )


def load_corpus(source: Path | str | None = None) -> Corpus:
    """List and read a source in one call (no progress reporting)."""
    return read_corpus(list_corpus_files(source))
