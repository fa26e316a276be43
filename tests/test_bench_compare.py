"""`recover bench compare` end to end on a short run: every mode on the same work and one kill.

The table's columns must come from the runs: the shrink baseline shows fewer microbatches after
the failure and drifts from the failure-free loss; recover keeps M and the trajectory;
checkpoint-restart keeps the trajectory but recommits the steps after its checkpoint.

The torchft harness's launcher (restarts of dead replicas, the end of a run) and its fault
hand-over are checked here on real processes without torchft; the torchft run itself only where
torchft is installed (the dev extra, which CI installs, has it; elsewhere those tests skip,
saying so). The short comparison leaves torchft's rows out (--without-torchft); the torchft
test runs its harness.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from conftest import child_env, leftover_processes

M = 6


def _torchft_installed() -> bool:
    from recover.tooling.torchft_harness import TorchftUnavailable, require_torchft

    try:
        require_torchft()
    except TorchftUnavailable:
        return False
    return True


@pytest.mark.timeout(300)
def test_short_compare_computes_every_column_from_the_runs(tiny_dataset, tmp_path):
    out = tmp_path / "cmp"
    r = subprocess.run(
        [sys.executable, "-m", "recover.cli", "bench", "compare", "--preset", "tiny",
         "--replicas", "2", "--steps", "12", "--microbatches", str(M), "--microbatch-size", "2",
         "--seq-len", "32", "--faults", "every=4,count=1,offset=2", "--ckpt-every", "4",
         "--data", str(tiny_dataset), "--out", str(out), "--json", str(tmp_path / "cmp.json"),
         "--without-torchft"],
        capture_output=True, text=True, timeout=280, env=child_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads((out / "compare.json").read_text())["rows"]}
    # torchft's rows are left out here (the torchft test below runs its harness): 40% of the
    # time of this test on 2 cores.
    assert set(rows) == {
        "failure-free",
        "recover",
        "recover+respawn",
        "checkpoint-restart",
        "shrink",
    }
    free, rec, ckr, shr = (
        rows[k] for k in ("failure-free", "recover", "checkpoint-restart", "shrink")
    )

    assert free["failures"] == 0 and free["tokens_per_s_ratio"] == pytest.approx(1.0)
    for row in (rec, rows["recover+respawn"], ckr, shr):
        assert row["failures"] == 1 and row["steps_committed"] == 12
        assert row["tokens_per_s"] > 0 and row["median_failure_to_commit_s"] > 0

    assert rec["microbatches_min_after_failure"] == M and rec["microbatches_last"] == M
    assert rec["loss_max_rel_dev"] <= 1e-4 and rec["param_rel_l2"] <= 1e-4
    assert rec["redo_events"] >= 1

    assert shr["microbatches_min_after_failure"] < M  # the global batch shrank
    assert shr["loss_max_rel_dev"] > 1e-4  # and the trajectory moved

    assert ckr["steps_recommitted"] >= 2  # the steps after checkpoint 4 were committed again
    assert ckr["loss_max_rel_dev"] <= 1e-4 and ckr["microbatches_min_after_failure"] == M

    # Each row carries its settings, shown in the table.
    assert rows["recover+respawn"]["settings"] == "--respawn 0"
    assert ckr["settings"] == "--mode checkpoint-restart --ckpt-every 4"
    markdown = (out / "compare.md").read_text()
    assert markdown.count("\n") >= 5 and "| --respawn 0 |" in markdown
    for run in rows:
        assert leftover_processes(str(out / "runs" / run)) == []


# ---- the torchft harness without torchft: its launcher and its fault hand-over ------------------

# A replica of the supervisor tests: argv = replica, restart, done file, behaviour.
_FAKE_REPLICA = """
import os, signal, sys, time
replica, restart, done, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if how == "fail":
    sys.exit(3)
if replica == 1 and restart == 0:
    os.kill(os.getpid(), signal.SIGKILL)  # dies mid-run
if replica == 0:
    time.sleep(2.0)
    open(done, "w").close()  # the final model: the run is done
    sys.exit(0)
time.sleep(60)  # replica 1's restart: still starting when the run ends
"""


def _fake_spawner(done, how, started):
    def spawn(replica, restart):
        started.append((replica, restart, time.monotonic()))
        return subprocess.Popen(
            [sys.executable, "-c", _FAKE_REPLICA, str(replica), str(restart), str(done), how]
        )

    return spawn


def test_supervisor_restarts_a_dead_replica_and_ends_the_run_when_done(tmp_path):
    from recover.tooling.torchft_harness import FINISH_GRACE_S, supervise

    done, started, respawned, procs = tmp_path / "done", [], [], []
    spawn = _fake_spawner(done, "run", started)

    def spawn_and_keep(replica, restart):
        procs.append(spawn(replica, restart))
        return procs[-1]

    t0 = time.monotonic()
    finished = supervise(
        spawn_and_keep, replicas=2, respawn_s=0.3, max_restarts=3, done=done.exists,
        deadline_s=60, on_respawn=lambda r, n: respawned.append((r, n)), log=lambda s: None,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert finished
    assert [(r, n) for r, n, _ in started] == [(0, 0), (1, 0), (1, 1)] and respawned == [(1, 1)]
    assert started[2][2] - started[1][2] >= 0.3  # restarted after the delay, not before
    # Replica 0 finished; replica 1's restart, still running at the end, was stopped (SIGKILL)
    # FINISH_GRACE_S after the run was done, not left to run on its own.
    assert [p.returncode for p in procs] == [0, -9, -9]
    assert elapsed < 2.0 + FINISH_GRACE_S + 10


@pytest.mark.parametrize("respawn_s, spawns", [(0.0, 3), (None, 1)])
def test_supervisor_restarts_at_most_max_restarts_and_only_when_asked(tmp_path, respawn_s, spawns):
    from recover.tooling.torchft_harness import supervise

    started = []
    finished = supervise(
        _fake_spawner(tmp_path / "done", "fail", started), replicas=2, respawn_s=respawn_s,
        max_restarts=2, done=(tmp_path / "done").exists, deadline_s=60, log=lambda s: None,
    )  # fmt: skip
    assert not finished  # every incarnation failed: the run is not done
    for replica in (0, 1):
        assert [n for r, n, _ in started if r == replica] == list(range(spawns))


def test_a_restarted_replica_gets_only_the_faults_that_have_not_fired(tmp_path):
    """A real kill fault fires in a child (the injector records it in the control file before it
    acts); the next incarnation of that replica gets its other faults, not the one that fired."""
    from recover.runtime.faults import read_fired
    from recover.tooling.torchft_harness import pending_faults

    fired = tmp_path / "faults.fired"
    first = "kill:replica=1,step=7,phase=backward,microbatch=0"
    later = "kill:replica=1,step=17,phase=backward,microbatch=0"
    other = "kill:replica=2,step=12,phase=backward,microbatch=0"
    child = (
        "import sys\n"
        "from pathlib import Path\n"
        "from recover.runtime.faults import FaultInjector, parse_fault\n"
        "inj = FaultInjector([parse_fault(f) for f in sys.argv[2:]], fired=Path(sys.argv[1]))\n"
        "inj('backward', 7, 0)\n"
        "print('not killed')\n"
    )
    r = subprocess.run([sys.executable, "-c", child, str(fired), first, later],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == -9, r.stdout + r.stderr  # the kill fired
    faults = (first, later, other, "slow:replica=1,step=3,factor=2")
    assert pending_faults(faults, 1, read_fired(fired)) == [
        later,
        "slow:replica=1,step=3,factor=2.0",
    ]
    assert pending_faults(faults, 2, read_fired(fired)) == [other]
    assert pending_faults(faults, 1, set()) == [first, later, "slow:replica=1,step=3,factor=2.0"]


def test_torchft_settings_rows_and_validation():
    from recover.tooling.torchft_harness import (
        DOCUMENTED,
        TUNED,
        TorchftHarnessConfig,
        describe_settings,
    )

    with pytest.raises(ValueError, match="respawn_s"):  # (the other checks: test_report.py)
        TorchftHarnessConfig(respawn_s=-1.0)
    assert describe_settings(DOCUMENTED).startswith(
        "join timeout 10 s, heartbeat timeout 5 s, async quorum, quorum timeout 60 s"
    )
    assert describe_settings(TUNED).startswith(
        "join timeout 1 s, heartbeat timeout 1 s, async quorum, quorum timeout 10 s, timeout 30 s"
    )
    assert describe_settings(TUNED).endswith("init_sync off, no restart")


def test_documented_settings_are_torchfts_own_defaults():
    if not _torchft_installed():
        pytest.skip("torchft is not installed (optional: pip install 'recover[torchft]')")
    from torchft import Manager

    from recover.tooling.torchft_harness import DOCUMENTED

    defaults = {k: p.default for k, p in inspect.signature(Manager.__init__).parameters.items()}
    assert defaults["use_async_quorum"] is DOCUMENTED.async_quorum
    assert defaults["timeout"] == timedelta(seconds=DOCUMENTED.timeout_s)
    assert defaults["quorum_timeout"] == timedelta(seconds=DOCUMENTED.quorum_timeout_s)
    assert defaults["connect_timeout"] == timedelta(seconds=DOCUMENTED.connect_timeout_s)
    assert defaults["heartbeat_interval"] == timedelta(seconds=DOCUMENTED.heartbeat_s)
    assert defaults["quorum_retries"] == DOCUMENTED.quorum_retries
    # init_sync: torchft's default is on; its docstring asks for off when every replica seeds its
    # weights the same, as ours do (the one departure, named in the settings).
    assert defaults["init_sync"] is True and DOCUMENTED.init_sync is False


# Slow (28 s on 2 cores; `pytest -m slow` runs it): the harness's launcher and fault hand-over,
# which are ours, are covered on every run by the fake-replica tests below; this one adds only
# torchft's own healing.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchft_restarts_a_killed_replica_which_heals_from_a_peer(tiny_dataset, tmp_path):
    if not _torchft_installed():
        pytest.skip("torchft is not installed (optional: pip install 'recover[torchft]')")
    from dataclasses import replace

    from recover.record import committed_steps, read_metrics
    from recover.tooling.torchft_harness import TUNED, run_torchft
    from recover.training.config import TrainConfig

    steps = 24
    cfg = TrainConfig(preset="tiny", steps=steps, microbatches=M, microbatch_size=2, seq_len=32,
                      eval_every=0, ckpt_every=0)  # fmt: skip
    # The survivors are slowed (60x per microbatch) after the kill, so that the restarted
    # process (a fresh interpreter: torch and torchft imported, the model built) is back before
    # the run ends.
    faults = ("kill:replica=1,step=2,phase=backward,microbatch=0",
              "slow:replica=0,step=3,factor=60", "slow:replica=2,step=3,factor=60")  # fmt: skip
    hcfg = replace(TUNED, replicas=3, respawn_s=0.0, run_deadline_s=250, faults=faults)
    out = tmp_path / "torchft"
    assert run_torchft(cfg, hcfg, data=tiny_dataset, out=out, log=lambda *a: None) == 0
    records = list(read_metrics(out / "metrics.jsonl"))
    respawned = [r for r in records if r.get("name") == "launcher.respawned"]
    assert [(r["replica"], r["restart"]) for r in respawned] == [(1, 1)]
    committed = committed_steps(out / "metrics.jsonl")
    assert sorted(committed) == list(range(steps))
    assert committed[2]["microbatches"] < M  # the step of the kill, redone without replica 1
    # Its restart healed from a live peer (torchft's checkpoint transport) and contributes again:
    # every step after the one it rejoined in holds all M microbatches from all 3 replicas.
    (rejoined,) = [r for r in records if r.get("name") == "torchft.rejoined"]
    assert rejoined["replica"] == 1 and 2 <= rejoined["step"] < steps - 1
    after = [committed[k] for k in range(rejoined["step"] + 1, steps)]
    assert all(s["microbatches"] == M and s["replicas"] == 3 for s in after)
    assert (out / "final" / "model.safetensors").exists()
    assert leftover_processes(str(out)) == []


def test_a_benchmark_run_that_outlives_its_timeout_goes_with_every_process_it_started(tmp_path):
    """Every timed benchmark run goes through `run_child`. torchrun's workers do not follow their
    agent, and `recover bench script` left a hung DDP rank behind when it timed out: the whole
    session of the timed-out command is killed."""
    from recover.tooling.bench.common import run_child

    marker = str(tmp_path / "grandchild")
    script = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}])\n"
        "print('grandchild started', flush=True)\n"
        "time.sleep(120)\n"
    )
    try:
        with pytest.raises(RuntimeError, match="did not finish in 4 s") as raised:
            run_child([sys.executable, "-c", script], timeout_s=4)
        assert "grandchild started" in str(raised.value)  # it was there before the kill
        assert not leftover_processes(marker)
    finally:
        for line in leftover_processes(marker):  # ours, found by their tmp_path: never leave one
            subprocess.run(["kill", "-9", line.split(":")[0]], check=False)
