"""The coordinator under load: the benchmark at small R, and a stalled event loop.

`recover bench coordinator` at a small R runs here with a kill and a silent hang: every step ends
with a burst of R done reports, and no healthy replica may be declared dead. A stalled event loop
(blocked for twice the lease while replicas keep heartbeating) must not turn heartbeats that wait
in the sockets, or replies it held, into deaths. No timing is asserted: only outcomes.
"""

from __future__ import annotations

import threading
import time

import pytest

from recover.bench_coordinator import BenchCoordinatorConfig, format_table, run_once
from recover.coordinator import CoordinatorClient, CoordinatorOptions, CoordinatorServer


@pytest.mark.timeout(90)
def test_bench_at_small_r_has_no_false_deaths_under_bursts_of_done_reports():
    cfg = BenchCoordinatorConfig(replicas=48, steps=3, warmup_steps=1, compute_s=0.2)
    row = run_once(cfg)
    print(format_table([row]))
    assert row["errors"] == [] and row["evicted_replicas"] == []
    assert row["false_deaths"] == 0
    assert row["commit_samples"] >= cfg.replicas  # steps committed with every replica
    assert row["kill_detect_s"] is not None and row["hang_evict_s"] is not None


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
