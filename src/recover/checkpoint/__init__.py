"""Checkpoints for people and scripts: read one, or save and resume your own model with it.

Job: the public face of the checkpoint package (the format is documented in docs/checkpoints.md;
the folders in `recover.checkpoint.folders`, the saved state in `recover.checkpoint.state`). The
built-in trainer saves through the same modules: a script that keeps its own state needs nothing
of the trainer's package. `load(path)` returns a checkpoint's content as plain state dicts;
`Checkpointer` saves a script's own model, optimizer and extra state (a scheduler) through the very
code `recover train` uses: DCP folders written by every rank of the replica, staged on the caller's
thread and written in the background, published atomically, verified on restore, resharded to
whatever layout restores them.

    import recover.checkpoint as ckpt
    saver = ckpt.Checkpointer("out/checkpoints", keep=3)
    start = saver.restore(model, optimizer) or 0          # the newest valid checkpoint's step
    ...
    saver.save(step + 1, model, optimizer)                # after the optimizer step of `step`
    saver.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from recover.checkpoint.folders import (
    CheckpointError,
    ResumePoint,
    find_resume_point,
    list_checkpoints,
)
from recover.checkpoint.state import (
    CheckpointWriter,
    SavedCheckpoint,
    dcp_state,
    load_dcp_state,
    read_checkpoint,
)
from recover.checks import is_int

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "SavedCheckpoint",
    "latest",
    "list_checkpoints",
    "load",
    "save",
]


def load(path: str | Path) -> dict:
    """The content of the checkpoint at `path` (a `step_N` folder, or a file of the older form)
    as plain CPU objects: {"model": {name: tensor}, "optimizer": {"state": {name: {...}},
    "param_groups": {name: {...}}} or None, "extra": {...}, "meta": {"step": N, ...}}. Verified
    first: CheckpointError naming the path when it is incomplete or corrupt. Needs host memory for
    the whole state."""
    return read_checkpoint(Path(path))


def latest(directory: str | Path) -> dict | None:
    """`load` of the newest valid checkpoint in `directory` (None when it has none); a corrupt
    newer one is skipped, and CheckpointError is raised when all are corrupt."""
    point = find_resume_point(Path(directory))
    return None if point is None else read_checkpoint(point.path)


def _default_group():
    """The ranks of this replica: the default process group when one exists (a replica of
    several ranks under `recover run` is its own world), else none (one rank)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group(backend="gloo")  # checkpoints alone use it
    return None


class Checkpointer:
    """Saves and restores a script's model, optimizer and extra state as ReCoVer checkpoints.

    - `directory`: where the `step_N` folders go;
    - `keep`: how many to keep (the newest);
    - `process_group`: the ranks that save one replica's state together; default: a new gloo group
      of the default group's ranks when there are several (create the Checkpointer on every rank:
      that is a collective), else none;
    - `fence`: optional `() -> bool`, asked on the first rank before a save and before it is
      published: False publishes nothing (an evicted incarnation);
    - `on_saved`: optional callback with a `SavedCheckpoint`, once a checkpoint is durable."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        process_group: Any = "default",
        fence: Callable[[], bool] | None = None,
        on_saved: Callable[[SavedCheckpoint], None] | None = None,
    ) -> None:
        group = _default_group() if process_group == "default" else process_group
        self.directory = Path(directory)
        self.group = group
        self._writer = CheckpointWriter(
            self.directory, keep=keep, on_saved=on_saved, fence=fence, process_group=group
        )

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        block: bool = False,
    ) -> Path | None:
        """Save the state as the checkpoint of `step` (the next step to run); every rank of the
        group calls it. Blocks for the staging copy of this rank's part; the rest runs in the
        background (`block`: wait for it). `meta`: JSON values kept in the checkpoint. Returns the
        folder (durable once `wait()` returns), or None when the fence refused."""
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        state = dcp_state(model, optimizer, extra=extra)
        return self._writer.save(step, state, dict(meta or {}), block=block)

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> int | None:
        """Load the newest valid checkpoint into `model`, `optimizer` and `extra`, whatever layout
        saved it; return its step (None, and nothing loaded, when there is none). Every rank of
        the group calls it. CheckpointError when every checkpoint is corrupt or one belongs to
        another model."""
        point = find_resume_point(self.directory)
        if point is None:
            return None
        for _path, why in point.skipped:
            log.warning(f"WARNING: {why}; skipping it and restoring the older {point.path}")
        _load(point, model, optimizer, extra, self.group)
        return point.step

    def wait(self) -> None:
        """Block until the save in flight is durable; CheckpointError if it failed."""
        self._writer.wait()

    def close(self) -> None:
        self._writer.close()


def _load(point: ResumePoint, model, optimizer, extra, group) -> None:
    if point.legacy_state is not None:
        raise CheckpointError(
            f"{point.path} is a checkpoint file of the older form, which only `recover train` "
            "resumes; read it with recover.checkpoint.load"
        )
    load_dcp_state(point.path, model, optimizer, extra=extra, process_group=group)


def save(
    directory: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    keep: int = 3,
    process_group: Any = "default",
) -> Path | None:
    """One synchronous save (`Checkpointer(...).save(..., block=True)`); returns the folder."""
    saver = Checkpointer(directory, keep=keep, process_group=process_group)
    try:
        return saver.save(step, model, optimizer, extra=extra, meta=meta, block=True)
    finally:
        saver.close()
