"""What every `recover bench` run shares: the machine's description, child processes' environment,
a `recover train` run, its median step time, and a benchmark's dataset and flags.

Timed runs include no start-up: step times come from the runs' own metrics (steps after the
first few).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from recover.record import committed_steps
from recover.training.config import TrainConfig

WARMUP_STEPS = 3  # steps excluded from step-time medians (allocation, first rendezvous)


def machine_info() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_recover(flags: list[str], out: Path, *, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "recover.cli", "train", *flags, "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env())
    if r.returncode != 0:
        raise RuntimeError(
            f"benchmark run failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}"
        )
    return out


def median_step_s(out: Path, *, skip: int = WARMUP_STEPS) -> float:
    steps = committed_steps(out / "metrics.jsonl")
    times = [s["step_s"] for k, s in sorted(steps.items()) if k >= skip]
    return statistics.median(times)


def bench_setup(args: argparse.Namespace):
    """The dataset, the TrainConfig of a benchmark run, and the `recover train` flags for it."""
    from recover.data.prepare import ensure_dataset
    from recover.training.config import TrainConfig

    data = (
        Path(args.data) if args.data else ensure_dataset(Path(args.data_root), show_progress=False)
    )
    cfg = TrainConfig(
        preset=args.preset, steps=args.steps, microbatches=args.microbatches,
        microbatch_size=args.microbatch_size, seq_len=args.seq_len, eval_every=0, ckpt_every=0,
    )  # fmt: skip
    flags = [*train_flags(cfg), "--replicas", str(args.replicas), "--data", str(data)]
    return data, cfg, flags


def train_flags(cfg: TrainConfig) -> list[str]:
    """The command-line flags that rebuild `cfg` in a child process."""
    out: list[str] = []
    for f in fields(TrainConfig):
        out += ["--" + f.name.replace("_", "-"), str(getattr(cfg, f.name))]
    return out
