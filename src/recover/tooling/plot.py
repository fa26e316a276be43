"""`recover plot RUN [RUN...]`: a run's record as PNGs, several runs overlaid.

Job: read each run folder's `metrics.jsonl` (docs/metrics.md) into the series a person looks at
first, and draw them: loss against step (runs overlaid: a faulty run over its reference),
committed tokens against wall time, step time with the failures, redos and joins marked, and live
replicas over time. `run_series` is pure (records in, numbers out) and `plot_runs` returns the
series it drew, so tests check the numbers, not only that a file exists. `recover bench compare`'s
report draws its loss and tokens plots with the same functions.

Time is seconds since the run's start (the launcher's `launcher.started`, else the first record
minus its step time). An event is marked at its own `step`, else at the step in flight when it was
written: the first step whose record came after it. matplotlib is optional (the `plot` extra) and imported only
when drawing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.record import committed_steps, marker, read_metrics
from recover.training.config import RunPaths

# Markers drawn on the step-time plot: marker -> (colour, line style).
STEP_MARKS = {"failure": ("tab:red", "-"), "redo": ("tab:orange", "--"), "join": ("tab:green", ":")}


def events_named(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("kind") == "event" and r.get("name") == name]


def wall_span(records: list[dict]) -> tuple[float, float]:
    """(start, end) of the run in Unix seconds: the launcher's events, else the records' span."""
    started = [float(r["t_wall"]) for r in events_named(records, "launcher.started")]
    finished = [float(r["t_wall"]) for r in events_named(records, "launcher.finished")]
    if started and finished:
        return min(started), max(finished)
    stamps = [float(r["t_wall"]) for r in records if "t_wall" in r]
    if not stamps:
        raise ValueError("metrics.jsonl holds no record with t_wall")
    return (min(started) if started else min(stamps)), (max(finished) if finished else max(stamps))


@dataclass
class RunSeries:
    """What the plots draw of one run (times in seconds since its start)."""

    loss: list[tuple[int, float]] = field(default_factory=list)  # (step, committed loss)
    val_loss: list[tuple[int, float]] = field(default_factory=list)  # (step, val loss)
    progress: list[tuple[float, float]] = field(default_factory=list)  # (t, work of 0..step)
    # The work `progress` counts: tokens, or microbatches for a script that logs no `tokens`.
    unit: str = "tokens"
    step_s: list[tuple[int, float]] = field(default_factory=list)  # (step, seconds)
    marks: dict[str, list[int]] = field(default_factory=dict)  # marker -> steps in flight
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (t, live replicas) steps
    failure_steps: list[int] = field(default_factory=list)  # steps of injected failures


def run_series(run: Path) -> RunSeries:
    """The series of one run folder (see RunSeries)."""
    metrics = RunPaths(out=Path(run)).metrics
    if not metrics.exists():
        raise FileNotFoundError(f"{run} has no metrics.jsonl: not a run folder")
    return series_of(list(read_metrics(metrics)), committed_steps(metrics))


def series_of(records: list[dict], committed: dict[int, dict]) -> RunSeries:
    """The series of a run's records (pure; `committed`: step -> its last step record)."""
    start, end = wall_span(records)
    if not events_named(records, "launcher.started"):  # a one-replica run: its first step
        first = min((r for r in records if "t_wall" in r), key=lambda r: r["t_wall"])
        start -= float(first.get("step_s") or 0.0)  # started a step time before its record
    s = RunSeries()
    s.unit = work_unit(committed.values())
    cumulative, total = {}, 0.0
    for step in sorted(committed):
        record = committed[step]
        total += float(record[s.unit])
        cumulative[step] = total
        if record.get("loss") is not None:
            s.loss.append((step, float(record["loss"])))
        s.step_s.append((step, float(record["step_s"])))
    # Progress when a step record was written: the tokens of steps 0..step. After a restart
    # from a checkpoint the curve falls back: the work that was lost.
    written = sorted(
        (float(r["t_wall"]), int(r["step"])) for r in records if r.get("kind") == "step"
    )
    progress = [(t - start, cumulative[step]) for t, step in written]
    s.progress = [(0.0, 0.0), *progress, (end - start, progress[-1][1] if progress else 0.0)]
    evals = {int(r["step"]): float(r["val_loss"]) for r in records if r.get("kind") == "eval"}
    s.val_loss = sorted(evals.items())
    for r in records:
        name = marker(r)
        if name in STEP_MARKS:
            step = r.get("step")
            if not isinstance(step, int):  # the step in flight: the first recorded after it
                later = [k for t, k in written if t >= float(r["t_wall"])]
                step = later[0] if later else max(committed, default=0)
            s.marks.setdefault(name, []).append(step)
    injected = events_named(records, "failure_injected")
    s.failure_steps = sorted({int(f["step"]) for f in injected if f.get("step") is not None})
    s.replicas = _live_replicas(records, start, end)
    return s


def work_unit(step_records) -> str:
    """What a run's step records count its work in: `tokens` (the built-in trainer's records,
    and a script's that logs them), else `microbatches` (every step record has them)."""
    return "tokens" if all("tokens" in r for r in step_records) else "microbatches"


def _live_replicas(records: list[dict], start: float, end: float) -> list[tuple[float, int]]:
    """(t, live replicas) at every change: the coordinator's views, else the step records'
    `replicas` (1 for a one-replica run)."""
    views = [
        (float(r["t_wall"]) - start, len(r["live"]))
        for r in events_named(records, "coordinator.epoch_changed")
        if isinstance(r.get("live"), list)
    ]
    if not views:  # a one-replica run: live from its start
        steps = [r for r in records if r.get("kind") == "step"]
        views = [(0.0, int(r.get("replicas", 1))) for r in steps][:1]
    changes = [(0.0, 0)]
    for t, live in sorted(views):
        if live != changes[-1][1]:
            changes.append((t, live))
    if len(changes) > 1 and changes[1][0] == 0.0:
        changes.pop(0)
    return [*changes, (end - start, changes[-1][1])]


def _labels(runs: list[Path]) -> list[str]:
    """The runs' folder names, or their paths when two share a name."""
    names = [Path(r).name for r in runs]
    return names if len(set(names)) == len(names) else [str(r) for r in runs]


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure  # optional dependency: the `plot` extra

    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig, ax


def draw_loss(series: dict[str, RunSeries], path: Path) -> Path:
    """Committed loss against step, one line per run; dashed: the steps of injected failures."""
    fig, ax = _figure("loss against step (dashed: failures injected)", "step", "loss (nats)")
    for i, (name, s) in enumerate(series.items()):
        color = f"C{i % 10}"
        if s.loss:
            ax.plot(*zip(*s.loss, strict=True), color=color, label=name, linewidth=1.2)
        for k, step in enumerate(s.failure_steps):
            ax.axvline(step, color=color, linestyle="--", alpha=0.6,
                       label=f"{name}: failure" if k == 0 else None)  # fmt: skip
    return _save(fig, ax, path)


def draw_step_time(series: dict[str, RunSeries], path: Path) -> Path:
    """Seconds per committed step, with the steps in flight at failures, redos and joins."""
    fig, ax = _figure("step time (failures, redos and joins marked)", "step",
                      "seconds since the previous commit")  # fmt: skip
    for i, (name, s) in enumerate(series.items()):
        if s.step_s:
            ax.plot(*zip(*s.step_s, strict=True), color=f"C{i % 10}", marker=".", label=name)
        for what, steps in s.marks.items():
            color, style = STEP_MARKS[what]
            for k, step in enumerate(steps):
                label = f"{name}: {what}" if k == 0 else None
                ax.axvline(step, color=color, linestyle=style, alpha=0.7, label=label)
    return _save(fig, ax, path)


def _draw_over_time(series: dict[str, RunSeries], path: Path, what: str, title: str, ylabel: str):
    """A step curve per run of its series `what`: (seconds since its start, value) changes."""
    fig, ax = _figure(title, "seconds since the run's start", ylabel)
    for i, (name, s) in enumerate(series.items()):
        if getattr(s, what):
            times, values = zip(*getattr(s, what), strict=True)
            ax.step(times, values, where="post", color=f"C{i % 10}", label=name, linewidth=1.2)
    if what == "replicas":
        ax.yaxis.get_major_locator().set_params(integer=True)
    return _save(fig, ax, path)


def draw_tokens(series: dict[str, RunSeries], path: Path) -> Path:
    """Committed tokens (steps 0..t) against seconds since each run's start (microbatches when
    a run's records have no tokens: a script that does not log them)."""
    units = {s.unit for s in series.values()} or {"tokens"}
    if len(units) > 1:
        raise ValueError(
            "the runs count their work differently (tokens, microbatches): give the script's "
            "step records tokens (replica.log(tokens=...)) to plot them together"
        )
    unit = units.pop()
    return _draw_over_time(series, path, "progress", f"committed {unit} against wall time",
                           f"committed {unit} (steps 0..t)")  # fmt: skip


def draw_replicas(series: dict[str, RunSeries], path: Path) -> Path:
    """Live replicas (the coordinator's views) against seconds since each run's start."""
    return _draw_over_time(series, path, "replicas", "live replicas over time", "live replicas")


def _save(fig, ax, path: Path) -> Path:
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


PLOTS = {
    "loss_vs_step.png": draw_loss,
    "tokens_vs_time.png": draw_tokens,
    "step_time.png": draw_step_time,
    "replicas_vs_time.png": draw_replicas,
}


def plot_runs(runs: list[Path], out: Path) -> dict[str, Any]:
    """Draw every plot of PLOTS for `runs` into `out`; return {"files": [paths], "series":
    {label: RunSeries}} (what was drawn). ImportError when matplotlib is missing."""
    import matplotlib  # noqa: F401  (fail before writing anything)

    series = dict(zip(_labels(runs), (run_series(r) for r in runs), strict=True))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [draw(series, out / name) for name, draw in PLOTS.items()]
    return {"files": files, "series": series}


def run_plot(args) -> int:
    """`recover plot`: the CLI's handler."""
    import sys

    out = args.out or Path(args.runs[0]) / "plots"
    try:
        done = plot_runs([Path(r) for r in args.runs], out)
    except ImportError as e:
        print(f"error: recover plot needs matplotlib ({e}): pip install 'recover[plot]'",
              file=sys.stderr)  # fmt: skip
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in done["files"]:
        print(f"wrote {path}")
    return 0
