"""The multi-host tier: the documented multi-node recipe, run on hosts made of network namespaces.

Each test builds its hosts with tests/hosts.py (a bridge, one address per host, each host its own
hostname and /etc/hosts) and runs the coordinator on host 0 and one replica per other host, as
docs/running.md "Multi-node" and docs/multinode.md say: `recover coordinator serve --host 0.0.0.0`, then
`recover worker` (under torchrun, as written there) with the coordinator's address. Then the
invariants: every step committed once with all M microbatches, the trajectory of a one-replica
run, identical survivors, and nothing left behind (processes, namespaces).

Faults are real: a SIGKILL at a declared point, a host cut off the bridge (its frames vanish, as
in a real partition) for less or more than the grace, a link with delay and loss. Only addresses
inside these namespaces are used; every namespace is removed at the end, also on failure.
Needs root, iproute2 and unshare (CI installs them); elsewhere every test skips with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import hosts
import pytest

from conftest import (
    TINY_TRAIN_FLAGS,
    assert_invariants,
    child_env,
    events,
    last_recorded_step,
    leftover_processes,
    run_cli,
    wait_until,
)
from recover import exits

pytestmark = pytest.mark.process

PORT = 29400
TOKEN = "multihost-test-token"
STEPS = 10
M = 4
FLAGS = [*TINY_TRAIN_FLAGS, "--steps", str(STEPS), "--eval-every", "0", "--ckpt-every", "0"]


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces():
    ok, why = hosts.available(tap=True)
    if not ok:
        pytest.skip(f"the multi-host tier needs network namespaces: {why}")


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory) -> Path:
    """The failure-free one-replica run every multi-host run must equal."""
    out = tmp_path_factory.mktemp("multihost") / "one"
    r = run_cli(["train", *FLAGS, "--replicas", "1", "--data", str(tiny_dataset),
                 "--out", str(out)], timeout=90)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _env(**extra: str) -> dict[str, str]:
    return {**child_env(), "RECOVER_TOKEN": TOKEN, **extra}


def start_coordinator(
    host: hosts.Host, run: Path, *args: str, lease: float = 1.0, replicas: int = 2
) -> subprocess.Popen:
    """The coordinator command of docs/running.md ("Multi-node") on `host`, bound to every interface."""
    run.mkdir(parents=True, exist_ok=True)
    return host.popen(
        [sys.executable, "-m", "recover.cli", "coordinator", "serve", "--host", "0.0.0.0",
         "--port", str(PORT), "--replicas", str(replicas),
         "--lease", str(lease),
         "--events", str(run / "metrics.jsonl"), *args],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def start_worker(
    host: hosts.Host,
    coordinator: hosts.Host,
    replica: int,
    data: Path,
    run: Path,
    *args: str,
    torchrun: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`recover worker` for `replica` on `host` (under torchrun as docs/multinode.md writes it)."""
    worker = ["worker", "--coordinator", f"{coordinator.addr}:{PORT}", "--replica-id",
              str(replica), "--data", str(data), "--out", str(run), *FLAGS, *args]  # fmt: skip
    if torchrun:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "1", "--max-restarts", "0", "-m", "recover.cli"]  # fmt: skip
    else:
        head = [sys.executable, "-m", "recover.cli"]
    return host.popen(
        [*head, *worker], env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def finish_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every process (killing what is left at the deadline); their output."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append(text or "")
    return out


def completed(code: int, outputs: list[str]) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], code, "\n".join(outputs), "")


@pytest.mark.timeout(150)
def test_the_documented_recipe_trains_across_hosts_through_a_kill(
    reference, tiny_dataset, tmp_path
):
    """The Multi-node commands of docs/running.md as written (coordinator bound to 0.0.0.0, one torchrun per
    replica on its own host): replica 1 SIGKILLed mid-step; the survivor commits every step
    with all M microbatches on the one-replica trajectory."""
    run = tmp_path / "run"
    with hosts.Network(3) as net:
        coordinator = start_coordinator(net.host(0), run)
        kill = "kill:replica=1,step=4,phase=backward,microbatch=0"
        workers = [
            start_worker(net.host(1), net.host(0), 0, tiny_dataset, run, torchrun=True),
            start_worker(
                net.host(2), net.host(0), 1, tiny_dataset, run, "--fault", kill, torchrun=True
            ),  # fmt: skip
        ]
        outputs = finish_all(workers, timeout=120)
        coord_out = finish_all([coordinator], timeout=15)
    assert workers[0].returncode == 0, outputs[0][-3000:]
    assert workers[1].returncode != 0  # it was killed
    dead = events(run, "coordinator.member_dead")
    assert [(e["replica_id"], e["how"]) for e in dead] == [(1, "exit")], dead
    assert_invariants(reference, run, completed(0, outputs), steps=STEPS, microbatches=M)
    assert coordinator.returncode == 0, coord_out[0][-2000:]


@pytest.mark.timeout(150)
def test_hostnames_that_resolve_to_loopback_still_train(reference, tiny_dataset, tmp_path):
    """A stock /etc/hosts maps each host's own name to 127.0.1.1, which gloo's default would
    advertise. Replica 0 names its interface (RECOVER_IFNAME; --ifname and torch's
    GLOO_SOCKET_IFNAME alike), replica 1 names nothing and advertises the address it reaches the
    coordinator from: they train together on the one-replica trajectory."""
    run = tmp_path / "run"
    with hosts.Network(3, mode="loopback") as net:
        coordinator = start_coordinator(net.host(0), run)
        workers = [
            start_worker(net.host(1), net.host(0), 0, tiny_dataset, run,
                         env=_env(RECOVER_IFNAME="eth0")),
            start_worker(net.host(2), net.host(0), 1, tiny_dataset, run),
        ]  # fmt: skip
        outputs = finish_all(workers, timeout=120)
        finish_all([coordinator], timeout=15)
    assert [w.returncode for w in workers] == [0, 0], outputs[0][-3000:]
    assert "interface eth0" in outputs[0] and "RECOVER_IFNAME" in outputs[0], outputs[0][-2000:]
    assert "reaches the coordinator" in outputs[1], outputs[1][-2000:]
    assert_invariants(reference, run, completed(0, outputs), steps=STEPS, microbatches=M)


@pytest.mark.timeout(60)
def test_an_interface_that_cannot_reach_the_peers_is_refused_in_one_line(tiny_dataset, tmp_path):
    """--ifname lo with the coordinator on another host would advertise loopback: the worker
    stops before it registers, with one line naming the host, the address and what to set."""
    run = tmp_path / "run"
    with hosts.Network(2) as net:
        coordinator = start_coordinator(net.host(0), run)
        worker = start_worker(net.host(1), net.host(0), 0, tiny_dataset, run, "--ifname", "lo")
        (out,) = finish_all([worker], timeout=40)
        coordinator.kill()
        finish_all([coordinator], timeout=10)
    assert worker.returncode not in (0, None) and "Traceback" not in out, out[-3000:]
    said = [line for line in out.splitlines() if "loopback" in line]
    assert said and net.host(1).name in said[0] and "--ifname" in said[0], out[-3000:]


@pytest.mark.timeout(150)
def test_a_replica_that_cannot_be_dialled_is_named_and_evicted(reference, tiny_dataset, tmp_path):
    """Replica 2's host can reach the coordinator only (its route to the other hosts is gone, as
    behind a firewall between racks): its group cannot form. Within a few attempts its peers'
    probes name it, the coordinator evicts it (`member_dead`, how "unreachable", its address in
    the reason), it exits with status 4 without a traceback, and the two others train every
    step with all M microbatches on the one-replica trajectory."""
    run = tmp_path / "run"
    with hosts.Network(4) as net:
        lone = net.host(3)
        for argv in (["route", "del", f"{net.subnet}.0/24", "dev", "eth0"],
                     ["route", "add", f"{net.host(0).addr}/32", "dev", "eth0"]):  # fmt: skip
            r = lone.run([net.tools["ip"], *argv], timeout=10)
            assert r.returncode == 0, r.stderr
        coordinator = start_coordinator(net.host(0), run, replicas=3)
        workers = [start_worker(net.host(r + 1), net.host(0), r, tiny_dataset, run) for r in (0, 1)]
        workers.append(start_worker(lone, net.host(0), 2, tiny_dataset, run))
        outputs = finish_all(workers, timeout=120)
        coord_out = finish_all([coordinator], timeout=15)
    assert [w.returncode for w in workers] == [0, 0, exits.EVICTED], coord_out[0][-3000:]
    assert "Traceback" not in outputs[2], outputs[2][-3000:]
    dead = events(run, "coordinator.member_dead")
    assert [(e["replica_id"], e["how"]) for e in dead] == [(2, "unreachable")], dead
    assert lone.addr in dead[0]["reason"], dead[0]["reason"]
    redos = events(run, "coordinator.redo")
    assert len(redos) <= 4, f"{len(redos)} redos before the eviction: {redos}"
    assert_invariants(reference, run, completed(0, outputs[:2]), steps=STEPS, microbatches=M)


@pytest.mark.timeout(150)
def test_a_run_that_lost_its_quorum_resumes_against_the_same_coordinator(
    reference, tiny_dataset, tmp_path
):
    """min_replicas 2 and replica 1 SIGKILLed: the quorum is lost, replica 0 saves the last
    committed step and exits 3 in one line. Both replicas restarted with --resume against the
    coordinator that is still up: the run forms again (`coordinator.reforming`), goes on from
    the checkpoint, and ends on the one-replica trajectory, every step recorded once."""
    run = tmp_path / "run"
    with hosts.Network(3) as net:
        coordinator = start_coordinator(net.host(0), run, "--min-replicas", "2")
        kill = "kill:replica=1,step=4,phase=backward,microbatch=0"
        first = [
            start_worker(net.host(1), net.host(0), 0, tiny_dataset, run),
            start_worker(net.host(2), net.host(0), 1, tiny_dataset, run, "--fault", kill),
        ]
        lost = finish_all(first, timeout=90)
        assert first[0].returncode == exits.QUORUM_LOST, lost[0][-3000:]
        assert "Traceback" not in lost[0] and "--resume" in lost[0], lost[0][-3000:]
        again = [
            start_worker(net.host(r + 1), net.host(0), r, tiny_dataset, run, "--resume")
            for r in (0, 1)
        ]
        outputs = finish_all(again, timeout=90)
        coord_out = finish_all([coordinator], timeout=15)
    assert [w.returncode for w in again] == [0, 0], outputs[0][-3000:] + coord_out[0][-2000:]
    (reform,) = events(run, "coordinator.reforming")
    assert reform["lost_at"] == 3, reform
    assert_invariants(reference, run, completed(0, outputs), steps=STEPS, microbatches=M)


@pytest.mark.timeout(150)
def test_a_replica_cut_off_past_its_lease_is_fenced_then_rejoins_as_a_new_member(
    reference, tiny_dataset, tmp_path
):
    """Replica 1's host leaves the network for 3 s (lease 1 s, grace 10 s): after its lease the
    coordinator declares it dead and replica 0 redoes the step alone, with all M microbatches.
    Healed within its grace, the old replica 1 learns it was evicted: status 4, no traceback,
    and not one line written into the run after the cut. Restarted, replica 1 registers as a
    new member, gets the live state and trains to the end on the one-replica trajectory.
    (Replica 0 is paced 100x from step 2 so that the run outlasts the restart.)"""
    run = tmp_path / "run"
    with hosts.Network(3) as net:
        coordinator = start_coordinator(net.host(0), run)
        pace = "slow:replica=0,step=2,factor=100"
        workers = [
            start_worker(net.host(1), net.host(0), 0, tiny_dataset, run, "--fault", pace),
            start_worker(net.host(2), net.host(0), 1, tiny_dataset, run),
        ]
        wait_until(lambda: last_recorded_step(run) >= 1, "step 1", alive=workers, timeout=90)
        net.host(2).partition()
        cut = time.time()
        time.sleep(3.0)  # the partition's length (what is tested), not a wait for a result
        net.host(2).heal()
        (old,) = finish_all([workers[1]], timeout=30)
        restarted = time.time()
        new = start_worker(net.host(2), net.host(0), 1, tiny_dataset, run)
        outputs = finish_all([workers[0], new], timeout=120)
        finish_all([coordinator], timeout=15)
    assert workers[1].returncode == exits.EVICTED and "Traceback" not in old, old[-3000:]
    assert [workers[0].returncode, new.returncode] == [0, 0], outputs[1][-3000:]
    dead = events(run, "coordinator.member_dead")
    assert [(e["replica_id"], e["how"]) for e in dead] == [(1, "lease")], dead
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    fenced = [
        r for r in lines
        if r.get("replica") == 1 and cut + 0.5 < r["t_wall"] < restarted
        and not r.get("name", "").startswith("coordinator.")  # the coordinator's, about it
    ]  # fmt: skip
    assert fenced == [], fenced
    assert {t["replica"] for t in events(run, "state_transfer")} == {1}
    assert_invariants(reference, run, completed(0, outputs), steps=STEPS, microbatches=M)


@pytest.mark.timeout(150)
def test_the_coordinators_host_cut_off_for_less_than_the_grace_is_survived(
    reference, tiny_dataset, tmp_path
):
    """The coordinator's host leaves the network for 3 s (lease 1 s, grace 10 s): every lease
    runs out together, the coordinator suspects itself (revalidated), nobody dies, the replicas
    wait within the grace, and the run goes on to the end on the one-replica trajectory."""
    run = tmp_path / "run"
    with hosts.Network(3) as net:
        coordinator = start_coordinator(net.host(0), run)
        workers = [start_worker(net.host(r + 1), net.host(0), r, tiny_dataset, run) for r in (0, 1)]
        wait_until(lambda: last_recorded_step(run) >= 2, "step 2", alive=workers, timeout=90)
        net.host(0).partition()
        time.sleep(3.0)  # the partition's length (what is tested), not a wait for a result
        net.host(0).heal()
        outputs = finish_all(workers, timeout=90)
        finish_all([coordinator], timeout=15)
    assert [w.returncode for w in workers] == [0, 0], outputs[0][-3000:]
    assert events(run, "coordinator.member_dead") == []
    assert events(run, "coordinator.revalidated"), "the coordinator never suspected itself"
    assert_invariants(reference, run, completed(0, outputs), steps=STEPS, microbatches=M)


@pytest.mark.timeout(150)
def test_the_coordinators_host_cut_off_past_the_grace_ends_the_run_within_its_bounds(
    tiny_dataset, tmp_path
):
    """Cut off for good: each replica stops within grace + lease of losing it (status 11, one
    line with its resume command, saying truly whether the last committed step was saved)."""
    run = tmp_path / "run"
    grace, lease = 3.0, 1.0
    with hosts.Network(3) as net:
        coordinator = start_coordinator(net.host(0), run)
        workers = [
            start_worker(
                net.host(r + 1),
                net.host(0),
                r,
                tiny_dataset,
                run,
                "--coordinator-grace",
                str(grace),
                "--steps",
                "400",
            )  # fmt: skip
            for r in (0, 1)
        ]
        wait_until(lambda: last_recorded_step(run) >= 2, "step 2", alive=workers, timeout=90)
        net.host(0).partition()
        cut = time.monotonic()
        ended = []
        for w in workers:
            w.wait(timeout=60)
            ended.append(time.monotonic() - cut)
        outputs = finish_all(workers, timeout=10)
        coordinator.kill()
        finish_all([coordinator], timeout=10)
    for w, out in zip(workers, outputs, strict=True):
        assert w.returncode == exits.COORDINATOR_LOST and "Traceback" not in out, out[-3000:]
        assert any("the coordinator is lost" in line for line in out.splitlines()), out[-2000:]
    # A step in flight when the cut came may wait one more lease to be abandoned; 1 s of slack
    # for a loaded machine's process exit.
    assert max(ended) <= grace + 2 * lease + 1.0, (ended, outputs)
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "step"]  # fmt: skip
    assert sorted(steps) == list(range(len(steps))), "a committed step without its one record"
    # No line claims a checkpoint that is not on disk. Cut off, the lowest replica cannot learn
    # whether the coordinator evicted it (its own link may be the one cut), so its fence refuses
    # the save, and its line says so; a save that went through is announced once, durable.
    saved = [(e["step"], e["replica"]) for e in events(run, "checkpoint_saved")]
    (lowest,) = [line for line in outputs[0].splitlines() if "the coordinator is lost" in line]
    claimed = f"step {len(steps) - 1}, the last committed, is checkpointed" in lowest
    assert claimed == bool(saved), (saved, lowest)
    if claimed:
        assert saved == [(len(steps), 0)] and (run / "checkpoints").is_dir()
    else:
        assert "was not saved" in lowest and not (run / "checkpoints").exists(), lowest
    assert leftover_processes(str(run)) == []


@pytest.mark.timeout(150)
def test_a_slow_lossy_link_causes_no_false_death(reference, tiny_dataset, tmp_path):
    """One replica's host behind 25 ms each way (a 50 ms round trip) and 5% frame loss (a
    user-space relay: this kernel has no netem): nobody is declared dead, and the run is the
    one-replica trajectory. With 5% loss TCP's resend backoff (200 ms, then 400 ms, ...) can
    silence a heartbeat for over a second: the default 1 s lease gave a false death in 1 of 3
    runs at a 100 ms round trip (docs/multinode.md), so this run uses the 3 s lease that page
    recommends for lossy links."""
    run = tmp_path / "run"
    with hosts.Network(3, impaired={2: (25.0, 0.05)}) as net:
        coordinator = start_coordinator(net.host(0), run, lease=3.0)
        workers = [start_worker(net.host(r + 1), net.host(0), r, tiny_dataset, run) for r in (0, 1)]
        outputs = finish_all(workers, timeout=130)
        finish_all([coordinator], timeout=15)
    assert [w.returncode for w in workers] == [0, 0], outputs[1][-3000:]
    assert events(run, "coordinator.member_dead") == []
    assert_invariants(reference, run, completed(0, outputs), steps=STEPS, microbatches=M)
