"""Scenarios: GPU-scale defaults, calibration from `recover bench` JSON, and the sweeps.

Job: turn a few physical assumptions (`GpuAssumptions`) and, when given, measured figures
(`BenchFigures`, read from `recover bench recovery|overhead` JSON) into `Costs` and `JobShape`, and
run the three studies the CLI reports: the paper's scenario, the scale sweep and the MTBF sweep.
Every rule here is stated with its source in docs/simulator.md; change one here, change it there.

Costs: each study is a few hundred engine runs of milliseconds each (seconds in all).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from recover.tooling.simulate.engine import SimResult
from recover.tooling.simulate.model import (
    LLAMA3_GPU_FAILURES_PER_HOUR,
    Costs,
    JobShape,
    PoissonFailures,
    StepFailures,
    gpu_microbatch_s,
    state_bytes_per_gpu,
)
from recover.tooling.simulate.policies import simulate

__all__ = [
    "PAPER",
    "POLICY_ORDER",
    "BenchFigures",
    "GpuAssumptions",
    "gpu_costs",
    "mean_results",
    "paper_scenario",
    "read_bench",
    "scale_sweep",
    "mtbf_sweep",
]

POLICY_ORDER = ("recover", "checkpoint-restart", "shrink", "spares")

# The ReCoVer paper's headline figures for its scenario (arXiv 2605.11215), quoted beside ours.
PAPER = {
    "gpus": 512,
    "replicas": 64,
    "gpus_per_replica": 8,
    "microbatches": 8192,
    "failure_every_steps": 5,
    "failures": 32,
    "gpu_hour_budget": 234.0,
    "throughput_ratio_vs_ckpt": 2.23,
    "more_tokens_vs_ckpt": 0.749,
}


@dataclass(frozen=True, kw_only=True)
class GpuAssumptions:
    """The physical assumptions of a GPU job (defaults and sources: docs/simulator.md)."""

    params: float = 8.0e9  # an 8B dense model (Llama-3-8B class)
    seq_len: int = 4096
    sequences_per_microbatch: int = 1
    gpus_per_replica: int = 8  # TP 8: one node of 8 GPUs is one replica
    microbatches_per_replica: int = 128  # the paper's 8192 / 64
    peak_flops: float = 989e12  # H100 SXM dense BF16
    mfu: float = 0.40  # Llama 3 reports 38-43% on 16k H100s
    link_bytes_per_s: float = 50e9  # one 400 Gb/s NIC per GPU
    grad_bytes_per_param: float = 2.0  # BF16 gradients reduced
    state_bytes_per_param: float = 16.0  # BF16 params + FP32 master, Adam m and v
    ckpt_write_bytes_per_s: float = 4e9  # blocking write of one full state (assumption)
    rebuild_s: float = 2.0  # NCCL communicator among survivors (assumption, not measured)
    restart_s: float = 300.0  # job restart: relaunch, rendezvous, NCCL init, load (assumption)
    repair_s: float | None = 3600.0  # a failed node is back in an hour (sweeps only)
    spare_fraction: float = 1 / 64  # hot spares as a fraction of replicas (at least one)

    def __post_init__(self) -> None:
        for name in ("params", "peak_flops", "link_bytes_per_s", "ckpt_write_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("seq_len", "sequences_per_microbatch", "gpus_per_replica",
                     "microbatches_per_replica"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not (0 < self.mfu <= 1):
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if self.rebuild_s < 0 or self.restart_s < 0:
            raise ValueError("rebuild_s and restart_s must be >= 0")
        if not (0 <= self.spare_fraction < 1):
            raise ValueError(f"spare_fraction must be in [0, 1), got {self.spare_fraction!r}")

    @property
    def tokens_per_microbatch(self) -> int:
        return self.seq_len * self.sequences_per_microbatch

    def shape(self, gpus: int) -> JobShape:
        replicas = gpus // self.gpus_per_replica
        if replicas < 2:
            raise ValueError(f"gpus must hold at least 2 replicas of {self.gpus_per_replica}")
        return JobShape(
            replicas=replicas, gpus_per_replica=self.gpus_per_replica,
            microbatches=self.microbatches_per_replica * replicas,
            tokens_per_microbatch=self.tokens_per_microbatch,
            spares=max(1, round(replicas * self.spare_fraction)),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class BenchFigures:
    """What `recover bench` measured, reduced to the simulator's inputs (None: not measured)."""

    recovery_fixed_s: float | None = None  # kill -> commit minus the recomputed work
    step_overhead_s: float | None = None  # recover step minus plain step, absolute seconds
    cpu_microbatch_s: float | None = None  # one microbatch on one core (the bench's preset)
    # `recover bench coordinator`: (replicas, commit median s, kill -> epoch published s) rows
    control_plane: tuple[tuple[int, float, float], ...] = ()
    sources: tuple[str, ...] = ()

    def control_plane_s(self, replicas: int) -> tuple[float, float] | None:
        """(commit s, detect s) of the coordinator at `replicas`, interpolated linearly in R
        between measured rows; beyond the last, extrapolated linearly from the last two (the
        per-step work grows with R); None when not measured."""
        rows = sorted(self.control_plane)
        if not rows:
            return None
        if len(rows) == 1 or replicas <= rows[0][0]:
            return rows[0][1], rows[0][2]
        for (r0, c0, d0), (r1, c1, d1) in zip(rows, rows[1:], strict=False):
            if replicas <= r1 or (r1, c1, d1) == rows[-1]:
                f = (replicas - r0) / (r1 - r0)
                return max(0.0, c0 + f * (c1 - c0)), max(0.0, d0 + f * (d1 - d0))
        raise AssertionError("unreachable")


def read_bench(paths: list[Path], *, cpu_cores: int) -> BenchFigures:
    """Read `recover bench recovery` and/or `overhead` JSON files (rules: docs/simulator.md).

    recovery: per-microbatch time mb = step_s / (ceil(M/R) * max(1, R / cores)) from the
    failure-free step time; the fixed cost of a failure is the `reduce`-phase kill -> commit time
    minus the survivors' extra work ceil(ceil(M/R) / (R-1)) microbatches (at R-1 live replicas).
    overhead: the median over pairs of recover_step_s - plain_step_s.
    """
    fixed = overhead = mb = None
    control: list[tuple[int, float, float]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        kind = data.get("benchmark")
        if kind == "recovery":
            cfg = data["config"]
            r, m = int(cfg["replicas"]), int(cfg["microbatches"])
            rows = {row["phase"]: row for row in data["rows"]}
            row = rows.get("reduce") or next(iter(rows.values()))
            q = math.ceil(m / r)
            mb = row["step_s"] / (q * max(1.0, r / cpu_cores))
            extra = math.ceil(q / (r - 1)) * mb * max(1.0, (r - 1) / cpu_cores)
            fixed = max(0.0, row["kill_to_commit_s"] - extra)
        elif kind == "coordinator":  # rows that met their run (failed rows skipped)
            for row in data["rows"]:
                if row.get("commit_s_median") is not None and row.get("false_deaths") == 0:
                    kill = row.get("kill_detect_s") or 0.0
                    control.append((int(row["replicas"]), row["commit_s_median"], kill))
        elif kind == "overhead":
            diffs = [p["recover_step_s"] - p["plain_step_s"] for p in data["pairs"]]
            overhead = max(0.0, statistics.median(diffs))
        else:
            raise ValueError(f"{path}: not a `recover bench` JSON (benchmark={kind!r})")
    # Several rows at one R (straight to the coordinator, through relays): the best one measured
    # is the control plane a deployment would run.
    best: dict[int, tuple[int, float, float]] = {}
    for row in control:
        if row[0] not in best or row[1:] < best[row[0]][1:]:
            best[row[0]] = row
    return BenchFigures(
        recovery_fixed_s=fixed, step_overhead_s=overhead, cpu_microbatch_s=mb,
        control_plane=tuple(sorted(best.values())), sources=tuple(str(p) for p in paths),
    )  # fmt: skip


# Defaults when no bench JSON is given: the figures measured on this project's machine (see
# docs/design.md): session-EOF detection ~3 ms; one coordinator commit round trip and the
# snapshot copy ~10 ms per step.
DEFAULT_DETECT_S = 0.003
DEFAULT_STEP_OVERHEAD_S = 0.010


def gpu_costs(
    a: GpuAssumptions, bench: BenchFigures | None = None, *, replicas: int | None = None
) -> Costs:
    """Costs of the GPU job: compute from FLOPs, transfers from bytes, failure costs from the
    bench (measured fixed part, kept as is) plus the GPU communicator rebuild (assumed).

    With a `recover bench coordinator` JSON and `replicas`, the control plane at that R is added:
    the commit round trip (done -> committed) to every step, and the time to publish a new epoch
    to every survivor to every failure's detection."""
    bench = bench or BenchFigures()
    detect = bench.recovery_fixed_s if bench.recovery_fixed_s is not None else DEFAULT_DETECT_S
    overhead = (
        bench.step_overhead_s if bench.step_overhead_s is not None else DEFAULT_STEP_OVERHEAD_S
    )
    control = bench.control_plane_s(replicas) if replicas is not None else None
    if control is not None:
        overhead += control[0]
        detect += control[1]
    state = state_bytes_per_gpu(
        a.params, a.gpus_per_replica, bytes_per_param=a.state_bytes_per_param
    )
    transfer = state / a.link_bytes_per_s
    return Costs(
        microbatch_s=gpu_microbatch_s(
            params=a.params, tokens_per_microbatch=a.tokens_per_microbatch,
            gpus_per_replica=a.gpus_per_replica, peak_flops=a.peak_flops, mfu=a.mfu,
        ),
        allreduce_shard_bytes=a.params * a.grad_bytes_per_param / a.gpus_per_replica,
        link_bytes_per_s=a.link_bytes_per_s,
        step_overhead_s=overhead,
        detect_s=detect,
        rebuild_s=a.rebuild_s,
        ckpt_s=a.params * a.state_bytes_per_param / a.ckpt_write_bytes_per_s,
        restart_s=a.restart_s,
        state_transfer_s=transfer,
        swap_s=transfer,
        repair_s=a.repair_s,
    )  # fmt: skip


def mean_results(results: list[SimResult]) -> dict:
    """Means over seeds of the figures the report shows."""
    keys = ("tokens_per_s", "tokens_per_live_gpu_s", "goodput", "failures", "wall_s", "tokens",
            "gpu_hours")  # fmt: skip
    out = {k: statistics.fmean(getattr(r, k) for r in results) for k in keys}
    out["tokens_per_gpu_hour"] = statistics.fmean(r.tokens / r.gpu_hours for r in results)
    out["seeds"] = len(results)
    out["stopped"] = sorted({r.stopped for r in results})
    return out


def paper_scenario(
    a: GpuAssumptions, bench: BenchFigures | None = None, *, restart_s: float | None = None
) -> dict:
    """512 GPUs as 64 replicas of 8, 8192 microbatches, a replica failure every 5 steps, 32 in
    all, no repairs, each policy run until it has held 234 GPU-hours."""
    a = replace(a, gpus_per_replica=PAPER["gpus_per_replica"],
                microbatches_per_replica=PAPER["microbatches"] // PAPER["replicas"],
                repair_s=None)  # fmt: skip
    costs = gpu_costs(a, bench, replicas=PAPER["replicas"])
    if restart_s is not None:
        costs = replace(costs, restart_s=restart_s)
    shape = replace(a.shape(PAPER["gpus"]), spares=0)
    failures = StepFailures(every=PAPER["failure_every_steps"], count=PAPER["failures"])
    runs = {
        p: simulate(p, shape, costs, failures, gpu_hour_budget=PAPER["gpu_hour_budget"])
        for p in ("recover", "checkpoint-restart", "shrink")
    }
    rec, ckpt = runs["recover"], runs["checkpoint-restart"]
    return {
        "restart_s": costs.restart_s,
        "results": {p: r.as_dict() for p, r in runs.items()},
        "throughput_ratio_vs_ckpt": rec.tokens_per_s / ckpt.tokens_per_s,
        "per_live_gpu_ratio_vs_ckpt": rec.tokens_per_live_gpu_s / ckpt.tokens_per_live_gpu_s,
        "more_tokens_vs_ckpt": rec.tokens / ckpt.tokens - 1.0,
    }


def _sweep_point(shape: JobShape, costs: Costs, failures: PoissonFailures, *, horizon_s: float,
                 seeds: int, seed: int) -> dict:  # fmt: skip
    return {
        p: mean_results(
            [
                simulate(p, shape, costs, failures, seed=seed + i, horizon_s=horizon_s)
                for i in range(seeds)
            ]
        )  # fmt: skip
        for p in POLICY_ORDER
    }


def scale_sweep(
    a: GpuAssumptions, bench: BenchFigures | None, *, gpus: list[int], failures: PoissonFailures,
    horizon_s: float, seeds: int, seed: int,
) -> list[dict]:  # fmt: skip
    rows = []
    for g in gpus:
        shape = a.shape(g)
        costs = gpu_costs(a, bench, replicas=shape.replicas)
        rows.append({
            "gpus": shape.gpus, "replicas": shape.replicas, "spares": shape.spares,
            "job_mtbf_h": failures.job_mtbf_s(shape.gpus) / 3600.0,
            "policies": _sweep_point(shape, costs, failures, horizon_s=horizon_s, seeds=seeds,
                                     seed=seed),
        })  # fmt: skip
    return rows


def mtbf_sweep(
    a: GpuAssumptions, bench: BenchFigures | None, *, gpus: int, mtbf_h: list[float],
    base: PoissonFailures, horizon_s: float, seeds: int, seed: int,
) -> list[dict]:  # fmt: skip
    shape = a.shape(gpus)
    costs = gpu_costs(a, bench, replicas=shape.replicas)
    rows = []
    for m in mtbf_h:
        failures = replace(base, gpu_rate_per_h=1.0 / (m * shape.gpus))
        rows.append({
            "gpus": shape.gpus, "job_mtbf_h": m,
            "policies": _sweep_point(shape, costs, failures, horizon_s=horizon_s, seeds=seeds,
                                     seed=seed),
        })  # fmt: skip
    return rows


def llama3_job_mtbf_h(gpus: int) -> float:
    return 1.0 / (LLAMA3_GPU_FAILURES_PER_HOUR * gpus)
