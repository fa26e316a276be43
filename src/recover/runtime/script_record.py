"""A script's step records: what `recover train` writes to `metrics.jsonl`, for any script.

Job: for a `Replica` (recover.runtime.api), keep the record of every committed step this replica
took part in (its committed loss, its M, the scalars the script gave with `replica.log`), and on
the replica that writes the records append them to the run's `metrics.jsonl`, once per step.
Then the run's tools (`recover compare`, `plot`, `status`, the TensorBoard and W&B mirrors) read a
`recover run` job as they read a `recover train` run.

When: the record of step t is written at the boundary after t, when the script's loop body of t
has returned (its `replica.log` calls are in), and before the report of step t+1, which is what
the coordinator relies on (docs/metrics.md, "A writer lost after its commit"): when the writer of
t is among t+1's survivors, everything before t+1 is recorded.

A writer lost after its commit: every replica keeps the records of its last `RECENT_KEPT` commits.
When the coordinator names this replica the writer of step t and says the records from step f < t
may be missing (`records_from`), it writes the records of f..t-1 that the file lacks, from what it
kept, in front of t's own. `due()` hands the same records to a script that keeps a log of its own
(`replica.committed_steps()`), so that log loses nothing either.

Fencing: the writer's `MetricsWriter` holds the client's fence; an evicted incarnation writes
nothing (and `writes()` says so before the script writes a log of its own).

The dashboards (`dashboards_for`): the TensorBoard and W&B mirrors of the same record, held by a
replica's first rank (recover.dashboards).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recover.record import MetricsWriter, read_metrics

if TYPE_CHECKING:
    from recover.dashboards import RecordMirror
    from recover.runtime.spec import ReplicaSpec

# Commits whose records every replica keeps (the gap a run of dead writers can leave).
RECENT_KEPT = 64

# Fields of a step record that the library owns; a script's scalars may not use these names.
OWN_FIELDS = frozenset(
    {"kind", "t_wall", "step", "loss", "microbatches", "replicas", "attempts", "epoch",
     "step_s", "wall_s", "writer", "skipped", "overlapped", "parts", "update_in_vote"}
)  # fmt: skip


class StepRecords:
    """The step records of one replica of a script (see the module docstring).

    `writer`: the run's metrics.jsonl (None: the launcher named no events file, nothing is
    written); `leads`: this rank writes for its replica (its first rank); `on_written`: called
    after records were appended (the dashboards' mirrors follow the file then)."""

    def __init__(
        self,
        writer: MetricsWriter | None,
        *,
        replica: int,
        leads: bool,
        on_written: Callable[[], None] = lambda: None,
    ) -> None:
        self.writer, self.replica, self.leads = writer, replica, leads
        self.on_written = on_written
        self.named = False  # the coordinator named this replica the writer of the last commit
        self._recent: dict[int, dict[str, Any]] = {}
        self._due: list[int] = []  # steps this rank writes at the next boundary
        self._t_start = self._t_last = time.perf_counter()
        self._t_wall_start = time.time()  # older records are another process's (a resumed run's)

    # ---- at the commit ---------------------------------------------------------------------------
    def committed(
        self,
        step: int,
        *,
        loss: float,
        microbatches: int,
        replicas: int,
        attempts: int,
        epoch: int,
        writer: bool,
        records_from: int,
        overlapped: float = 0.0,
        parts: Mapping[str, float] | None = None,
        ahead: tuple[int, ...] = (),
    ) -> None:
        """Step `step` committed with this mean loss; `writer`: this replica writes its records,
        and those from `records_from` on that the run folder lacks (a lost writer's)."""
        now = time.perf_counter()
        record = {
            "step": step,
            "loss": loss if math.isfinite(loss) else None,  # (null: skipped as non-finite)
            "microbatches": microbatches,
            "replicas": replicas,
            "attempts": attempts,
            "epoch": epoch,
            "overlapped": overlapped,
            # where this rank's time in the step went (the step machine's PARTS)
            "parts": {k: round(v, 6) for k, v in (parts or {}).items()},
            # ids of the step computed during the previous step's vote (attach(ahead=...))
            **({"ahead": list(ahead)} if ahead else {}),
            "step_s": round(now - self._t_last, 6),
            "wall_s": round(now - self._t_start, 6),
        }
        self._t_last = now
        self._recent[step] = record
        for old in [k for k in self._recent if k <= step - RECENT_KEPT]:
            del self._recent[old]
        self.named = writer
        self._due = [*self._missing(records_from, step), step] if writer else []

    def _missing(self, first: int, upto: int) -> list[int]:
        """Steps in first..upto-1 that this process kept and the run folder has no record of
        (written since this process started: an older record is another run's)."""
        if first >= upto or self.writer is None:
            return []
        kept = [s for s in range(first, upto) if s in self._recent]
        if not kept:
            return []
        seen = {
            int(r["step"])
            for r in read_metrics(self.writer.path)
            if r.get("kind") == "step" and r.get("t_wall", 0) >= self._t_wall_start
        }
        return [s for s in kept if s not in seen]

    # ---- in the script's loop body ---------------------------------------------------------------
    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Add the script's scalars to step `step`'s record (ValueError on a bad name or value)."""
        for name, value in scalars.items():
            if name in OWN_FIELDS:
                raise ValueError(
                    f"replica.log({name}=...): {name!r} is a field the library writes itself; "
                    "give the scalar another name"
                )
            if isinstance(value, bool) or not isinstance(value, Real | None):
                raise ValueError(
                    f"replica.log({name}={value!r}): a scalar is a number (or None), got "
                    f"{type(value).__name__}; pass float(tensor) for a tensor"
                )
        self._recent[step].update(
            {
                k: (None if v is None or not math.isfinite(v) else float(v))
                for k, v in scalars.items()
            }
        )

    def update_ran(self, step: int, seconds: float, *, during_vote: bool) -> None:
        """The update given to attach() ran for step `step`: its time is the step's "apply"
        part, and whether it ran while the vote completed is `update_in_vote`."""
        record = self._recent[step]
        record["parts"]["apply"] = round(seconds, 6)
        record["update_in_vote"] = during_vote

    def skipped(self, step: int, reason: str) -> None:
        self._recent[step]["skipped"] = reason

    def due(self) -> list[dict[str, Any]]:
        """Copies of the records this rank writes at the next boundary ([] on the other
        replicas): a lost writer's steps first, then the current one."""
        return [dict(self._recent[s]) for s in self._due] if self.writes() else []

    def writes(self) -> bool:
        """This rank writes the last commit's records: named by the coordinator, the replica's
        first rank, and not fenced (an evicted incarnation writes nothing)."""
        return self.named and self.leads and (self.writer is None or self.writer.allowed())

    # ---- at the boundary -------------------------------------------------------------------------
    def write_due(self, event: Callable[..., None]) -> int:
        """Append the due records (a lost writer's with a `records_filled` event); the count
        written."""
        due, self._due = self._due, []
        if not due or self.writer is None or not self.leads:
            return 0
        written = 0
        for step in due:
            if self.writer.step(**self._recent[step], writer=self.replica) is not None:
                written += 1
        filled = due[:-1]
        if filled and written:
            event("records_filled", replica=self.replica, steps=filled, eval=None, checkpoint=None)
        if written:
            self.on_written()
        return written

    def wall_s(self) -> float:
        return time.perf_counter() - self._t_start


def dashboards_for(
    spec: ReplicaSpec, metrics: Path, replica: int, config: Mapping[str, Any] | None
) -> list[RecordMirror]:
    """The mirrors of the record asked for (`--tensorboard`, `--wandb`), held by a replica's
    first rank; each follows only the steps its replica wrote (recover.dashboards)."""
    if not (spec.tensorboard or spec.wandb):
        return []
    from recover.dashboards import Backend, RecordMirror, TensorBoardBackend, WandbBackend

    backends: list[Backend] = []
    if spec.tensorboard:
        backends.append(TensorBoardBackend(Path(spec.tensorboard)))
    if spec.wandb:
        backends.append(WandbBackend(spec.wandb, metrics.parent, config=dict(config or {})))
    return [RecordMirror(metrics, replica=replica, backend=b) for b in backends]


__all__ = ["OWN_FIELDS", "RECENT_KEPT", "StepRecords", "dashboards_for"]
