"""Clean ways out, with real processes and real signals: nothing that committed is lost.

- SIGTERM to the launcher (a preemption, `kubectl delete`): every replica stops at its next step
  boundary, the writer checkpoints the committed state, the launcher exits 130 naming the
  checkpoint, and `--resume` lands on the failure-free trajectory.
- SIGTERM to one replica: a planned leave at a step boundary; the others go on, every step is
  recorded once with all M microbatches, and the run still succeeds.
- SIGKILL of the coordinator, no standby: nothing can commit any more; after the grace the lowest
  replica checkpoints the last committed step, every replica exits with one line (status 11), and
  the `--resume` command the launcher names continues on the trajectory.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import (
    assert_invariants,
    assert_last_commit_saved_once,
    coordinator_lost_lines,
    coordinator_pid,
    events,
    finish,
    leftover_processes,
    replica_pid,
    run_cli,
    start_cli,
    start_train,
    wait_for_step,
)
from recover.record import committed_steps, read_metrics

M = 4
# The stops come once step 5 is recorded; 55 steps more (3 s at least) is the margin for the
# signal to land mid-run, and a shorter run costs the reference and each resume less.
STEPS = 60
FLAGS = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", str(M),
    "--steps", str(STEPS), "--eval-every", "0", "--ckpt-every", "0", "--warmup-steps", "2",
    "--lr", "1e-3", "--min-lr", "1e-4",
]  # fmt: skip


def start(data: Path, out: Path, *extra: str) -> subprocess.Popen:
    return start_train(data, out, *FLAGS, *extra)


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("graceful") / "ref"
    r = finish(start(tiny_dataset, out, "--replicas", "2"))
    assert r.returncode == 0, r.stdout[-3000:]
    return out


@pytest.mark.timeout(240)
def test_sigterm_to_the_launcher_saves_the_committed_state_and_resume_continues(
    reference, tiny_dataset, tmp_path
):
    out = tmp_path / "run"
    # --quiet hides the step lines, not the line that says where the state is and what to run.
    proc = start(tiny_dataset, out, "--replicas", "2", "--quiet")
    try:
        wait_for_step(out, 5, alive=[proc], timeout=60)
        proc.terminate()  # the launcher alone, as a scheduler stops a job
    finally:
        r = finish(proc)
    assert r.returncode == 130, r.stdout[-3000:]
    saved = [e["step"] for e in events(out, "checkpoint_saved")]
    recorded = committed_steps(out / "metrics.jsonl")
    assert saved and max(saved) == max(recorded) + 1, (saved, sorted(recorded))
    assert f"the state after step {max(saved) - 1} is checkpointed in " in r.stdout
    assert f"step_{max(saved):08d}" in r.stdout and "--resume" in r.stdout
    assert sorted(recorded) == list(range(max(saved))), "a committed step has no record"
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    assert leftover_processes(str(out)) == []

    r = finish(start(tiny_dataset, out, "--replicas", "2", "--resume"))
    assert_invariants(reference, out, r, steps=STEPS, microbatches=M)


@pytest.mark.timeout(240)
def test_sigterm_to_one_replica_is_a_planned_leave(reference, tiny_dataset, tmp_path):
    out = tmp_path / "run"
    proc = start(tiny_dataset, out, "--replicas", "3")
    try:
        wait_for_step(out, 5, alive=[proc], timeout=60)
        os.kill(replica_pid(out, 1), signal.SIGTERM)
    finally:
        r = finish(proc)
    assert "replica 1 left at a step boundary when asked to stop (status 10)" in r.stdout
    assert_invariants(reference, out, r, steps=STEPS, microbatches=M)
    assert [e["replica"] for e in events(out, "replica_stopped")] == [1]
    # Its done report asked to leave, so the commit planned the next step without it: nobody
    # waited for it, nothing was redone, every step committed at its first attempt.
    assert not events(out, "coordinator.redo")
    assert {s["attempts"] for s in committed_steps(out / "metrics.jsonl").values()} == {1}
    (left,) = [
        e for e in events(out, "coordinator.epoch_changed") if "as they asked" in e["reason"]
    ]
    assert left["live"] == [0, 2]


@pytest.mark.timeout(240)
def test_a_lost_coordinator_costs_nothing_that_committed(reference, tiny_dataset, tmp_path):
    out = tmp_path / "run"
    # No standby: the replicas wait --coordinator-grace for a coordinator (short here), then stop.
    proc = start(tiny_dataset, out, "--replicas", "2", "--coordinator-grace", "1")
    try:
        wait_for_step(out, 5, alive=[proc], timeout=60)
        os.kill(coordinator_pid(out), signal.SIGKILL)
    finally:
        r = finish(proc)
    lost = coordinator_lost_lines(r)
    assert sorted(line.split("]")[0] for line in lost) == ["[replica 0", "[replica 1"], lost
    assert_last_commit_saved_once(out)
    assert leftover_processes(str(out)) == []

    # The exact command the launcher names resumes the run onto the failure-free trajectory.
    (line,) = [x for x in r.stdout.splitlines() if "continue with: recover train" in x]
    command = shlex.split(line.split("continue with: ")[1])
    assert command[-1] == "--resume"
    r = finish(start_cli(command[1:]))
    assert_invariants(reference, out, r, steps=STEPS, microbatches=M)
    steps = [s["step"] for s in read_metrics(out / "metrics.jsonl") if s.get("kind") == "step"]
    assert sorted(steps) == list(range(STEPS)), "a committed step lost or recorded twice"


@pytest.mark.timeout(60)
def test_a_worker_that_never_joined_saves_nothing(tiny_dataset, tmp_path):
    """No coordinator at the address: the worker gives up registering, says so in one line, and
    writes no checkpoint (it never held the run's state: a checkpoint would be its initial
    parameters, passed off as the run's)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: nothing listens there
    out = tmp_path / "run"
    r = run_cli(
        ["worker", *FLAGS, "--coordinator", f"127.0.0.1:{port}", "--replica-id", "0",
         "--data", str(tiny_dataset), "--out", str(out), "--register-timeout", "2"],
        timeout=50,
    )  # fmt: skip
    assert r.returncode == 11, r.stdout + r.stderr
    assert "the coordinator cannot be reached" in r.stderr and "Traceback" not in r.stderr
    assert "checkpointed" not in r.stderr
    assert (
        not list((out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else True
    )
