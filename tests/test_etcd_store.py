"""The etcd-backed state store and the leader election, against a real etcd.

A fixture starts a private etcd (127.0.0.1, free ports, a temp data dir) and stops it by pid.
Checked: the state round-trips through etcd; a save under a superseded term is refused and writes
nothing; one candidate wins a term, the other waits and wins the next term when the leader's
lease runs out (never while it is renewed); a leader whose process stalls lets its lease go; a
frozen leader (no renewals past its TTL) knows it no longer leads before anyone tells it.
The tests that need etcd skip where no etcd binary is installed (Debian: etcd-server; CI installs
it); the launcher's checks of --coordinators and --state need none.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from recover.coordinator.decide import decide, initial_state
from recover.coordinator.election import Election
from recover.coordinator.etcd import (
    EtcdClient,
    EtcdStateStore,
    EtcdUnavailable,
    Fenced,
    parse_state_url,
)
from recover.coordinator.etcd_local import find_etcd, start_local_etcd
from recover.coordinator.messages import Register, Takeover
from recover.coordinator.state_store import CoordinatorOptions, state_to_json

if find_etcd() is None and os.environ.get("CI"):  # CI must run these (.ci/run installs it)
    raise RuntimeError("no etcd binary in CI: .ci/run installs Debian's etcd-server")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    if find_etcd() is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    server = start_local_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


def _client(etcd) -> EtcdClient:
    return EtcdClient(etcd.endpoints, timeout_s=2.0)


def _state(n: int):
    opts = CoordinatorOptions(expected_replicas=2, microbatches=4)
    s = initial_state(opts, 0.0)
    for r in range(n):
        s, _, _ = decide(
            0.0, s, Register(replica_id=r, incarnation=f"i{r}", fingerprint={}, next_step=0)
        )
    return s


def test_parse_state_url():
    url = parse_state_url("etcd://a:1,b:2/jobs/run7")
    assert url.endpoints == (("a", 1), ("b", 2)) and url.prefix == "/jobs/run7"
    assert parse_state_url("etcd://h:2379").prefix == "/recover/default"
    for bad in ("http://h:1", "etcd://h", "etcd://h:x", "etcd://:5"):
        with pytest.raises(ValueError, match="--state"):
            parse_state_url(bad)


def test_state_round_trip_and_fencing(etcd):
    a, b = EtcdStateStore(_client(etcd), "/t1"), EtcdStateStore(_client(etcd), "/t1")
    assert a.load() is None
    with pytest.raises(Fenced):  # never elected: no term
        a.save(_state(1))
    a.client.put("/t1/term", "1")
    a.fence(1)
    s2 = _state(2)  # the run formed: epoch 1, two live members
    a.save(s2)
    assert state_to_json(b.load()) == state_to_json(s2)
    b.client.put("/t1/term", "2")  # a new leader's term
    b.fence(2)
    with pytest.raises(Fenced, match="term 1 was superseded"):
        a.save(_state(1))
    assert state_to_json(b.load()) == state_to_json(s2), "the fenced save wrote something"


def test_unreachable_endpoint_is_named():
    client = EtcdClient((("127.0.0.1", 1),), timeout_s=0.5)
    with pytest.raises(EtcdUnavailable, match="127.0.0.1:1"):
        client.get("/x")


@pytest.mark.parametrize(
    ("status", "unavailable"),
    [(408, True), (503, True), (400, False)],
)
def test_an_endpoint_that_times_out_or_fails_is_unavailable_and_a_bad_request_is_not(
    status, unavailable
):
    """etcd's gateway answers 408 "the client connection is closing" while its server shuts down
    (seen when etcd was killed under load: the coordinator's election crashed on it instead of
    retrying). Like a 5xx, that is the endpoint's failure: EtcdUnavailable, which callers retry;
    a 4xx about the request itself stays a ValueError."""
    import http.server
    import json

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the http.server name)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": "grpc: the client connection is closing"}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = EtcdClient((("127.0.0.1", server.server_port),), timeout_s=2)
        expected = EtcdUnavailable if unavailable else ValueError
        with pytest.raises(expected, match=f"{status} grpc: the client connection is closing"):
            client.get("/x")
        client.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_one_leader_per_term_and_takeover_after_lease(etcd):
    first = Election(_client(etcd), "/t2", identity="a", ttl_s=1, poll_s=0.05)
    second = Election(_client(etcd), "/t2", identity="b", ttl_s=1, poll_s=0.05)
    assert first.campaign() == 1 and first.holds()
    won: list[int] = []
    stop = threading.Event()
    waiter = threading.Thread(target=lambda: won.append(second.campaign(stop)))
    waiter.start()
    try:
        time.sleep(2.5)  # > 2 TTLs: renewed, so no takeover
        assert not won and first.holds() and first.leader()["identity"] == "a"
        first._stop.set()  # the leader stops renewing (as a SIGKILL would)
        t0 = time.monotonic()
        waiter.join(5.0)
        took = time.monotonic() - t0
    finally:
        stop.set()
        waiter.join(5.0)
    assert won == [2], "the standby did not win the next term"
    assert took < first.granted_ttl_s + 1.0, f"takeover took {took:.2f} s"
    assert not first.holds(), "the old leader still believes it leads"
    assert second.leader()["identity"] == "b"
    # Publishing is a write fenced by the term: the old leader's is refused and writes nothing.
    assert not first.publish({"port": 1}) and "port" not in second.leader()
    assert second.publish({"port": 2}) and second.leader()["port"] == 2
    second.resign()
    assert second.leader() is None


def test_stalled_service_lets_the_lease_go(etcd):
    alive = threading.Event()
    alive.set()
    e = Election(_client(etcd), "/t3", identity="a", ttl_s=1, poll_s=0.05, alive=alive.is_set)
    assert e.campaign() == 1
    alive.clear()  # the coordinator's loop stopped ticking
    deadline = time.monotonic() + 5
    while e.leader() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert e.leader() is None and not e.holds()


def test_takeover_redoes_the_attempt_without_deaths():
    s = _state(2)  # formed: epoch 1, attempt of step 0 in epoch 1, nobody reported
    assert s.status == "running"
    t, out, why = decide(10.0, s, Takeover(term=2, grace_s=5.0))
    assert t.epoch == s.epoch + 1 and t.attempt_epoch == t.epoch and t.step == 0
    assert t.live == s.live and sorted(t.plan) == sorted(s.plan)
    assert not any(d.name == "member_dead" for d in out), out
    # every member's lease now runs 5 s from the takeover
    assert all(m.last_seen + s.options.lease_s == pytest.approx(15.0) for m in t.members.values())
    assert "term 2 took over" in why


def test_history_is_compacted(etcd):
    store = EtcdStateStore(_client(etcd), "/t4")
    store.client.put("/t4/term", "1")
    store.fence(1)
    store.COMPACT_EVERY = 3
    store.save(_state(1))
    first = store.client.get("/t4/state")[1]  # the mod revision of the first save
    for n in range(2, 4):
        store.save(_state(n))
    key = base64.b64encode(b"/t4/state").decode()
    with pytest.raises(ValueError, match="compacted"):  # that version is gone
        store.client.call("/v3/kv/range", {"key": key, "revision": str(first)})
    assert state_to_json(store.load()) == state_to_json(_state(3))


def test_launch_config_names_what_ha_needs(monkeypatch):
    import recover.launch as launch

    with pytest.raises(ValueError, match="--coordinators must be an int >= 1"):
        launch.LaunchConfig(replicas=2, coordinators=0)
    with pytest.raises(ValueError, match="--state must look like etcd://"):
        launch.LaunchConfig(replicas=2, coordinators=2, state="http://h:2379")
    monkeypatch.setattr(launch.config, "find_etcd", lambda: None)
    with pytest.raises(ValueError, match="apt-get install etcd-server, or give --state"):
        launch.LaunchConfig(replicas=2, coordinators=2)
    launch.LaunchConfig(replicas=2, coordinators=2, state="etcd://h:2379/run1")  # no binary needed


def test_a_private_etcd_dies_with_the_process_that_started_it(tmp_path):
    """A launcher SIGKILLed mid-run leaves no etcd behind (PR_SET_PDEATHSIG)."""
    if find_etcd() is None:
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    code = (
        "import sys, time; from recover.coordinator.etcd_local import start_local_etcd; "
        "print(start_local_etcd(sys.argv[1]).proc.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    etcd_pid = None
    try:
        etcd_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        end = time.monotonic() + 10
        while Path(f"/proc/{etcd_pid}").exists() and time.monotonic() < end:
            time.sleep(0.05)  # (reparented: init reaps it)
        assert not Path(f"/proc/{etcd_pid}").exists(), "etcd outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if etcd_pid is not None and Path(f"/proc/{etcd_pid}").exists():
            os.kill(etcd_pid, signal.SIGKILL)
