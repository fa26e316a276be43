"""Checkpoint folders on disk: names, publication, verification, and which one to resume from.

Job: the part of the checkpoint format (docs/checkpoints.md) that is about folders and files, for
the writer (`recover.checkpoint.state.CheckpointWriter`) and every reader: where a checkpoint of
step N lives, which folders are temporaries and whose, what makes a folder a valid checkpoint, and
which checkpoint a resume takes.

Invariants:
- A checkpoint folder `step_N/` is either absent or complete. Every rank writes its files into
  `step_N.tmp.HOST.PID/` (the leading rank's host and PID); DCP fsyncs each file and its
  `.metadata`; then the leading rank writes the marker `recover.json` last (format, step, metadata,
  every file's size and CRC-32), fsyncs it, renames the folder into place and fsyncs the parent.
- A temporary folder whose writer is gone (a process of this host that no longer exists: killed
  mid-save) is removed when the next writer starts (`remove_stale_tmp`). Another host's
  temporaries are left alone: its writer may be alive.
- A checkpoint is verified before it is used (`verify_checkpoint`): the marker must be there, its
  own content must match the CRC-32 it carries (`_marker_crc32`: an edited step or file list), its
  step must be the one its folder is named after, and every file it lists must have its recorded
  size (a truncated shard) and CRC-32 (an altered one); a failure raises `CheckpointError` naming
  the path and what differs.
- Resuming (`find_resume_point`) takes the newest *valid* checkpoint: a corrupt newer one is skipped
  with its error reported to the caller; when checkpoints exist and none is valid, it raises,
  never falling back to step 0.
- Checkpoints of the older single-file form (`step_N.ckpt`: b'RCVRCKP1', SHA-256, a torch.save
  payload of the full state) are still read, never written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recover.processes import host_name, process_alive

FORMAT = "recover-dcp/1"
MARKER = "recover.json"  # written last: a folder without it is not a checkpoint
LEGACY_MAGIC = b"RCVRCKP1"
_NAME = re.compile(r"^step_(\d{8})$")
_LEGACY_NAME = re.compile(r"^step_(\d{8})\.ckpt$")
# A temporary: a save in progress `step_N.tmp.HOST.PID`, a checkpoint being removed
# `step_N.old.tmp.HOST.PID`, and the older single-file forms `step_N.ckpt.tmp.HOST.PID` and
# `step_N.ckpt.tmpPID`.
_TMP = re.compile(r"^step_\d{8}(?:\.ckpt|\.old)?\.tmp(?:\.(?P<host>[^/]+)\.|)(?P<pid>\d+)$")
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read, or does not belong to this run."""


def checkpoint_path(directory: Path, step: int) -> Path:
    """The folder of the checkpoint whose next step to run is `step`."""
    return directory / f"step_{step:08d}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the published checkpoints in `directory`, oldest first: folders, and files
    of the older form (a folder wins over a file of the same step)."""
    if not directory.is_dir():
        return []
    found: dict[int, Path] = {}
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_dir():
            found[int(m.group(1))] = entry
    for entry in directory.iterdir():
        m = _LEGACY_NAME.match(entry.name)
        if m and entry.is_file():
            found.setdefault(int(m.group(1)), entry)
    return sorted(found.items())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_tmp(directory: Path) -> list[Path]:
    """Remove the temporaries of writers of this host that are gone; return their paths.

    A writer SIGKILLed mid-save leaves `step_N.tmp.HOST.PID/`. Its PID no longer exists on this
    host, so it is stale. A temporary of another host, or of a live process here, is kept."""
    if not directory.is_dir():
        return []
    host, removed = host_name(), []
    for entry in directory.iterdir():
        m = _TMP.match(entry.name)
        if m is None or m.group("host") not in (None, host):
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or process_alive(pid):
            continue
        if not entry.exists():  # another writer starting at the same moment removed it
            continue
        _remove(entry)
        removed.append(entry)
    return sorted(removed)


# ---- the state each rank saves ---------------------------------------------------------------


def _crc32(path: Path) -> int:
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _describe_files(folder: Path) -> dict[str, dict[str, int]]:
    return {
        entry.name: {"bytes": entry.stat().st_size, "crc32": _crc32(entry)}
        for entry in sorted(folder.iterdir())
        if entry.is_file() and entry.name != MARKER
    }


def _marker_crc32(marker: dict) -> int:
    """CRC-32 of the marker's content without its own checksum, in one canonical JSON form."""
    content = {k: v for k, v in marker.items() if k != "marker_crc32"}
    return zlib.crc32(json.dumps(content, sort_keys=True, separators=(",", ":")).encode())


def verify_checkpoint(path: Path, *, checksums: bool = True) -> dict:
    """The marker of the checkpoint folder `path`, after checking that every file it lists has
    its size and (with `checksums`) its CRC-32; CheckpointError naming the path otherwise."""
    marker_path = path / MARKER
    try:
        marker = json.loads(marker_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MARKER} (the marker written last)"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: unreadable {MARKER}: {e}") from e
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} is not in a format this version reads "
            f"({marker.get('format') if isinstance(marker, dict) else '?'}; expected {FORMAT})"
        )
    # (checkpoints written before the marker carried its own checksum have none)
    if "marker_crc32" in marker and marker["marker_crc32"] != _marker_crc32(marker):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its {MARKER} does not match its own checksum "
            "(altered); delete it to resume from an older one"
        )
    named = re.fullmatch(r"step_(\d{8})", path.name)
    if named is not None and marker.get("step") != int(named.group(1)):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its {MARKER} says step {marker.get('step')!r}, its "
            f"folder is named after step {int(named.group(1))}; delete it to resume from an "
            "older one"
        )
    meta = marker.get("meta")
    if isinstance(meta, dict) and "step" in meta and meta["step"] != marker.get("step"):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its {MARKER} says step {marker.get('step')!r}, its "
            f"saved metadata step {meta['step']!r}; delete it to resume from an older one"
        )
    for name, want in marker.get("files", {}).items():
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} is missing") from None
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {size} bytes, {want['bytes']} were "
                "written (truncated or altered); delete it to resume from an older one"
            )
        if checksums and _crc32(file) != want["crc32"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: the checksum of {name} does not match (altered); "
                "delete it to resume from an older one"
            )
    return marker


def read_legacy_checkpoint(path: Path) -> dict:
    """Load and verify a checkpoint file of the older form (b'RCVRCKP1', SHA-256, payload)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(LEGACY_MAGIC) + 32)
            payload = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if len(head) < len(LEGACY_MAGIC) + 32 or head[: len(LEGACY_MAGIC)] != LEGACY_MAGIC:
        raise CheckpointError(f"checkpoint {path} is corrupt: not a ReCoVer checkpoint file")
    if hashlib.sha256(payload).digest() != head[len(LEGACY_MAGIC) :]:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its checksum does not match (truncated or altered); "
            "delete it to resume from an older one"
        )
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # a verified payload that torch cannot read is still a corrupt file
        raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from e
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint {path} is corrupt: no step recorded")
    return state


_LEGACY_META = ("step", "train", "data_hash", "layout")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resumed run starts from, and the newer ones it had to skip."""

    path: Path
    meta: dict  # step (the next step to run), and what the writer recorded (train, data_hash...)
    skipped: tuple[tuple[Path, str], ...] = ()  # (path, why) of each corrupt newer checkpoint
    legacy_state: dict | None = field(default=None, repr=False)  # a file of the older form

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def open_checkpoint(path: Path) -> ResumePoint:
    """A verified checkpoint (folder, or file of the older form), ready to load."""
    if path.is_file():
        state = read_legacy_checkpoint(path)
        meta = {k: state[k] for k in _LEGACY_META if k in state}
        return ResumePoint(path=path, meta=meta, legacy_state=state)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}")
    return ResumePoint(path=path, meta=verify_checkpoint(path)["meta"])


def find_resume_point(directory: Path) -> ResumePoint | None:
    """The newest valid checkpoint in `directory`; None only when there is no checkpoint at all.

    A corrupt checkpoint (no marker, a wrong size or checksum) is skipped for the next older one
    and listed in `skipped`, for the caller to warn about. If every checkpoint is corrupt this
    raises CheckpointError naming each: a run with checkpoints never silently restarts at 0."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            point = open_checkpoint(path)
        except CheckpointError as e:
            skipped.append((path, str(e)))
            continue
        return ResumePoint(path, point.meta, tuple(skipped), point.legacy_state)
    if not skipped:
        return None
    reasons = "; ".join(why for _, why in skipped)
    raise CheckpointError(
        f"no valid checkpoint in {directory}: all {len(skipped)} are corrupt ({reasons}). "
        "Restore one from a backup, or remove them to start again from step 0"
    )
