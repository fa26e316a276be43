"""What every `recover bench` run shares: the machine's description, child processes' environment
and CPU time, a `recover train` run, its median step time, and a benchmark's dataset and flags.

Timed runs include no start-up: step times come from the runs' own metrics (steps after the
first few).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from recover.record import committed_steps
from recover.training.config import TrainConfig

WARMUP_STEPS = 3  # steps excluded from step-time medians (allocation, first rendezvous)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user and system, all threads) process `pid` has used; None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(parts[11]) + int(parts[12])) / _CLK_TCK  # utime, stime


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


def run_child(cmd: list[str], *, timeout_s: float) -> str:
    """Run one benchmark command to its end and return its output; RuntimeError with the tail of
    its output if it fails or outlives `timeout_s`. It runs in a session of its own, killed whole
    on a timeout or an interrupt: a launcher's workers (torchrun's do not follow their agent)
    are never left behind."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except BaseException as e:  # a timeout, or Ctrl-C: the whole session goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        raise RuntimeError(
            f"{' '.join(cmd[:6])} ... did not finish in {timeout_s:.0f} s (killed with every "
            f"process of its session): {output[-2000:]}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}): {output[-2000:]}")
    return output


def run_recover(flags: list[str], out: Path, *, timeout_s: float) -> Path:
    run_child(
        [sys.executable, "-m", "recover.cli", "train", *flags, "--out", str(out), "--quiet"],
        timeout_s=timeout_s,
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
