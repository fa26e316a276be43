"""Fault specs that could never fire (or never end) are refused at start-up, naming the field; the
launcher's exit status says whether every step committed, whatever died on the way.

Real processes for the exit status: a replica SIGKILLed from outside (no --fault), and a fault
that fires in a respawned incarnation; both runs commit every step and exit 0 with a line that
lists the deaths. A run record with a missing step fails the verdict with a line naming the step.

A fault fires once per run: the launcher learns that it fired from its own control file
(RUN/faults.fired), never from the run's record; a `recover run` script that writes its events
elsewhere still has each fault fire once, its second respawn given neither again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    EXAMPLES,
    events,
    finish,
    leftover_processes,
    replica_pid,
    run_cli,
    start_cli,
    start_train,
    wait_for_step,
)
from recover.launch import FIRED_FILE, LaunchConfig, LocalLauncher
from recover.logs import setup_logging
from recover.record import MetricsWriter, committed_steps, read_metrics
from recover.runtime.faults import (
    FaultInjector,
    check_faults_fit,
    fault_flag,
    parse_fault,
    read_fired,
    record_fired,
)
from recover.training.config import TrainConfig

M = 6
FLAGS = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", str(M),
    "--eval-every", "0", "--warmup-steps", "2", "--check-every", "25", "--ckpt-every", "0",
    "--lr", "1e-3", "--min-lr", "1e-4",
]  # fmt: skip


@pytest.mark.parametrize(
    "spec, field",
    [
        ("hang:replica=0,step=1,phase=forward,wake_after=nan", "wake_after"),
        ("hang:replica=0,step=1,phase=forward,wake_after=inf", "wake_after"),
        ("hang:replica=0,step=1,phase=forward,wake_after=-1", "wake_after"),
        ("slow:replica=0,step=1,factor=nan", "factor"),
        ("slow:replica=0,step=1,factor=inf", "factor"),
        ("slow:replica=0,step=1,factor=-3", "factor"),
    ],
)
def test_non_finite_or_negative_fault_values_are_refused(spec, field):
    with pytest.raises(ValueError, match=f"{field} must be a finite number >= 0"):
        parse_fault(spec)


def test_a_wake_up_later_than_an_hour_is_refused():
    """A hang woken after 1e308 s kept a launcher waiting after the run ended."""
    assert parse_fault("hang:replica=0,step=1,phase=forward,wake_after=3600").wake_after == 3600
    with pytest.raises(ValueError, match="wake_after must be <= 3600 s"):
        parse_fault("hang:replica=0,step=1,phase=forward,wake_after=1e308")


def test_a_nan_fault_is_for_the_backward_phase_only():
    assert parse_fault("nan:replica=1,step=2,phase=backward,microbatch=1").kind == "nan"
    with pytest.raises(ValueError, match="phase backward only"):
        parse_fault("nan:replica=1,step=2,phase=reduce")


def test_faults_beyond_the_run_are_refused_naming_the_field():
    def check(spec: str) -> None:
        check_faults_fit([parse_fault(spec)], steps=24, microbatches=8)

    check("kill:replica=0,step=23,phase=backward,microbatch=7")  # the last step, the last id
    check("kill:replica=0,step=3,phase=reduce,microbatch=50")  # (no microbatch at a reduce)
    with pytest.raises(ValueError, match=r"microbatch=50 never comes.*--microbatches 8"):
        check("kill:replica=0,step=3,phase=backward,microbatch=50")
    with pytest.raises(ValueError, match=r"microbatch=8 never comes"):
        check("exit:replica=0,step=3,phase=forward,microbatch=8")
    with pytest.raises(ValueError, match=r"step=999 never comes.*--steps 24"):
        check("kill:replica=0,step=999,phase=reduce")
    with pytest.raises(ValueError, match=r"step=24 never comes"):
        check("slow:replica=0,step=24,factor=2")
    # M = 0: the coordinator learns M from the replicas; only the step is checked.
    check_faults_fit([parse_fault("kill:replica=0,step=1,phase=forward,microbatch=50")],
                     steps=2, microbatches=0)  # fmt: skip


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("hang:replica=1,step=1,phase=forward,wake_after=nan", "wake_after"),
        ("kill:replica=1,step=1,phase=backward,microbatch=50", "microbatch=50"),
        ("kill:replica=1,step=999,phase=reduce", "step=999"),
        ("kill:replica=1,step=1,phase=transfer", "--respawn"),  # no joiner: it never fires
    ],
)
def test_recover_train_refuses_them_before_anything_starts(
    spec, needle, tiny_dataset, tmp_path, capsys
):
    from recover.cli import main

    out = tmp_path / "run"
    args = ["train", *FLAGS, "--steps", "24", "--replicas", "2", "--fault", spec]
    assert main([*args, "--data", str(tiny_dataset), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "--fault" in err, err
    assert not out.exists(), "nothing may be written for a refused fault"


def start(data: Path, out: Path, *extra: str) -> subprocess.Popen:
    return start_train(data, out, *FLAGS, *extra)


def assert_every_step_recorded(out: Path, steps: int) -> None:
    committed = committed_steps(out / "metrics.jsonl")
    assert sorted(committed) == list(range(steps))
    assert all(s["microbatches"] == M for s in committed.values())
    (verdict,) = events(out, "launcher.verdict")
    assert verdict["ok"] and verdict["problems"] == []


@pytest.mark.timeout(120)
def test_an_external_sigkill_of_a_replica_still_exits_0_when_every_step_committed(
    tiny_dataset, tmp_path
):
    out, steps = tmp_path / "run", 150
    proc = start(tiny_dataset, out, "--replicas", "2", "--steps", str(steps))
    try:
        wait_for_step(out, 3, alive=[proc], timeout=60)
        pid = replica_pid(out, 1)
        assert proc.poll() is None and pid is not None, "the run ended before the kill"
        os.kill(pid, signal.SIGKILL)  # not a --fault: the launcher did not inject it
    finally:
        r = finish(proc, 90)
    assert r.returncode == 0, r.stdout[-3000:]
    assert_every_step_recorded(out, steps)
    assert not events(out, "failure_injected")
    assert "lost on the way: replica 1 killed by SIGKILL" in r.stdout, r.stdout[-3000:]
    assert leftover_processes(str(out)) == []


@pytest.mark.timeout(180)
def test_a_fault_in_a_respawned_incarnation_still_exits_0_when_every_step_committed(
    tiny_dataset, tmp_path
):
    # Replica 1 dies at step 1; its respawn dies while receiving the state (the fault of the
    # transfer phase fires only in a joiner); the next respawn joins and the run ends.
    out, steps = tmp_path / "run", 80  # the second respawn joined at step 7 (2 cores, loaded)
    r = finish(
        start(
            tiny_dataset, out, "--replicas", "2", "--steps", str(steps), "--respawn", "0",
            "--fault", "kill:replica=1,step=1,phase=backward",
            "--fault", "kill:replica=1,step=1,phase=transfer",
        ),
        150,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert_every_step_recorded(out, steps)
    assert sorted(e["phase"] for e in events(out, "failure_injected")) == ["backward", "transfer"]
    assert "replica 1 (restart 1) killed by SIGKILL" in r.stdout, r.stdout[-3000:]
    assert leftover_processes(str(out)) == []


@contextlib.contextmanager
def verdict_launcher(tmp_path: Path, steps: int, faults=()):
    """A launcher of `steps` steps, given `faults`, whose verdict is read without running: its
    record written by the test, its lines logged as `recover train` logs them (to stderr)."""
    cfg = TrainConfig(preset="tiny", steps=steps, microbatches=M)
    launcher = LocalLauncher(
        cfg, LaunchConfig(replicas=2, faults=tuple(faults)), data=tmp_path, out=tmp_path,
        resume=False, data_info={}, console=sys.stdout,  # (capsys's)
    )  # fmt: skip
    launcher.writer = MetricsWriter(launcher.paths.metrics)
    log = logging.getLogger("recover")
    saved = (list(log.handlers), log.level, log.propagate)
    setup_logging("info")
    try:
        yield launcher
    finally:
        log.handlers[:], log.level, log.propagate = saved
        launcher.writer.close()


def test_a_run_record_missing_a_step_fails_the_verdict_with_a_line(tmp_path, capsys):
    with verdict_launcher(tmp_path, 4) as launcher:
        for step, microbatches in ((0, M), (1, M), (3, M - 2)):
            launcher.writer.step(step=step, loss=1.0, microbatches=microbatches)
        assert launcher._verdict([(0, 0, 0), (1, 0, -signal.SIGTERM)]) == 1
        line = capsys.readouterr().err  # an error
        assert "training failed: no step record for step(s) 2" in line, line
        assert f"step(s) 3 did not sum all {M} microbatches" in line
        assert "replica 1 killed by SIGTERM" in line
        launcher.writer.step(step=2, loss=1.0, microbatches=M)
        launcher.writer.step(step=3, loss=1.0, microbatches=M)
        assert launcher._verdict([(0, 0, 0), (1, 0, -signal.SIGTERM)]) == 0
        assert launcher._verdict([(0, 0, 3), (1, 0, 3)]) == 1  # quorum lost
        assert "replica 0: quorum lost" in capsys.readouterr().err


def test_the_verdict_names_a_declared_fault_that_never_fired(tmp_path, capsys):
    """A drill whose fault never fired (its replica was planned no such microbatch, or the run
    ended before its step) did not exercise what it declared: the launcher says so, naming the
    fault, and records it in its verdict; a run whose every step committed still exits 0."""
    fired, never, slow = (
        parse_fault(s)
        for s in (
            "kill:replica=1,step=1,phase=backward,microbatch=0",
            "kill:replica=0,step=2,phase=forward,microbatch=3",
            "slow:replica=1,step=0,factor=2",
        )
    )
    with verdict_launcher(tmp_path, 3, (fired, never, slow)) as launcher:
        for step in range(3):
            launcher.writer.step(step=step, loss=1.0, microbatches=M)
        record_fired(launcher.fired_file, fired)  # what the injector does before it acts
        assert launcher._verdict([(0, 0, 0), (1, 0, -signal.SIGKILL)]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "never fired" in x)
    assert fault_flag(never) in line and fault_flag(fired) not in line, line
    assert "slow:" not in line  # a slow fault acts from its step on; it never "fires" once
    (verdict,) = events(tmp_path, "launcher.verdict")
    assert verdict["ok"] and verdict["unfired"] == [fault_flag(never)]


def test_the_launcher_gives_a_new_process_only_the_faults_not_recorded_as_fired(tmp_path):
    nan, transfer, slow = (
        parse_fault(s)
        for s in (
            "nan:replica=1,step=1,phase=backward,microbatch=0",
            "kill:replica=1,step=1,phase=transfer",
            "slow:replica=1,step=0,factor=2",
        )
    )
    cfg = TrainConfig(preset="tiny", steps=4, microbatches=M)
    launcher = LocalLauncher(
        cfg, LaunchConfig(replicas=2, faults=(nan, transfer, slow), respawn_s=0.0), data=tmp_path,
        out=tmp_path,
        resume=False, data_info={}, console=None,
    )  # fmt: skip
    # The run's record is not what the launcher goes by: an event there fires nothing.
    writer = MetricsWriter(launcher.paths.metrics)
    writer.event("failure_injected", fault="kill", replica=1, rank=0, step=1, phase="transfer")
    writer.close()
    assert launcher._pending_faults(1) == [nan, transfer, slow]
    # A replica process records its fault in the launcher's file before the fault acts.
    acted = []
    injector = FaultInjector(
        [parse_fault(fault_flag(f)) for f in (nan, transfer)],  # (as RECOVER_FAULTS gives them)
        corrupt=lambda: acted.append(read_fired(launcher.fired_file)),
        fired=launcher.fired_file,
    )
    injector("backward", 1, 0)
    assert acted == [{fault_flag(nan)}]
    assert launcher._pending_faults(1) == [transfer, slow]
    injector("backward", 1, 0)  # (once per process, too)
    assert len(acted) == 1
    # A line still being written is not a fired fault yet.
    with open(launcher.fired_file, "a") as f:
        f.write(fault_flag(transfer)[:-3])
    assert launcher._pending_faults(1) == [transfer, slow]
    assert launcher._pending_faults(0) == []


@pytest.mark.timeout(240)
def test_a_fault_fires_once_per_run_wherever_the_script_writes_its_events(
    custom_token_file, tmp_path
):
    """`recover run` of examples/train_custom.py, whose processes write their events to a file of
    their own (RECOVER_EVENTS is the script's to honour), not the run's metrics.jsonl. Replica 1
    is SIGKILLed at step 1, its respawn while receiving the state; the second respawn, given
    neither fault again, joins and trains to the end: each fault fired once."""
    out = tmp_path / "run"
    elsewhere = tmp_path / "script-events.jsonl"
    script = tmp_path / "custom_elsewhere.py"
    script.write_text(
        "import os, runpy, sys\n"
        f"os.environ['RECOVER_EVENTS'] = {str(elsewhere)!r}\n"
        f"sys.argv[0] = {str(EXAMPLES / 'train_custom.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    r = finish(
        start_cli([
            "run", "--out", str(out / "job"), "--replicas", "2", "--respawn", "0",
            "--fault", "kill:replica=1,step=1,phase=backward",
            "--fault", "kill:replica=1,step=1,phase=transfer",
            "--", sys.executable, str(script), "--out", str(out / "result"),
            "--data", str(custom_token_file),
            "--steps", "80", "--microbatches", "4",  # the second respawn joined at step 7
        ]),
        200,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert not events(out / "job", "failure_injected"), "the script's events went to the record"
    injected = [e for e in read_metrics(elsewhere) if e.get("name") == "failure_injected"]
    assert sorted(e["phase"] for e in injected) == ["backward", "transfer"], injected
    fired = (out / "job" / FIRED_FILE).read_text().splitlines()
    assert sorted(fired) == ["kill:replica=1,step=1,phase=backward,microbatch=0",
                             "kill:replica=1,step=1,phase=transfer"]  # fmt: skip
    joined = [e for e in read_metrics(elsewhere) if e.get("name") == "state_transfer"]
    assert {e["replica"] for e in joined} == {1}, "the second respawn never joined"
    assert "replica 1 (restart 1) killed by SIGKILL" in r.stdout, r.stdout[-3000:]
    assert "(restart 2) killed" not in r.stdout, r.stdout[-3000:]
    assert leftover_processes(str(out)) == []


def test_a_fault_in_the_work_ahead_is_refused_where_there_is_none(tmp_path):
    """Phase `ahead` (the next step's first microbatch, computed during step T's vote) fires
    only where the run computes ahead and step T has a next step: elsewhere it is refused at
    start-up, naming why, instead of never firing."""
    spec = parse_fault("kill:replica=1,step=2,phase=ahead")
    assert fault_flag(spec) == "kill:replica=1,step=2,phase=ahead"
    check_faults_fit([spec], steps=4, microbatches=M)
    with pytest.raises(ValueError, match="step=2 has no next step"):
        check_faults_fit([spec], steps=3, microbatches=M)
    with pytest.raises(ValueError, match="never fires, the run has --no-ahead"):
        check_faults_fit([spec], steps=4, microbatches=M, ahead="the run has --no-ahead")
    check_faults_fit(  # (other phases do not care)
        [parse_fault("kill:replica=1,step=2,phase=backward")], steps=3, microbatches=M,
        ahead="the run has --no-ahead",
    )  # fmt: skip
    r = run_cli(["train", "--replicas", "2", "--no-ahead", "--out", str(tmp_path / "run"),
                 "--fault", fault_flag(spec)])  # fmt: skip
    assert r.returncode != 0 and "never fires, the run has --no-ahead" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
