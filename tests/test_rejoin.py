"""Rejoin and scale-up with real processes: respawned and hand-started replicas join a running job
at a step boundary, get the state by live transfer, and the trajectory is unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_invariants as check_invariants
from conftest import child_env, events, finish, leftover_processes
from recover.record import committed_steps, read_metrics

M = 6
# Steps of a run: long enough that a joiner commits well before the end. What a join waits for is
# time (a fork or a cold torch import, the registration, the transfer at a step boundary), so the
# runs are paced by a straggler, replica 0 sleeping (F - 1) times each microbatch's compute
# (`slow` faults, equal shares), rather than made of more steps: a paced step costs the same CPU
# as a plain one, and the whole suite is CPU-bound. Measured at load average 3-6 unpaced, the
# replica killed at step 3: a respawned tiny replica of a 4-replica run (25-30 steps/s) committed
# at steps 26-71 (1-2.5 s after the kill), a respawned replica of 2 sharded ranks (2.7-9 steps/s)
# at steps 13-64; hand-started cold joiners at step 111 of 200 under a 10x pace, with 27 s of the
# run left; a replica killed at its first commit with a standby waiting joined at step 3 (load
# average 10-13). SHORT_STEPS at PACE (about 4x longer steps) lasts as long as 320 plain steps:
# 4.5x the 4-replica respawn's latest join, 5x the sharded one's (it paces too); the joiners'
# pace is 25x, the wall time their 200 steps at 10x had. Every run here is SHORT_STEPS long: one
# reference for all.
SHORT_STEPS = 80
PACE = ["--balance", "equal", "--fault", "slow:replica=0,step=0,factor=4"]
STEPS = SHORT_STEPS
FLAGS = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", str(M),
    "--eval-every", "0", "--warmup-steps", "2", "--check-every", "25",
    # A gentler learning rate than the default 3e-3: over 300 steps at 3e-3 the tiny model
    # amplifies the fp32 summation-order differences between plans to ~1e-4 of the parameters
    # (measured 1.4e-4, the bound of the check); at 1e-3 they stay near 5e-7.
    "--ckpt-every", "0", "--lr", "1e-3", "--min-lr", "1e-4",
]  # fmt: skip


def assert_invariants(
    reference: Path, out: Path, r: subprocess.CompletedProcess, steps: int = STEPS
) -> None:
    check_invariants(reference, out, r, steps=steps, microbatches=M)


def cli(*args: str, env=None, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "recover.cli", *args], stdin=stdin,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or child_env(),
    )  # fmt: skip


def failure_free(data: Path, out: Path, steps: int) -> Path:
    r = finish(cli("train", *FLAGS, "--steps", str(steps), "--data", str(data), "--out", str(out)),
               120)  # fmt: skip
    assert r.returncode == 0, r.stdout
    return out


def send_and_close(proc: subprocess.Popen, text: str) -> None:
    """Write `text` to `proc`'s stdin and close it (then `finish` waits for it as for any)."""
    proc.stdin.write(text)
    proc.stdin.close()
    proc.stdin = None  # (communicate() would flush the closed pipe)


@pytest.fixture(scope="module")
def short_reference(tiny_dataset, tmp_path_factory) -> Path:
    return failure_free(tiny_dataset, tmp_path_factory.mktemp("ref") / "one", SHORT_STEPS)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def respawned_run(reference, data: Path, out: Path, replicas: int, steps: int, *extra: str):
    """A run whose dead replica is respawned at once: the invariants of docs/design.md hold, every replica
    (the respawned one too) finishes with the same parameters, and its state_transfer events."""
    r = finish(
        cli("train", *FLAGS, "--steps", str(steps), "--data", str(data), "--out", str(out),
            "--replicas", str(replicas), "--respawn", "0", *extra),
        150,
    )  # fmt: skip
    assert_invariants(reference, out, r, steps)
    finished = {e["replica"]: e["param_hash"] for e in events(out, "replica_finished")}
    assert sorted(finished) == list(range(replicas)) and len(set(finished.values())) == 1
    return r, events(out, "state_transfer")


@pytest.mark.timeout(180)
def test_a_killed_replica_is_respawned_and_four_replicas_train_again(
    short_reference, tiny_dataset, tmp_path
):
    out = tmp_path / "respawn"
    # --balance equal: under the default throughput weights a replica slow at step 0 (a loaded
    # CI host) was planned 0 of the 6 ids at steps 1-4, so its backward at step 3, where the
    # kill is declared, never ran and the kill never fired
    r, transfers = respawned_run(
        short_reference, tiny_dataset, out, 4, STEPS, *PACE,
        "--fault", "kill:replica=2,step=3,phase=backward",
    )  # fmt: skip
    assert "respawning replica 2" in r.stdout
    assert [t["replica"] for t in transfers] == [2] and transfers[0]["bytes"] > 0
    assert sorted(transfers[0]["sources"]) == [0, 1, 3]  # a share from each survivor
    joined_at = transfers[0]["step"]
    steps = committed_steps(out / "metrics.jsonl")
    assert all(steps[s]["replicas"] == 3 for s in range(4, joined_at))
    assert all(steps[s]["replicas"] == 4 for s in range(joined_at, STEPS))


# Slow (40 s on 2 cores): the same behaviour, a replica of two FSDP2 ranks killed, respawned and
# each rank given its position's shards, runs by default through the script API
# (test_api.py::test_the_script_sharded_by_fsdp2_survives_a_rank_kill_and_rejoins), and the
# trainer's sharded state through test_multirank's resumes across layouts.
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_replica_of_two_sharded_ranks_is_respawned_and_gets_its_halves(
    short_reference, tiny_dataset, tmp_path
):
    # Rank 1 of replica 1 is killed; its mate stops; the launcher respawns both ranks, which join
    # at a step boundary: each receives the state of its position (its half of the parameters
    # and of the AdamW moments) from replica 0's rank at the same position.
    out = tmp_path / "respawn-hsdp"
    r, transfers = respawned_run(
        short_reference, tiny_dataset, out, 2, SHORT_STEPS, "--shard", "2", "--watchdog", "2",
        *PACE, "--fault", "kill:replica=1,rank=1,step=3,phase=backward",
    )  # fmt: skip
    assert "respawning replica 1" in r.stdout
    assert sorted((t["replica"], t["rank"]) for t in transfers) == [(1, 0), (1, 1)]
    assert len({t["step"] for t in transfers}) == 1 and all(t["bytes"] > 0 for t in transfers)
    assert committed_steps(out / "metrics.jsonl")[SHORT_STEPS - 1]["replicas"] == 2


@pytest.mark.timeout(180)
def test_hand_started_joiners_refused_killed_in_transfer_and_scale_up(
    short_reference, tiny_dataset, tmp_path
):
    out = tmp_path / "join"
    env = child_env() | {"RECOVER_TOKEN": "test-token-123"}
    data = ["--data", str(tiny_dataset), "--out", str(out)]
    # Paced: replica 0 computes its (equal) share 25x slower, so the run is still going when the
    # joiners, each importing torch on a busy machine, register (unpaced, the tiny steps can end
    # first; see SHORT_STEPS's note). A straggler changes no committed value: the trajectory is
    # the reference's.
    pace = ["--balance", "equal", "--fault", "slow:replica=0,step=0,factor=25"]
    run = cli(
        "train", *FLAGS, "--steps", str(SHORT_STEPS), *data, "--replicas", "3", *pace, env=env
    )
    joiners: list[subprocess.Popen] = []
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists() and committed_steps(out / "metrics.jsonl"),
                 90, "the run to start")  # fmt: skip
        address = json.loads((out / "coordinator.json").read_text())
        where = [
            "--coordinator",
            f"127.0.0.1:{address['port']}",
            "--steps",
            str(SHORT_STEPS),
            *data,
        ]
        # A joiner with a 10x learning rate is refused, naming the field; one killed while
        # receiving the state leaves the others training.
        bad = cli("worker", *FLAGS, "--lr", "1e-2", *where, "--replica-id", "3", env=env)
        doomed = cli("worker", *FLAGS, *where, "--replica-id", "4",
                     "--fault", "kill:replica=4,step=0,phase=transfer", env=env)  # fmt: skip
        # Scale-up: a good joiner is admitted at a step boundary and trains to the end.
        good = cli("worker", *FLAGS, *where, "--replica-id", "5", env=env)
        joiners += [bad, doomed, good]
        refused = finish(bad, 60)
        assert refused.returncode == 6, refused.stdout
        assert "fingerprint field 'lr' differs: run has 0.001, replica has 0.01" in refused.stdout
        assert finish(doomed, 60).returncode == -9
        joined = finish(good, 120)
        assert joined.returncode == 0, joined.stdout
        r = finish(run, 60)
    finally:
        for p in [run, *joiners]:
            if p.poll() is None:
                p.terminate()  # the launcher reaps its children on SIGTERM
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    assert_invariants(short_reference, out, r, SHORT_STEPS)
    assert any(e.get("during") == "state transfer" for e in events(out, "failure_detected"))
    # Only the good joiner ever loads the state; it may load it twice when it was admitted with
    # the doomed one (the transfer is repeated in the epoch after the doomed one died in it).
    assert {t["replica"] for t in events(out, "state_transfer")} == {5}
    # The refused joiner left no trace in the run's record (it never was a member); the
    # coordinator's refusal is the record of it.
    assert not [
        e for e in read_metrics(out / "metrics.jsonl")
        if e.get("replica") == 3 and not e.get("name", "").startswith("coordinator.")
    ]  # fmt: skip
    finished = {e["replica"]: e["param_hash"] for e in events(out, "replica_finished")}
    assert sorted(finished) == [0, 1, 2, 5] and len(set(finished.values())) == 1
    assert max(s["replicas"] for s in committed_steps(out / "metrics.jsonl").values()) == 4
    assert leftover_processes(str(out)) == []


def _alive(pid: int) -> bool:
    """Running (a zombie, ended and not yet reaped by its parent, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(180)
def test_a_standby_takes_a_killed_replicas_slot_and_a_dead_standby_is_replaced(
    short_reference, tiny_dataset, tmp_path
):
    # Three replicas and one warm standby. The test SIGKILLs the waiting standby (it is replaced,
    # quietly), then replica 2 once the replacement waits: the replacement takes replica 2's
    # slot, gets the state by transfer, and a third standby is started behind it. Standbys are
    # never members and leave nothing running.
    out = tmp_path / "standby"
    run = cli("train", *FLAGS, "--steps", str(SHORT_STEPS), "--data", str(tiny_dataset),
              "--out", str(out), "--replicas", "3", "--standby", "1", *PACE)  # fmt: skip
    standbys: dict[str, int] = {}

    def started(name: str) -> bool:
        if (out / "metrics.jsonl").exists():
            standbys.update(
                (e["standby"], e["pid"]) for e in events(out, "launcher.standby_started")
            )
        return name in standbys

    try:
        wait_for(lambda: started("standby 1"), 60, "the first standby")
        os.kill(standbys["standby 1"], signal.SIGKILL)
        wait_for(lambda: started("standby 2"), 30, "a standby in place of the killed one")
        wait_for(lambda: committed_steps(out / "metrics.jsonl"), 60, "the first commit")
        victim = next(e["pid"] for e in events(out, "rank_started") if e["replica"] == 2)
        os.kill(victim, signal.SIGKILL)
        r = finish(run, 150)
    finally:
        if run.poll() is None:
            run.terminate()  # the launcher reaps its children on SIGTERM
            finish(run, 10)
        for pid in standbys.values():  # (a standby is the zygote's child: reaped there)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert_invariants(short_reference, out, r, SHORT_STEPS)
    assert "standby 1" not in r.stdout  # replaced quietly (its lines are debug ones)
    # The second standby became replica 2's next incarnation and got the state by transfer.
    pids = [e["pid"] for e in events(out, "rank_started") if e["replica"] == 2]
    assert pids == [victim, standbys["standby 2"]]
    assert [(e["replica"], e["how"]) for e in events(out, "launcher.respawned")] == [(2, "standby")]
    assert [t["replica"] for t in events(out, "state_transfer")] == [2]
    # A third one was started behind it, and waited to the end without ever registering.
    assert started("standby 3") and sorted(standbys) == ["standby 1", "standby 2", "standby 3"]
    retired = events(out, "launcher.standby_retired")
    assert [e["standby"] for e in retired] == ["standby 3"] and retired[0]["cpu_s"] > 0
    registered = {e["replica_id"] for e in events(out, "coordinator.registered")}
    assert registered == {0, 1, 2}
    assert max(s["replicas"] for s in committed_steps(out / "metrics.jsonl").values()) == 3
    assert not [pid for pid in standbys.values() if _alive(pid)]


def test_standby_settings_are_checked():
    from recover.launch import LaunchConfig
    from recover.runtime.layout import ReplicaLayout
    from recover.runtime.spec import ReplicaSpec

    assert (
        LaunchConfig(replicas=2).standby == 0 and LaunchConfig(replicas=2).respawn_delay_s is None
    )
    assert LaunchConfig(replicas=2, standby=1).respawn_delay_s == 0.0  # standbys imply respawns
    assert LaunchConfig(replicas=2, standby=1, respawn_s=2.0).respawn_delay_s == 2.0
    with pytest.raises(ValueError, match="--standby must be >= 0"):
        LaunchConfig(replicas=2, standby=-1)
    with pytest.raises(ValueError, match="replicas of one rank"):
        LaunchConfig(replicas=2, standby=1, replica=ReplicaSpec(layout=ReplicaLayout(shard=2)))
    with pytest.raises(ValueError, match="--mode recover"):
        LaunchConfig(replicas=2, standby=1, replica=ReplicaSpec(mode="shrink"))


@pytest.mark.timeout(180)
def test_a_standby_started_by_hand_waits_writing_nothing(tiny_dataset, tmp_path):
    # A node agent's standby: closed without a line it leaves (exit 0) and wrote nothing; a line
    # that names no replica is refused with the expected form. Neither contacts the coordinator
    # (none listens at the address given).
    out = tmp_path / "never"
    args = ["worker", "--standby", *FLAGS, "--steps", "10", "--coordinator", "127.0.0.1:9",
            "--data", str(tiny_dataset), "--out", str(out)]  # fmt: skip
    retired = cli(*args, stdin=subprocess.PIPE)
    garbled = cli(*args, stdin=subprocess.PIPE)
    try:
        send_and_close(retired, "")
        send_and_close(garbled, "replica 5\n")
        r, g = finish(retired, 120), finish(garbled, 120)  # (each imports torch: 25 s at load 15)
    finally:
        for p in (retired, garbled):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert r.returncode == 0, r.stdout
    assert not out.exists()
    assert g.returncode == 2 and "JSON object with RECOVER_REPLICA_ID" in g.stdout, g.stdout
    assert not out.exists()
