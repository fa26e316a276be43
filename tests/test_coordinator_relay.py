"""Relays: the pure parts (batched done reports, leases judged at a relay, views sent relative to
the one a replica holds) and a coordinator with relays in front, with real sockets on 127.0.0.1.

Faults are real at the transport: a replica's session closes (as its process exit does), a
replica stops heartbeating (a hang), a relay stops (its replicas go with it).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import pytest

from recover.coordinator import CoordinatorClient, CoordinatorOptions, CoordinatorServer
from recover.coordinator.decide import decide, initial_state, view_of
from recover.coordinator.messages import LeaseExpired, Register, ReportDone, ReportsDone
from recover.coordinator.protocol import View, merge_view
from recover.coordinator.relay import RelayServer
from recover.coordinator.views import ViewCache, split_plan


def _formed(r: int, m: int):
    opts = CoordinatorOptions(expected_replicas=r, microbatches=m, start_deadline_s=1e9)
    s = initial_state(opts, 0.0)
    for i in range(r):
        reg = Register(replica_id=i, incarnation=f"i{i}", fingerprint={}, next_step=0)
        s = decide(0.0, s, reg)[0]
    assert s.status == "running"
    return s


def _done(r: int, s, **kw) -> ReportDone:
    return ReportDone(replica_id=r, incarnation=f"i{r}", step=s.step, epoch=s.attempt_epoch, **kw)


# ---------------------------------------------------------------- pure parts


def test_a_batch_of_done_reports_is_judged_as_the_same_reports_one_by_one():
    s = _formed(4, 8)
    one_by_one = s
    for r in range(4):
        one_by_one = decide(0.1, one_by_one, _done(r, s, throughput=2.0))[0]
    batch = decide(0.1, s, ReportsDone(tuple(_done(r, s, throughput=2.0) for r in range(4))))[0]
    assert one_by_one.committed_step == batch.committed_step == s.step
    assert batch.members == one_by_one.members and batch.plan == one_by_one.plan

    # A batch missing one live member commits nothing; a stale report in it is refused alone.
    stale = replace(_done(3, s), step=s.step + 5)
    part, decisions, _ = decide(0.1, s, ReportsDone((_done(0, s), _done(1, s), stale)))
    assert part.committed_step == s.committed_step and part.reports == {0: "done", 1: "done"}
    assert [(d.name, d.replica_id, d.code) for d in decisions] == [("refused", 3, "stale")]
    rest = decide(0.2, part, ReportsDone((_done(2, s), _done(3, s))))[0]
    assert rest.committed_step == s.step


def test_a_lease_judged_at_a_relay_kills_like_one_judged_here():
    s = _formed(3, 6)
    after, decisions, _ = decide(0.5, s, LeaseExpired(replica_id=1, incarnation="i1"))
    assert after.live == (0, 2) and after.epoch == s.epoch + 1
    dead = [d for d in decisions if d.name == "member_dead"]
    assert [(d.replica_id, d.how) for d in dead] == [(1, "lease")]
    assert after.fenced["i1"] == "evicted"
    # A stale message for a fenced incarnation is refused, and changes nothing.
    again, decisions, _ = decide(0.6, after, LeaseExpired(replica_id=1, incarnation="i1"))
    assert again.live == after.live and decisions[0].code == "evicted"


def test_a_view_sent_relative_to_the_one_held_rebuilds_the_current_view():
    s = _formed(6, 12)
    cache, held = ViewCache(), {}
    states = [s]
    s = decide(0.1, s, ReportsDone(tuple(_done(r, s) for r in range(6))))[0]  # commit
    states.append(s)
    s = decide(0.2, s, LeaseExpired(replica_id=4, incarnation="i4"))[0]  # epoch change
    states.append(s)
    s = decide(0.3, s, ReportsDone(tuple(_done(r, s) for r in s.live)))[0]  # new plan
    states.append(s)
    for st in states:
        v = view_of(st)
        cache.publish(v)
        held[v.version] = v
    assert cache.version == s.view_version
    current = view_of(s)
    for version, old in held.items():
        body = cache.encoded(version)
        got = merge_view(old, json.loads(body))
        assert got == current, version
        if old.plan_version == current.plan_version:
            assert b'"plan":' not in body  # the plan is not re-sent
        if old.epoch == current.epoch:
            assert b'"live_runs":' not in body  # nor the live set
    # Relative to an unknown version: the whole view, which needs nothing held.
    assert merge_view(None, json.loads(cache.encoded(-1))) == current
    # A delta meant for another epoch than the one held is dropped, never merged.
    delta = json.loads(cache.encoded(states[1].view_version))
    assert merge_view(replace(view_of(states[0]), epoch=99), delta) is None
    # A relay keeps the plan as bytes: cut off, the rest is the view without its plan.
    rest, plan = split_plan(cache.encoded(-1))
    assert json.loads(b"{" + plan + b"}")["plan"] and b'"plan":' not in rest
    assert View.from_dict({**json.loads(rest), "plan_ids": {}, "weights": {}}).live == s.live


def test_the_whole_view_is_compact_and_decodes_to_the_same_view():
    s = _formed(64, 8192)
    cache = ViewCache()
    cache.publish(view_of(s), microbatches=8192)
    body = cache.encoded(-1)
    assert len(body) < 600  # 64 live replicas, 8,192 ids: the rule, not the runs
    assert json.loads(body)["plan"]["assign"] == 8192
    assert View.from_dict(json.loads(body)) == view_of(s)
    # After a death, the next attempt's plan is the rule over the survivors (two runs of ids).
    s = decide(0.1, s, LeaseExpired(replica_id=5, incarnation="i5"))[0]
    s = decide(0.2, s, ReportsDone(tuple(_done(r, s) for r in range(64) if r != 5)))[0]
    cache.publish(view_of(s), microbatches=8192)
    assert json.loads(cache.encoded(-1))["plan"]["members"] == [0, 5, 6, 64]
    assert View.from_dict(json.loads(cache.encoded(-1))) == view_of(s)


# ---------------------------------------------------------------- with sockets


def _register_all(clients: list[CoordinatorClient]) -> None:
    threads = [
        threading.Thread(target=c.register, kwargs=dict(fingerprint={}, next_step=0, deadline_s=20))
        for c in clients
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)


def _step(clients: list[CoordinatorClient], failing: int | None = None) -> list:
    """Every client reports its view's attempt (done, or failed for client `failing`) in the one
    round trip that returns the outcome; each done report's `on_taken` runs exactly once."""
    outcomes: list = [None] * len(clients)
    taken = [0] * len(clients)

    def one(i: int, c: CoordinatorClient) -> None:
        v = c.view
        if i == failing:
            outcomes[i] = c.report_failed(
                step=v.step, epoch=v.attempt_epoch, reason="injected", deadline_s=15
            )
            return
        outcomes[i] = c.report_done(
            step=v.step,
            epoch=v.attempt_epoch,
            deadline_s=15,
            on_taken=lambda: taken.__setitem__(i, taken[i] + 1),
        )

    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert taken == [int(i != failing) for i in range(len(clients))]
    return outcomes


def _wait(pred, timeout_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        time.sleep(0.005)
    return time.monotonic() - t0


@pytest.mark.timeout(60)
def test_replicas_behind_relays_commit_and_their_deaths_reach_the_coordinator():
    lease = 0.6
    opts = CoordinatorOptions(expected_replicas=6, microbatches=12, lease_s=lease)
    with CoordinatorServer(opts, store_port=None) as server:
        relays = [RelayServer(server.address, relay_id=f"rack{i}") for i in range(2)]
        clients: list[CoordinatorClient] = []
        try:
            for relay in relays:
                relay.start()
            clients = [
                CoordinatorClient(*relays[r % 2].address, replica_id=r, heartbeat_s=0.05)
                for r in range(6)
            ]
            _register_all(clients)
            assert all(c.view is not None and c.view.live == tuple(range(6)) for c in clients)
            # The coordinator holds no replica lease: they are the relays'.
            assert len(server._leases._at) == 0 and set(server._relays) == {"rack0", "rack1"}
            for _ in range(3):  # bursts of done reports, batched per relay
                assert [type(o).__name__ for o in _step(clients)] == ["StepCommitted"] * 6
            a = clients[0]
            # A failed report (forwarded up without its wait): every replica is told to redo,
            # the one that failed too, each from its relay's copy of the view.
            step = a.view.step
            redo = _step(clients, failing=4)
            assert [type(o).__name__ for o in redo] == ["StepRedo"] * 6
            assert {(o.step, o.view.attempt_epoch) for o in redo} == {(step, a.view.epoch)}
            assert [type(o).__name__ for o in _step(clients)] == ["StepCommitted"] * 6

            clients[5].close()  # replica 5 (behind rack1) exits: its session EOF at the relay
            _wait(lambda: 5 not in a.view.live)
            clients[3]._stop.set()  # replica 3 hangs: no heartbeat, its sockets stay open
            _wait(lambda: 3 not in a.view.live, timeout_s=lease + 5)
            dead = {
                d["replica_id"]: d["how"]
                for d in server.decisions()
                if d["decision"] == "member_dead"
            }
            assert dead == {5: "exit", 3: "lease"}
            survivors = [clients[r] for r in (0, 1, 2, 4)]
            assert [type(o).__name__ for o in _step(survivors)] == ["StepCommitted"] * 4

            relays[1].stop()  # rack1 dies: its replicas (1 here) die with it
            _wait(lambda: 1 not in a.view.live)
            dead = {
                d["replica_id"]: d["how"]
                for d in server.decisions()
                if d["decision"] == "member_dead"
            }
            assert dead == {5: "exit", 3: "lease", 1: "exit"}
            assert a.view.live == (0, 2, 4)
            assert [type(o).__name__ for o in _step([clients[0], clients[2], clients[4]])] == [
                "StepCommitted"
            ] * 3
        finally:
            for c in clients:
                c.close()
            for relay in relays:
                relay.stop()
