"""The coordinator server: the transport around `decide()`, plus the torch TCPStore host.

Job: accept length-prefixed JSON requests on TCP, run every message through `decide()`, tick
every ~20 ms for leases, answer long-polls (new view, outcome of an attempt; a done or failed
report with `deadline_s` is one: client.py), log decisions
(last ~200 in memory; every one as a JSON line in `events_path`), save the state through a
`StateStore` (in a background thread, batched), and host the `TCPStore` that per-epoch process
groups are built on.

Design (justified in docs/design.md, "Coordinator transport"): one asyncio event loop in one
background thread owns the state, so `decide()` runs strictly one message at a time without
locks; long-polls are coroutines parked on a "view changed" event. The connection on which a
replica registered is its *session*: EOF on it without a prior `leave` is reported to the rules
as `ProcessExit`, which makes a SIGKILLed replica visible within milliseconds.

Work per message does not grow with R (docs/coordinator.md has the measurements):
- a heartbeat of a current member is answered at once and queued with the time it was
  read; the queue reaches `decide` as one `Heartbeats` batch per tick. A lease is judged only
  after the loop has drained the sockets that were readable (a few zero sleeps) and the batch
  applied, so a burst of work that delays reading never turns into false deaths. A gap of more
  than half a lease in the loop's own ticks (the coordinator stopped or stalled) restarts every
  lease first (`Resumed`, `_notice_pause`): nobody dies for the coordinator's pause. The leases are
  kept in deadline order (an ordered map, moved to the end at each heartbeat): a tick looks only
  at the members whose deadline passed (`Tick(due=...)`), never scans them all;
- each view version is encoded to JSON once and spliced into every reply that carries it;
  heartbeats carry it only when the replica's `view_version` is older;
- a heartbeat may ask to be held (`hold_s`): the reply then comes at the next epoch, step or
  status change, or after hold_s. That pushes an epoch change to every replica at once instead
  of at its next heartbeat;
- long-polls park on one future each, woken only when the epoch, step, attempt or status
  changes (registrations while forming wake nobody);
- the state is saved by a background thread, at most every `save_interval_s`, newest revision
  only, and once more at stop.

Relays (relay.py) speak for their replicas: a connection that carries `relay` binds to that
relay; replicas registered through it hold no lease here (the relay judges them) and die with
it (its connection's end, or its `relay_beat` lease); `done_batch` applies a relay's batch of
done reports as one `ReportsDone`. Every reply's view is relative to the `view_version` the
request names (views.py).

Addresses (recover.addresses, docs/design.md "Across machines"): the store's address a replica
is given (in its register reply, and after a takeover in every reply that may start an epoch) is
`advertise` when set; bound to a wildcard (0.0.0.0, ::), the local address of the connection that
replica came in on (the address it reached us at, so one it can dial; never the wildcard); else
the bound address. A register from another host while that address is loopback is refused
(code "address", naming --advertise) before it joins anything.

Invariants: a bad frame, a wrong token, an unknown kind or a malformed field closes only that
connection (after an error reply when possible); every wait has a deadline (long-polls are capped
at `max_wait_s`, a frame body must arrive within `body_timeout_s`).
Limits: event writes run on the event loop (a local file). The saved state can be up to
save_interval_s older than what replicas saw. The only store today (`InMemoryStateStore`) does
not outlive the process and gets a final save at stop, so nothing is lost; a store that outlives
a crash (etcd) must also hold back the replies that reveal a commit until its revision is saved
(docs/coordinator.md, "Durability").
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recover.addresses import advertised_store_host, is_loopback, is_wildcard, unmapped
from recover.checks import is_number
from recover.coordinator.attempt import attempt_outcome
from recover.coordinator.decide import (
    check_member,
    decide,
    initial_state,
    resume_state,
    view_of,
)
from recover.coordinator.etcd import Fenced
from recover.coordinator.pacing import LeaseQueue, StreamProtocol, Waiters
from recover.coordinator.placement import NodeClaim, place
from recover.coordinator.protocol import (
    MESSAGE_KINDS,
    Decision,
    Heartbeat,
    Heartbeats,
    LeaseExpired,
    Leave,
    ProcessExit,
    ProtocolError,
    Refused,
    Register,
    Resumed,
    Takeover,
    Tick,
    check_field,
    decode_done_batch,
    decode_message,
)
from recover.coordinator.service import LoopService, reply_and_close
from recover.coordinator.state_store import (
    LIVE,
    PENDING,
    TERMINAL,
    CoordinatorOptions,
    CoordinatorState,
    InMemoryStateStore,
    StateStore,
)
from recover.coordinator.views import ViewCache, frame
from recover.record import unwritable

__all__ = ["CoordinatorServer"]

log = logging.getLogger("recover.coordinator")

# A reply's "view" value meaning: the current view, pre-encoded and spliced in, relative to the
# version the request says it holds (`view_version`; views.py)
_VIEW = object()
_MAX_HOLD_S = 1.0  # the longest a heartbeat reply may be held (a lease is >= this in practice)
_DRAIN_ROUNDS = 4  # zero sleeps before a tick: readable sockets are read and their frames handled
_TAKEN = frame({"ok": True, "taken": True})  # a waiting report is on record (client.py)


@dataclass
class _Conn:
    id: int
    peer: str
    writer: asyncio.StreamWriter | None = None
    peer_host: str | None = None  # the remote IP address
    local: str | None = None  # our IP address on this connection (what the peer dialled)
    session: tuple[int, str] | None = None  # (replica_id, incarnation) registered here
    left: bool = False
    gone: asyncio.Future | None = None  # resolved when the peer closes (StreamProtocol)
    relay: str | None = None  # the relay that speaks on this connection (relay.py)


@dataclass
class _Relay:
    """A relay's replicas (registered through it) and its connections: they live and die with it
    in our view (a relay's replicas heartbeat the relay, which holds their leases)."""

    sessions: set[tuple[int, str]]
    writers: set[asyncio.StreamWriter]


@dataclass
class _Node:
    """A node agent (recover.agent) as the server keeps it: what it may host, what it hosts."""

    slots: int
    joined: int
    holds: tuple[int, ...] = ()
    peer: str = ""


def _number(req: dict[str, Any], name: str) -> float:
    v = req.get(name)
    if not is_number(v) or not v >= 0:
        raise ProtocolError(f"field {name!r} must be a number >= 0, got {v!r}"[:200])
    return float(v)


# Decisions made at every step of a healthy run; the others are worth a person's look.
ROUTINE_DECISIONS = frozenset({"committed", "registered"})
# Decisions that lose a member or stop the run: logged as warnings.
WARNING_DECISIONS = frozenset({"member_dead", "quorum_lost", "diverged"})


class CoordinatorServer(LoopService):
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
        events_path: str | os.PathLike | None = None,
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
        node_lease_s: float = 5.0,
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
            ("node_lease_s", node_lease_s),
        ):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        super().__init__(token=token, max_wait_s=max_wait_s, body_timeout_s=body_timeout_s)
        self._options = options
        self._host, self._port, self._store_port = host, port, store_port
        self._advertise = advertise.strip("[] ") if advertise is not None else None
        self._fixed_loopback = False  # the store's fixed host is loopback (set at start)
        self._events_path = events_path
        self._state_store = state_store if state_store is not None else InMemoryStateStore()
        self._tick_s = tick_s
        self._log: deque[dict[str, Any]] = deque(maxlen=log_size)
        # The decisions that are not routine (not a commit or a registration): deaths, redos,
        # epochs, joins, stops. Kept apart, so that a death is still shown (`recover status`)
        # after thousands of commits have pushed it out of the log.
        self._notable: deque[dict[str, Any]] = deque(maxlen=log_size)
        self._log_lock = threading.Lock()
        self._state: CoordinatorState | None = None
        self._store_address: tuple[str, int] | None = None
        self._tcp_store: Any = None
        self._events_fd: int | None = None
        self._sessions: dict[tuple[int, str], int] = {}
        self._conn_ids = itertools.count(1)
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self._save_interval_s = save_interval_s
        self._saver: threading.Thread | None = None
        self._save_stop = threading.Event()
        # Leases in deadline order: replica -> coordinator clock of its last heartbeat (read).
        self._leases = LeaseQueue(options.lease_s)
        self._beats: list[tuple[int, str, float]] = []  # read, not yet applied (one per tick)
        self._held = Waiters()  # held heartbeats: woken by epoch or status changes only
        self._wake_key: tuple = ()
        # replica -> the newest view version a reply to it carried (on any connection), so a
        # heartbeat does not send again what the replica's rpc connection just got
        self._delivered: dict[int, int] = {}
        self._views = ViewCache()
        # Relays: their replicas, their leases (one per relay, kept by its held relay_beat) and
        # their held beats (woken at every view change).
        self._relays: dict[str, _Relay] = {}
        self._relay_leases = LeaseQueue(options.lease_s)
        self._relay_held = Waiters()
        # Node agents (recover.agent): name -> what it hosts, and one lease each, kept by its
        # beats. Not in the replicated state: after a takeover the agents' claims rebuild it.
        self._nodes: dict[str, _Node] = {}
        self._node_leases = LeaseQueue(node_lease_s)
        self._nodes_joined = itertools.count()
        self._placed = True  # False: the table changed since the ids were last placed
        self._placed_at = 0.0
        # Our own pauses (`_notice_pause`): when the loop last looked at the clock, and until
        # when a session that ends is no death (its replica gave up on us while we were paused).
        self._looked_at: float | None = None  # (set at the first tick)
        self._revalidated_until = 0.0
        # High availability (docs/coordinator.md, "The control plane in etcd"). `term`: this
        # leader's term; a loaded state is then taken over (`Takeover`). `authority()`: whether
        # it still leads (election.py); once False it decides nothing and serves nothing more.
        # A durable store (etcd) holds every reply that shows the state back until the revision
        # it shows is saved, so no replica acts on a decision a successor would not know.
        self._term, self._authority = term, authority
        self._takeover_grace_s = takeover_grace_s
        self._durable = bool(getattr(self._state_store, "durable", False))
        self._saved_revision = -1
        self._save_waiters: list[tuple[int, asyncio.Future]] = []
        self._dirty = threading.Event()
        self._deposed: str | None = None
        self.last_tick = time.monotonic()  # the loop's liveness (election.py stops renewing)
        self._pending_records: list[Decision] = []
        self._unsaved_events: list[tuple[int, bytes]] = []  # (revision, line), durable stores
        self._last_saved = -1  # the saver thread's last saved revision
        self._view_revision = 0  # the revision at which the published view last changed

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 30.0) -> None:
        """Bind, host the TCPStore, load the state; returns when listening."""
        if self._thread is not None:
            raise RuntimeError("CoordinatorServer.start() called twice")
        now = time.monotonic()
        loaded = self._state_store.load()
        if loaded is not None and loaded.options != self._options:
            raise ValueError(f"options differ from the saved state's: {loaded.options}")
        self._state = (
            initial_state(self._options, now) if loaded is None else (resume_state(loaded, now))
        )
        if loaded is not None and self._term is not None:
            self._state, decisions, reason = decide(
                now, self._state, Takeover(term=self._term, grace_s=self._takeover_grace_s)
            )
            self._pending_records = decisions  # recorded once the events file is open
            log.warning("%s", reason)
        self._wake_key = self._key(self._state)
        self._view_revision = self._state.revision
        alive = [m for m in self._state.members.values() if m.state in (PENDING, LIVE)]
        self._leases = LeaseQueue(
            self._options.lease_s, [(m.replica_id, m.last_seen) for m in alive]
        )
        if self._store_port is not None:
            from torch.distributed import TCPStore  # the only torch use; clients stay torch-free

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
        if self._events_path is not None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            try:
                self._events_fd = os.open(self._events_path, flags, 0o644)
            except OSError as e:  # a read-only or full run folder: one line, status STORAGE
                raise unwritable(self._events_path, e) from e
        for d in self._pending_records:
            self._record(d)
        self._start_loop()
        self._saver = threading.Thread(target=self._save_loop, name="coordinator-save", daemon=True)
        self._saver.start()
        self._wait_ready(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_loop(timeout_s)
        self._save_stop.set()
        if self._saver is not None:
            self._saver.join(timeout_s)
        if self._durable and self._deposed is None:  # the final save's events (the loop has
            self._flush_events(self._last_saved)  # ended: it would have written them)
        if self._events_fd is not None:
            os.close(self._events_fd)
            self._events_fd = None
        self._tcp_store = None

    @property
    def store_address(self) -> tuple[str, int] | None:
        """(host, port) of the store: the advertised or bound host (bound to a wildcard without
        `advertise`, the wildcard: each replica is told the address it reached us at)."""
        return self._store_address

    def _store_for(self, conn: _Conn | None) -> list | None:
        """The store's address as the peer on `conn` is told it (see the module docstring)."""
        if self._store_address is None:
            return None
        local = conn.local if conn is not None else None
        host = advertised_store_host(self._host, self._advertise, local)
        return [host, self._store_address[1]]

    def _store_refusal(self, conn: _Conn) -> dict[str, Any] | None:
        """A register from another host told a loopback store address (a loopback --advertise,
        or a loopback bind it somehow reached) is refused before it joins: it could never build
        a group (one line, what to set)."""
        store = self._store_for(conn)
        if store is None or conn.peer_host is None or is_loopback(conn.peer_host):
            return None
        if not self._fixed_loopback:  # a wildcard's per-connection address is never loopback
            return None  # for a peer on another host
        why = (
            f"the coordinator would give its store as {store[0]}:{store[1]}, a loopback address, "
            f"to a replica connecting from {conn.peer_host}, which cannot dial it: start the "
            f"coordinator with --advertise set to an address of its host that {conn.peer_host} "
            "reaches (or, bound to 0.0.0.0, without --advertise)"
        )
        log.error("refused a registration: %s", why)
        return {"ok": False, "code": "address", "reason": why}

    @property
    def deposed(self) -> str | None:
        """Why this leader stopped leading (its term was superseded or its lease lost), or None."""
        return self._deposed

    def state(self) -> CoordinatorState:
        """The current state (never mutated after publication: safe to read from any thread)."""
        return self._state

    def decisions(self) -> list[dict[str, Any]]:
        with self._log_lock:
            return list(self._log)

    def notable_decisions(self) -> list[dict[str, Any]]:
        """The last decisions that are not routine (ROUTINE_DECISIONS), oldest first."""
        with self._log_lock:
            return list(self._notable)

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
            await asyncio.sleep(self._tick_s)
            for _ in range(_DRAIN_ROUNDS):  # read what is readable before judging any lease
                await asyncio.sleep(0)
            self.last_tick = time.monotonic()
            if self._authority is not None and not self._authority():
                self._depose("its lease ran out (it was stalled or lost etcd)")
                return
            try:
                self._notice_pause(time.monotonic())  # before any lease is judged
                self._flush_beats()
                now = time.monotonic()
                due = self._leases.due(now)
                st = self._state
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
                self._stop_event.set()
                return

    def _check_authority(self) -> None:
        if self._deposed is not None or (self._authority is not None and not self._authority()):
            self._depose("its lease ran out (it was stalled or lost etcd)")
            raise _Deposed(self._deposed)

    def _apply(self, msg: Any, now: float | None = None) -> tuple[list[Decision], str]:
        self._check_authority()
        old = self._state
        new, decisions, reason = decide(time.monotonic() if now is None else now, old, msg)
        self._state = new
        for d in decisions:
            self._record(d)
        if new.view_version != old.view_version:
            # What a reply shows must be durable before it leaves: the view, as of this revision
            # (a registration alone moves no view, so R registrations wait for no save).
            self._view_revision = new.revision
            key = self._key(new)
            if key != self._wake_key:
                if key[:2] != self._wake_key[:2]:  # (epoch, status): push to held heartbeats
                    self._held.wake()
                self._wake_key = key
                self._waiters.wake()
                self._relay_held.wake()
        if self._durable and new.revision != old.revision:
            self._dirty.set()  # saved at once (a reply waits for it), batched while it saves
        return decisions, reason

    @staticmethod
    def _key(s: CoordinatorState) -> tuple:
        """What long-polls wait for: a new epoch, attempt, step or status. Held heartbeats wait
        for the first two fields only: commits and redos reach a replica as the answer to its
        report (a redo moves the epoch too), so a commit does not send every replica its view twice."""
        return (s.epoch, s.status, s.attempt_epoch, s.step, s.committed_step)

    # ------------------------------------------------------------ leases and saving

    def _flush_beats(self) -> None:
        if self._beats:
            beats, self._beats = tuple(self._beats), []
            self._apply(Heartbeats(seen=beats))

    def _requeue(self, due: list[int]) -> None:
        members = self._state.members
        alive = {}
        for r in due:
            m = members.get(r)
            alive[r] = m.last_seen if m is not None and m.state in (PENDING, LIVE) else None
        self._leases.settle(due, alive)

    def _notice_pause(self, now: float) -> None:
        """A gap of more than half a lease since the loop last looked at the clock means the
        coordinator itself was not running (SIGSTOP, a stalled or swapping host): nobody could be
        heard meanwhile. The leases then restart (`Resumed`, recorded as `revalidated`) before
        any is judged, relays' too, and for one lease a session that ends is no death: its
        replica gave up on a reply and registers again, and its fresh lease judges it."""
        gap, self._looked_at = now - (self._looked_at or now), now
        if gap <= self._options.lease_s / 2:
            return
        self._apply(Resumed(paused_s=gap), now)
        for relay_id in self._relays:
            self._relay_leases.touch(relay_id, now)
        self._revalidated_until = now + self._options.lease_s

    def _save_loop(self) -> None:
        """Save the newest revision at most every save_interval_s, and once more at stop."""
        saved = None
        failing = False
        started = 0.0
        while True:
            if self._durable:  # when dirty (replies wait for it), at most one save per interval:
                # what changes meanwhile goes in the next (group commit), so a burst of changes
                # (R registrations) costs ten saves a second, not one per change
                self._save_stop.wait(max(0.0, started + self._save_interval_s - time.monotonic()))
                self._dirty.wait(self._save_interval_s)
                self._dirty.clear()
                stopping = self._save_stop.is_set()
                started = time.monotonic()
            else:
                stopping = self._save_stop.wait(self._save_interval_s)
            state = self._state
            if state is not None and state.revision != saved and self._deposed is None:
                try:
                    self._state_store.save(state)
                    saved = self._last_saved = state.revision
                    if failing:
                        log.warning("saving the coordinator state works again")
                    failing = False
                    if self._durable:
                        self._call_in_loop(self._on_saved, saved)
                except Fenced as e:
                    self._call_in_loop(self._depose, str(e))
                    return
                except Exception as e:  # keep serving; the next round retries
                    if not failing:  # once per outage (it retries ten times a second)
                        log.warning("saving the coordinator state failed (retrying): %s", e)
                    failing = True
                    self._save_stop.wait(self._save_interval_s)
                    self._dirty.set()
            if stopping:
                return

    def _call_in_loop(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has ended (stop): nobody waits any more
            pass

    def _on_saved(self, revision: int) -> None:
        self._saved_revision = max(self._saved_revision, revision)
        self._flush_events(self._saved_revision)
        keep = []
        for rev, fut in self._save_waiters:
            if rev <= self._saved_revision:
                if not fut.done():
                    fut.set_result(True)
            else:
                keep.append((rev, fut))
        self._save_waiters = keep

    async def _saved(self, revision: int) -> bool:
        """Wait until `revision` is durable; False when it never will be (deposed, stopping)."""
        if revision <= self._saved_revision:
            return True
        if self._deposed is not None or self._stopping:
            return False
        fut = self._loop.create_future()
        self._save_waiters.append((revision, fut))
        return await fut

    def _depose(self, why: str) -> None:
        """Stop leading: decide nothing, reveal nothing, close every connection (loop thread)."""
        if self._deposed is not None:
            return
        # The events of decisions already saved belong in the record (a successor builds on
        # them); the others were never durable and are never written.
        self._flush_events(self._last_saved)
        self._unsaved_events = []
        self._deposed = why
        log.error("coordinator of term %s stands down: %s", self._term, why)
        for _, fut in self._save_waiters:
            if not fut.done():
                fut.set_result(False)
        self._save_waiters = []
        self._stop_event.set()

    def _frame(self, reply: dict[str, Any], known: Any = None) -> bytes:
        """One reply frame; a `_VIEW` value is replaced by the current view, encoded once per
        version and sent relative to `known`, the view version the requester holds."""
        if reply.get("view") is not _VIEW:
            return frame(reply)
        st = self._state
        if self._views.version != st.view_version:
            self._views.publish(view_of(st), microbatches=st.options.microbatches)
        reply = {k: v for k, v in reply.items() if k != "view"}
        return frame(reply, self._views.encoded(known))

    def _record(self, d: Decision) -> None:
        record = d.to_dict()
        entry = {"t_wall": time.time(), "t_mono": time.monotonic(), **record}
        with self._log_lock:
            self._log.append(entry)
            if d.name not in ROUTINE_DECISIONS:
                self._notable.append(entry)
        # Commits happen every step: the replicas' step lines already show them. A death or a
        # stopped run is shown at --log-level warning too.
        level = (
            logging.DEBUG if d.name in ROUTINE_DECISIONS
            else logging.WARNING if d.name in WARNING_DECISIONS else logging.INFO
        )  # fmt: skip
        log.log(level, "%s: %s", d.name, d.reason)
        if self._events_fd is not None:
            fields = {k: v for k, v in record.items() if k not in ("decision", "reason")}
            if "replica_id" in fields:  # docs/metrics.md names a replica `replica` in events
                fields["replica"] = fields["replica_id"]
            # The step in flight when it was decided: the file's order cannot tell (a writer may
            # append the previous step's record after this line).
            fields.setdefault("step", self._state.step)
            line = {
                "kind": "event",
                "name": f"coordinator.{d.name}",
                "t_wall": entry["t_wall"],
                "reason": d.reason,
                **fields,
            }
            if self._term is not None:  # which leader decided it (a takeover starts a new term)
                line["term"] = self._term
            data = (json.dumps(line) + "\n").encode()
            if self._durable:  # written once durable; never, if this leader is deposed first
                self._unsaved_events.append((self._state.revision, data))
            else:
                self._write_event(data)

    def _write_event(self, data: bytes) -> None:
        """One whole line to the run's record. When it cannot be written (a full disk, a
        read-only folder) the coordinator stops: it decides nothing more that it cannot record
        (the replicas then stop as for a lost coordinator; the process exits exits.STORAGE)."""
        if self._events_fd is None or self._error is not None:
            return
        try:
            written = os.write(self._events_fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            self._error = unwritable(self._events_path, e)
            log.critical(f"{self._error}: the coordinator stops (it records every decision)")
            if self._loop is not None and self._stop_event is not None:
                self._loop.call_soon_threadsafe(self._stop_event.set)

    def _flush_events(self, revision: int) -> None:
        """Write the events of decisions whose state (up to `revision`) is saved."""
        keep = []
        for rev, data in self._unsaved_events:
            if rev <= revision and self._events_fd is not None:
                self._write_event(data)
            elif rev > revision:
                keep.append((rev, data))
        self._unsaved_events = keep

    # ------------------------------------------------------------ connections

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
        self._tasks.add(asyncio.current_task())
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
            self._tasks.discard(asyncio.current_task())
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
            self._delivered[req["replica_id"]] = self._state.view_version
        shows = self._durable and ("view" in reply or "outcome" in reply)
        revision = self._view_revision
        data = self._frame(reply, req.get("view_version"))
        if shows and not await self._saved(revision):
            return None
        return data

    def _session_lost(self, conn: _Conn) -> None:
        r, inc = conn.session
        if self._sessions.get((r, inc)) != conn.id:
            return  # the replica re-registered on a newer connection
        del self._sessions[(r, inc)]
        now = time.monotonic()
        self._notice_pause(now)
        if now < self._revalidated_until:
            log.info("replica %s: its session ended while we were paused; its lease judges it", r)
            return
        if not check_member(self._state, r, inc)[0]:
            self._apply(ProcessExit(replica_id=r, incarnation=inc))

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

    async def _handle_heartbeat(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        msg = decode_message(req)
        r, inc = msg.replica_id, msg.incarnation
        self._check_authority()
        st, now = self._state, time.monotonic()
        if check_member(st, r, inc)[0]:
            reply = self._handle_message(req, conn, msg)  # a refusal
        else:  # the common case: O(1) now, applied with the tick's batch
            self._beats.append((r, inc, now))
            self._leases.touch(r, now)
            reply = {"ok": True, "reason": "heartbeat"}
        hold = req.get("hold_s")
        known = req.get("view_version")
        if not isinstance(known, int) or isinstance(known, bool):
            known = -1
        if (
            reply.get("ok")
            and isinstance(hold, int | float)
            and not isinstance(hold, bool)
            and hold > 0
            and max(known, self._delivered.get(r, -1)) == self._state.view_version
        ):
            # A held session that the replica's death closes must end now, not after the hold:
            # its EOF is what declares the death.
            await self._held.park(min(float(hold), _MAX_HOLD_S), conn.gone)
            # While we held the reply the replica could not heartbeat: its lease runs from now.
            if not check_member(self._state, r, inc)[0]:
                now = time.monotonic()
                self._beats.append((r, inc, now))
                self._leases.touch(r, now)
        if (
            not reply.get("ok")
            or max(known, self._delivered.get(r, -1)) != self._state.view_version
        ):
            # Pushed to every replica at each epoch change, relative to the view it holds: a
            # delta of the live set, and no plan when it holds this plan (views.py).
            reply["view"] = _VIEW
        return reply

    def _handle_message(self, req: dict[str, Any], conn: _Conn, msg: Any = None) -> dict[str, Any]:
        msg = decode_message(req) if msg is None else msg
        now = time.monotonic()
        decisions, reason = self._apply(msg, now)
        for d in decisions:
            if isinstance(d, Refused) and d.incarnation == getattr(msg, "incarnation", None):
                return {"ok": False, "code": d.code, "reason": d.reason, "view": _VIEW}
        reply: dict[str, Any] = {"ok": True, "reason": reason}
        relay = self._relays.get(conn.relay) if conn.relay is not None else None
        if isinstance(msg, Register | Heartbeat) and relay is None:
            self._leases.touch(msg.replica_id, now)
        if isinstance(msg, Register):
            if relay is not None:  # its session and lease are the relay's
                relay.sessions.add((msg.replica_id, msg.incarnation))
            else:
                conn.session = (msg.replica_id, msg.incarnation)
                self._sessions[conn.session] = conn.id
            reply["store"] = self._store_for(conn)
            # The replica's fence window (client.writes_allowed): how long it may go unconfirmed.
            reply["lease_s"] = self._options.lease_s
        elif relay is not None and isinstance(msg, Leave | ProcessExit | LeaseExpired):
            relay.sessions.discard((msg.replica_id, msg.incarnation))
        if isinstance(msg, Leave) and relay is None:
            conn.left = True
        if not isinstance(msg, Heartbeat) or req.get("view_version") != self._state.view_version:
            reply["view"] = _VIEW
        return reply

    # ------------------------------------------------------------ relays

    def _bind_relay(self, conn: _Conn, relay_id: Any) -> None:
        if not isinstance(relay_id, str) or not 0 < len(relay_id) <= 128:
            raise ProtocolError(f"field 'relay' must be a non-empty string, got {relay_id!r}"[:200])
        if conn.relay == relay_id:
            return
        if conn.relay is not None:
            raise ProtocolError("one connection speaks for one relay")
        conn.relay = relay_id
        relay = self._relays.get(relay_id)
        if relay is None:
            relay = self._relays[relay_id] = _Relay(sessions=set(), writers=set())
            self._relay_leases.touch(relay_id, time.monotonic())
            log.info("relay %s connected from %s", relay_id, conn.peer)
        relay.writers.add(conn.writer)

    def _relay_lost(self, relay_id: str, how: str) -> None:
        """A relay's connection ended (how="exit") or its lease ran out ("lease"): every replica
        registered through it is gone with it (the next view says so), and its connections are
        closed (a hung relay that wakes up finds its replicas fenced)."""
        relay = self._relays.pop(relay_id, None)
        if relay is None:
            return
        self._relay_leases.settle([relay_id], {relay_id: None})
        log.warning("relay %s lost (%s) with %d replicas", relay_id, how, len(relay.sessions))
        for r, inc in sorted(relay.sessions):
            if not check_member(self._state, r, inc)[0]:
                msg = ProcessExit if how == "exit" else LeaseExpired
                self._apply(msg(replica_id=r, incarnation=inc))
        for w in relay.writers:
            w.close()

    async def _handle_relay_beat(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        """A relay's heartbeat, held like a replica's but woken by any view change (a relay
        answers its replicas' long-polls from its copy of the view). The relay holds its
        replicas' leases: none of their heartbeats comes here (an older relay's `seen`, which
        answered accusations, is ignored)."""
        relay_id = conn.relay
        if relay_id not in self._relays:
            return {"ok": False, "code": "unknown", "reason": f"relay {relay_id} was declared lost"}
        self._relay_leases.touch(relay_id, time.monotonic())
        known = req.get("view_version")
        hold = req.get("hold_s")
        if (
            isinstance(hold, int | float)
            and not isinstance(hold, bool)
            and hold > 0
            and known == self._state.view_version
        ):
            await self._relay_held.park(min(float(hold), _MAX_HOLD_S), conn.gone)
            if relay_id in self._relays:  # its lease runs from the reply
                self._relay_leases.touch(relay_id, time.monotonic())
        reply: dict[str, Any] = {"ok": True, "lease_s": self._options.lease_s}
        if known != self._state.view_version:
            reply["view"] = _VIEW
        return reply

    # ------------------------------------------------------------ node agents

    def _handle_node_beat(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        """A node agent's beat: its name, its free slots now, the ids it runs. The reply is the
        ids it hosts from now on (placement.place over every live node), the run's status and
        R. A beat keeps the node's lease; `leaving: true` (drained, its replicas gone) removes
        it at once, its ids free for another node (`why`: the agent's words, for the record)."""
        self._check_authority()
        name = req.get("node")
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise ProtocolError(f"field 'node' must be a non-empty string, got {name!r}"[:200])
        slots, holds = req.get("slots"), req.get("holds", [])
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ProtocolError(f"field 'slots' must be an int >= 0, got {slots!r}"[:200])
        if not isinstance(holds, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in holds
        ):
            raise ProtocolError(f"field 'holds' must be a list of replica ids, got {holds!r}"[:200])
        st = self._state
        if req.get("leaving") is True:
            node = self._nodes.pop(name, None)
            self._placed = False
            if node is not None:
                self._node_leases.settle([name], {name: None})
                why = req.get("why")
                why = why[:200] if isinstance(why, str) and why else "it left"
                self._node_event("node_left", name, ids=list(node.holds), reason=why)
            return {"ok": True, "assign": [], "status": st.status}
        node = self._nodes.get(name)
        if node is None:  # new, or known to a leader before us: its claim is what it runs
            node = self._nodes[name] = _Node(
                slots=slots, joined=next(self._nodes_joined), holds=tuple(holds), peer=conn.peer
            )
            self._node_event("node_joined", name, slots=slots, ids=sorted(holds), peer=conn.peer)
            self._placed = False
        if node.slots != slots:
            node.slots, self._placed = slots, False
        self._node_leases.touch(name, time.monotonic())
        # Only a change of the table moves ids, at most once a tick (3 ms at 12,500 ids on 1,563
        # nodes): a storm of joins costs the loop ticks, not joins x placements. A node given
        # nothing yet hears its ids at its next beat (the tick loop places them meanwhile).
        now = time.monotonic()
        if not self._placed and now - self._placed_at >= self._tick_s:
            self._place_nodes()
        return {
            "ok": True,
            "assign": list(node.holds),
            "status": st.status,
            "replicas": st.options.expected_replicas,
            "node_lease_s": self._node_leases.lease_s,
        }

    def _place_nodes(self) -> None:
        placed = place(
            self._state.options.expected_replicas,
            [NodeClaim(n, x.slots, x.joined, x.holds) for n, x in self._nodes.items()],
        )
        for n, ids in placed.items():
            x = self._nodes[n]
            if ids != x.holds:
                self._node_event("node_assigned", n, ids=list(ids), was=list(x.holds))
                x.holds = ids
        self._placed, self._placed_at = True, time.monotonic()

    def _node_lost(self, name: str) -> None:
        """A node agent silent past its lease: its ids are free for the other nodes (a standby
        node's next beat is given them); its replicas, if any still run, are judged by their
        own leases. An agent that comes back is a new node (it joins again, holding nothing
        the others took)."""
        node = self._nodes.pop(name, None)
        self._node_leases.settle([name], {name: None})
        self._placed = False
        if node is not None:
            self._node_event(
                "node_lost", name, ids=list(node.holds),
                reason=f"no beat for {self._node_leases.lease_s:g} s (its lease)",
            )  # fmt: skip

    def _node_event(self, what: str, node: str, **fields: Any) -> None:
        """A node's change, logged and in the run's record (`coordinator.node_*` events)."""
        level = logging.WARNING if what == "node_lost" else logging.INFO
        log.log(level, "%s: %s %s", what, node, fields)
        if self._events_fd is not None:
            line = {
                "kind": "event", "name": f"coordinator.{what}", "t_wall": time.time(),
                "node": node, "step": self._state.step, **fields,
            }  # fmt: skip
            self._write_event((json.dumps(line) + "\n").encode())

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The node table (for `status` and tests): name -> slots, holds."""
        return {n: {"slots": x.slots, "holds": list(x.holds)} for n, x in self._nodes.items()}

    def _handle_done_batch(self, req: dict[str, Any]) -> dict[str, Any]:
        msg = decode_done_batch(req)
        decisions, reason = self._apply(msg)
        refused = {
            str(d.replica_id): [d.code, d.reason] for d in decisions if isinstance(d, Refused)
        }
        return {"ok": True, "reason": reason, "refused": refused, "view": _VIEW}

    async def _handle_wait_view(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        after = check_field("epoch", req.get("newer_than_epoch"))
        deadline_s = _number(req, "deadline_s")
        who = self._who(req, required=False)

        def ready() -> dict[str, Any] | None:
            if who is not None and (refusal := self._refusal(*who)):
                return refusal
            s = self._state
            if s.epoch > after or s.status in TERMINAL:
                return {"ok": True, "view": _VIEW}
            return None

        result = await self._wait_for(ready, deadline_s)
        return self._with_store(result or {"ok": True, "timeout": True, "view": _VIEW}, conn)

    async def _handle_wait_outcome(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        who = self._who(req, required=True)
        step = check_field("step", req.get("step"))
        epoch = check_field("epoch", req.get("epoch"))
        deadline_s = _number(req, "deadline_s")
        return await self._outcome(who, step, epoch, deadline_s, conn)

    async def _handle_report_and_wait(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        """A done or failed report that carries `deadline_s`: taken as any report, then answered
        with the attempt's outcome as wait_outcome answers it (one round trip a step). When the
        outcome is not decided at once, `{"taken": true}` goes first: the report is on record."""
        deadline_s = _number(req, "deadline_s")
        reply = self._handle_message(req, conn)
        if not reply.get("ok"):
            return reply  # refused (stale: the client asks wait_outcome)
        msg_step, msg_epoch = req["step"], req["epoch"]  # (checked by the decoder)
        who = (req["replica_id"], req["incarnation"])
        return await self._outcome(who, msg_step, msg_epoch, deadline_s, conn, conn.writer)

    async def _outcome(
        self,
        who: tuple[int, str],
        step: int,
        epoch: int,
        deadline_s: float,
        conn: _Conn,
        taken: asyncio.StreamWriter | None = None,
    ) -> dict[str, Any]:
        """The reply to a wait for attempt (step, epoch)'s outcome; with `taken`, a writer that
        gets `{"taken": true}` first unless the outcome is decided at once."""

        def ready() -> dict[str, Any] | None:
            refusal = self._refusal(*who)
            # A planned leaver is fenced as left by the very commit it waits for: it gets that.
            left_now = refusal and refusal["code"] == "left" and step <= self._state.committed_step
            if refusal and not left_now:
                return refusal
            out = attempt_outcome(self._state, step, epoch)
            if out is None:
                return None
            if out[0] == "stale":
                return {"ok": False, "code": "stale", "reason": out[1], "view": _VIEW}
            return {"ok": True, "outcome": out[0], "reason": out[1], "view": _VIEW}

        result = ready()
        if result is None:
            if taken is not None:
                taken.write(_TAKEN)  # shows nothing of the state: no save to wait for
            result = await self._wait_for(ready, deadline_s)
        if result is None:
            result = {"ok": True, "outcome": "timeout", "reason": "deadline passed", "view": _VIEW}
        return self._with_store(result, conn)

    def _with_store(self, reply: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        """The store's address with the replies after which a replica may build a process group
        (a new epoch): after a takeover, the new leader's store, whichever reply comes first."""
        if self._term is not None and self._store_address is not None and reply.get("ok"):
            reply["store"] = self._store_for(conn)
        return reply

    def _who(self, req: dict[str, Any], *, required: bool) -> tuple[int, str] | None:
        if not required and "replica_id" not in req:
            return None
        return check_field("replica_id", req.get("replica_id")), check_field(
            "incarnation", req.get("incarnation")
        )

    def _refusal(self, replica_id: int, incarnation: str) -> dict[str, Any] | None:
        code, why = check_member(self._state, replica_id, incarnation)
        if not code:
            return None
        return {"ok": False, "code": code, "reason": f"refused ({code}): {why}"}

    def _status(self, conn: _Conn | None = None) -> dict[str, Any]:
        s, now = self._state, time.monotonic()
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


class _Deposed(Exception):
    """Raised inside the loop when this leader may no longer decide (see `_depose`)."""


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
