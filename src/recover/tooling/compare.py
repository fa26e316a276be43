"""`recover compare RUN_A RUN_B`: are two runs on the same trajectory?

Job: read the committed loss of both runs (the last record of each step) and their final models,
and report (1) the largest relative difference of the committed loss over the steps both runs
committed, (2) the relative L2 distance of the final parameters, ||a - b|| / ||a||, and (3) the
committed steps of either run that have no step record. Both distances are compared with one
tolerance; the exit status is 1 when either exceeds it, when nothing is shared, or when a run has
a gap (a committed step without a record is a difference: lost data, whatever the parameters say).

A run's committed steps are 0..last, where last is the highest step that any of these says was
committed: a step record, a `coordinator.committed` event, or the run's `summary` record (a
finished run committed every step up to its `steps`). Steps are committed in order, so a step
below the last one with no record is a gap. Runs of different lengths are still compared on the
steps both committed.

Relative loss difference at a step: |a - b| / max(|a|, |b|, tiny); a step skipped as non-finite
(null loss) in both runs agrees, in one run only it is an infinite difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from recover.record import committed_steps, read_metrics
from recover.training.config import RunPaths


@dataclass(frozen=True)
class Comparison:
    common_steps: int
    max_loss_rel_diff: float
    worst_step: int | None
    param_rel_l2: float | None  # None when a final model is missing
    # Committed steps with no step record, in run A and in run B (see the module docstring).
    missing_a: tuple[int, ...] = ()
    missing_b: tuple[int, ...] = ()

    def passes(self, rtol: float) -> bool:
        if self.common_steps == 0 or self.param_rel_l2 is None:
            return False
        if self.missing_a or self.missing_b:
            return False
        return self.max_loss_rel_diff <= rtol and self.param_rel_l2 <= rtol


def _final_params(run: Path) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    path = RunPaths(out=run).final_model
    return load_file(str(path)) if path.exists() else None


def param_rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError("the two final models have different parameter names")
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    norm = sum(float(a[k].double().pow(2).sum()) for k in a)
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


def last_committed_step(metrics: Path) -> int:
    """The highest step the run's record says was committed (-1: none); see the docstring."""
    last = -1
    for record in read_metrics(metrics):
        kind = record.get("kind")
        if kind == "step" or (kind == "event" and record.get("name") == "coordinator.committed"):
            if isinstance(record.get("step"), int):
                last = max(last, record["step"])
        elif kind == "summary" and isinstance(record.get("steps"), int):
            last = max(last, record["steps"] - 1)
    return last


def missing_steps(metrics: Path) -> tuple[int, ...]:
    """Committed steps of the run in `metrics` that have no step record (its gaps)."""
    recorded = committed_steps(metrics)
    return tuple(s for s in range(last_committed_step(metrics) + 1) if s not in recorded)


def compare_runs(run_a: Path, run_b: Path) -> Comparison:
    for run in (run_a, run_b):
        if not RunPaths(out=run).metrics.exists():
            raise FileNotFoundError(f"{run}: no metrics.jsonl; is it a run folder?")
    steps_a = committed_steps(RunPaths(out=run_a).metrics)
    steps_b = committed_steps(RunPaths(out=run_b).metrics)
    common = sorted(steps_a.keys() & steps_b.keys())
    worst, worst_step = 0.0, None
    for step in common:
        la, lb = steps_a[step].get("loss"), steps_b[step].get("loss")
        if la is None or lb is None:  # a step skipped as non-finite records a null loss
            rel = 0.0 if la is None and lb is None else math.inf
        else:
            la, lb = float(la), float(lb)
            rel = abs(la - lb) / max(abs(la), abs(lb), 1e-12)
        if not math.isfinite(rel):
            rel = math.inf
        if rel > worst or worst_step is None:
            worst, worst_step = rel, step
    pa, pb = _final_params(run_a), _final_params(run_b)
    dist = param_rel_l2(pa, pb) if pa is not None and pb is not None else None
    return Comparison(
        common_steps=len(common),
        max_loss_rel_diff=worst,
        worst_step=worst_step,
        param_rel_l2=dist,
        missing_a=missing_steps(RunPaths(out=run_a).metrics),
        missing_b=missing_steps(RunPaths(out=run_b).metrics),
    )


def _format_missing(steps: tuple[int, ...]) -> str:
    if not steps:
        return "none"
    shown = ", ".join(str(s) for s in steps[:10])
    return shown + (f" (and {len(steps) - 10} more)" if len(steps) > 10 else "")


def format_comparison(c: Comparison, rtol: float, run_a: Path, run_b: Path) -> str:
    verdict = "PASS" if c.passes(rtol) else "FAIL"
    lines = [
        f"compare {run_a} vs {run_b}",
        f"  common committed steps     {c.common_steps}",
        f"  max relative loss diff     {c.max_loss_rel_diff:.3e}"
        + (f" (step {c.worst_step})" if c.worst_step is not None else ""),
        "  final params relative L2   "
        + (f"{c.param_rel_l2:.3e}" if c.param_rel_l2 is not None else "missing final model"),
        f"  committed, no record       A: {_format_missing(c.missing_a)}; "
        f"B: {_format_missing(c.missing_b)}",
        f"  tolerance                  {rtol:.1e} -> {verdict}",
    ]
    return "\n".join(lines)
