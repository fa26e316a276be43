"""The side-by-side comparison of modes: run folders in, one table (JSON, Markdown, PNG plots) out.

Job: for each run folder (config.json + metrics.jsonl + final/model.safetensors, schema in
docs/metrics.md) compute the columns of `recover bench compare` from the records alone, and write
them as `compare.json`, `compare.md` and two plots. Method, per column (docs/baselines.md says
the same for readers of the report):

- wall time: `t_wall` of the `launcher.finished` event minus that of the `launcher.started` event
  (the first started, the last finished); without them, the last record's `t_wall` minus the
  first's. Start-up, restarts and shutdown are all inside it: that is what a user pays.
- committed tokens per second (effective throughput): the tokens of the committed steps, each step
  once (the last record of a step wins, `recover.record.committed_steps`), over the wall time;
  and its ratio to the reference (failure-free) run.
- tokens per second per live replica (the paper's normalisation): the effective throughput over
  the time-weighted mean of `replicas` of all step records (weights: each record's `step_s`; a
  record without `replicas` counts one replica). Re-committed steps count: replicas were live then.
- median seconds from a failure to the next commit: for each `failure_injected` event, the first
  step record with a later `t_wall`; failures never followed by a commit are counted apart.
- steps lost or redone: (step records - distinct committed steps), the steps committed again after
  a restart, plus the `coordinator.redo` events, the steps redone in-step.
- global batch after failures: `microbatches` of the last committed step, and the minimum over the
  committed steps at or after the step of the first failure.
- loss deviation and final parameter distance: `recover.tooling.compare.compare_runs(reference, run)`.
- settings: not computed here; the caller puts each run's settings in its row (`recover bench
  compare`: a mode's own flags, the torchft runs' lighthouse and manager settings).

Invariants: nothing here is a constant of a mode; every number comes from the run's own records.
Pure apart from reading the run folders and writing the report files.

Limits: events with no `step` field are placed by `t_wall` only; clocks of different writers are
assumed to agree (all writers share one host in `recover train`).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from recover.record import committed_steps, read_metrics
from recover.tooling.compare import compare_runs
from recover.tooling.plot import draw_loss, draw_tokens, events_named, run_series, wall_span
from recover.training.config import RunPaths

__all__ = [
    "COLUMNS",
    "summarize_run",
    "build_table",
    "format_markdown",
    "write_report",
]

# (row key, Markdown header, format) for the Markdown table; compare.json carries every key.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("name", "run", "{}"),
    ("mode", "mode", "{}"),
    ("settings", "settings", "{}"),  # set by the caller (recover bench compare); "-" without
    ("tokens_per_s", "committed tok/s (effective)", "{:.1f}"),
    ("tokens_per_s_ratio", "vs failure-free", "{:.3f}x"),
    ("tokens_per_s_per_replica", "tok/s per live replica (paper's normalisation)", "{:.1f}"),
    ("mean_live_replicas", "mean live replicas", "{:.2f}"),
    ("failures", "failures", "{}"),
    ("median_failure_to_commit_s", "median s failure -> next commit", "{:.2f}"),
    ("steps_lost_or_redone", "steps lost or redone", "{}"),
    ("microbatches_last", "microbatches, last step", "{}"),
    ("microbatches_min_after_failure", "microbatches, min after 1st failure", "{}"),
    ("loss_max_rel_dev", "max rel loss deviation", "{:.2e}"),
    ("param_rel_l2", "final param rel L2", "{:.2e}"),
)


def _run_mode(run: Path) -> str:
    config_path = RunPaths(out=run).config
    if not config_path.exists():
        return "recover"
    config = json.loads(config_path.read_text())
    return str(config.get("launch", {}).get("mode") or "recover")


def _configured_microbatches(run: Path) -> int | None:
    config_path = RunPaths(out=run).config
    if not config_path.exists():
        return None
    value = json.loads(config_path.read_text()).get("train", {}).get("microbatches")
    return int(value) if value is not None else None


def _throughput(run: Path) -> tuple[float, float, float]:
    """(committed tokens, wall seconds, committed tokens per second) of a run folder."""
    metrics = RunPaths(out=run).metrics
    records = list(read_metrics(metrics))
    start, end = wall_span(records)
    tokens = float(sum(float(s.get("tokens", 0)) for s in committed_steps(metrics).values()))
    wall = end - start
    return tokens, wall, (tokens / wall if wall > 0 else math.nan)


def _mean_live_replicas(step_records: list[dict]) -> float:
    """Time-weighted mean of `replicas` over the step records (weights: `step_s`)."""
    if not step_records:
        return math.nan
    replicas = [float(r.get("replicas", 1)) for r in step_records]
    weights = [max(0.0, float(r.get("step_s", 0.0))) for r in step_records]
    total = sum(weights)
    if total <= 0:  # no timings: every record weighs the same
        return sum(replicas) / len(replicas)
    return sum(n * w for n, w in zip(replicas, weights, strict=True)) / total


def _failure_to_commit(failures: list[dict], step_records: list[dict]) -> tuple[list[float], int]:
    """Seconds from each failure to the first step record after it, and how many had none."""
    commit_times = sorted(float(r["t_wall"]) for r in step_records)
    delays, without = [], 0
    for failure in failures:
        t_fail = float(failure["t_wall"])
        later = [t for t in commit_times if t > t_fail]
        if later:
            delays.append(later[0] - t_fail)
        else:
            without += 1
    return delays, without


def _first_failure_step(failures: list[dict], step_records: list[dict]) -> int | None:
    """The step of the first failure: its `step` field, else the step committed next after it."""
    if not failures:
        return None
    first = min(failures, key=lambda r: float(r["t_wall"]))
    if first.get("step") is not None:
        return int(first["step"])
    later = [r for r in step_records if float(r["t_wall"]) > float(first["t_wall"])]
    return int(min(later, key=lambda r: float(r["t_wall"]))["step"]) if later else None


def summarize_run(run: Path, *, reference: Path | None) -> dict[str, Any]:
    """Every column of the comparison for one run folder, computed from its records.

    `reference` is the failure-free run to compare against (loss, parameters, throughput ratio);
    with None those columns are None. Raises FileNotFoundError when metrics.jsonl is missing.
    """
    run = Path(run)
    metrics = RunPaths(out=run).metrics
    if not metrics.exists():
        raise FileNotFoundError(f"{run}: no metrics.jsonl; is it a run folder?")
    records = list(read_metrics(metrics))
    step_records = [r for r in records if r.get("kind") == "step"]
    committed = committed_steps(metrics)
    tokens, wall, tokens_per_s = _throughput(run)
    mean_live = _mean_live_replicas(step_records)
    failures = events_named(records, "failure_injected")
    delays, without_commit = _failure_to_commit(failures, step_records)
    recommitted = len(step_records) - len(committed)
    redone = len(events_named(records, "coordinator.redo"))
    first_fail = _first_failure_step(failures, step_records)
    after = [int(s["microbatches"]) for k, s in committed.items() if first_fail is not None
             and k >= first_fail and "microbatches" in s]  # fmt: skip
    last = committed[max(committed)] if committed else None

    row: dict[str, Any] = {
        "run": str(run),
        "mode": _run_mode(run),
        "microbatches_configured": _configured_microbatches(run),
        "steps_committed": len(committed),
        "step_records": len(step_records),
        "tokens_committed": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_ratio": None,
        "mean_live_replicas": mean_live,
        "tokens_per_s_per_replica": tokens_per_s / mean_live if mean_live > 0 else math.nan,
        "failures": len(failures),
        "failure_to_commit_s": delays,
        "failures_without_commit": without_commit,
        "median_failure_to_commit_s": statistics.median(delays) if delays else None,
        "steps_recommitted": recommitted,
        "redo_events": redone,
        "steps_lost_or_redone": recommitted + redone,
        "first_failure_step": first_fail,
        "microbatches_last": int(last["microbatches"]) if last and "microbatches" in last else None,
        "microbatches_min_after_failure": min(after) if after else None,
        "loss_max_rel_dev": None,
        "loss_worst_step": None,
        "common_steps": None,
        "param_rel_l2": None,
    }
    if reference is not None:
        _, _, ref_tokens_per_s = _throughput(Path(reference))
        if ref_tokens_per_s > 0:
            row["tokens_per_s_ratio"] = tokens_per_s / ref_tokens_per_s
        c = compare_runs(Path(reference), run)
        row["loss_max_rel_dev"] = c.max_loss_rel_diff if c.common_steps else None
        row["loss_worst_step"] = c.worst_step
        row["common_steps"] = c.common_steps
        row["param_rel_l2"] = c.param_rel_l2
    return row


def build_table(runs: dict[str, Path], *, reference: str) -> list[dict[str, Any]]:
    """One row per run (in the order given), each compared with `runs[reference]`."""
    if reference not in runs:
        raise ValueError(f"reference must be one of the runs {sorted(runs)}, got {reference!r}")
    ref_path = Path(runs[reference])
    rows = []
    for name, path in runs.items():
        row = {"name": name, "reference": reference}
        row.update(summarize_run(Path(path), reference=ref_path))
        rows.append(row)
    return rows


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as one Markdown table (also fine to print on a terminal)."""
    header = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(r.get(k), f) for k, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join([header, rule, *body])


def _json_safe(value: Any) -> Any:
    """NaN and infinities are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _draw_plots(runs: dict[str, Path], out_dir: Path) -> tuple[Path, Path]:
    series = {name: run_series(Path(path)) for name, path in runs.items()}
    loss_png = draw_loss(series, out_dir / "loss_vs_step.png")
    return loss_png, draw_tokens(series, out_dir / "tokens_vs_time.png")


def write_report(
    rows: list[dict[str, Any]], out_dir: Path, runs: dict[str, Path]
) -> dict[str, Any]:
    """Write compare.json, compare.md and (with matplotlib) two PNGs into `out_dir`.

    Returns {"json", "markdown", "loss_png", "tokens_png": Path or None, "plots_skipped": the
    reason or None}; a missing matplotlib skips the plots and says so in compare.md.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    loss_png = tokens_png = None
    skipped = None
    try:
        loss_png, tokens_png = _draw_plots(runs, out_dir)
    except ImportError as e:
        skipped = f"plots skipped: matplotlib is not installed ({e}); pip install 'recover[plot]'"

    json_path = out_dir / "compare.json"
    document = {
        "format": 1,
        "columns": {key: title for key, title, _ in COLUMNS},
        "rows": rows,
        "runs": {name: str(path) for name, path in runs.items()},
        "plots": {"loss": loss_png and loss_png.name, "tokens": tokens_png and tokens_png.name},
    }
    json_path.write_text(json.dumps(_json_safe(document), indent=2, allow_nan=False) + "\n")

    md_path = out_dir / "compare.md"
    lines = [format_markdown(rows), ""]
    if rows:
        lines.append(f"Reference (failure-free) run: `{rows[0].get('reference', '?')}`. "
                     "Method: docs/baselines.md.")  # fmt: skip
    if loss_png is not None and tokens_png is not None:
        lines += ["", f"![loss against step]({loss_png.name})",
                  "", f"![committed tokens against wall time]({tokens_png.name})"]  # fmt: skip
    if skipped:
        lines += ["", skipped]
    md_path.write_text("\n".join(lines) + "\n")
    return {
        "json": json_path,
        "markdown": md_path,
        "loss_png": loss_png,
        "tokens_png": tokens_png,
        "plots_skipped": skipped,
    }
