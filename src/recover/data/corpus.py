"""Corpus: the text documents a dataset is made of, read in one fixed order.

Job: turn a source into an ordered list of documents ``(relative path, bytes)`` and a content hash.

Sources:

* the default, embedded source (``source=None``): the ``*.py`` files of the running interpreter's
  standard library (``sysconfig.get_paths()["stdlib"]``), excluding ``site-packages``, every
  ``test``/``tests`` folder (which also drops the lib2to3 test data), ``idlelib`` and hidden
  folders. A file that is not clean UTF-8 text (bad UTF-8 or a NUL byte) is skipped and listed in
  ``Corpus.skipped``. About 11 MB and ~700 files on CPython 3.11.
* a user source: one text file, or a folder whose every regular file below it is a document
  (hidden files and folders skipped, symlinked folders not followed). A user source is strict: a
  missing path, no files, only empty files, a file that cannot be read, a special file (FIFO,
  socket, device) or a binary file (NUL byte or not UTF-8) raises ``DataError`` naming the path.
  One text file is cut at line ends into chunks of about ``FILE_CHUNK_BYTES`` so that it can be
  split into train and validation documents like a folder.

Invariants: documents are sorted by relative path (POSIX separators), so the order and the content
hash depend only on the files' names and bytes, never on the file system's listing order.
``content_hash`` is a sha256 over the length-prefixed (relative path, bytes) of every document in
order; it identifies the input of a dataset.

Costs and limits: the whole corpus is held in memory (fine for tens of MB; a multi-GB corpus needs
a streaming reader, which this module does not provide). It never writes anything.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STDLIB_SOURCE = "python-stdlib"
# Folder names never descended into for the default stdlib source.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})
# A single-file user source is cut into documents of about this many bytes (at line ends).
FILE_CHUNK_BYTES = 16 * 1024


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
    """

    label: str
    root: Path
    files: tuple[tuple[str, Path], ...]
    strict: bool
    python_version: str | None


@dataclass(frozen=True)
class Corpus:
    """The documents of a source in order, the files skipped, and the content hash."""

    label: str
    documents: tuple[Document, ...]
    skipped: tuple[str, ...]
    python_version: str | None
    content_hash: str


def compute_content_hash(documents: tuple[Document, ...] | list[Document]) -> str:
    """sha256 over the length-prefixed (relative path, bytes) of each document, in order."""
    h = hashlib.sha256()
    for doc in documents:
        name = doc.relpath.encode("utf-8")
        h.update(len(name).to_bytes(8, "little"))
        h.update(name)
        h.update(len(doc.data).to_bytes(8, "little"))
        h.update(doc.data)
    return "sha256:" + h.hexdigest()


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


def _list_user_source(source: Path) -> CorpusListing:
    root = Path(os.path.abspath(source))
    if not os.path.lexists(root):
        raise DataError(f"source {root} does not exist")
    if root.is_file():
        return CorpusListing(
            label=str(root), root=root, files=((root.name, root),), strict=True, python_version=None
        )
    if not root.is_dir():
        raise DataError(f"source {root} is neither a regular file nor a folder")
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            relparts = path.relative_to(root).parts
            if _is_hidden(relparts):
                continue
            files.append(("/".join(relparts), path))
    files.sort(key=lambda item: item[0])
    if not files:
        raise DataError(f"source {root} holds no files")
    return CorpusListing(
        label=str(root), root=root, files=tuple(files), strict=True, python_version=None
    )


def list_corpus_files(source: Path | str | None = None) -> CorpusListing:
    """Find the files of ``source`` (None: the embedded stdlib source) in corpus order.

    Raises DataError for a missing user source or a folder without files.
    """
    if source is None:
        return _list_stdlib()
    return _list_user_source(Path(source))


def _read_file(path: Path) -> bytes:
    """Read one regular file; DataError naming the path for special files and I/O errors."""
    try:
        st = os.stat(path)  # follows symlinks; a dangling one raises here
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path} is not a regular file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _binary_reason(data: bytes) -> str | None:
    if b"\x00" in data:
        return "contains a NUL byte"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text (byte offset {exc.start})"
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


def read_corpus(listing: CorpusListing, *, advance: Callable[[], None] | None = None) -> Corpus:
    """Read every listed file (calling ``advance()`` after each), check it and build the Corpus.

    Strict listings raise DataError naming the first bad file; the stdlib listing skips it.
    """
    documents: list[Document] = []
    skipped: list[str] = []
    single_file = listing.strict and listing.root.is_file()
    for relpath, path in listing.files:
        if listing.strict:
            data = _read_file(path)
        else:
            try:
                data = _read_file(path)
            except DataError:
                skipped.append(relpath)
                if advance is not None:
                    advance()
                continue
        reason = _binary_reason(data)
        if reason is not None:
            if listing.strict:
                raise DataError(f"{path} {reason}; only text files can be used as a source")
            skipped.append(relpath)
        elif single_file:
            documents.extend(_chunk_at_lines(relpath, data, FILE_CHUNK_BYTES))
        else:
            documents.append(Document(relpath=relpath, data=data))
        if advance is not None:
            advance()
    if not any(doc.data for doc in documents):
        raise DataError(f"source {listing.root} holds no text (all files empty or skipped)")
    return Corpus(
        label=listing.label,
        documents=tuple(documents),
        skipped=tuple(skipped),
        python_version=listing.python_version,
        content_hash=compute_content_hash(documents),
    )


def load_corpus(source: Path | str | None = None) -> Corpus:
    """List and read a source in one call (no progress reporting)."""
    return read_corpus(list_corpus_files(source))
