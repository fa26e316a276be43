"""The run's record: the JSONL stream `metrics.jsonl` that every part of a run appends to.

Job: append one JSON object per line (the schema in docs/metrics.md is the contract for every
later tool) and read it back. Replicas (steps, evals, checkpoints, the library's events), the
launcher and the tools share this one module; the terminal lines are `recover.training.console`.

Invariants: every record is written as one whole line in one `write` on a file opened in append
mode, so several writers (the coordinator and the writer replica) never interleave
within a line. Records are never rewritten; a reader takes the last record of a step when a step
appears twice (a resumed run re-commits the steps after its checkpoint).

Fencing: a writer may hold a `fence` (a callable: may this process write now?). An evicted
incarnation's fence is closed, and every record it would write from then on is dropped, from any
thread (the training thread, the checkpoint thread, the stall guard): it writes nothing to the
run folder after its eviction (docs/design.md, "Fencing").
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class RecordUnwritable(OSError):
    """The run's record (or another file of the run folder) could not be written: the disk is
    full, the folder read-only. The run stops (exits.STORAGE) instead of going on with a record
    that silently lacks what was committed; the message names the path and the reason."""

    def __str__(self) -> str:  # the message alone: it names the path and the reason already
        return str(self.strerror)


def unwritable(path: Path | str, error: OSError) -> RecordUnwritable:
    """`error` (an OSError writing `path`) as a RecordUnwritable, its errno kept."""
    return RecordUnwritable(error.errno, f"cannot write {path}: {error.strerror or error}")


class MetricsWriter:
    """Appends records to a metrics.jsonl file; each record is one line, one write."""

    def __init__(self, path: Path, *, fence: Callable[[], bool] | None = None) -> None:
        self.path = path
        self.fence = fence  # None: never fenced (a one-replica run, the launcher, the tools)
        self.dropped = 0  # records not written because the fence was closed
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_APPEND: every write lands at the current end, atomically for one short line.
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise unwritable(path, e) from e
        # Records come from the training thread and the checkpoint thread (checkpoint_saved); the
        # lock keeps a write from racing close() onto a descriptor number reused by another file.
        self._lock = threading.Lock()

    def allowed(self) -> bool:
        """Whether this process may write to the run folder now (its fence is open)."""
        return self.fence is None or self.fence()

    def write(self, kind: str, **fields: Any) -> dict | None:
        """Append one record; None (nothing written) when the fence is closed."""
        if not self.allowed():  # checked outside the lock: it may wait for a confirmation
            self.dropped += 1
            return None
        record = {"kind": kind, "t_wall": round(time.time(), 6), **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"{self.path}: the metrics writer is closed")
            try:
                written = os.write(self._fd, line)
            except OSError as e:
                raise unwritable(self.path, e) from e
            if written != len(line):  # a full disk took part of the line: the rest is lost
                raise unwritable(self.path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return record

    def step(self, **fields: Any) -> dict | None:
        return self.write("step", **fields)

    def eval(self, **fields: Any) -> dict | None:
        return self.write("eval", **fields)

    def event(self, name: str, **fields: Any) -> dict | None:
        return self.write("event", name=name, **fields)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_metrics(path: Path) -> Iterator[dict]:
    """Records of a metrics.jsonl file; a torn last line (a writer killed mid-line) is skipped."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def committed_steps(path: Path) -> dict[int, dict]:
    """step -> the last `step` record of that step (a resumed run may have committed it twice)."""
    steps: dict[int, dict] = {}
    for record in read_metrics(path):
        if record.get("kind") == "step":
            steps[int(record["step"])] = record
    return steps


# Events that mark the moments of a run worth seeing on a plot or a dashboard: name -> the marker.
MARKERS = {
    "coordinator.member_dead": "failure",  # a replica declared dead (once per failure)
    "coordinator.redo": "redo",  # a step redone in a new epoch
    "recovered": "recovery",  # a replica saw its step commit after a fault
    "replica_joining": "join",  # a replica admitted into the running job
    "coordinator.epoch_changed": "epoch",  # a new view
}


def marker(record: dict) -> str | None:
    """The marker of an event record (MARKERS), or None for any other record."""
    return MARKERS.get(record.get("name", "")) if record.get("kind") == "event" else None
