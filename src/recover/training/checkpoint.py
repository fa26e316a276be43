"""Checkpoints: periodic, asynchronous, atomic, verified.

Job: save the committed training state (model, optimizer, the next step to run, the trajectory
config and the dataset hash) so that a resumed run continues on exactly the trajectory of an
uninterrupted one. Sample order and dropout are pure functions of (seed, step, j), so no RNG state
is needed.

Invariants:
- A checkpoint file is either absent or complete: it is written to `NAME.tmp.HOST.PID`, fsynced,
  renamed into place, and the folder is fsynced. Only then does the writer call its `on_saved`
  callback (the `checkpoint_saved` event): an event never names a file that is not durable.
- Fencing: with a `fence`, the rename happens only while it is open (checked after the fsync,
  just before publishing); a writer evicted meanwhile removes its temporary file and publishes
  nothing, and announces nothing.
- A temporary file whose writer is gone (a process of this host that no longer exists: killed
  mid-save) is removed when the next writer starts (`remove_stale_tmp`). Another host's
  temporaries are left alone: its writer may be alive.
- A checkpoint is verified on load: the file starts with a magic tag and the SHA-256 of the payload;
  a truncated or altered file raises `CheckpointError` naming the path.
- Resuming (`find_resume_point`) takes the newest *valid* checkpoint: a corrupt newer one is
  skipped with its error reported to the caller (who warns loudly and writes an event); when
  checkpoints exist and none is valid, it raises, never falling back to step 0.
- Only the last `keep` checkpoints are kept.

Cost: the state is copied to CPU memory on the caller's thread (a memcpy of the model and the
optimizer moments); serialisation and the disk write run on one background thread, so a save costs
the training loop only the copy. Errors on that thread surface at the next save or at `close()`.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"RCVRCKP1"
_NAME = re.compile(r"^step_(\d{8})\.ckpt$")
# A temporary file: `step_N.ckpt.tmp.HOST.PID` (and `step_N.ckpt.tmpPID`, an older form).
_TMP = re.compile(r"^step_\d{8}\.ckpt\.tmp(?:\.(?P<host>[^/]+)\.|)(?P<pid>\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or does not belong to this run."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.ckpt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found)


def _detach_copy(obj: Any) -> Any:
    """A deep copy of a state dict with every tensor cloned to CPU, so training can go on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _detach_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_detach_copy(v) for v in obj)
    return obj


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_tmp(directory: Path) -> list[Path]:
    """Remove the temporary files of writers of this host that are gone; return their paths.

    A writer SIGKILLed mid-save leaves `step_N.ckpt.tmp.HOST.PID`. Its PID no longer exists on
    this host, so it is stale. A file of another host, or of a live process here, is kept."""
    if not directory.is_dir():
        return []
    host, removed = _host(), []
    for entry in directory.iterdir():
        m = _TMP.match(entry.name)
        if m is None or m.group("host") not in (None, host):
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:  # another writer starting at the same moment removed it
            continue
        removed.append(entry)
    return sorted(removed)


def write_checkpoint(
    path: Path, state: dict, *, fence: Callable[[], bool] | None = None
) -> int | None:
    """Serialise `state` and write it atomically and durably to `path` (synchronous); return its
    size in bytes. When this returns, the file and its name are on disk (fsync, rename, fsync of
    the folder). None, and nothing published, when `fence` says this process may not write."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    # One temporary name per process: two replicas saving the same state race harmlessly. The host
    # and PID in the name let the next writer tell a dead writer's leftover from a live one's.
    tmp = path.with_name(f"{path.name}.tmp.{_host()}.{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(hashlib.sha256(payload).digest())
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    if fence is not None and not fence():  # evicted while it wrote: publish nothing
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return len(MAGIC) + 32 + len(payload)


def read_checkpoint(path: Path) -> dict:
    """Load and verify a checkpoint; raise CheckpointError naming the path if it is corrupt."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    header = len(MAGIC) + 32
    if len(data) < header or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"checkpoint {path} is corrupt: not a ReCoVer checkpoint file")
    digest, payload = data[len(MAGIC) : header], data[header:]
    if hashlib.sha256(payload).digest() != digest:
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


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that is durable on disk: what `checkpoint_saved` reports."""

    step: int  # the next step to run
    path: Path
    bytes: int
    seconds: float  # from the save's start (after the copy) to the fsync of its folder


class CheckpointWriter:
    """Writes checkpoints on one background thread; keeps the last `keep`.

    `on_saved` is called on the writer thread once a checkpoint is durable (after fsync and
    rename), never before; an error in it is recorded like a failed save."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        on_saved: Callable[[SavedCheckpoint], None] | None = None,
        fence: Callable[[], bool] | None = None,
    ) -> None:
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        self.directory = directory
        self.keep = keep
        self.on_saved = on_saved
        self.fence = fence  # checked before each rename (see the module docstring)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: dict, *, block: bool = False) -> Path:
        """Queue a save of `state` (copied now) as the checkpoint of `step`; returns its path.
        The file is durable when `on_saved` is called (at the latest when `wait()` returns)."""
        self.wait()
        path = checkpoint_path(self.directory, step)
        snapshot = _detach_copy(state)
        self._thread = threading.Thread(
            target=self._write, args=(step, path, snapshot), name="checkpoint-writer", daemon=True
        )
        self._thread.start()
        if block:
            self.wait()
        return path

    def _write(self, step: int, path: Path, state: dict) -> None:
        try:
            t0 = time.perf_counter()
            size = write_checkpoint(path, state, fence=self.fence)
            if size is None:  # fenced: nothing published, nothing to announce or prune
                return
            saved = SavedCheckpoint(step, path, size, time.perf_counter() - t0)
            if self.on_saved is not None:
                self.on_saved(saved)
            for _, old in list_checkpoints(self.directory)[: -self.keep]:
                old.unlink(missing_ok=True)
        except BaseException as e:  # recorded and re-raised on the training thread by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"checkpoint save failed: {error}") from error

    def close(self) -> None:
        self.wait()


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resumed run starts from, and the newer ones it had to skip."""

    state: dict
    path: Path
    skipped: tuple[tuple[Path, str], ...] = ()  # (path, why) of each corrupt newer checkpoint


def find_resume_point(directory: Path) -> ResumePoint | None:
    """The newest valid checkpoint in `directory`; None only when there is no checkpoint at all.

    A corrupt checkpoint (bad magic, checksum, or payload) is skipped for the next older one and
    listed in `skipped`, for the caller to warn about. If every checkpoint is corrupt this raises
    CheckpointError naming each: a run with checkpoints never silently restarts from step 0."""
    found = list_checkpoints(directory)
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(found):
        try:
            state = read_checkpoint(path)
        except CheckpointError as e:
            skipped.append((path, str(e)))
            continue
        return ResumePoint(state=state, path=path, skipped=tuple(skipped))
    if not skipped:
        return None
    reasons = "; ".join(why for _, why in skipped)
    raise CheckpointError(
        f"no valid checkpoint in {directory}: all {len(skipped)} are corrupt ({reasons}). "
        "Restore one from a backup, or remove them to start again from step 0"
    )


def load_latest(directory: Path) -> dict | None:
    """The newest valid checkpoint's state, or None if there is none (see find_resume_point)."""
    point = find_resume_point(directory)
    return None if point is None else point.state
