"""The coordinator under load: the benchmark at small R, and a stalled event loop.

`recover bench coordinator` at a small R runs here with a kill and a silent hang, straight to the
coordinator and through two relays: every step ends with a burst of R done reports, and no
healthy replica may be declared dead. A stalled event loop
(blocked for twice the lease while replicas keep heartbeating) must not turn heartbeats that wait
in the sockets, or replies it held, into deaths. No timing is asserted: only outcomes.
"""

from __future__ import annotations

import threading
import time

import pytest

from recover.coordinator import CoordinatorClient, CoordinatorOptions, CoordinatorServer
from recover.tooling.bench.coordinator import BenchCoordinatorConfig, format_table, run_once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("relays", [0, 2], ids=["direct", "two-relays"])
def test_bench_at_small_r_has_no_false_deaths_under_bursts_of_done_reports(relays):
    cfg = BenchCoordinatorConfig(
        replicas=48, steps=3, warmup_steps=1, compute_s=0.2, relays=relays, drivers=2
    )
    row = run_once(cfg)
    print(format_table([row]))
    assert "failed" not in row, row.get("failed")
    assert row["errors"] == [] and row["evicted_replicas"] == []
    assert row["false_deaths"] == 0
    assert row["commit_samples"] >= cfg.replicas  # steps committed with every replica
    # The killed replica (behind relay 0 when there are relays) and the hung one were declared
    # dead and every survivor saw it; a step committed after both.
    assert row["kill_detect_s"] is not None and row["hang_evict_s"] is not None
    if relays:
        assert row["relay_cpu"] is not None


@pytest.mark.timeout(90)
def test_the_coordinator_tier_behind_simulated_relays_commits_and_publishes_deaths():
    from recover.tooling.bench.coordinator_tier import run_tier

    cfg = BenchCoordinatorConfig(
        replicas=64, relays=4, upstream_only=True, steps=2, warmup_steps=1, compute_s=0.2
    )
    row = run_tier(cfg)
    assert "failed" not in row, row.get("failed")
    assert row["false_deaths"] == 0 and row["commit_samples"] >= cfg.relays
    # process_exit and lease_expired from relay 0 reached every relay's view
    assert row["kill_detect_s"] is not None and row["expiry_publish_s"] is not None


@pytest.mark.timeout(60)
def test_a_stalled_event_loop_declares_no_healthy_replica_dead():
    lease = 0.5
    opts = CoordinatorOptions(expected_replicas=6, microbatches=12, lease_s=lease)
    with CoordinatorServer(opts, store_port=None) as server:
        clients = [CoordinatorClient(*server.address, replica_id=r) for r in range(6)]
        try:
            threads = [
                threading.Thread(
                    target=c.register, kwargs=dict(fingerprint={}, next_step=0, deadline_s=20)
                )
                for c in clients
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            assert server.state().live == tuple(range(6))
            time.sleep(3 * 0.1)  # heartbeats and held replies in flight
            stalled = threading.Event()

            def stall():
                time.sleep(2 * lease)  # the loop reads nothing for two leases
                stalled.set()

            server._loop.call_soon_threadsafe(stall)
            assert stalled.wait(10)
            time.sleep(lease)  # ticks after the stall judge every lease
            dead = [d for d in server.decisions() if d["decision"] == "member_dead"]
            assert dead == [] and server.state().live == tuple(range(6))
        finally:
            for c in clients:
                c.close()


def test_the_simulator_reads_the_measured_control_plane(tmp_path):
    import json

    from recover.tooling.simulate.scenarios import GpuAssumptions, gpu_costs, read_bench

    rows = [
        {"replicas": 64, "commit_s_median": 0.02, "kill_detect_s": 0.01, "false_deaths": 0},
        {"replicas": 1024, "commit_s_median": 0.5, "kill_detect_s": 0.4, "false_deaths": 0},
        # the same R through relays, measured better: the one the simulator keeps
        {"replicas": 1024, "commit_s_median": 0.6, "kill_detect_s": 0.1, "false_deaths": 0},
        {
            "replicas": 1024,
            "relays": 8,
            "commit_s_median": 0.5,
            "kill_detect_s": 0.4,
            "false_deaths": 0,
        },
        {"replicas": 2048, "commit_s_median": 1.0, "kill_detect_s": 9.0, "false_deaths": 700},
        {"replicas": 4096, "failed": "forming did not happen"},
    ]
    path = tmp_path / "bench-coordinator.json"
    path.write_text(json.dumps({"benchmark": "coordinator", "rows": rows}))
    bench = read_bench([path], cpu_cores=2)
    assert bench.control_plane == ((64, 0.02, 0.01), (1024, 0.5, 0.4))  # runs that held only
    assert bench.control_plane_s(32) == (0.02, 0.01)
    commit, detect = bench.control_plane_s(544)  # half way: linear in R
    assert commit == pytest.approx(0.26) and detect == pytest.approx(0.205)
    assert bench.control_plane_s(1984)[0] == pytest.approx(0.98)  # extrapolated past the last
    a = GpuAssumptions()
    base, at = gpu_costs(a, bench), gpu_costs(a, bench, replicas=1024)
    assert at.step_overhead_s == pytest.approx(base.step_overhead_s + 0.5)
    assert at.detect_s == pytest.approx(base.detect_s + 0.4)


@pytest.mark.timeout(60)
def test_an_epoch_change_is_pushed_to_held_heartbeats_and_keeps_the_plan():
    opts = CoordinatorOptions(expected_replicas=3, microbatches=6, lease_s=5.0)
    with CoordinatorServer(opts, store_port=None) as server:
        # A long heartbeat period: each heartbeat's reply is held for up to 1 s.
        clients = [
            CoordinatorClient(*server.address, replica_id=r, heartbeat_s=1.0) for r in range(3)
        ]
        try:
            threads = [
                threading.Thread(
                    target=c.register, kwargs=dict(fingerprint={}, next_step=0, deadline_s=20)
                )
                for c in clients
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            a = clients[0]
            before = a.view
            assert before.epoch == 1 and before.plan == {0: (0, 1), 1: (2, 3), 2: (4, 5)}
            end = time.monotonic() + 10  # the first heartbeats go 1 s after registering
            while len(server._held) < 3 and time.monotonic() < end:
                time.sleep(0.01)
            assert len(server._held) == 3  # every heartbeat's reply is held, waiting for a push
            clients[2].close()  # replica 2 exits: a new epoch without it
            end = time.monotonic() + 10
            while a.view.epoch == 1 and time.monotonic() < end:
                time.sleep(0.01)
            after = a.view
            assert after.epoch == 2 and after.live == (0, 1)
            # The attempt is unchanged, so the pushed view came without its plan: the client
            # kept the attempt's plan (the dead replica's ids are reassigned by a redo, later).
            assert after.attempt_epoch == 1 and after.plan == before.plan
            dead = [d for d in server.decisions() if d["decision"] == "member_dead"]
            assert [(d["replica_id"], d["how"]) for d in dead] == [(2, "exit")]
        finally:
            for c in clients:
                c.close()
