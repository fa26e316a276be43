"""Dashboards: the run's record mirrored to TensorBoard (`--tensorboard DIR`) and W&B (`--wandb
PROJECT`).

Job: give dashboard users the run's scalars (train loss, val loss, lr, grad norm, tokens/s, step
time, achieved TFLOP/s and MFU, live replicas) and its events (failures, redos, recoveries, joins,
epochs: as cumulative-count scalars and one text entry each), from the run's own record.

How: `metrics.jsonl` stays the record; a `RecordMirror` only follows it. It is held by the replica
that writes step records (RunRecorder: the writer), and each time that replica has written a step
record it reads what the file gained since its last read. The file is cut into segments, each
ending at a step record; the segment of a step record is mirrored by the replica named in it as
its writer (the coordinator named it with the commit), so every record the file gains is
mirrored once, whoever wrote it (the coordinator, another replica, the launcher) and whichever
replica was the writer before. Records that were in the file when the mirror started (a resumed
run's history) are counted for the cumulative markers but not mirrored again. What the file
gains after the summary (the launcher's last events) is not mirrored. The mirror hands scalars
and texts to a backend: TensorBoard's event files, or a W&B run.

A backend whose sends can be lost with the writer (W&B: its client dies with the writer's node)
says through which step they were confirmed (`mirrored_through`); a replica that takes the pen
over mirrors again the others' segments after that step (it keeps the last `KEPT_SEGMENTS`): at
least once. A row that the old writer's client sends after all (it outlives a SIGKILLed writer)
is then there twice, same step, same value.

W&B: one W&B run per run folder, whatever the writer: its id is drawn once and kept in
`RUN/wandb_run_id`, so a later writer (after the writer died) and a `--resume` continue the same
W&B run (`resume="allow"`). The x axis of every series is the training step (`trainer/step`), so
a run resumed from a checkpoint may log a step again, as its record does. W&B's own files go to
`RUN/wandb/client-PID/` (a folder per writer's client), and the last step its client confirmed
to `RUN/wandb_mirrored`; `WANDB_MODE=offline` (W&B's own setting) keeps them there for `wandb
sync`. The W&B client imports slowly and starts
a service process: it runs in a process of its own, fed by a thread, so the training thread only
queues; `close()` waits (at most `WANDB_CLOSE_S`) for it to send what it was given and finish the
run. A W&B error is logged once and the mirror stops: the record itself is never at risk.

Costs: one read of the new bytes per step, on the writer only; TensorBoard's event files are
flushed per step. It must not change the record: it reads `metrics.jsonl` and writes only under
DIR (TensorBoard) or RUN/wandb, RUN/wandb_run_id and RUN/wandb_mirrored (W&B).

Size: the record's mirror and its two backends (TensorBoard, W&B with its client process),
which share the mirror's contract (segments, the pen, what was confirmed).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from recover.record import marker

log = logging.getLogger("recover.dashboards")

WANDB_CLOSE_S = 60.0  # how long close() waits for W&B to take what was queued and finish
KEPT_SEGMENTS = 1000  # others' segments kept by a mirror, to mirror again if it takes the pen over


def _needs(package: str, flag: str, extra: str) -> None:
    from importlib.util import find_spec  # (without importing torch: the launcher stays light)

    if find_spec(package) is None:
        raise ValueError(f"{flag} needs the {package} package: pip install 'recover[{extra}]'")


def check_tensorboard() -> None:
    """ValueError unless TensorBoard's writer can be imported (the optional extra)."""
    _needs("tensorboard", "--tensorboard", "tensorboard")


def check_wandb(project: str) -> None:
    """ValueError unless `project` names a W&B project (PROJECT or ENTITY/PROJECT) and the W&B
    client can be imported (the optional extra)."""
    _split_project(project)
    _needs("wandb", "--wandb", "wandb")


def _split_project(project: str) -> tuple[str | None, str]:
    parts = project.split("/")
    if len(parts) > 2 or not all(p.strip() for p in parts):
        raise ValueError(f"--wandb {project!r}: expected PROJECT or ENTITY/PROJECT")
    return (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])


# marker (recover.record.MARKERS) -> the tag of its cumulative count
EVENT_TAGS = {
    "failure": "events/failures",
    "redo": "events/redos",
    "recovery": "events/recoveries",  # steps committed after a failure (once, not per survivor)
    "join": "events/joins",
    "epoch": "events/epochs",
}

# step record field -> dashboard tag
STEP_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "step_s": "train/step_s",
    "tflop_per_s": "train/tflop_per_s",
    "mfu": "train/mfu",
    "replicas": "replicas/live",
    "attempts": "replicas/attempts",
}


class Backend(Protocol):
    def scalar(self, tag: str, value: float, step: int, t: float | None) -> None: ...
    def text(self, tag: str, text: str, step: int, t: float | None) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def mirrored_through(self) -> int | None: ...  # None: nothing sent is lost with its writer
    def pen_returned(self) -> None: ...  # others wrote since this replica last did


class RecordMirror:
    """Mirrors `metrics` (a metrics.jsonl) into `backend`, for the segments whose step record
    names `replica` as its writer (None: a one-replica run, whose every step record is its own)."""

    def __init__(self, metrics: Path, *, replica: int | None, backend: Backend) -> None:
        self.metrics, self.replica, self.backend = Path(metrics), replica, backend
        self._offset = 0
        self._start = metrics.stat().st_size if metrics.exists() else 0  # history before it
        self._segment: list[tuple[dict, dict]] = []  # (record, counts) since the last step record
        self._counts: Counter[str] = Counter()  # marker -> events so far (history included)
        self._last_step = 0
        self._others: list[list[tuple[dict, dict]]] = []  # others' segments since this one wrote
        self._recovered: set = set()  # steps whose recovery was counted (once, not per survivor)
        self._recoveries_sent: set = set()  # steps whose recovery count was sent

    def follow(self, *, final: bool = False) -> None:
        """Read what the file gained; mirror the segments this replica wrote the step record of
        (`final`: and the records after the last step record, up to the summary)."""
        for record, history in self._read_new():
            counted = marker(record)
            if counted == "recovery":  # every survivor records it: one recovery per step
                step = record.get("step")
                if step in self._recovered:
                    counted = None
                self._recovered.add(step)
            if counted is not None:
                self._counts[counted] += 1
            if history:
                continue
            self._segment.append((record, dict(self._counts)))
            if record.get("kind") == "step":
                mine = record.get("writer") == self.replica
                segment, self._segment = self._segment, []
                if not mine:
                    self._others = [*self._others[1 - KEPT_SEGMENTS :], segment]
                    continue
                if self._others:  # the pen came to this replica: what did its writer send?
                    self.backend.pen_returned()
                    through = self.backend.mirrored_through()
                    if through is not None:
                        for other in self._others:
                            if int(other[-1][0]["step"]) > through:
                                self._mirror(other)
                    self._others = []
                self._mirror(segment)
        if final and self._segment:
            segment, self._segment = self._segment, []
            self._mirror(segment)
        self.backend.flush()

    def close(self) -> None:
        self.backend.close()

    # ---- internals -----------------------------------------------------------------------------
    def _read_new(self):
        """(record, before the mirror started) for each whole line the file gained."""
        if not self.metrics.exists():
            return
        with open(self.metrics, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        position = self._offset
        for line in data[:end].split(b"\n")[:-1]:
            history = position < self._start
            position += len(line) + 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            yield record, history
        self._offset += end

    def _mirror(self, segment: list[tuple[dict, dict]]) -> None:
        out = self.backend
        # Events without a step of their own happened while the segment's step was in flight.
        steps = [int(r["step"]) for r, _ in segment if r.get("kind") == "step"]
        in_flight = steps[0] if steps else self._last_step
        for record, counts in segment:
            kind, t = record.get("kind"), record.get("t_wall")
            if kind == "step":
                step = self._last_step = int(record["step"])
                for field, tag in STEP_SCALARS.items():
                    if isinstance(record.get(field), int | float):
                        out.scalar(tag, record[field], step, t)
                if record.get("step_s") and isinstance(record.get("tokens"), int | float):
                    out.scalar("train/tokens_per_s", record["tokens"] / record["step_s"], step, t)
            elif kind == "eval":
                out.scalar("val/loss", record["val_loss"], int(record["step"]), t)
            elif kind == "summary":
                out.text("summary", _describe(record), self._last_step, t)
            elif kind == "event":
                step = record.get("step")
                step = step if isinstance(step, int) else in_flight
                name = marker(record)
                if name == "recovery":  # one point per recovered step, whoever recorded it
                    if record.get("step") in self._recoveries_sent:
                        name = None
                    self._recoveries_sent.add(record.get("step"))
                if name is not None:
                    out.scalar(EVENT_TAGS[name], counts.get(name, 0), step, t)
                    if name == "epoch" and isinstance(record.get("epoch"), int):
                        out.scalar("replicas/epoch", record["epoch"], step, t)
                out.text("events", f"**{record['name']}** {_describe(record)}", step, t)


def _describe(record: dict) -> str:
    """A record's fields as `key=value` text (its kind, name and time left out)."""
    skip = ("kind", "name", "t_wall", "local_values", "model_values")
    return ", ".join(f"{k}={v}" for k, v in record.items() if k not in skip)


class TensorBoardBackend:
    """Event files under `logdir`, opened on the first thing written (a replica that never
    writes step records leaves no event file).

    TensorBoard reads a folder's event files in the order of their names (the second each was
    opened, then host and pid), and draws a series in the order it reads it. So that this order is
    the order of the steps whoever wrote them: a writer that gets the pen back after others wrote
    starts a new file instead of appending to its old one (which sorts before theirs), and a file
    is opened only once its name sorts after every event file already in the folder (when the
    last one was opened in this very second, by a process whose host or pid sorts after this
    one's, that is a wait of under a second, at a change of writer only)."""

    def __init__(self, logdir: Path) -> None:
        check_tensorboard()
        self.logdir = Path(logdir)
        self._tb = None

    def _writer(self):
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            _wait_to_sort_last(self.logdir)
            self._tb = SummaryWriter(log_dir=str(self.logdir))
        return self._tb

    def scalar(self, tag: str, value: float, step: int, t: float | None) -> None:
        self._writer().add_scalar(tag, value, step, walltime=t)

    def text(self, tag: str, text: str, step: int, t: float | None) -> None:
        self._writer().add_text(tag, text, step, walltime=t)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def mirrored_through(self) -> int | None:
        return None  # each writer's own event files, flushed per step

    def pen_returned(self) -> None:
        self.close()  # the next scalar opens a new file, named to sort after the others'


_EVENT_FILES = "events.out.tfevents.*"
_CLOCK_SKEW_S = 2.0  # longest wait for this host's clock to pass the newest file's second


def _wait_to_sort_last(logdir: Path) -> None:
    """Wait until an event file opened now is named after every one in `logdir`: its second
    (the name's first field after the prefix) later than theirs."""
    newest = -1
    for path in Path(logdir).glob(_EVENT_FILES):
        stamp = path.name.split(".")[3]
        if stamp.isdigit():
            newest = max(newest, int(stamp))
    deadline = time.monotonic() + _CLOCK_SKEW_S
    while int(time.time()) <= newest:
        if time.monotonic() >= deadline:
            log.warning(
                "TensorBoard: an event file in %s is named after this host's clock (another "
                "host's clock is ahead): its series may be drawn out of step order", logdir,
            )  # fmt: skip
            return
        time.sleep(max(0.001, newest + 1 - time.time()))


def wandb_run_id(run: Path) -> str:
    """The W&B run id of run folder `run`: drawn by the first writer, kept in RUN/wandb_run_id
    (created exclusively, so two writers cannot draw two ids)."""
    path = Path(run) / "wandb_run_id"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(uuid.uuid4().hex[:16] + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path.read_text().strip()


_STEP_AXIS = "trainer/step"
_CLOSE = object()


class WandbBackend:
    """A W&B run for run folder `run` (project PROJECT or ENTITY/PROJECT), fed to a W&B client in
    a process of its own (`python -m recover.dashboards`: W&B's imports, threads and
    service never take the training process's CPU or interpreter lock, and a writer SIGKILLed
    mid-run leaves it to send what it was given: it stops at the end of its input). Scalars of
    one step are logged together; event texts go to an `events` table logged when the mirror
    closes, the summary to the run's summary. The training thread only queues: a thread of this
    backend writes to the client's input."""

    def __init__(self, project: str, run: Path, *, config: dict[str, Any]) -> None:
        check_wandb(project)
        entity, name = _split_project(project)
        self.run_dir = Path(run)
        self._start_line = {"project": name, "entity": entity, "run": str(self.run_dir),
                            "config": config}  # fmt: skip
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, dict[str, float]] = {}  # step -> its scalars, until flushed
        self._failed = threading.Event()
        self._thread: threading.Thread | None = None  # started on the first thing written
        self._client: subprocess.Popen | None = None

    def scalar(self, tag: str, value: float, step: int, t: float | None) -> None:
        self._pending.setdefault(step, {})[tag] = value

    def text(self, tag: str, text: str, step: int, t: float | None) -> None:
        self._send({"text": tag, "step": step, "value": text})

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for step in sorted(pending):
            self._send({"log": pending[step], "step": step})

    def close(self) -> None:
        self.flush()
        if self._thread is None:
            return
        self._queue.put(_CLOSE)
        self._thread.join(WANDB_CLOSE_S)
        client, self._thread = self._client, None
        if client is None:
            return
        try:
            client.wait(max(1.0, WANDB_CLOSE_S))
        except subprocess.TimeoutExpired:
            log.warning(
                "W&B did not finish within %.0f s; stopped: what it has not sent stays in %s",
                WANDB_CLOSE_S, self.run_dir / "wandb",
            )  # fmt: skip
            client.kill()
            client.wait()

    def pen_returned(self) -> None:
        pass  # one W&B run, whichever writer: its rows carry their step

    def mirrored_through(self) -> int | None:
        """The last step whose rows a writer of this run folder handed to W&B (-1: none)."""
        try:
            return int((self.run_dir / "wandb_mirrored").read_text())
        except (OSError, ValueError):
            return -1

    def _send(self, line: dict) -> None:
        if self._failed.is_set():
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._pipe, name="recover-wandb", daemon=True)
            self._thread.start()
        self._queue.put(line)

    def _pipe(self) -> None:
        """Start the client and write every queued line to it, until close."""
        try:
            self._client = subprocess.Popen(
                [sys.executable, "-m", "recover.dashboards"],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            self._client.stdin.write(json.dumps(self._start_line) + "\n")
            while (line := self._queue.get()) is not _CLOSE:
                self._client.stdin.write(json.dumps(line) + "\n")
                self._client.stdin.flush()
        except (OSError, ValueError) as e:  # the client is gone; the record is unaffected
            self._failed.set()
            log.warning("W&B mirror stopped (metrics.jsonl is unaffected): %s", e)
        finally:
            if self._client is not None:
                try:
                    self._client.stdin.close()
                except OSError:
                    pass


def _feed_wandb(lines) -> int:
    """The W&B client process: a start line, then one line per log/text, until end of input."""
    import wandb

    start = json.loads(next(lines))
    run_dir = Path(start["run"])
    # A folder per client: W&B names its offline folder by the second and the run id, so two
    # writers' clients started in the same second would share one file.
    files = run_dir / "wandb" / f"client-{os.getpid()}"
    files.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=start["project"],
        entity=start["entity"],
        id=wandb_run_id(run_dir),
        resume="allow",
        name=run_dir.name,
        dir=str(files),
        config=start["config"],
        settings=wandb.Settings(
            console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False
        ),
    )
    run.define_metric(_STEP_AXIS)
    run.define_metric("*", step_metric=_STEP_AXIS)
    events, last = [], -1
    try:
        for raw in lines:
            line = json.loads(raw)
            if "log" in line:
                run.log({_STEP_AXIS: line["step"], **line["log"]})
                if line["step"] > last:  # handed on: a later writer need not send it again
                    last = line["step"]
                    tmp = run_dir / f"wandb_mirrored.tmp{os.getpid()}"
                    tmp.write_text(f"{last}\n")
                    os.replace(tmp, run_dir / "wandb_mirrored")
            elif line["text"] == "summary":
                run.summary["summary"] = line["value"]
            else:
                events.append([line["step"], line["value"]])
        if events:
            table = wandb.Table(columns=["step", "event"], data=events)
            run.log({_STEP_AXIS: max(last, 0), "events": table})
    finally:
        run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(_feed_wandb(iter(sys.stdin)))
