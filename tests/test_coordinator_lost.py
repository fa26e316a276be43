"""A coordinator that freezes, with no standby to take over: nobody is declared dead for it.

Real processes, a real fault: `recover train` with two replicas whose coordinator is SIGSTOPped
for longer than its lease and than its replicas' rpc timeout (their sessions drop and register
again), then SIGCONTed: training goes on, the coordinator records its own pause (`revalidated`),
and no `member_dead` or `quorum_lost`. The pure rule behind it (`Resumed`) is checked with an
injected clock. A coordinator that dies (SIGKILL, no standby) is tests/test_graceful.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_coordinator_decide import Sim

from conftest import child_env, events, finish, leftover_processes
from recover.coordinator.protocol import Resumed
from recover.record import committed_steps, read_metrics

M = 4
STEPS = 30
FLAGS = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", str(M),
    "--steps", str(STEPS), "--eval-every", "0", "--warmup-steps", "2", "--ckpt-every", "0",
    "--replicas", "2",
]  # fmt: skip
PAUSE_S = 6.0  # the SIGSTOP: > the lease (1 s) and > a replica's rpc timeout (5 s)


def start_train(data: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "recover.cli", "train", *FLAGS, "--data", str(data),
         "--out", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip


def step_records(out: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"]


def coordinator_pid_after(out: Path, proc: subprocess.Popen, steps: int) -> int:
    """The coordinator's pid, once `steps` steps have committed (bounded wait)."""
    end = time.monotonic() + 120
    while time.monotonic() < end and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(set(step_records(out))) >= steps:
            return int(json.loads((out / "coordinator.json").read_text())["pid"])
        time.sleep(0.02)
    raise AssertionError(f"the run did not commit {steps} steps in time (exit {proc.poll()})")


def test_coordinator_paused_past_its_lease_declares_nobody_dead(tiny_dataset, tmp_path):
    out = tmp_path / "paused"
    proc = start_train(tiny_dataset, out, "--coordinator-grace", "30")  # the pause is shorter
    try:
        pid = coordinator_pid_after(out, proc, 3)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)  # the fault itself: the coordinator stays frozen this long
        finally:
            os.kill(pid, signal.SIGCONT)
        r = finish(proc, timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    assert not events(out, "coordinator.member_dead"), "declared dead for the coordinator's pause"
    assert not events(out, "coordinator.quorum_lost")
    # The coordinator noticed its own pause (it may also notice shorter stalls of a loaded host).
    (noticed,) = [
        e for e in events(out, "coordinator.revalidated") if e["paused_s"] >= PAUSE_S * 0.9
    ]
    assert sorted(noticed["members"]) == [0, 1]
    # Training went on where it was: every step once, all M microbatches, both replicas to the end
    # with the same parameters.
    assert sorted(step_records(out)) == list(range(STEPS))
    assert {s["microbatches"] for s in committed_steps(out / "metrics.jsonl").values()} == {M}
    hashes = {e["replica"]: e["param_hash"] for e in events(out, "replica_finished")}
    assert sorted(hashes) == [0, 1] and len(set(hashes.values())) == 1, hashes
    assert leftover_processes(str(out)) == []


@pytest.mark.unit
def test_a_resumed_coordinator_judges_no_lease_for_its_own_pause():
    sim = Sim(expected_replicas=3)
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


@pytest.mark.unit
def test_an_accusation_open_at_the_pause_gets_a_fresh_grace():
    sim = Sim(expected_replicas=2)
    for r in range(2):
        sim.reg(r)
    sim.tick(0.05)
    sim.failed(0, suspects=[1])
    sim.send(Resumed(paused_s=5.0), dt=5.0)
    assert not [d for d in sim.tick(0.1) if d.name == "member_dead"]
    sim.hb(0)
    dead = [d for d in sim.tick(0.3) if d.name == "member_dead"]  # still silent after its grace
    assert [(d.replica_id, d.how) for d in dead] == [(1, "report")]
