"""Node agents (`recover agent`) with real processes: a node dies mid-step and a standby node
hosts its replica; a drained node leaves at a step boundary; the run stays on the one-replica
trajectory with all M microbatches in every step, each step recorded once.

Three agents on this machine (nodes "a", "b" and the standby "c", one slot each) serve a
coordinator of R = 2 started by hand, as a scheduler's nodes would (docs/multinode.md). The
Slurm recipe's test (test_slurm.py) runs the same agents under slurmd; this one needs nothing
but this machine and covers the agent's hand-over and drain in the default suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from test_api import EXAMPLES, STEPS, assert_same_trajectory, custom_args, custom_reference

from conftest import events, leftover_processes, start_cli, wait_until
from recover.supervisor import free_ports

__all__ = ["custom_reference"]  # (the module fixture, shared with test_api)

pytestmark = pytest.mark.process

TOKEN = "agent-test-token"
NODE_LEASE_S = 1.5


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (children, their children...), read from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def kill_node(agent: subprocess.Popen) -> list[int]:
    """A node's death: its agent and every process under it SIGKILLed at once."""
    victims = [agent.pid, *descendants(agent.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=10)
    return victims


def start_agent(node: str, port: int, out: Path, args: list[str], *faults: str, relay=False):
    log = open(out / f"agent-{node}.log", "w")  # (a pipe nobody reads would fill and block it)
    flags = [f"--fault={f}" for f in faults] + (["--relay"] if relay else [])
    return start_cli(
        ["agent", "--coordinator", f"127.0.0.1:{port}", "--node", node, "--slots", "1",
         "--respawn", "0", "--out", str(out / "job"), *flags, "--",
         "python", str(EXAMPLES / "train_custom.py"), "--out", str(out / "result"), *args],
        stdout=log, env={**os.environ, "OMP_NUM_THREADS": "1", "RECOVER_TOKEN": TOKEN},
    )  # fmt: skip


def node_events(out: Path, name: str, node: str) -> list[dict]:
    if not (out / "job" / "metrics.jsonl").exists():  # (before the first event)
        return []
    return [e for e in events(out / "job", name) if e.get("node") == node]


@pytest.mark.timeout(240)
def test_a_dead_node_is_replaced_by_a_standby_and_a_drained_node_leaves(
    custom_reference, custom_token_file, tmp_path
):
    out = tmp_path
    (out / "job").mkdir()
    (port,) = free_ports(1)
    coordinator = start_cli(
        ["coordinator", "serve", "--port", str(port), "--replicas", "2", "--min-replicas", "1",
         "--node-lease", str(NODE_LEASE_S), "--events", str(out / "job" / "metrics.jsonl")],
        stdout=open(out / "coordinator.log", "w"),
        env={**os.environ, "OMP_NUM_THREADS": "1", "RECOVER_TOKEN": TOKEN},
    )  # fmt: skip
    # Replica 0 is SIGKILLed in a forward of step 2: its agent restarts it in place (--respawn
    # 0) and it rejoins. Replica 1 stops itself (SIGSTOP) in a backward of step 24 of 60, well
    # after that (were replica 1 the only holder of the state when it died, the run would stop,
    # as test_coordinator_decide says): its node is then killed
    # whole, the stopped replica with it, so no exit of it ever reaches its agent (a node's
    # death, not a replica's). Slower replicas pace the run, so that the standby joins well
    # before the end and node a's drain comes before it too: replica 0 (5x) throughout, and
    # replica 1 (5x) after its hang, which is its next incarnation's, on the standby node.
    hang = STEPS * 2 // 5
    args = custom_args(custom_token_file)
    faults = (
        "kill:replica=0,step=2,phase=forward", f"hang:replica=1,step={hang},phase=backward",
        "slow:replica=0,step=0,factor=5", f"slow:replica=1,step={hang + 1},factor=5",
    )  # fmt: skip
    agents: dict[str, subprocess.Popen] = {}
    try:
        for node in ("a", "b"):  # (a relays its replicas' sessions; b's speak to the coordinator)
            agents[node] = start_agent(node, port, out, args, *faults, relay=node == "a")
            wait_until(lambda n=node: node_events(out, "coordinator.node_assigned", n),
                       f"node {node} to be given an id", alive=[coordinator], timeout=60)  # fmt: skip
        agents["c"] = start_agent("c", port, out, args, *faults, relay=True)  # last: the standby
        wait_until(lambda: node_events(out, "coordinator.node_joined", "c"), "the standby node",
                   alive=[coordinator], timeout=60)  # fmt: skip
        hosts = {e["node"]: e["ids"] for e in events(out / "job", "coordinator.node_assigned")}
        assert hosts == {"a": [0], "b": [1]}, hosts
        hung = lambda: [e for e in node_events(out, "failure_injected", None) if e["replica"] == 1]  # noqa: E731
        wait_until(hung, "replica 1's hang",
                   alive=[coordinator], timeout=120)  # fmt: skip
        killed = kill_node(agents["b"])
        assert len(killed) >= 2  # the agent and (at least) the stopped replica under it
        wait_until(lambda: {e["replica"] for e in node_events(out, "state_transfer", None)} == {0, 1},
                   "the respawned replica 0 and the standby's replica 1 to join",
                   alive=[coordinator], timeout=60)  # fmt: skip
        # Node "a" drained (scancel, a pod deleted): its replica leaves at a step boundary.
        agents["a"].send_signal(signal.SIGTERM)
        codes = {n: agents[n].wait(timeout=120) for n in ("a", "c")}
        assert coordinator.wait(timeout=30) == 0
    finally:
        for p in [*agents.values(), coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = {n: (out / f"agent-{n}.log").read_text() for n in agents}
    assert codes == {"a": 0, "c": 0}, logs
    assert agents["b"].returncode == -signal.SIGKILL
    lost = node_events(out, "coordinator.node_lost", "b")
    assert [e["ids"] for e in lost] == [[1]], lost
    assert [e["ids"] for e in node_events(out, "coordinator.node_assigned", "c")] == [[1]]
    transfers = events(out / "job", "state_transfer")
    assert {t["replica"] for t in transfers} == {0, 1}, transfers
    assert [d["replica_id"] for d in events(out / "job", "coordinator.member_dead")] == [0, 1]
    respawned = node_events(out, "agent.respawned", "a")
    assert [(e["replica"], e["restart"]) for e in respawned] == [(0, 1)], respawned
    drained = node_events(out, "agent.finished", "a")
    assert [(e["exit_status"], e["reason"]) for e in drained] == [
        (0, "drained: its replicas left at a step boundary")
    ]
    assert node_events(out, "coordinator.node_left", "a"), "the drained node left the table"
    left = events(out / "job", "coordinator.epoch_changed")
    assert any("replicas [0] left at the boundary" in e["reason"] for e in left), left
    finished = node_events(out, "agent.finished", "c")
    assert [(e["exit_status"], e["reason"]) for e in finished] == [(0, "the run finished")]
    # The invariants: every step once with all M, on the one-replica run's trajectory.
    assert_same_trajectory(custom_reference, out, steps=STEPS)
    # Nodes a and c relayed their replicas (their sessions reached the coordinator through the
    # agents); node b's replica spoke to it directly.
    served = (out / "coordinator.log").read_text()
    assert "relay node:a connected" in served and "relay node:c connected" in served, served[-3000:]
    assert "relay node:b" not in served
    assert {e["node"] for e in events(out / "job", "agent.relay_started")} == {"a", "c"}
    steps = [r for r in map(json.loads, (out / "job" / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "step"]  # fmt: skip
    assert sorted(r["step"] for r in steps) == list(range(STEPS))
    assert leftover_processes(str(out)) == []


@pytest.mark.unit
def test_the_docs_exit_table_lists_every_agent_status():
    from recover.agent import AGENT_EXITS

    text = (Path(__file__).resolve().parents[1] / "docs" / "multinode.md").read_text()
    table = text.split("### Exit statuses", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert sorted(int(r) for r in rows if r.isdigit()) == sorted(AGENT_EXITS)


@pytest.mark.unit
def test_a_failed_agent_writes_torchelastics_error_file(tmp_path):
    from recover.agent import write_error_file

    path = tmp_path / "error.json"
    write_error_file(str(path), "the coordinator was lost: timed out", 11, "node7")
    data = json.loads(path.read_text())
    assert (
        data["message"]["message"] == "recover agent on node7: the coordinator was lost: timed out"
    )
    assert data["message"]["extraInfo"]["exit_status"] == 11
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    write_error_file(None, "ignored", 1, "node7")  # unset: nothing written, no error


@pytest.mark.unit
def test_bad_agent_flags_are_one_line_errors(capsys):
    from recover.cli import main

    assert main(["agent", "--", "python", "x.py"]) == 2
    assert "--coordinator HOST:PORT is required" in capsys.readouterr().err
    assert main(["agent", "--coordinator", "h:1", "--slots", "-1", "--", "python", "x.py"]) == 2
    assert "--slots must be an int >= 0" in capsys.readouterr().err
    assert main(["agent", "--coordinator", "h:1"]) == 2
    assert "needs a command after --" in capsys.readouterr().err
    assert main(["agent", "--coordinator", "nope", "--", "python", "x.py"]) == 2
    assert "--coordinator must be HOST:PORT" in capsys.readouterr().err
