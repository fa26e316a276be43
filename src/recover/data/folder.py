"""A dataset folder on disk: its meta.json, whether it already holds a dataset, its atomic publish.

Job: what `prepare` and `adopt` share about the folder they make (format: docs/data.md): the
format's constants (`META_FILE`, `SPLITS`, the format version written and those read), writing
meta.json, telling whether an existing folder holds exactly the dataset asked for (reused), another
one or other files (a DataError naming the path) or nothing, the hidden temporary sibling a dataset
is written into, and the rename that publishes it.

Invariants:

* A reader never sees a half-written dataset: it is written into a hidden temporary sibling
  (`.NAME.tmp-PID-HOST-XXXX`), meta.json last and fsynced, then renamed into place; when another
  writer published the same dataset first, theirs stands and the temporary folder is removed.
* An existing folder is reused only when it holds exactly the files its meta.json names, at their
  sizes, with the same content hash and settings; anything else there is refused, never
  overwritten or removed.
* A temporary folder is removed by a later prepare only when its name says that this host made
  it and its process is gone; another host's, or a live process's, are kept.

Must not: read the corpus, tokenize, or build a dataset's meta (its callers pass meta and settings).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from recover.data.corpus import DataError
from recover.processes import host_name, process_alive

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)  # 1: documents listed inside meta.json, no settings block
META_FILE = "meta.json"
SPLITS = ("train", "val")


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """meta.json, sorted keys, fsynced (written last into a temporary folder)."""
    _write_file(folder / META_FILE, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())


def _expected_files(meta: dict[str, Any]) -> set[str]:
    names = {META_FILE}
    for split in SPLITS:
        names.update(s["file"] for s in meta["shards"][split])
    if meta["tokenizer"].get("file"):
        names.add(meta["tokenizer"]["file"])
    if meta.get("documents_file"):
        names.add(meta["documents_file"])
    return names


def _read_complete_meta(out_dir: Path) -> dict[str, Any] | None:
    """meta.json of out_dir if it holds exactly one complete dataset, else None."""
    try:
        meta = json.loads((out_dir / META_FILE).read_text(encoding="utf-8"))
        if meta.get("format_version") not in READABLE_FORMAT_VERSIONS:
            return None
        if set(os.listdir(out_dir)) != _expected_files(meta):
            return None
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in SPLITS:
            for shard in meta["shards"][split]:
                size = (out_dir / shard["file"]).stat().st_size
                if "offset" in shard:  # an adopted file shared by both splits
                    if size < (shard["offset"] + shard["tokens"]) * itemsize:
                        return None
                elif size != shard["tokens"] * itemsize:
                    return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta


def meta_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """The settings a dataset was made with (derived for format 1, which did not record them)."""
    if "settings" in meta:
        return meta["settings"]
    return {
        "tokenizer": meta["tokenizer"]["kind"],
        "requested_vocab_size": meta["tokenizer"].get("requested_vocab_size"),
        "val_fraction": meta.get("val_fraction"),
        "shard_tokens": meta.get("shard_tokens"),
        "source_format": "text",
        "text_field": None,
        "tokenizer_sha256": None,
        "eod_token": None,
    }


def check_out_dir_early(out_dir: Path) -> None:
    """Fail before any work when out_dir cannot possibly be reused or created."""
    if not os.path.lexists(out_dir):
        return
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise DataError(f"output {out_dir} exists and is not a folder")
    entries = os.listdir(out_dir)
    if entries and META_FILE not in entries:
        raise DataError(f"output {out_dir} exists and holds other files; choose another --out")


def reuse_existing(out_dir: Path, settings: dict[str, Any], content_hash: str) -> dict | None:
    """out_dir's meta when it already holds this dataset; None when it is absent or empty;
    DataError when it holds something else."""
    if not os.path.lexists(out_dir):
        return None
    check_out_dir_early(out_dir)
    if not os.listdir(out_dir):
        return None  # an empty folder is replaced by the rename
    meta = _read_complete_meta(out_dir)
    if meta is None:
        raise DataError(f"output {out_dir} holds an incomplete or unknown dataset; remove it")
    found = meta_settings(meta)
    if meta.get("content_hash") != content_hash or found != settings:
        raise DataError(
            f"output {out_dir} holds another dataset (content {meta.get('content_hash')}, "
            f"settings {found}); remove it or choose another --out"
        )
    return meta


def publish(tmp: Path, out_dir: Path, reuse: Callable[[], dict | None]) -> bool:
    """Rename the finished ``tmp`` to ``out_dir``; False when someone else published the same
    dataset meanwhile (``reuse()`` says so), in which case ``tmp`` is removed."""
    try:
        os.rename(tmp, out_dir)
        return True
    except OSError:
        if reuse() is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise


def make_temporary_folder(out_dir: Path) -> Path:
    """A new hidden temporary sibling of `out_dir`, named after this host and process; the
    temporaries of this folder's killed prepares (of this host, their process gone) go first."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_temporaries(out_dir):
        log.info(f"removed {stale}: the temporary folder of a prepare that was killed")
    prefix = f".{out_dir.name}.tmp-{os.getpid()}-{host_name()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    return tmp


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Remove the temporary folders of prepares of `out_dir` that ran on this host and whose
    process is gone (killed before they could remove them); return their paths. Another host's,
    or a live process's, are kept."""
    pattern = re.compile(
        rf"^\.{re.escape(out_dir.name)}\.tmp-(?P<pid>\d+)-(?P<host>.+)-[a-z0-9_]+$"
    )
    removed = []
    for entry in sorted(out_dir.parent.iterdir()) if out_dir.parent.is_dir() else ():
        m = pattern.match(entry.name)
        if m is None or m.group("host") != host_name() or not entry.is_dir():
            continue
        if int(m.group("pid")) == os.getpid() or process_alive(int(m.group("pid"))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "READABLE_FORMAT_VERSIONS",
    "SPLITS",
    "check_out_dir_early",
    "make_temporary_folder",
    "meta_settings",
    "publish",
    "remove_stale_temporaries",
    "reuse_existing",
    "write_meta",
]
