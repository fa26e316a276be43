"""The Slurm recipe for real: examples/slurm/recover.sbatch on a cluster of four slurmd nodes
(tests/slurm.py: each node its own network namespace, address and hostname on this machine).

Three replicas of examples/train_custom.py on three nodes, the fourth a standby. Once training
runs, the test kills a node whole (its slurmd, step daemon, agent and replica, SIGKILL): the
coordinator declares the node lost after its lease, the standby is handed its replica id, that
replica joins with the live state, and the run ends on the one-replica trajectory with every step
recorded once with all M microbatches. The job completes with status 0; each surviving node's
agent ends with status 0.

The same agent behaviour without Slurm (a node killed, a standby, a drain) is test_agent.py's,
in the default suite; this one is `slow` (about 40 s of a 2-core machine).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import slurm
from hosts import Network
from test_api import EXAMPLES, STEPS, assert_same_trajectory, custom_args, custom_reference

__all__ = ["custom_reference"]  # (the module fixture, shared with test_api)

pytestmark = [pytest.mark.process, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["ctl", "node1", "node2", "node3", "node4"]


@pytest.fixture
def cluster():
    ok, why = slurm.available()
    if not ok:
        pytest.skip(why)
    with Network(len(NAMES), names=NAMES) as net:
        yield slurm.SlurmCluster(net)


def records(run: Path) -> list[dict]:
    from recover.record import read_metrics

    return list(read_metrics(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else []


def committed(run: Path) -> list[int]:
    return [r["step"] for r in records(run) if r.get("kind") == "step"]


def named(run: Path, name: str) -> list[dict]:
    return [r for r in records(run) if r.get("name") == name]


@pytest.mark.timeout(300)
def test_a_slurm_job_survives_a_node_killed_mid_step_on_its_standby_node(
    cluster, custom_reference, custom_token_file, tmp_path
):
    run = tmp_path / "run"
    command = [sys.executable, str(EXAMPLES / "train_custom.py"), "--out", str(tmp_path / "result"),
               *custom_args(custom_token_file)]  # fmt: skip
    env = {
        "RECOVER_TOKEN": "slurm-test-token",
        "PATH": slurm.path_with(Path(sys.executable).parent),
        "OMP_NUM_THREADS": "1",
        "REPLICAS": "3",
        "RUN": str(run),
        "COORDINATOR_FLAGS": "--node-lease 1.5",
        # every replica 5x slower from step 6 (the kill comes after step 5 commits) paces the
        # run, so that the standby joins well before the end
        "AGENT_FLAGS": "--slots 1 --relay "
        + " ".join(f"--fault slow:replica={r},step=6,factor=5" for r in range(3)),
    }
    job = cluster.sbatch(
        ["--nodes", "4", "--output", str(tmp_path / "job.out"), "--chdir", str(ROOT),
         str(ROOT / "examples" / "slurm" / "recover.sbatch"), *command],
        env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while max(committed(run), default=-1) < 5:
        assert time.monotonic() < deadline, (tmp_path / "job.out").read_text()[-3000:]
        assert cluster.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), (
            cluster.job(job), cluster.logs(),
        )  # fmt: skip
        time.sleep(0.2)
    hosts = {e["node"]: e["ids"] for e in named(run, "coordinator.node_assigned")}
    assert sorted(r for ids in hosts.values() for r in ids) == [0, 1, 2], hosts
    # The node to kill: one that hosts a replica, not node1 (the batch host, with the coordinator).
    victim = next(n for n in ("node2", "node3", "node4") if hosts.get(n))
    lost_ids = hosts[victim]
    killed = cluster.kill_node(victim)
    assert killed, "nothing ran on the node"
    info = cluster.wait_job(job, timeout_s=200)
    out = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])

    lost = [e for e in named(run, "coordinator.node_lost") if e["node"] == victim]
    assert [e["ids"] for e in lost] == [lost_ids], lost
    (standby,) = [n for n in NAMES[1:] if n not in hosts]
    taken = [e["ids"] for e in named(run, "coordinator.node_assigned") if e["node"] == standby]
    assert taken == [lost_ids], taken
    assert {t["replica"] for t in named(run, "state_transfer")} == set(lost_ids)
    # every agent relayed its node's replicas (--relay): sessions crossed hosts through them
    assert {e["node"] for e in named(run, "agent.relay_started")} == set(NAMES[1:])
    finished = {e["node"]: e["exit_status"] for e in named(run, "agent.finished")}
    assert finished == {n: 0 for n in NAMES[1:] if n != victim}, finished
    # The invariants: every step once with all M, on the one-replica run's trajectory.
    assert sorted(committed(run)) == list(range(STEPS))
    assert_same_trajectory(custom_reference, tmp_path, steps=STEPS)
