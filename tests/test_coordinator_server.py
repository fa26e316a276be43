"""The coordinator server with real processes and real signals.

Four torch-free replica processes register and heartbeat. SIGKILL one: it is dead (how="exit")
within milliseconds through its session EOF. SIGSTOP another: it is dead (how="lease") after about
one lease. The others see the new view; the stopped one, resumed, is refused as evicted and exits.
Bad requests (wrong token, garbage, oversized frame, stale epoch) are refused on their connection
only. Run as a script (`python tests/test_coordinator_server.py N`) to print median detection times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from recover.coordinator import CoordinatorOptions, CoordinatorServer
from recover.coordinator.channel import request_once
from recover.coordinator.cli import add_coordinator_parser, run_coordinator_cli
from recover.coordinator.client import CoordinatorClient
from recover.coordinator.protocol import recv_frame, send_frame

TOKEN = "test-token-1234"
LEASE_S = 0.6

REPLICA = r"""
import json, sys
from recover.coordinator.client import CoordinatorClient, DeadlineExceeded, Evicted

host, port, rid, token, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
c = CoordinatorClient(host, port, replica_id=rid, token=token, heartbeat_s=0.1, rpc_timeout_s=2.0)

def dump(v):
    rec = {"epoch": v.epoch, "live": list(v.live), "status": v.status,
           "incarnation": c.incarnation, "store": c.store_address}
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")

try:
    v = c.register(fingerprint={"model": "tiny"}, next_step=0, deadline_s=30.0)
    dump(v)
    while True:
        try:
            v = c.wait_view(newer_than_epoch=v.epoch, deadline_s=0.3)
            dump(v)
        except DeadlineExceeded:
            pass
except Evicted as e:
    print(f"EVICTED: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
"""


def _poll(cond, deadline_s, what):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")


def _last(path: Path):
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines else None


def _death(server, rid):
    for d in server.decisions():
        if d["decision"] == "member_dead" and d["replica_id"] == rid:
            return d
    return None


def _spawn_replicas(tmp: Path, server, n):
    script = tmp / "replica.py"
    script.write_text(REPLICA)
    host, port = server.address
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    for r in range(n):
        args = [sys.executable, str(script), host, str(port), str(r), TOKEN, str(tmp / f"r{r}")]
        err = open(tmp / f"r{r}.err", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(args, stderr=err, env=env), err))
    return procs


def _reap(procs):
    for p, err in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)
        err.close()


def run_failure_scenario(tmp: Path) -> dict:
    """Kill one replica, stop another; return detection times and what everyone saw."""
    opts = CoordinatorOptions(expected_replicas=4, microbatches=8, lease_s=LEASE_S)
    server = CoordinatorServer(opts, token=TOKEN, events_path=tmp / "events.jsonl")
    server.start()
    procs = []
    try:
        procs = _spawn_replicas(tmp, server, 4)
        _poll(
            lambda: all((_last(tmp / f"r{r}") or {}).get("status") == "running" for r in range(4)),
            30.0,
            "4 replicas running",
        )
        t_kill = time.monotonic()
        os.kill(procs[0][0].pid, signal.SIGKILL)
        dead0 = _poll(lambda: _death(server, 0), 5.0, "death of replica 0")
        t_stop = time.monotonic()
        os.kill(procs[1][0].pid, signal.SIGSTOP)
        dead1 = _poll(lambda: _death(server, 1), 5.0 + LEASE_S, "death of replica 1")
        seen = _poll(
            lambda: all((_last(tmp / f"r{r}") or {}).get("live") == [2, 3] for r in (2, 3)),
            5.0,
            "survivors' new view",
        )
        os.kill(procs[1][0].pid, signal.SIGCONT)
        rc1 = procs[1][0].wait(timeout=10)
        procs[1][1].flush()
        return {
            "server": server,
            "procs": procs,
            "exit_s": dead0["t_mono"] - t_kill,
            "exit_how": dead0["how"],
            "lease_s": dead1["t_mono"] - t_stop,
            "lease_how": dead1["how"],
            "seen": seen,
            "rc1": rc1,
            "stderr1": (tmp / "r1.err").read_text(),
        }
    except BaseException:
        _reap(procs)
        server.stop()
        raise


def _raw(server, payload: bytes):
    """Send raw bytes; return (reply or None, whether the server closed the connection)."""
    with socket.create_connection(server.address, timeout=5.0) as s:
        s.sendall(payload)
        try:
            reply = recv_frame(s)
        except (ConnectionError, OSError):
            reply = None
        try:
            closed = s.recv(1) == b""
        except (ConnectionError, OSError):
            closed = True
    return reply, closed


def _frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


@pytest.mark.timeout(90)
def test_kill_stop_detection_fencing_and_bad_requests(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="recover.coordinator.server")
    res = run_failure_scenario(tmp_path)
    server, procs = res["server"], res["procs"]
    try:
        print(f"detection: exit {res['exit_s'] * 1e3:.1f} ms, lease {res['lease_s'] * 1e3:.0f} ms")
        assert res["exit_how"] == "exit" and res["exit_s"] < 0.5
        # The lease runs from the last heartbeat, up to one heartbeat period before the stop.
        assert res["lease_how"] == "lease" and LEASE_S - 0.15 <= res["lease_s"] < LEASE_S + 1.0
        view = server.state()
        assert view.live == (2, 3) and view.epoch == 3
        # The deaths are kept among the notable decisions (`recover status` shows them first),
        # which hold no routine commit or registration.
        notable = [d["decision"] for d in server.notable_decisions()]
        assert notable.count("member_dead") == 2, notable
        assert not {"committed", "registered"} & set(notable), notable
        # Shown at --log-level warning too: a death is not routine.
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum(m.startswith("member_dead") for m in warned) == 2, warned
        assert res["rc1"] == 3 and "EVICTED" in res["stderr1"] and "evicted" in res["stderr1"]

        # The store address travels in the register reply and the TCPStore answers.
        from torch.distributed import TCPStore

        host, port = (_last(tmp_path / "r2") or {})["store"]
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
        store.set("k", "v")
        assert store.get("k") == b"v"

        ok = {"kind": "view", "token": TOKEN}
        cases = {  # name: (bytes sent, expected code, words the reason must contain)
            "wrong token": (_frame({"kind": "view", "token": "nope"}), "unauthorized", "token"),
            "missing token": (_frame({"kind": "view"}), "unauthorized", "token"),
            "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_request", "limit"),
            "bad json": (struct.pack(">I", 5) + b"{nope", "bad_request", "JSON"),
            "oversized": (struct.pack(">I", 2 << 20) + b"x" * 1024, "bad_request", "limit"),
            "unknown kind": (_frame({"kind": "boom", "token": TOKEN}), "bad_request", "kind"),
            "bad field": (
                _frame({"kind": "heartbeat", "token": TOKEN, "replica_id": "x"}),
                "bad_request",
                "replica_id",
            ),
        }
        for name, (payload, code, word) in cases.items():
            t0 = time.monotonic()
            reply, closed = _raw(server, payload)
            assert closed and time.monotonic() - t0 < 2.0, name  # refused at once, then closed
            assert reply is not None and reply["ok"] is False, (name, reply)
            assert reply["code"] == code and word in reply["reason"], (name, reply)
            assert request_once(*server.address, ok, token=TOKEN)["ok"]  # still serving
        # Stale epoch: a live replica's report for an attempt that is not the current one.
        inc2 = _last(tmp_path / "r2")["incarnation"]
        stale = {"kind": "done", "replica_id": 2, "incarnation": inc2, "step": 0, "epoch": 0}
        reply = request_once(*server.address, stale, token=TOKEN)
        assert (reply["ok"], reply["code"]) == (False, "stale")
        poll = {**stale, "kind": "wait_outcome", "step": 3, "epoch": 1, "deadline_s": 0.1}
        reply = request_once(*server.address, poll, token=TOKEN)
        assert (reply["ok"], reply["code"]) == (False, "stale")
        # None of that disturbed the live replicas' sessions.
        assert server.state().live == (2, 3) and all(p.poll() is None for p, _ in procs[2:])

        events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        names = [e["name"] for e in events]
        assert "coordinator.member_dead" in names and all(e["kind"] == "event" for e in events)
        assert all("reason" in e and "t_wall" in e for e in events)
        dead = [(e["replica"], e["how"]) for e in events if e["name"] == "coordinator.member_dead"]
        assert dead == [(0, "exit"), (1, "lease")]
    finally:
        _reap(procs)
        server.stop()


@pytest.mark.timeout(60)
def test_client_reports_commit_and_redo_through_the_server():
    opts = CoordinatorOptions(expected_replicas=2, microbatches=4, lease_s=1.0)
    with CoordinatorServer(opts, store_port=None) as server:
        a = CoordinatorClient(*server.address, replica_id=0)
        b = CoordinatorClient(*server.address, replica_id=1)
        try:
            tb = threading.Thread(
                target=b.register, kwargs=dict(fingerprint={}, next_step=0, deadline_s=10)
            )
            tb.start()
            v = a.register(fingerprint={}, next_step=0, deadline_s=10)
            tb.join(10)
            assert v.live == (0, 1) and v.plan == {0: (0, 1), 1: (2, 3)}
            taken = []  # each done report's "commit" point: once, before its outcome is used

            def done(c, epoch):
                mark = lambda: taken.append(c.replica_id)  # noqa: E731
                return c.report_done(step=0, epoch=epoch, deadline_s=5, on_taken=mark)

            def failed(c, epoch):
                return c.report_failed(step=0, epoch=epoch, reason="injected", deadline_s=5)

            outs = _concurrently(lambda: done(a, 1), lambda: failed(b, 1))
            assert [type(o).__name__ for o in outs] == ["StepRedo", "StepRedo"]
            assert outs[0].view.attempt_epoch == outs[1].view.attempt_epoch == 2
            assert taken == [0]  # not on a failed report
            outs = _concurrently(lambda: done(a, 2), lambda: done(b, 2))
            assert [type(o).__name__ for o in outs] == ["StepCommitted", "StepCommitted"]
            assert outs[0].step == outs[1].step == 0 and sorted(taken) == [0, 0, 1]
            b.leave(step=1)
            a.leave(step=1)
            assert server.state().status == "finished"
        finally:
            a.close()
            b.close()


def _register(*clients):
    """Every client registered (at once: the run forms when all have)."""
    _concurrently(
        *(lambda c=c: c.register(fingerprint={}, next_step=0, deadline_s=10) for c in clients)
    )


def _concurrently(*calls):
    """Each call on a thread of its own; their results, in order (a call's error re-raised)."""
    results: list = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as e:  # re-raised below, in the test's thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.timeout(60)
def test_a_report_is_answered_with_its_outcome_and_an_old_style_report_at_once():
    """One round trip a step: a done report with `deadline_s` gets `{"taken": true}` when the
    attempt is undecided, then the outcome once the last report decides it; a done report
    without `deadline_s` (an older client) is answered at once, without an outcome, and
    `wait_outcome` still gives it."""
    opts = CoordinatorOptions(expected_replicas=2, microbatches=4, lease_s=1.0)
    with CoordinatorServer(opts, store_port=None) as server:
        a = CoordinatorClient(*server.address, replica_id=0)
        b = CoordinatorClient(*server.address, replica_id=1)
        try:
            _register(a, b)
            with socket.create_connection(server.address, timeout=5) as raw:
                head = {"replica_id": 0, "incarnation": a.incarnation, "step": 0, "epoch": 1}
                send_frame(raw, {"kind": "done", **head, "deadline_s": 5})
                assert recv_frame(raw) == {"ok": True, "taken": True}
                old = {"kind": "done", "replica_id": 1, "incarnation": b.incarnation}
                reply = request_once(*server.address, {**old, "step": 0, "epoch": 1})
                assert reply["ok"] and "outcome" not in reply  # answered at once, as before
                reply = recv_frame(raw)
                assert (reply["ok"], reply["outcome"]) == (True, "committed")
                assert reply["view"]["committed_step"] == 0
                # The old way's second trip still answers; the last report of a step gets its
                # outcome at once (no "taken" frame: it decided it).
                assert b.wait_outcome(step=0, epoch=1, deadline_s=5).step == 0
                send_frame(raw, {"kind": "done", **head, "step": 1, "deadline_s": 5})
                assert recv_frame(raw) == {"ok": True, "taken": True}
                assert b.report_done(step=1, epoch=1, deadline_s=5).step == 1
                assert recv_frame(raw)["outcome"] == "committed"
        finally:
            a.close()
            b.close()


@pytest.mark.timeout(60)
def test_a_report_sent_now_is_answered_when_read_on_the_same_thread():
    """`start_report_done` sends the report and returns; the answer waits in the connection
    while the thread does other work (a step's update during its vote), with no helper thread:
    `may_commit` reads what arrived without waiting, `wait_taken` blocks until the report is
    on record (its commit point runs then, once), `outcome` gives the answer. A connection cut
    while the answer is awaited is asked again (reports are idempotent): the same outcome."""
    opts = CoordinatorOptions(expected_replicas=2, microbatches=4, lease_s=5.0)
    with CoordinatorServer(opts, store_port=None) as server:
        a = CoordinatorClient(*server.address, replica_id=0)
        b = CoordinatorClient(*server.address, replica_id=1)
        try:
            _register(a, b)
            threads = threading.active_count()
            taken: list[int] = []
            pending = a.start_report_done(
                step=0, epoch=1, deadline_s=5, on_taken=lambda: taken.append(0)
            )
            assert threading.active_count() == threads  # (no thread waits for the answer)
            assert pending.may_commit()  # undecided: b has not reported
            pending.wait_taken()  # the taken frame: a's report is on record
            assert taken == [0]
            assert b.report_done(step=0, epoch=1, deadline_s=5).step == 0  # b decides it
            _poll(lambda: a._rpc.readable(), 5, "the commit to reach a")
            assert pending.may_commit()
            assert pending.outcome().step == 0 and taken == [0]  # (on_taken ran once)
            assert a.view is not None and a.view.committed_step == 0

            # Step 1: a's connection is cut after its report is on record; the outcome is the
            # one the coordinator decides, asked for again on a new connection.
            pending = a.start_report_done(
                step=1, epoch=1, deadline_s=5, on_taken=lambda: taken.append(1)
            )
            pending.wait_taken()
            a._rpc.interrupt()  # (as when the heartbeat thread finds the leader gone)
            outs = _concurrently(
                pending.outcome, lambda: b.report_done(step=1, epoch=1, deadline_s=5)
            )
            assert [type(o).__name__ for o in outs] == ["StepCommitted", "StepCommitted"]
            assert outs[0].step == 1 and taken == [0, 1]

            # A report whose attempt is redone: may_commit says so once the answer is in (the
            # taken frame may come first).
            pending = a.start_report_done(step=2, epoch=1, deadline_s=5)
            redo = b.report_failed(step=2, epoch=1, reason="injected", deadline_s=5)
            assert type(redo).__name__ == "StepRedo"
            _poll(lambda: not pending.may_commit(), 5, "a to read that its attempt is redone")
            assert type(pending.outcome()).__name__ == "StepRedo"

            # A report whose answer is never read does not hold the client's close.
            a.start_report_done(step=2, epoch=redo.view.attempt_epoch, deadline_s=5)
            t0 = time.monotonic()
            a.close()
            assert time.monotonic() - t0 < 3
        finally:
            a.close()
            b.close()


def test_the_tick_sleeps_until_the_first_lease_runs_out():
    """The tick loop looks every tick_s while the run forms; once it runs, it sleeps until the
    first lease runs out (at most 0.1 s): ten looks a second, not fifty, while every replica
    heartbeats; and never past a deadline by more than tick_s, so a silent replica is judged as
    promptly as at a fixed tick (its death, by lease, is recorded within tick_s + a heartbeat's
    hold of its lease running out)."""
    opts = CoordinatorOptions(expected_replicas=2, microbatches=4, lease_s=0.5)
    with CoordinatorServer(opts, store_port=None, tick_s=0.02) as server:
        waits: list[tuple[str, float, float]] = []  # (status, the wait, the time to the deadline)
        real = server._tick_wait_s

        def recorded(now):
            wait = real(now)
            front = server._leases.deadline()
            waits.append((server.state().status, wait, math.inf if front is None else front - now))
            return wait

        server._tick_wait_s = recorded
        a = CoordinatorClient(*server.address, replica_id=0, heartbeat_s=0.05)
        b = CoordinatorClient(*server.address, replica_id=1, heartbeat_s=0.05)
        try:
            time.sleep(0.2)
            assert waits and all(w == 0.02 for st, w, _ in waits if st == "forming"), waits
            tb = threading.Thread(
                target=b.register, kwargs=dict(fingerprint={}, next_step=0, deadline_s=10)
            )
            tb.start()
            a.register(fingerprint={}, next_step=0, deadline_s=10)
            tb.join(10)
            waits.clear()
            time.sleep(1.0)
            running = [(w, left) for st, w, left in waits if st == "running"]
            # Fresh leases (heartbeats every 0.05 s, held 0.05 s): the first runs out 0.4 s on.
            assert 5 <= len(running) <= 12 and all(w == 0.1 for w, _ in running), running
            with a._session.lock:  # a's heartbeats stop: its lease runs out 0.5 s after the last
                silent = time.monotonic()
                _poll(lambda: server.state().members[0].state == "dead", 3.0, "a's lease")
                judged = time.monotonic() - silent
            assert server.state().members[0].how == "lease"
            assert 0.5 - 0.06 <= judged <= 0.5 + 0.05 + 0.02 + 0.1, judged  # (+0.1: a busy box)
            for _st, w, left in waits:  # never past a deadline by more than tick_s
                assert w <= max(0.02, left + 0.001) + 1e-9, (w, left)
        finally:
            a.close()
            b.close()


def test_a_client_silent_longer_than_its_lease_may_not_write_until_confirmed():
    """The fence (client.writes_allowed): a member whose heartbeats stop (its session held, as
    in a frozen process) may not write once its last confirmation is older than the window,
    even before it learns of its eviction; then it learns it and stays fenced. Its peer writes."""
    opts = CoordinatorOptions(expected_replicas=2, microbatches=4, lease_s=0.4)
    with CoordinatorServer(opts, store_port=None) as server:
        a = CoordinatorClient(*server.address, replica_id=0)
        b = CoordinatorClient(*server.address, replica_id=1)
        try:
            tb = threading.Thread(
                target=b.register, kwargs=dict(fingerprint={}, next_step=0, deadline_s=10)
            )
            tb.start()
            a.register(fingerprint={}, next_step=0, deadline_s=10)
            tb.join(10)
            assert a.writes_allowed() and b.writes_allowed()
            with a._session.lock:  # no heartbeat gets out: the coordinator evicts it (lease)
                time.sleep(0.8)
                assert not a.evicted  # it has not heard yet ...
                assert not a.writes_allowed(wait_s=0.1)  # ... but its confirmation is stale
            assert not a.writes_allowed()  # the next round is refused: evicted
            assert a.evicted and b.writes_allowed()
        finally:
            a.close()
            b.close()


@pytest.mark.timeout(60)
def test_coordinator_process_and_status_cli(tmp_path, capsys):
    addr_file = tmp_path / "addr.json"
    cmd = [sys.executable, "-m", "recover.coordinator.cli", "coordinator", "serve"]
    cmd += ["--replicas", "1", "--port", "0", "--token", TOKEN]
    cmd += ["--address-file", str(addr_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = None
    try:
        _poll(addr_file.exists, 30.0, "the coordinator's address file")
        info = json.loads(addr_file.read_text())
        assert info["store_port"] > 0
        client = CoordinatorClient(info["host"], info["port"], replica_id=0, token=TOKEN)
        client.register(fingerprint={"microbatches": 2}, next_step=0, deadline_s=10)
        parser = argparse.ArgumentParser()
        add_coordinator_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(
            ["coordinator", "status", "--addr", f"{info['host']}:{info['port']}", "--token", TOKEN]
        )
        assert run_coordinator_cli(args) == 0
        out = capsys.readouterr().out
        assert "epoch 1" in out and "live [0]" in out and "lease age" in out
        assert "admitted" in out
        bad = parser.parse_args(
            ["coordinator", "status", "--addr", f"{info['host']}:{info['port']}", "--token", "x"]
        )
        assert run_coordinator_cli(bad) == 2
        client.leave(step=0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stderr.close()


def _frame_roundtrip_sanity():
    a, b = socket.socketpair()
    try:
        send_frame(a, {"x": 1})
        assert recv_frame(b) == {"x": 1}
    finally:
        a.close()
        b.close()


def test_status_shows_a_death_that_commits_pushed_out_of_the_log():
    """`recover status` lists the last notable decisions first, with their age: a death 14 s
    old was hidden behind the 10 routine commits that followed it."""
    import time

    from recover.coordinator.cli import format_status

    view = {"status": "running", "epoch": 2, "step": 40, "committed_step": 39,
            "attempt_epoch": 2, "live": [0, 2], "reason": "step 39 committed"}  # fmt: skip
    commits = [{"decision": "committed", "reason": f"step {s} committed"} for s in range(30, 40)]
    death = {"decision": "member_dead", "reason": "replica 1 lease expired",
             "t_wall": time.time() - 14}  # fmt: skip
    text = format_status(
        {"view": view, "members": [], "decisions": commits, "notable": [death]}, 10
    )
    events, decisions = text.split("last 10 decisions:")
    assert "member_dead" in events and "14 s ago" in events and "lease expired" in events, text
    assert "member_dead" not in decisions


def test_frame_roundtrip():
    _frame_roundtrip_sanity()


if __name__ == "__main__":  # python tests/test_coordinator_server.py N -> median detection times
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    exits, leases = [], []
    for _ in range(n):
        with tempfile.TemporaryDirectory() as d:
            r = run_failure_scenario(Path(d))
            try:
                exits.append(r["exit_s"])
                leases.append(r["lease_s"])
            finally:
                _reap(r["procs"])
                r["server"].stop()
    print(
        f"n={n} lease_s={LEASE_S} heartbeat_s=0.1: median exit detection "
        f"{statistics.median(exits) * 1e3:.1f} ms (max {max(exits) * 1e3:.1f}), median lease "
        f"detection {statistics.median(leases) * 1e3:.0f} ms (max {max(leases) * 1e3:.0f})"
    )


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) that listen on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
def test_the_store_listens_only_where_the_coordinator_does():
    """torch's TCPStore, which takes no token, would listen on every interface: the coordinator
    binds it to its own address (docs/design.md, "Threat model")."""
    opts = CoordinatorOptions(expected_replicas=1, microbatches=2)
    with CoordinatorServer(opts, host="127.0.0.1", port=0, store_port=0) as server:
        _, store_port = server.store_address
        assert _listening(store_port) == ["0100007F"]  # 127.0.0.1 only, no wildcard
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", store_port, is_master=False)
        client.set("k", "v")
        assert client.get("k") == b"v"
