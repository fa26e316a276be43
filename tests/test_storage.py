"""A run folder that cannot be written stops the run cleanly, on every process, in one line.

Real storage faults: the run folder on a small tmpfs of its own, filled up mid-run by the test (a
full disk), or remounted read-only before the run starts. Needs root (mount); skipped elsewhere,
run in CI (as root). Before: the coordinator's record write raised inside its connection handler
and it then refused stale reports ten times a second for ever, and a read-only folder at start was
a traceback or "coordinator died".
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from conftest import (
    TINY_TRAIN_FLAGS,
    finish,
    finish_after,
    leftover_processes,
    start_cli,
    wait_until,
)
from recover import exits
from recover.record import committed_steps, read_metrics


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` for the test (unmounted on the way out, whatever
    happens); skips where this process may not mount."""
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write zeros into `disk` until it is full; the filler file."""
    filler = disk / "filler"
    chunk = bytes(64 * 1024)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
    with open(filler, "ab", buffering=0) as f:  # and the last bytes a chunk did not fit
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return filler


@pytest.mark.timeout(120)
def test_a_disk_that_fills_mid_run_stops_the_run_in_one_line(tiny_dataset, tmp_path):
    """Two replicas train into a run folder on an 8 MB tmpfs; at step 3 the test fills it. The
    first process whose write fails (the coordinator recording a decision, or the writer replica
    its step record) stops: one line naming the path and "No space left on device", status 13,
    and the run ends within the coordinator grace and its bounds, not a livelock. Every record
    the file holds is whole, and the committed steps recorded are 0..k, each once."""
    with small_disk(tmp_path / "disk", "8m") as disk:
        out = disk / "run"
        proc = start_cli(
            ["train", "--data", str(tiny_dataset), "--out", str(out), *TINY_TRAIN_FLAGS,
             "--replicas", "2", "--steps", "2000", "--ckpt-every", "0",
             "--coordinator-grace", "2"],
        )  # fmt: skip
        try:
            wait_until(
                lambda: (out / "metrics.jsonl").exists()
                and len(committed_steps(out / "metrics.jsonl")) >= 3,
                "3 committed steps", alive=[proc], timeout=90,
            )  # fmt: skip
        except BaseException:
            proc.kill()  # (the launcher's children die with it)
            proc.wait()
            raise
        r, took = finish_after(proc, lambda: fill(disk), 60)
        assert r.returncode == exits.STORAGE, r.stdout[-3000:]
        assert "Traceback" not in r.stdout, r.stdout[-3000:]
        assert "No space left on device" in r.stdout, r.stdout[-3000:]
        assert took < 30, took  # the grace (2 s), the stop grace and the reaping, not for ever
        lines = (out / "metrics.jsonl").read_bytes().split(b"\n")
        assert lines[-1] == b"", "a torn last line"
        steps = sorted(
            r["step"] for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"
        )
        assert steps == list(range(len(steps))) and len(steps) >= 3, steps
        assert leftover_processes(str(out)) == []


@pytest.mark.timeout(60)
def test_a_read_only_run_folder_at_start_is_one_line(tiny_dataset, tmp_path):
    """A run folder on a read-only file system: `recover train` and `recover run` end at once
    with one line naming the path, status 13, no traceback, nothing started."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        for args in (
            ["train", "--data", str(tiny_dataset), "--out", str(disk / "run"),
             *TINY_TRAIN_FLAGS, "--replicas", "2"],
            ["run", "--out", str(disk / "job"), "--", "true"],
        ):  # fmt: skip
            r = finish(start_cli(args), timeout=40)
            assert r.returncode == exits.STORAGE, r.stdout[-3000:]
            assert "Traceback" not in r.stdout and "coordinator died" not in r.stdout, r.stdout
            (said,) = [line for line in r.stdout.splitlines() if line.startswith("error:")]
            assert str(disk) in said and "Read-only file system" in said, said
        assert not os.listdir(disk)
