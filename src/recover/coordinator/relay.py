"""A relay: holds the sessions, leases and long-polls of 64-128 replicas for the coordinator.

Job: downstream, speak to replicas exactly as the coordinator does (the same frames, requests and
replies: `CoordinatorClient` and the load test point at a relay unchanged); upstream, send the
coordinator only what changes membership or the attempt, and fan its views out.
- Sessions and leases are held here. A replica's session EOF (its process exit) goes up as
  `process_exit` within milliseconds; a lease that runs out here goes up as `lease_expired`.
  Heartbeats stop here: the coordinator sees one held `relay_beat` per relay instead of R.
- Done reports of one attempt are batched (`done_batch`): sent when every live replica of this
  relay reported, or `batch_s` after the first report, whichever comes first. The coordinator
  judges every report as if it came alone: a batch never changes what a commit means.
- Registrations, failed reports, leave and status go up as they are, and their replies come back
  as they are; a report that waits for its outcome (`deadline_s`) goes up without the wait.
- Views: the relay's `relay_beat` is held by the coordinator until the view changes, so the
  relay's copy follows each version within a round trip; `wait_view`, `wait_outcome`, held
  heartbeats and the outcome a waiting report asks for are answered from that copy, encoded
  once per version (views.py).

Invariants: the coordinator declares every replica of a relay dead when the relay's upstream
connection ends or its beat lease runs out: a dead relay takes its replicas with it, and a hung
one finds them fenced. If the upstream connection breaks, the relay stops and closes its
replicas' connections (they see EOF; a replica restarts as a new incarnation).
Costs: per heartbeat O(1) here and nothing upstream; per step one done_batch per relay; per
view version one beat reply (O(change) bytes) per relay, then one encoding per distinct version
its replicas hold. Limits: forwarded requests share one upstream connection (in order).

Size: one relay: its downstream server for a node's replicas, its one upstream session, and
the mapping between them; splitting them would pass the same tables across modules.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import struct
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from recover.checks import is_number
from recover.coordinator.attempt import attempt_outcome
from recover.coordinator.messages import check_field
from recover.coordinator.pacing import LeaseQueue, StreamProtocol, Waiters
from recover.coordinator.protocol import (
    DEFAULT_LEASE_S,
    MAX_FRAME,
    ProtocolError,
    View,
    merge_view,
)
from recover.coordinator.service import LoopService
from recover.coordinator.views import ViewCache, frame, split_plan

__all__ = ["RelayServer"]

log = logging.getLogger("recover.coordinator.relay")

# A done report waiting in a batch: its done_batch row (replica_id, incarnation, param_hash,
# throughput), and the future that the batch's reply (its head) resolves.
_BatchRow = tuple[list[Any], asyncio.Future[dict[str, Any]]]

_HEADER = struct.Struct(">I")
_VIEW_AT = b',"view":'
_DRAIN_ROUNDS = 4
_MAX_HOLD_S = 1.0
_FORWARDED = ("register", "failed", "leave", "process_exit", "status")
# What a done_batch row carries; a done report with any other field goes up alone.
_BATCHED_FIELDS = {
    "kind", "replica_id", "incarnation", "step", "epoch", "param_hash", "throughput",
    "view_version", "token",
}  # fmt: skip
_HEARTBEAT_OK = frame({"ok": True, "reason": "heartbeat"})  # the common reply, encoded once
_TAKEN = frame({"ok": True, "taken": True})  # a waiting report is on record (client.py)


@dataclass
class _Member:
    incarnation: str
    state: str = "pending"  # pending | live | dead | left | expired
    why: str = ""


@dataclass
class _Conn:
    gone: asyncio.Future[None] | None
    session: tuple[int, str] | None = None
    left: bool = False
    writer: asyncio.StreamWriter | None = None


class _Upstream:
    """One connection to the coordinator: a request, then its reply (head dict, view bytes)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, limit=MAX_FRAME + 8), self.timeout_s
        )

    async def call(
        self, req: dict[str, Any], wait_s: float = 0.0
    ) -> tuple[dict[str, Any], bytes | None]:
        reader, writer = self.reader, self.writer
        if reader is None or writer is None:  # (the relay's `_main` opens both before any call)
            raise RuntimeError(f"upstream {self.host}:{self.port} called before open()")
        async with self.lock:
            writer.write(frame(req))
            async with asyncio.timeout(wait_s + self.timeout_s):
                (n,) = _HEADER.unpack(await reader.readexactly(4))
                body = await reader.readexactly(n)
        at = body.find(_VIEW_AT)  # the view is spliced in last; quotes in strings are escaped
        if at < 0:
            return json.loads(body), None
        return json.loads(body[:at] + b"}"), body[at + len(_VIEW_AT) : -1]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class RelayServer(LoopService):
    """`RelayServer((host, port)).start()`; `.address`; `.stop()`. See the module docstring."""

    _what = "relay"

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        relay_id: str | None = None,
        beat_s: float = 0.25,
        batch_s: float = 0.01,
        tick_s: float = 0.02,
        max_wait_s: float = 60.0,
        body_timeout_s: float = 10.0,
        upstream_timeout_s: float = 10.0,
    ) -> None:
        for name, v in (("beat_s", beat_s), ("batch_s", batch_s), ("tick_s", tick_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        super().__init__(token=token, max_wait_s=max_wait_s, body_timeout_s=body_timeout_s)
        self._upstream_addr = upstream
        self._host, self._port = host, port
        self._up_token = token
        self.relay_id = relay_id or uuid.uuid4().hex[:12]
        self._beat_s, self._batch_s, self._tick_s = beat_s, batch_s, tick_s
        self._up_timeout_s = upstream_timeout_s
        self._members: dict[int, _Member] = {}
        # Replica -> its lease; the length is the coordinator's, told at each beat (`_beat`).
        self._leases: LeaseQueue[int] = LeaseQueue(DEFAULT_LEASE_S)
        self._heard: dict[int, float] = {}  # replica -> when its last heartbeat was read
        self._n_live = 0  # our replicas in the current view's live set (a done batch's size)
        self._view: View | None = None  # the coordinator's view, without its plan
        self._views = ViewCache()
        self._plan = b""
        self._held = Waiters()  # held heartbeats: epoch or status changes
        # (step, epoch) -> its done reports not yet sent up: a done_batch row each, and the
        # future its reply resolves.
        self._batches: dict[tuple[int, int], list[_BatchRow]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ids = itertools.count()

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 30.0) -> None:
        """Connect upstream, then listen; returns when listening."""
        self._start_loop()
        self._wait_ready(timeout_s)

    async def _main(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        host, port = self._upstream_addr
        self._beat_up = _Upstream(host, port, self._up_timeout_s)
        self._rpc_up = _Upstream(host, port, self._up_timeout_s)
        await self._beat_up.open()
        await self._rpc_up.open()
        await self._beat(hold=False)  # the lease and the view before any replica is served

        def protocol() -> StreamProtocol:
            return StreamProtocol(asyncio.StreamReader(loop=loop), self._handle, loop=loop)

        server = await loop.create_server(protocol, self._host, self._port)
        self._address = tuple(server.sockets[0].getsockname()[:2])
        self._ready.set()
        background = [
            asyncio.create_task(self._beat_loop()),
            asyncio.create_task(self._tick_loop()),
        ]
        try:
            await self._stop_event.wait()
        finally:
            self._stopping = True
            for t in background:
                t.cancel()
            server.close()
            self._waiters.wake()
            self._held.wake()
            for w in list(self._writers):
                w.close()
            self._beat_up.close()
            self._rpc_up.close()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=2.0)

    # ------------------------------------------------------------ upstream

    def _up(self, req: dict[str, Any]) -> dict[str, Any]:
        req = {**req, "relay": self.relay_id}
        if self._up_token is not None:
            req["token"] = self._up_token
        return req

    async def _beat(self, hold: bool) -> None:
        req = {"kind": "relay_beat", "view_version": self._views.version}
        if hold:
            req["hold_s"] = self._beat_s
        head, view = await self._beat_up.call(self._up(req), self._beat_s)
        if not head.get("ok"):
            raise ConnectionError(f"the coordinator refused this relay: {head.get('reason')}")
        self._leases.lease_s = float(head.get("lease_s", self._leases.lease_s))
        if view is not None:
            self._absorb(view)

    async def _beat_loop(self) -> None:
        try:
            while True:
                await self._beat(hold=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the coordinator is gone (or refused us): stop, loudly
            log.error("relay %s: upstream lost: %r; stopping", self.relay_id, e)
            self._error = e
            self._request_stop()

    def _absorb(self, body: bytes) -> None:
        """A view from upstream (relative to ours) -> our copy, encoded for our replicas."""
        rest, plan = split_plan(body)
        raw = json.loads(rest)
        if plan is not None:
            raw["plan_ids"], raw["weights"] = {}, {}  # we keep the plan as bytes only
        view = merge_view(self._view, raw)
        if view is None:
            return
        old = self._view
        self._view = view
        self._views.publish(view, plan if plan is not None else self._plan)
        if plan is not None:
            self._plan = plan
        if old is None or old.epoch != view.epoch:
            live = set(view.live)
            for r, m in self._members.items():
                if r in live and m.state == "pending":
                    m.state = "live"
                elif r not in live and m.state == "live":
                    m.state, m.why = "dead", f"epoch {view.epoch} no longer holds replica {r}"
                    self._leases.settle([r], {r: None})
            self._n_live = sum(r in live for r in self._members)

        def key(v: View) -> tuple[int, str, int, int, int]:
            return (v.epoch, v.status, v.attempt_epoch, v.step, v.committed_step)

        if old is None or key(old) != key(view):
            if old is None or key(old)[:2] != key(view)[:2]:
                self._held.wake()
            self._waiters.wake()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell(self, req: dict[str, Any]) -> None:
        """A membership change upstream (process_exit, lease_expired); its reply is not needed."""
        try:
            head, view = await self._rpc_up.call(self._up(req))
        except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.error("relay %s: could not tell the coordinator %s: %r", self.relay_id, req, e)
            self._error = e
            self._request_stop()

    # ------------------------------------------------------------ leases

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            for _ in range(_DRAIN_ROUNDS):  # read what is readable before judging any lease
                await asyncio.sleep(0)
            now = time.monotonic()
            due = self._leases.due(now)
            for r in due:
                m = self._members.get(r)
                if m is None or m.state not in ("pending", "live"):
                    continue
                silent = now - self._heard.get(r, now)
                m.state = "expired" if m.state == "pending" else "dead"
                m.why = f"replica {r} lease expired at relay {self.relay_id}: silent {silent:.3f} s"
                req = {"kind": "lease_expired", "replica_id": r, "incarnation": m.incarnation}
                self._spawn(self._tell(req))
            self._leases.settle(due, {})

    def _lost(self, session: tuple[int, str]) -> None:
        """The session `session` (replica, incarnation) ended: its connection's EOF."""
        r, inc = session
        m = self._members.get(r)
        if m is None or m.incarnation != inc or m.state not in ("pending", "live"):
            return
        m.state, m.why = "dead", f"replica {r} process exited (session EOF at its relay)"
        self._leases.settle([r], {r: None})
        self._spawn(self._tell({"kind": "process_exit", "replica_id": r, "incarnation": inc}))

    # ------------------------------------------------------------ downstream

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(gone=getattr(writer.transport.get_protocol(), "gone", None), writer=writer)
        task = asyncio.current_task()
        if task is None:  # (asyncio runs each connection's callback as a task of its own)
            raise RuntimeError("a relay connection handled outside a task")
        self._writers.add(writer)
        self._tasks.add(task)
        peer = str(writer.get_extra_info("peername"))
        try:
            await self._serve_requests(reader, writer, lambda req: self._dispatch(req, conn), peer)
        except (ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            if conn.session is not None and not conn.left and not self._stopping:
                self._lost(conn.session)
            writer.close()

    def _reply(self, reply: dict[str, Any], known: Any = -1) -> bytes:
        return frame(reply, self._views.encoded(known))

    def _refusal(self, r: Any, inc: Any) -> dict[str, Any] | None:
        m = self._members.get(r)
        if m is None or m.incarnation != inc:
            why = f"replica {r} incarnation {inc} is not a member (at relay {self.relay_id})"
            return {"ok": False, "code": "unknown", "reason": f"refused (unknown): {why}"}
        if m.state in ("pending", "live"):
            return None
        code = {"dead": "evicted", "left": "left", "expired": "expired"}[m.state]
        return {"ok": False, "code": code, "reason": f"refused ({code}): {m.why}"}

    async def _dispatch(self, req: dict[str, Any], conn: _Conn) -> bytes:
        kind = req.get("kind")
        known = req.get("view_version", -1)
        if kind in ("done", "failed") and "deadline_s" in req:
            return await self._report_and_wait(req, conn)
        if kind in _FORWARDED:
            return await self._forward(req, conn)
        if kind == "heartbeat":
            reply = await self._heartbeat(req, conn)
            if reply is None:
                return _HEARTBEAT_OK
            if reply.get("ok") and known == self._views.version:
                return frame(reply)  # it holds the current view
            return self._reply(reply, known)
        if kind == "done":
            return await self._done(req)
        if kind == "wait_view":
            return self._reply(await self._wait_view(req), known)
        if kind == "wait_outcome":
            return self._reply(await self._wait_outcome(req), known)
        if kind == "view":
            return self._reply({"ok": True}, known)
        raise ProtocolError(f"unknown request kind {kind!r}"[:200])

    async def _forward(self, req: dict[str, Any], conn: _Conn) -> bytes:
        return frame(*await self._forward_call(req, conn))

    async def _forward_call(
        self, req: dict[str, Any], conn: _Conn
    ) -> tuple[dict[str, Any], bytes | None]:
        head, view = await self._rpc_up.call(self._up(req))
        kind = req.get("kind")
        r, inc = req.get("replica_id"), req.get("incarnation")
        if head.get("ok") and kind == "register":
            # Accepted: the coordinator checked both fields (an int, a non-empty string).
            r, inc = check_field("replica_id", r), check_field("incarnation", inc)
            m = self._members.get(r)
            if m is None or m.incarnation != inc or m.state == "expired":
                m = self._members[r] = _Member(incarnation=inc)
            if self._view is not None and r in self._view.live and m.state == "pending":
                m.state = "live"
            conn.session = (r, inc)
            now = time.monotonic()
            self._heard[r] = now
            self._leases.touch(r, now)
        elif kind == "leave" and r in self._members and self._members[r].incarnation == inc:
            conn.left = True
            self._members[r].state, self._members[r].why = "left", "it left cleanly"
            self._leases.settle([r], {r: None})
        return head, view

    async def _heartbeat(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any] | None:
        """None: the common reply (alive, and it holds the current view)."""
        r = check_field("replica_id", req.get("replica_id"))
        inc = check_field("incarnation", req.get("incarnation"))
        known = req.get("view_version", -1)
        refusal = self._refusal(r, inc)
        if refusal is not None:
            return refusal
        now = time.monotonic()
        self._heard[r] = now
        self._leases.touch(r, now)
        hold = req.get("hold_s")
        if (
            isinstance(hold, int | float)
            and not isinstance(hold, bool)
            and hold > 0
            and known == self._views.version
        ):
            await self._held.park(min(float(hold), _MAX_HOLD_S), conn.gone)
            if self._refusal(r, inc) is None:  # its lease runs from the reply
                now = time.monotonic()
                self._heard[r] = now
                self._leases.touch(r, now)
        if known == self._views.version:
            return None
        return {"ok": True, "reason": "heartbeat"}

    async def _report_and_wait(self, req: dict[str, Any], conn: _Conn) -> bytes:
        """A report that waits for its outcome (client.py): it goes up without the wait (a
        done in a batch, a failed report forwarded: the upstream connection is shared, in
        order), and the outcome comes from our copy of the view, as for wait_outcome, with
        `{"taken": true}` first unless it is decided at once."""
        deadline_s = self._deadline(req)
        known = req.get("view_version", -1)
        report = {k: v for k, v in req.items() if k != "deadline_s"}
        if req.get("kind") == "done":
            head, view = await self._done_call(report)
        else:
            head, view = await self._forward_call(report, conn)
        if not head.get("ok"):
            return frame(head, view) if view is not None else self._reply(head, known)
        step, epoch = report["step"], report["epoch"]  # (checked upstream)
        ready = self._outcome_ready((report["replica_id"], report["incarnation"]), step, epoch)
        result = ready()
        if result is None:
            if conn.writer is None:  # (a replica's connection: `_handle` gave it its writer)
                raise RuntimeError("a waiting report on a connection without a writer")
            conn.writer.write(_TAKEN)
            result = await self._wait_for(ready, deadline_s)
        result = result or {"ok": True, "outcome": "timeout", "reason": "deadline passed"}
        return self._reply(result, known)

    async def _done(self, req: dict[str, Any]) -> bytes:
        head, view = await self._done_call(req)
        return frame(head, view) if view is not None else self._reply(head, req.get("view_version"))

    async def _done_call(self, req: dict[str, Any]) -> tuple[dict[str, Any], bytes | None]:
        """A done report, batched up (or alone): (its reply, the view bytes to send with it:
        None for ours, relative to the version the replica holds)."""
        r = check_field("replica_id", req.get("replica_id"))
        inc = check_field("incarnation", req.get("incarnation"))
        step, epoch = check_field("step", req.get("step")), check_field("epoch", req.get("epoch"))
        h = check_field("param_hash", req.get("param_hash"))
        tp = check_field("throughput", req.get("throughput"))
        refusal = self._refusal(r, inc)
        if refusal is not None:
            return refusal, None
        if set(req) - _BATCHED_FIELDS:  # a field a batch row does not carry: send it alone
            return await self._forward_call(req, _Conn(gone=None))
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        batch = self._batches.setdefault((step, epoch), [])
        batch.append(([r, inc, h, tp], fut))
        if len(batch) == 1:
            asyncio.get_running_loop().call_later(self._batch_s, self._flush, (step, epoch))
        if len(batch) >= self._n_live:
            self._flush((step, epoch))
        head = await fut
        refused = head.get("refused", {}).get(str(r))
        if refused is not None:
            return {"ok": False, "code": refused[0], "reason": refused[1]}, None
        return {"ok": True, "reason": head.get("reason", "")}, None

    def _flush(self, attempt: tuple[int, int]) -> None:
        batch = self._batches.pop(attempt, None)
        if batch:
            self._spawn(self._send_batch(attempt, batch))

    async def _send_batch(self, attempt: tuple[int, int], batch: list[_BatchRow]) -> None:
        req = {"kind": "done_batch", "step": attempt[0], "epoch": attempt[1]}
        req.update(reports=[row for row, _ in batch], view_version=self._views.version)
        try:
            head, view = await self._rpc_up.call(self._up(req))
            if view is not None:
                self._absorb(view)  # the commit, when this batch completed the attempt
        except (OSError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
            head = {"refused": {str(row[0]): ["unreachable", repr(e)] for row, _ in batch}}
            self._error = e
            self._request_stop()
        for _, fut in batch:
            if not fut.done():
                fut.set_result(head)

    def _held_view(self) -> View:
        """Our copy of the coordinator's view: there from `_main`'s first beat on, before any
        replica is served (that beat asks with version -1, so its reply carries the view)."""
        if self._view is None:
            raise RuntimeError(f"relay {self.relay_id}: no view from the coordinator yet")
        return self._view

    def _deadline(self, req: dict[str, Any]) -> float:
        v: Any = req.get("deadline_s")  # a wire value of any type: checked here
        if not is_number(v) or not v >= 0:
            raise ProtocolError(f"field 'deadline_s' must be a number >= 0, got {v!r}"[:200])
        return float(v)

    async def _wait_view(self, req: dict[str, Any]) -> dict[str, Any]:
        after = check_field("epoch", req.get("newer_than_epoch"))
        who = None
        if "replica_id" in req:
            who = (
                check_field("replica_id", req["replica_id"]),
                check_field("incarnation", req.get("incarnation")),
            )

        def ready() -> dict[str, Any] | None:
            if who is not None and (refusal := self._refusal(*who)):
                return refusal
            v = self._held_view()
            if v.epoch > after or v.status in ("quorum_lost", "finished", "diverged"):
                return {"ok": True}
            return None

        return await self._wait_for(ready, self._deadline(req)) or {"ok": True, "timeout": True}

    async def _wait_outcome(self, req: dict[str, Any]) -> dict[str, Any]:
        who = (
            check_field("replica_id", req.get("replica_id")),
            check_field("incarnation", req.get("incarnation")),
        )
        step = check_field("step", req.get("step"))
        epoch = check_field("epoch", req.get("epoch"))
        result = await self._wait_for(self._outcome_ready(who, step, epoch), self._deadline(req))
        return result or {"ok": True, "outcome": "timeout", "reason": "deadline passed"}

    def _outcome_ready(
        self, who: tuple[int, str], step: int, epoch: int
    ) -> Callable[[], dict[str, Any] | None]:
        """The predicate of a wait for attempt (step, epoch)'s outcome, on our copy of the view."""

        def ready() -> dict[str, Any] | None:
            if refusal := self._refusal(*who):
                return refusal
            out = attempt_outcome(self._held_view(), step, epoch)  # (the fields it reads)
            if out is None:
                return None
            if out[0] == "stale":
                return {"ok": False, "code": "stale", "reason": out[1]}
            return {"ok": True, "outcome": out[0], "reason": out[1]}

        return ready
