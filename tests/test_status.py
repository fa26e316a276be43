"""`recover status RUN`: a running local job's coordinator, found from its run folder, with the
run's token kept in a file only its owner can read, and gone with the run."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_TRAIN_FLAGS, child_env, finish, leftover_processes, run_cli
from recover.record import committed_steps


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and max(committed_steps(path), default=-1) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} was not committed in {out} (exit {proc.poll()})")


@pytest.mark.timeout(120)
def test_status_of_a_running_local_job(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "recover.cli", "train", *TINY_TRAIN_FLAGS, "--steps", "2000",
         "--replicas", "2", "--balance", "equal", "--data", str(tiny_dataset), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip
    try:
        wait_for_step(out, 2, proc)
        token = out / "coordinator.token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600  # its owner's only
        env = {k: v for k, v in os.environ.items() if k != "RECOVER_TOKEN"}  # the file's, only
        r = subprocess.run(
            [sys.executable, "-m", "recover.cli", "status", str(out)],
            capture_output=True, text=True, timeout=30, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        text = r.stdout
        assert re.search(r"replica +0 live .*lease age [0-9.]+ s", text), text
        assert re.search(r"replica +1 live .*share 2 microbatches", text), text
        assert re.search(r"\| epoch 1 \| step \d+ \|", text), text
        step = int(re.search(r"\| step (\d+) \|", text).group(1))
        assert step >= 2
        assert re.search(r"microbatches/s \([0-9,]+ tokens/s\)", text), text
        assert "last 10 decisions:" in text and "committed" in text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # stops at the next step boundary: exit 130
        r = finish(proc, timeout=60)
    assert r.returncode == 130, r.stdout[-2000:]
    assert not (out / "coordinator.token").exists()
    assert not (out / "coordinator.json").exists()
    assert not leftover_processes(str(out))
    after = run_cli(["status", str(out)])
    assert after.returncode == 2 and "no multi-replica run is going on" in after.stderr


def test_coordinator_status_takes_its_address_from_the_environment():
    env = dict(child_env(), RECOVER_COORDINATOR="127.0.0.1:1")  # nothing listens there
    r = subprocess.run(
        [sys.executable, "-m", "recover.cli", "coordinator", "status"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert r.returncode == 2 and "127.0.0.1:1" in r.stderr, r.stderr
    env.pop("RECOVER_COORDINATOR")
    r = subprocess.run(
        [sys.executable, "-m", "recover.cli", "coordinator", "status"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert r.returncode == 2 and "RECOVER_COORDINATOR" in r.stderr, r.stderr
