"""The coordinator server: the transport around `decide()`, plus the torch TCPStore host.

Job: accept length-prefixed JSON requests on TCP, route each by its kind, tick every ~20 ms for
leases, answer long-polls (new view, outcome of an attempt; a done or failed report with
`deadline_s` is one: client.py), log decisions (last ~200 in memory; every one as a JSON line in
`events_path`), save the state through a `StateStore` (in a background thread, batched), and
host the `TCPStore` that per-epoch process groups are built on.

`CoordinatorServer` is built in layers, one module each, bottom up: the loop thread
(service.py); the rules driver (driver.py: the state, every message through `decide`, the
decisions' record, the saving, the leader's term); the answers to replicas and relays
(connections.py: sessions, heartbeats and held replies, long-polls, relays, the store's address
per peer); the node agents (nodes.py). This module adds the arguments and their checks, start
and stop (the TCPStore), the accept loop and the route of each request kind, the tick, and
`status`.

Design (justified in docs/design.md, "Coordinator transport"): one asyncio event loop in one
background thread owns the state, so `decide()` runs strictly one message at a time without
locks; long-polls are coroutines parked on a "view changed" event. The connection on which a
replica registered is its *session*: EOF on it without a prior `leave` is reported to the rules
as `ProcessExit`, which makes a SIGKILLed replica visible within milliseconds.

The tick (docs/coordinator.md has the measurements): a lease is judged only after the loop has
drained the sockets that were readable (a few zero sleeps) and the tick's batch of heartbeats
applied, so a burst of work that delays reading never turns into false deaths. A gap of more
than half a lease in the loop's own ticks restarts every lease first (`Resumed`,
connections.py). The tick then looks only at the members whose deadline passed
(`Tick(due=...)`), never scans them all, and judges the relays' and the node agents' leases.

Invariants: a bad frame, a wrong token, an unknown kind or a malformed field closes only that
connection (after an error reply when possible); every wait has a deadline (long-polls are capped
at `max_wait_s`, a frame body must arrive within `body_timeout_s`).
Must not: import torch before it hosts a store (tools and clients stay torch-free).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from recover.addresses import advertised_store_host, is_loopback, is_wildcard, unmapped
from recover.coordinator.connections import _VIEW, _Conn
from recover.coordinator.decide import view_of
from recover.coordinator.driver import _Deposed
from recover.coordinator.messages import MESSAGE_KINDS, Tick
from recover.coordinator.nodes import NodeAgents
from recover.coordinator.options import CoordinatorOptions
from recover.coordinator.pacing import StreamProtocol
from recover.coordinator.protocol import ProtocolError
from recover.coordinator.service import reply_and_close
from recover.coordinator.state_store import StateStore

__all__ = ["CoordinatorServer"]

log = logging.getLogger("recover.coordinator")

# The longest sleep of the tick loop between leases (_tick_wait_s), and how far past a lease's
# deadline it wakes (the lease is judged as run out strictly after its deadline).
_IDLE_TICK_S = 0.1
_PAST_DEADLINE_S = 0.001
_DRAIN_ROUNDS = 4  # zero sleeps before a tick: readable sockets are read and their frames handled


class CoordinatorServer(NodeAgents):
    """`CoordinatorServer(options).start()`; `.address`, `.store_address`; `.stop()`.

    `store_port=None` hosts no TCPStore (tools and tests that build no process groups);
    `state_store` defaults to an `InMemoryStateStore`. `advertise`: the store host given to
    replicas (default: the bound host; bound to a wildcard, the address each replica reached us
    at; see the module docstring).
    """

    _what = "coordinator"

    def __init__(
        self,
        options: CoordinatorOptions,
        host: str = "127.0.0.1",
        port: int = 0,
        store_port: int | None = 0,
        token: str | None = None,
        events_path: str | os.PathLike[str] | None = None,
        *,
        state_store: StateStore | None = None,
        tick_s: float = 0.02,
        max_wait_s: float = 60.0,
        body_timeout_s: float = 10.0,
        log_size: int = 200,
        save_interval_s: float = 0.1,
        term: int | None = None,
        authority: Callable[[], bool] | None = None,
        takeover_grace_s: float = 5.0,
        advertise: str | None = None,
    ) -> None:
        if not isinstance(options, CoordinatorOptions):
            raise ValueError(f"options must be CoordinatorOptions, got {type(options).__name__}")
        if token is not None and not token:
            raise ValueError("token must be a non-empty string or None")
        if advertise is not None and (not isinstance(advertise, str) or not advertise.strip()):
            raise ValueError(f"advertise must be a host name or address, got {advertise!r}")
        for name, v in (
            ("tick_s", tick_s),
            ("max_wait_s", max_wait_s),
            ("save_interval_s", save_interval_s),
        ):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        super().__init__(
            options,
            host=host,
            advertise=advertise,
            tick_s=tick_s,
            node_lease_s=options.node_lease_s,
            token=token,
            max_wait_s=max_wait_s,
            body_timeout_s=body_timeout_s,
            events_path=events_path,
            state_store=state_store,
            log_size=log_size,
            save_interval_s=save_interval_s,
            term=term,
            authority=authority,
            takeover_grace_s=takeover_grace_s,
        )
        self._port, self._store_port = port, store_port
        self._tcp_store: Any = None
        self._conn_ids = itertools.count(1)
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 30.0) -> None:
        """Bind, host the TCPStore, load the state; returns when listening."""
        if self._thread is not None:
            raise RuntimeError("CoordinatorServer.start() called twice")
        self._load_state()
        if self._store_port is not None:
            # The only torch use; clients stay torch-free. (torch re-exports TCPStore without
            # listing it: only mypy --strict objects, hence both codes.)
            from torch.distributed import TCPStore  # type: ignore[attr-defined, unused-ignore]

            # torch's TCPStore listens on every interface, whatever host it is given; it takes no
            # token. Bound here, on the coordinator's own address, it is reachable only where the
            # coordinator is (127.0.0.1 for a local run). See docs/design.md, "Threat model".
            listening = _listening_socket(self._host, self._store_port)
            port = listening.getsockname()[1]
            self._tcp_store = TCPStore(
                self._host, port, is_master=True, wait_for_workers=False,
                master_listen_fd=listening.detach(),  # the store owns (and closes) it from here
            )  # fmt: skip
            fixed = advertised_store_host(self._host, self._advertise, None)
            self._store_address = (fixed, int(self._tcp_store.port))
            # Resolved once here, not on the loop at each registration (a name may need DNS).
            self._fixed_loopback = not is_wildcard(fixed) and _resolves_to_loopback(fixed)
        self._open_record()
        self._start_loop()
        self._wait_ready(timeout_s)
        # The saver hands each durable revision to the loop (`_on_saved` wakes the replies that
        # wait for it): it starts once the loop runs, or a first save could find no loop to tell.
        self._start_saver()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_loop(timeout_s)
        self._close_record(timeout_s)
        self._tcp_store = None

    @property
    def store_address(self) -> tuple[str, int] | None:
        """(host, port) of the store: the advertised or bound host (bound to a wildcard without
        `advertise`, the wildcard: each replica is told the address it reached us at)."""
        return self._store_address

    # ------------------------------------------------------------ the event loop

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        loop = self._loop

        def protocol() -> StreamProtocol:  # what asyncio.start_server builds, plus `gone`
            return StreamProtocol(asyncio.StreamReader(loop=loop), self._handle, loop=loop)

        server = await loop.create_server(protocol, self._host, self._port)
        self._address = tuple(server.sockets[0].getsockname()[:2])
        self._ready.set()
        ticker = asyncio.create_task(self._tick_loop())
        try:
            await self._stop_event.wait()
        finally:
            self._stopping = True
            ticker.cancel()
            server.close()
            self._waiters.wake()  # long-polls and held heartbeats see _stopping and return
            self._held.wake()
            self._relay_held.wake()
            for w in list(self._writers):
                w.close()
            if self._tasks:  # let handlers end on their own (cancelling them logs noise)
                await asyncio.wait(list(self._tasks), timeout=2.0)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick_wait_s(time.monotonic()))
            if time.monotonic() > self._first_deadline():  # a lease is due
                for _ in range(_DRAIN_ROUNDS):  # read what is readable before judging it
                    await asyncio.sleep(0)
            self.last_tick = time.monotonic()
            if self._authority is not None and not self._authority():
                self._depose("its lease ran out (it was stalled or lost etcd)")
                return
            try:
                self._notice_pause(time.monotonic())  # before any lease is judged
                now = time.monotonic()
                due = self._leases.due(now)
                st = self.state()
                self._flush_beats(now, needed=bool(due) or st.status == "forming")
                if due or st.status == "forming":
                    self._apply(Tick(due=tuple(due)), now)
                    self._requeue(due)
                for relay in self._relay_leases.due(now):
                    self._relay_lost(relay, "lease")
                for node in self._node_leases.due(now):
                    self._node_lost(node)
                if not self._placed:
                    self._place_nodes()
            except _Deposed:
                return
            except Exception as e:  # a broken rule must stop the service loudly
                log.critical("coordinator tick failed; stopping", exc_info=True)
                self._error = e
                self._request_stop()
                return

    def _tick_wait_s(self, now: float) -> float:
        """How long the tick loop sleeps: tick_s while the run forms or node ids wait to be
        placed; else until the first lease runs out, never less than tick_s (judged as promptly
        as at a fixed tick) nor more than _IDLE_TICK_S (the heartbeats' batch and the pause check
        need a look that often). Leases only move later (a heartbeat sends its holder to the
        back), so no deadline comes before the one slept to. A fixed 20 ms tick cost the
        coordinator of a 3-replica job a fifth of its CPU."""
        if not self._placed or self.state().status == "forming":
            return self._tick_s
        return min(_IDLE_TICK_S, max(self._tick_s, self._first_deadline() - now + _PAST_DEADLINE_S))

    def _first_deadline(self) -> float:
        """When the first lease (a member's, a relay's or a node's) runs out; inf with none. A
        tick after it judges a lease: only then does it first read what is readable (the zero
        sleeps cost a tenth of the idle coordinator's CPU when done at every tick)."""
        queues = (self._leases, self._relay_leases, self._node_leases)
        return min((d for q in queues if (d := q.deadline()) is not None), default=math.inf)

    # ------------------------------------------------------------ accept, answer, route

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:  # asyncio runs each connection's handler as a task of its own
            raise RuntimeError("a connection's handler runs outside a task")
        peer = writer.get_extra_info("peername")
        local = writer.get_extra_info("sockname")
        conn = _Conn(
            id=next(self._conn_ids),
            peer=str(peer),
            writer=writer,
            peer_host=unmapped(str(peer[0])) if isinstance(peer, tuple) else None,
            local=unmapped(str(local[0])) if isinstance(local, tuple) else None,
        )
        conn.gone = getattr(writer.transport.get_protocol(), "gone", None)
        self._writers.add(writer)
        self._tasks.add(task)
        try:
            await self._serve_requests(
                reader, writer, lambda req: self._answer(req, conn), str(peer)
            )
        except (ConnectionError, OSError, _Deposed):
            pass  # the peer went away (a session's loss is handled below), or we stood down
        except Exception:
            log.exception("internal error serving %s; closing that connection", peer)
            await reply_and_close(writer, "internal", "internal coordinator error")
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            if self._deposed is None:
                if conn.session is not None and not conn.left and not self._stopping:
                    self._session_lost(conn)
                if conn.relay is not None and not self._stopping:
                    self._relay_lost(conn.relay, "exit")
            writer.close()

    async def _answer(self, req: dict[str, Any], conn: _Conn) -> bytes | None:
        """The reply to one request, as bytes; None when it may never be sent (deposed or
        stopping before what it shows is durable)."""
        reply = await self._dispatch(req, conn)
        if reply.get("view") is _VIEW and isinstance(req.get("replica_id"), int):
            self._delivered[req["replica_id"]] = self.state().view_version
        shows = self._durable and ("view" in reply or "outcome" in reply)
        revision = self._view_revision
        data = self._frame(reply, req.get("view_version"))
        if shows and not await self._saved(revision):
            return None
        return data

    async def _dispatch(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        kind = req.get("kind")
        if "relay" in req:
            self._bind_relay(conn, req["relay"])
        if kind == "relay_beat":
            return await self._handle_relay_beat(req, conn)
        if kind == "done_batch":
            return self._handle_done_batch(req)
        if kind == "node_beat":
            return self._handle_node_beat(req, conn)
        if kind == "register" and (refusal := self._store_refusal(conn)):
            return refusal
        if kind == "heartbeat":
            return await self._handle_heartbeat(req, conn)
        if kind in ("done", "failed") and "deadline_s" in req:
            return await self._handle_report_and_wait(req, conn)
        if kind in MESSAGE_KINDS:
            return self._handle_message(req, conn)
        if kind == "wait_view":
            return await self._handle_wait_view(req, conn)
        if kind == "wait_outcome":
            return await self._handle_wait_outcome(req, conn)
        if kind == "view":
            return {"ok": True, "view": _VIEW}
        if kind == "status":
            return self._status(conn)
        raise ProtocolError(f"unknown request kind {kind!r}"[:200])

    def _status(self, conn: _Conn | None = None) -> dict[str, Any]:
        s, now = self.state(), time.monotonic()
        members = [
            {
                "replica_id": m.replica_id,
                "incarnation": m.incarnation,
                "state": m.state,
                "how": m.how,
                "lease_age_s": round(now - self._leases.get(m.replica_id, m.last_seen), 3),
                "throughput": m.throughput,
            }
            for _, m in sorted(s.members.items())
        ]
        return {
            "ok": True,
            "view": view_of(s).to_dict(),  # fresh: `pending` moves without a new version
            "members": members,
            "decisions": self.decisions(),
            "notable": self.notable_decisions(),
            "store": self._store_for(conn),
            "options": vars(s.options),
            "nodes": self.nodes(),
        }


def _resolves_to_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) resolves to loopback addresses only."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(is_loopback(str(info[4][0])) for info in infos)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` only (IPv4 or IPv6, as the address resolves)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock
