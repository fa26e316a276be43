"""A coordinator that freezes, with no standby to take over: nobody is declared dead for it.

Real processes, a real fault: `recover train` with two replicas whose coordinator is SIGSTOPped
for longer than its lease and than its replicas' rpc timeout (their sessions drop and register
again), then SIGCONTed: training goes on, the coordinator records its own pause (`revalidated`),
and no `member_dead` or `quorum_lost`. The pure rule behind it (`Resumed`) is checked with an
injected clock. A coordinator that dies (SIGKILL, no standby) is tests/test_graceful.py's.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_coordinator_decide import Sim

from conftest import (
    EXAMPLES,
    assert_last_commit_saved_once,
    coordinator_lost_lines,
    coordinator_pid,
    events,
    finish,
    finish_after,
    last_recorded_step,
    leftover_processes,
    start_cli,
    start_train,
    wait_for_step,
    wait_until,
)
from recover.coordinator.messages import Resumed
from recover.record import committed_steps, read_metrics

M = 4
STEPS = 30
FLAGS = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", str(M),
    "--steps", str(STEPS), "--eval-every", "0", "--warmup-steps", "2", "--ckpt-every", "0",
    "--replicas", "2",
]  # fmt: skip
PAUSE_S = 6.0  # the SIGSTOP: > the lease (1 s) and > a replica's rpc timeout (5 s)


def step_records(out: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"]


def test_coordinator_paused_past_its_lease_declares_nobody_dead(tiny_dataset, tmp_path):
    out = tmp_path / "paused"
    # (--coordinator-grace 30: longer than the pause)
    proc = start_train(tiny_dataset, out, *FLAGS, "--coordinator-grace", "30")
    try:
        wait_for_step(out, 2, alive=[proc], timeout=120)
        pid = coordinator_pid(out)
        stopped = time.time()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)  # the fault itself: the coordinator stays frozen this long
        finally:
            continued = time.time()  # (before the signal: the coordinator may record first)
            os.kill(pid, signal.SIGCONT)
    finally:
        r = finish(proc, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    assert not events(out, "coordinator.member_dead"), "declared dead for the coordinator's pause"
    assert not events(out, "coordinator.quorum_lost")
    # The coordinator noticed its own pause once. A loaded host may stall it at other times too
    # (CI has seen a second stall of over 5 s), and each stall is noticed: each `revalidated`
    # covers the time from the loop's last look at the clock to its event, so the noticed gaps
    # never overlap (one gap noticed twice would), and exactly one spans the SIGSTOP.
    gaps = sorted(
        (e["t_wall"] - e["paused_s"], e["t_wall"], e)
        for e in events(out, "coordinator.revalidated")
    )
    slack = 0.25  # (the event's wall time is taken just after the loop's monotonic look)
    for (_, end, _), (start, _, _) in itertools.pairwise(gaps):
        assert start >= end - slack, f"one pause noticed twice: {gaps}"
    (noticed,) = [
        e for start, end, e in gaps if start <= stopped + slack and end >= continued - slack
    ]
    assert noticed["paused_s"] >= PAUSE_S * 0.9, noticed
    assert sorted(noticed["members"]) == [0, 1]
    # Training went on where it was: every step once, all M microbatches, both replicas to the end
    # with the same parameters.
    assert sorted(step_records(out)) == list(range(STEPS))
    assert {s["microbatches"] for s in committed_steps(out / "metrics.jsonl").values()} == {M}
    hashes = {e["replica"]: e["param_hash"] for e in events(out, "replica_finished")}
    assert sorted(hashes) == [0, 1] and len(set(hashes.values())) == 1, hashes
    assert leftover_processes(str(out)) == []


def test_a_coordinator_frozen_past_the_grace_stops_the_run_as_a_lost_one(tiny_dataset, tmp_path):
    """The coordinator is SIGSTOPped for good: its process lives on, its sockets accept, nothing
    answers. After --coordinator-grace the replicas stop (status 11, one line each), within the
    grace and its bounds, and the launcher ends as for a dead coordinator: status 11, the
    `launcher.coordinator_lost` event, and where the last committed state is with the command to
    continue. No line claims a checkpoint that is not on disk (a frozen coordinator confirms no
    membership: the fence keeps the lowest replica from writing)."""
    out = tmp_path / "frozen"
    grace = 2.0
    proc = start_train(
        tiny_dataset, out, *FLAGS, "--steps", "400", "--coordinator-grace", str(grace)
    )
    try:
        wait_for_step(out, 2, alive=[proc], timeout=120)
    except BaseException:
        proc.kill()  # (the launcher's children die with it)
        proc.wait()
        raise
    r, took = finish_after(proc, lambda: os.kill(coordinator_pid(out), signal.SIGSTOP), 90)
    lost = coordinator_lost_lines(r)
    assert sorted(line.split("]")[0] for line in lost) == ["[replica 0", "[replica 1"], lost
    (said,) = [line for line in r.stdout.splitlines() if "stopped, the coordinator lost" in line]
    assert said.startswith("[launcher]") and "its process is alive" in said, said
    (ended,) = events(out, "launcher.coordinator_lost")
    assert ended["exit_status"] is None and set(ended["replicas"].values()) == {11}, ended
    # Bounded by the grace: the rpc timeout (5 s) and the fence window, not minutes.
    assert took < grace + 20, took
    saved = [e["step"] for e in events(out, "checkpoint_saved")]
    for step in saved:
        assert (out / "checkpoints" / f"step_{step:08d}").is_dir()
    if saved:
        assert "--resume" in said, said
    else:
        assert "no checkpoint was saved" in said, said
        assert not [line for line in r.stdout.splitlines() if "checkpointed step" in line]
    assert leftover_processes(str(out)) == []


def test_a_script_that_does_not_catch_coordinator_lost_ends_with_one_line(
    custom_token_file, tmp_path
):
    """`recover run` of examples/train_custom.py (which does not catch CoordinatorLost): the
    coordinator SIGKILLed mid-run, each replica ends with its one line and status 11 after the
    grace, no traceback, and the launcher exits 11 too."""
    out = tmp_path / "run"
    losses = out / "result" / "losses.jsonl"
    proc = start_cli([
        "run", "--out", str(out / "job"), "--replicas", "2", "--coordinator-grace", "1", "--",
        sys.executable, str(EXAMPLES / "train_custom.py"), "--out", str(out / "result"),
        "--data", str(custom_token_file), "--steps", "300", "--microbatches", "4",
    ])  # fmt: skip
    try:
        wait_until(
            lambda: losses.exists() and len(losses.read_text().splitlines()) >= 3,
            "3 steps committed", alive=[proc], timeout=120,
        )  # fmt: skip
        os.kill(coordinator_pid(out / "job"), signal.SIGKILL)
    finally:
        r = finish(proc, timeout=120)
    lost = coordinator_lost_lines(r)
    assert sorted(line.split("]")[0] for line in lost) == ["[replica 0", "[replica 1"], lost
    (said,) = [line for line in r.stdout.splitlines() if "stopped, the coordinator lost" in line]
    assert said.startswith("[launcher]") and "raised recover.CoordinatorLost" in said, said
    (ended,) = events(out / "job", "launcher.coordinator_lost")
    assert ended["replicas"] == {"replica 0": 11, "replica 1": 11}, ended
    assert leftover_processes(str(out)) == []


def test_hand_started_workers_end_with_one_line_naming_their_resume_command(tiny_dataset, tmp_path):
    """The multi-node way: `recover coordinator serve` and one `recover worker` per replica. The
    coordinator SIGKILLed mid-run: each worker ends after the grace with status 11 and one line
    that names its own command with --resume; the lowest checkpointed the last committed step."""
    addr, run = tmp_path / "addr.json", tmp_path / "run"
    coordinator = start_cli(
        ["coordinator", "serve", "--replicas", "2", "--port", "0", "--lease", "1",
         "--address-file", str(addr)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    workers: list[subprocess.Popen] = []
    try:
        wait_until(addr.exists, "the coordinator's address", alive=[coordinator], timeout=60)
        info = json.loads(addr.read_text())
        for r in (0, 1):
            workers.append(start_cli([
                "worker", *FLAGS[:-2], "--coordinator", f"{info['host']}:{info['port']}",
                "--replica-id", str(r), "--data", str(tiny_dataset), "--out", str(run),
                "--coordinator-grace", "1",
            ]))  # fmt: skip
        wait_until(
            lambda: last_recorded_step(run) >= 2, "3 steps committed", alive=workers, timeout=120
        )
        coordinator.kill()
        coordinator.wait()
        results = [finish(w, timeout=60) for w in workers]
    finally:
        for p in (coordinator, *workers):
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, res in enumerate(results):
        (line,) = coordinator_lost_lines(res)
        command = shlex.split(line.split("to continue: ")[1])
        assert command[:2] == ["recover", "worker"] and command[-1] == "--resume", line
        assert command[command.index("--replica-id") + 1] == str(r), line
    assert_last_commit_saved_once(run)


@pytest.mark.unit
def test_a_resumed_coordinator_judges_no_lease_for_its_own_pause():
    # (Its heartbeats come 0.6 s before the tick, a majority silent over half a lease: without
    # self_suspicion_s=0 the self-suspicion rule would spare replica 2 as well.)
    sim = Sim(expected_replicas=3, self_suspicion_s=0)
    for r in range(3):
        sim.reg(r)
    sim.tick(0.05)
    assert sim.state.status == "running"
    sim.hb(0)
    sim.send(Resumed(paused_s=17.0), dt=17.0)  # nobody could heartbeat for 17 s
    assert sorted(sim.state.live) == [0, 1, 2]
    assert not [d for d in sim.tick(0.5) if d.name == "member_dead"]  # within the fresh lease
    sim.hb(0)
    sim.hb(1)
    dead = [d for d in sim.tick(0.6) if d.name == "member_dead"]  # replica 2 stayed silent
    assert [(d.replica_id, d.how) for d in dead] == [(2, "lease")]
