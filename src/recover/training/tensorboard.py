"""The TensorBoard sink (`--tensorboard DIR`): the run's record, mirrored as event files.

Job: give TensorBoard users the run's scalars (train loss, val loss, lr, grad norm, tokens/s,
step time, achieved TFLOP/s and MFU, live replicas) and its events (failures, redos, recoveries,
joins, epochs: as cumulative-count scalars and one text entry each), from the run's own record.

How: `metrics.jsonl` stays the record; the sink only follows it. It is held by the replica that
writes step records (RunRecorder: the writer), and each time that replica has written a step
record it reads what the file gained since its last read. The file is cut into segments, each
ending at a step record; the segment of a step record is mirrored by the replica named in it as
its writer (the coordinator named it with the commit), so every record the file gains is
mirrored once, whoever wrote it (the coordinator, another replica, the launcher) and whichever
replica was the writer before. Records that were in the file when the sink started (a resumed run's history)
are counted for the cumulative markers but not mirrored again. What the file gains after the
summary (the launcher's last events) is not mirrored.

Costs: one read of the new bytes per step, on the writer only; event files are flushed per step.
It must not change the record: it reads `metrics.jsonl` and writes only under DIR.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from recover.record import marker


def check_tensorboard() -> None:
    """ValueError unless TensorBoard's writer can be imported (the optional extra)."""
    from importlib.util import find_spec  # (without importing torch: the launcher stays light)

    if find_spec("tensorboard") is None:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install 'recover[tensorboard]'"
        )


# step record field -> TensorBoard tag
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


class TensorBoardSink:
    """Mirrors `metrics` (a metrics.jsonl) into TensorBoard event files under `logdir`, for the
    segments whose step record names `replica` as its writer (None: a one-replica run, whose
    every step record is its own)."""

    def __init__(self, logdir: Path, metrics: Path, *, replica: int | None) -> None:
        check_tensorboard()
        self.logdir, self.metrics, self.replica = Path(logdir), Path(metrics), replica
        self._offset = 0
        self._start = metrics.stat().st_size if metrics.exists() else 0  # history before it
        self._segment: list[tuple[dict, dict]] = []  # (record, counts) since the last step record
        self._counts: Counter[str] = Counter()  # marker -> events so far (history included)
        self._last_step = 0
        self._tb = None  # opened on the first record mirrored: a replica that never writes
        # step records leaves no event file

    def follow(self, *, final: bool = False) -> None:
        """Read what the file gained; mirror the segments this replica wrote the step record of
        (`final`: and the records after the last step record, up to the summary)."""
        for record, history in self._read_new():
            counted = marker(record)
            if counted is not None:
                self._counts[counted] += 1
            if history:
                continue
            self._segment.append((record, dict(self._counts)))
            if record.get("kind") == "step":
                mine = record.get("writer") == self.replica
                segment, self._segment = self._segment, []
                if mine:
                    self._mirror(segment)
        if final and self._segment:
            segment, self._segment = self._segment, []
            self._mirror(segment)
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    # ---- internals -----------------------------------------------------------------------------
    def _read_new(self):
        """(record, before the sink started) for each whole line the file gained."""
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

    def _writer(self):
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.logdir))
        return self._tb

    def _mirror(self, segment: list[tuple[dict, dict]]) -> None:
        tb = self._writer()
        # Events without a step of their own happened while the segment's step was in flight.
        steps = [int(r["step"]) for r, _ in segment if r.get("kind") == "step"]
        in_flight = steps[0] if steps else self._last_step
        for record, counts in segment:
            kind, t = record.get("kind"), record.get("t_wall")
            if kind == "step":
                step = self._last_step = int(record["step"])
                for field, tag in STEP_SCALARS.items():
                    if isinstance(record.get(field), int | float):
                        tb.add_scalar(tag, record[field], step, walltime=t)
                if record.get("step_s"):
                    tokens_per_s = record["tokens"] / record["step_s"]
                    tb.add_scalar("train/tokens_per_s", tokens_per_s, step, walltime=t)
            elif kind == "eval":
                tb.add_scalar("val/loss", record["val_loss"], int(record["step"]), walltime=t)
            elif kind == "summary":
                tb.add_text("summary", _describe(record), self._last_step, walltime=t)
            elif kind == "event":
                step = record.get("step")
                step = step if isinstance(step, int) else in_flight
                name = marker(record)
                if name is not None:
                    tb.add_scalar(f"events/{name}s", counts.get(name, 0), step, walltime=t)
                    if name == "epoch" and isinstance(record.get("epoch"), int):
                        tb.add_scalar("replicas/epoch", record["epoch"], step, walltime=t)
                tb.add_text("events", f"**{record['name']}** {_describe(record)}", step, walltime=t)


def _describe(record: dict) -> str:
    """A record's fields as `key=value` text (its kind, name and time left out)."""
    skip = ("kind", "name", "t_wall", "local_values", "model_values")
    return ", ".join(f"{k}={v}" for k, v in record.items() if k not in skip)
