"""Checkpoints: periodic, asynchronous, atomic, verified.

Job: save the committed training state (model, optimizer, the next step to run, the trajectory
config and the dataset hash) so that a resumed run continues on exactly the trajectory of an
uninterrupted one. Sample order and dropout are pure functions of (seed, step, j), so no RNG state
is needed.

Invariants:
- A checkpoint file is either absent or complete: it is written to `NAME.tmp`, fsynced, then
  renamed into place.
- A checkpoint is verified on load: the file starts with a magic tag and the SHA-256 of the payload;
  a truncated or altered file raises `CheckpointError` naming the path.
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
import threading
from pathlib import Path
from typing import Any

import torch

MAGIC = b"RCVRCKP1"
_NAME = re.compile(r"^step_(\d{8})\.ckpt$")


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


def write_checkpoint(path: Path, state: dict) -> None:
    """Serialise `state` and write it atomically to `path` (synchronous)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    # One temporary name per process: two replicas saving the same state race harmlessly.
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(hashlib.sha256(payload).digest())
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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


class CheckpointWriter:
    """Writes checkpoints on one background thread; keeps the last `keep`."""

    def __init__(self, directory: Path, *, keep: int) -> None:
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        self.directory = directory
        self.keep = keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: dict, *, block: bool = False) -> Path:
        """Queue a save of `state` (copied now) as the checkpoint of `step`; returns its path."""
        self.wait()
        path = checkpoint_path(self.directory, step)
        snapshot = _detach_copy(state)
        self._thread = threading.Thread(
            target=self._write, args=(path, snapshot), name="checkpoint-writer", daemon=True
        )
        self._thread.start()
        if block:
            self.wait()
        return path

    def _write(self, path: Path, state: dict) -> None:
        try:
            write_checkpoint(path, state)
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


def load_latest(directory: Path) -> dict | None:
    """The newest checkpoint's state, or None if there is none. A corrupt newest one raises."""
    found = list_checkpoints(directory)
    if not found:
        return None
    return read_checkpoint(found[-1][1])
