"""Validation: the simulator's predicted effective throughput against measured run folders.

Job: for a run folder (config.json + metrics.jsonl, schema in docs/metrics.md), measure the
effective throughput (committed tokens of steps `skip..last` over the wall time from the commit of
step `skip - 1` to the last commit), rebuild the run as a simulator job (R, M, tokens per
microbatch, the declared failures from `failure_injected` events), calibrate the one free
parameter (the per-microbatch time) from the failure-free steps *before* the first failure, and
predict. The failure costs are not fitted: they come from `Costs` (bench figures or defaults).

Mode of a run: `MODE=PATH` on the command line, else config.json's `launch.mode` or `mode`, else
`recover`. Limits: one microbatch phase per run (that of the first failure); the calibration
assumes the failure-free steps are representative (on a shared machine they move with load).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from recover.record import committed_steps, read_metrics
from recover.tooling.simulate.model import Costs, JobShape, StepFailures
from recover.tooling.simulate.policies import simulate

__all__ = ["Validation", "measure_run", "validate_run", "parse_validate_arg"]

SKIP_STEPS = 3  # like `recover bench`: the first steps carry start-up costs
MODES = ("recover", "checkpoint-restart", "shrink", "spares")


@dataclass(frozen=True)
class Validation:
    run: str
    mode: str
    steps: int
    failures: int
    measured_tokens_per_s: float
    predicted_tokens_per_s: float

    @property
    def rel_error(self) -> float:
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1.0

    def as_dict(self) -> dict:
        return {
            "run": self.run, "mode": self.mode, "steps": self.steps, "failures": self.failures,
            "measured_tokens_per_s": self.measured_tokens_per_s,
            "predicted_tokens_per_s": self.predicted_tokens_per_s, "rel_error": self.rel_error,
        }  # fmt: skip


def parse_validate_arg(text: str) -> tuple[str | None, Path]:
    """`PATH` or `MODE=PATH`."""
    mode, sep, path = text.partition("=")
    if sep and mode in MODES:
        return mode, Path(path)
    return None, Path(text)


def _run_mode(config: dict) -> str:
    mode = config.get("launch", {}).get("mode") or config.get("mode") or "recover"
    if mode not in MODES:
        raise ValueError(f"config.json mode must be one of {MODES}, got {mode!r}")
    return mode


def measure_run(run: Path, *, skip: int = SKIP_STEPS) -> dict:
    """What the run did: its shape, its failures and its effective throughput."""
    config = json.loads((run / "config.json").read_text())
    train = config["train"]
    steps = committed_steps(run / "metrics.jsonl")
    if not steps or max(steps) < skip + 1:
        raise ValueError(f"{run}: needs more than {skip + 1} committed steps")
    first, last = skip, max(steps)
    if (first - 1) not in steps:
        raise ValueError(f"{run}: step {first - 1} is missing from metrics.jsonl")
    tokens = sum(float(s["tokens"]) for k, s in steps.items() if first <= k <= last)
    wall = steps[last]["t_wall"] - steps[first - 1]["t_wall"]
    injected = [
        r for r in read_metrics(run / "metrics.jsonl")
        if r.get("kind") == "event" and r.get("name") == "failure_injected"
        and first <= int(r.get("step", -1)) <= last
    ]  # fmt: skip
    fail_steps = sorted({int(r["step"]) for r in injected})
    clean_end = fail_steps[0] if fail_steps else last + 1
    clean = [s["step_s"] for k, s in steps.items()
             if first <= k < clean_end and s.get("attempts", 1) == 1]  # fmt: skip
    if not clean:
        raise ValueError(f"{run}: no failure-free step after step {skip} to calibrate on")
    restarts = _measured_restarts(run, statistics.median(clean))
    return {
        "restart_detect_s": restarts[0],
        "restart_s": restarts[1],
        "mode": _run_mode(config),
        "replicas": int(config.get("launch", {}).get("replicas", 1)),
        "microbatches": int(train["microbatches"]),
        "tokens_per_microbatch": int(train["microbatch_size"]) * int(train["seq_len"]),
        "ckpt_every": int(train.get("ckpt_every", 0)),
        "first": first,
        "last": last,
        "tokens": tokens,
        "wall_s": wall,
        "clean_step_s": statistics.median(clean),
        "fail_steps": fail_steps,
        "fail_phase": injected[0].get("phase") if injected else None,
        "fail_microbatch": injected[0].get("microbatch") if injected else None,
    }


def _measured_restarts(run: Path, clean_step_s: float) -> tuple[float, float] | tuple[None, None]:
    """checkpoint-restart runs: (failure -> the launcher's restart, restart -> job running again),
    medians over the run's restarts; the second is the first commit after the restart less one
    step. These are the run's own measured costs, which the validation feeds to the model."""
    records = list(read_metrics(run / "metrics.jsonl"))
    restarts = [r["t_wall"] for r in records if r.get("name") == "launcher.restarted"]
    if not restarts:
        return None, None
    kills = [r["t_wall"] for r in records if r.get("name") == "failure_injected"]
    commits = sorted(r["t_wall"] for r in records if r.get("kind") == "step")
    detect, back = [], []
    for t in restarts:
        before = [k for k in kills if k <= t]
        if before:
            detect.append(t - max(before))
        after = [c for c in commits if c > t]
        if after:
            back.append(max(0.0, min(after) - t - clean_step_s))
    return (
        statistics.median(detect) if detect else None,
        statistics.median(back) if back else None,
    )


def _phase_fraction(phase: str | None, microbatch: int | None, quota: int) -> float:
    """Where in a step the declared fault lands, as a fraction of the step."""
    if phase in ("forward", "backward"):
        k = microbatch or 0
        return min(0.95, (k + (0.25 if phase == "forward" else 0.75)) / quota)
    if phase == "reduce":
        return 0.97
    return 0.99  # commit, optimizer: after the reduce


def validate_run(run: Path, costs: Costs, *, mode: str | None = None, cpu_cores: int) -> Validation:
    """Predict the run's effective throughput with `costs` (its microbatch_s is replaced by the
    calibrated one) and compare with the measured one."""
    m = measure_run(run)
    mode = mode or m["mode"]
    r, big_m = m["replicas"], m["microbatches"]
    quota = math.ceil(big_m / r)
    mb = m["clean_step_s"] / (quota * max(1.0, r / cpu_cores))
    costs = replace(costs, microbatch_s=mb, cpu_cores=cpu_cores, allreduce_shard_bytes=0.0,
                    allreduce_alpha_s=0.0,
                    step_overhead_s=0.0)  # fmt: skip
    if mode == "checkpoint-restart" and costs.ckpt_interval_s is None and m["ckpt_every"] > 0:
        costs = replace(costs, ckpt_interval_s=m["ckpt_every"] * m["clean_step_s"])
    if mode == "checkpoint-restart" and m["restart_s"] is not None:
        # the run's own restart costs; its checkpoints are asynchronous (no blocking part)
        costs = replace(costs, restart_s=m["restart_s"], detect_s=m["restart_detect_s"] or 0.0,
                        ckpt_s=0.0)  # fmt: skip
    shape = JobShape(replicas=r, gpus_per_replica=1, microbatches=big_m,
                     tokens_per_microbatch=m["tokens_per_microbatch"])  # fmt: skip
    failures = StepFailures(
        every=1,
        count=0,
        at=tuple(s - m["first"] for s in m["fail_steps"]),
        phase=_phase_fraction(m["fail_phase"], m["fail_microbatch"], quota),
    )
    n_steps = m["last"] - m["first"] + 1
    result = simulate(mode, shape, costs, failures, max_steps=n_steps)
    return Validation(
        run=str(run), mode=mode, steps=n_steps, failures=len(m["fail_steps"]),
        measured_tokens_per_s=m["tokens"] / m["wall_s"],
        predicted_tokens_per_s=result.tokens_per_s,
    )  # fmt: skip
