"""Records: documents from JSONL, parquet and a Hugging Face ``datasets`` folder saved to disk.

Job: stream the records of record-shaped sources as ``Document``s, one record one document, read
in batches so that memory holds one batch, never a file. ``iter_documents`` streams the
documents of any listing (a ``text`` one through ``corpus``).

* ``jsonl``: one JSON object per line; its ``text_field`` (default ``text``) is the document.
  Blank lines are skipped. A document is named ``<file>#L<line number>`` (1-based).
* ``parquet``: the ``text_field`` column, read a batch of rows at a time; ``<file>#<row>``.
* ``hf-disk``: a folder written by ``datasets.Dataset.save_to_disk``: ``state.json`` lists its
  Arrow stream files in order; the ``text_field`` column of each; ``<file>#<row>``. Reading needs
  only ``pyarrow``, not ``datasets``. A saved ``DatasetDict`` is one such folder per split.

``parquet`` and ``hf-disk`` need ``pyarrow`` (``pip install 'recover[parquet]'``); without it the
error names the extra. Every record is checked like a text file: a missing field, a value that
is not a string (null included), a NUL character or text that is not valid UTF-8 (a lone
surrogate) is a DataError naming the file and the line or row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recover.data.corpus import (
    Advance,
    CorpusListing,
    DataError,
    Document,
    iter_text_documents,
    open_source_file,
)

_ROWS_PER_BATCH = 1024
PYARROW_EXTRA = "pip install 'recover[parquet]' (pyarrow)"


def _import_pyarrow(what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise DataError(f"reading {what} needs pyarrow: {PYARROW_EXTRA}") from exc
    return pyarrow


def _document(relpath: str, value: Any, where: str, field: str) -> Document:
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise DataError(f"{where}: field {field!r} is {got}, not a string")
    if "\x00" in value:
        raise DataError(f"{where}: field {field!r} contains a NUL character")
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: field {field!r} is not valid UTF-8 text ({exc.reason})") from exc
    return Document(relpath=relpath, data=data)


def _iter_jsonl(
    relpath: str, path: Path, field: str, advance: Advance | None
) -> Iterator[Document]:
    with open_source_file(path) as f:  # type: ignore[attr-defined]
        for lineno, line in enumerate(f, start=1):
            if advance is not None:
                advance(len(line))
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                record = json.loads(line)
            except ValueError as exc:  # bad JSON or bad UTF-8
                raise DataError(f"{where}: not a JSON object ({exc})") from exc
            if not isinstance(record, dict):
                raise DataError(f"{where}: not a JSON object")
            if field not in record:
                found = ", ".join(sorted(record)[:8]) or "none"
                raise DataError(
                    f"{where}: no field {field!r} (fields: {found}); choose one with --text-field"
                )
            yield _document(f"{relpath}#L{lineno}", record[field], where, field)


def _column_of(schema_names: list[str], path: Path, field: str) -> None:
    if field not in schema_names:
        found = ", ".join(schema_names[:8]) or "none"
        raise DataError(
            f"{path}: no column {field!r} (columns: {found}); choose one with --text-field"
        )


def _iter_batches(
    relpath: str, path: Path, field: str, batches: Iterator[Any]
) -> Iterator[Document]:
    row = 0
    for batch in batches:
        for value in batch.column(field).to_pylist():
            yield _document(f"{relpath}#{row}", value, f"{path} row {row}", field)
            row += 1


def _iter_parquet(
    relpath: str, path: Path, field: str, advance: Advance | None
) -> Iterator[Document]:
    pa = _import_pyarrow("parquet")
    open_source_file(path).close()  # type: ignore[attr-defined]  # a named error for bad paths
    try:
        reader = pa.parquet.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a parquet file ({exc})") from exc
    _column_of(reader.schema_arrow.names, path, field)
    size, rows = path.stat().st_size, max(reader.metadata.num_rows, 1)
    done = 0
    batches = reader.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[field])
    for index, doc in enumerate(_iter_batches(relpath, path, field, batches)):
        if advance is not None:
            step = size * (index + 1) // rows - done
            done += step
            advance(step)
        yield doc


def _iter_arrow_stream(
    relpath: str, path: Path, field: str, advance: Advance | None
) -> Iterator[Document]:
    pa = _import_pyarrow("a saved datasets folder")
    try:
        source = pa.memory_map(str(path), "r")
        reader = pa.ipc.open_stream(source)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not an Arrow stream file ({exc})") from exc
    _column_of(reader.schema.names, path, field)
    yield from _iter_batches(relpath, path, field, iter(reader))
    if advance is not None:
        advance(path.stat().st_size)


_READERS = {"jsonl": _iter_jsonl, "parquet": _iter_parquet, "hf-disk": _iter_arrow_stream}


def _iter_records(listing: CorpusListing, advance: Advance | None) -> Iterator[Document]:
    read = _READERS[listing.format]
    for relpath, path in listing.files:
        yield from read(relpath, path, listing.text_field, advance)


def iter_documents(
    listing: CorpusListing,
    *,
    skipped: list[str] | None = None,
    advance: Advance | None = None,
) -> Iterator[Document]:
    """The documents of any listing, one at a time, in corpus order (see ``corpus``).

    ``skipped`` collects the stdlib files left out; ``advance(n)`` is told the source bytes
    consumed, for a progress bar.
    """
    if listing.format == "text":
        return iter_text_documents(listing, skipped=skipped, advance=advance)
    if listing.format not in _READERS:
        raise ValueError(f"unknown source format {listing.format!r}")
    return _iter_records(listing, advance)
