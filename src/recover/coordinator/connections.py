"""What a request on a connection to the coordinator gets: sessions, held replies, long-polls.

Job: `Connections`, the layer of `CoordinatorServer` above the rules driver (driver.py), answers
the requests that replicas and relays send on a connection (`_Conn`; server.py accepts it and
routes each request here by its kind): a rule message (decoded, applied through `_apply`,
answered with the view), a heartbeat (answered at once, held when it asks), a done or failed
report that waits for its attempt's outcome, the long-polls `wait_view` and `wait_outcome`, a
relay's beat and its batch of done reports. It keeps the sessions and the relays, tells each
peer the store's address it can dial, and notices the coordinator's own pauses.

Sessions: the connection on which a replica registered is its *session*: EOF on it without a
prior `leave` is reported to the rules as `ProcessExit` (`_session_lost`), which makes a
SIGKILLed replica visible within milliseconds. A gap of more than half a lease in the loop's
own ticks (the coordinator stopped or stalled) restarts every lease first (`Resumed`,
`_notice_pause`), and for one lease a session that ends is no death: nobody dies for the
coordinator's pause.

Work per request does not grow with R (docs/coordinator.md has the measurements):
- a heartbeat of a current member is answered at once and queued with the time it was read;
  the rules get the queue in `Heartbeats` batches, when a tick judges a lease and every
  lease_s / 4 at most otherwise (driver.py, `_flush_beats`);
- each view version is encoded to JSON once and spliced into every reply that carries it
  (`_VIEW`, `_frame`; views.py), relative to the `view_version` the request names; heartbeats
  carry it only when the replica's `view_version` is older;
- a heartbeat may ask to be held (`hold_s`): the reply then comes at the next epoch or status
  change, or after hold_s (at most `_MAX_HOLD_S`), or at once when its peer closes. That pushes
  an epoch change to every replica at once instead of at its next heartbeat;
- long-polls park on one future each, woken only when the epoch, step, attempt or status
  changes (registrations while forming wake nobody).

Relays (relay.py) speak for their replicas: a connection that carries `relay` binds to that
relay; replicas registered through it hold no lease here (the relay judges them) and die with
it (its connection's end, or its `relay_beat` lease); `done_batch` applies a relay's batch of
done reports as one `ReportsDone`.

Addresses (recover.addresses, docs/design.md "Across machines"): the store's address a replica
is given (in its register reply, and after a takeover in every reply that may start an epoch) is
`advertise` when set; bound to a wildcard (0.0.0.0, ::), the local address of the connection that
replica came in on (the address it reached us at, so one it can dial; never the wildcard); else
the bound address. A register from another host while that address is loopback is refused
(code "address", naming --advertise) before it joins anything.

Invariants: a malformed field raises `ProtocolError` (the server then closes that connection
only); every wait has a deadline (a held reply `_MAX_HOLD_S`, a long-poll its `deadline_s`,
capped at `max_wait_s`).
Must not: call `decide` (only `_apply` does), accept connections or route requests
(server.py), or write the run's record (driver.py).
Size: the answer of every request kind a replica or a relay sends, beside the sessions and
relays they all change (a registration through a relay joins the relay's sessions,
`_handle_message`); each answer is short, and an eighth of the file is this docstring. The
accept loop and the route are in server.py, the node agents in nodes.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from recover.addresses import advertised_store_host, is_loopback
from recover.checks import is_number
from recover.coordinator.attempt import attempt_outcome
from recover.coordinator.decide import check_member, view_of
from recover.coordinator.decisions import Refused
from recover.coordinator.driver import RulesDriver
from recover.coordinator.messages import (
    Heartbeat,
    LeaseExpired,
    Leave,
    ProcessExit,
    Register,
    Resumed,
    check_field,
    decode_done_batch,
    decode_message,
)
from recover.coordinator.options import CoordinatorOptions
from recover.coordinator.pacing import LeaseQueue
from recover.coordinator.protocol import ProtocolError
from recover.coordinator.state_store import TERMINAL
from recover.coordinator.views import ViewCache, frame

__all__ = ["Connections"]

log = logging.getLogger("recover.coordinator")

# A reply's "view" value meaning: the current view, pre-encoded and spliced in, relative to the
# version the request says it holds (`view_version`; views.py)
_VIEW = object()
_MAX_HOLD_S = 1.0  # the longest a heartbeat reply may be held (a lease is >= this in practice)
_TAKEN = frame({"ok": True, "taken": True})  # a waiting report is on record (client.py)


@dataclass
class _Conn:
    id: int
    peer: str
    writer: asyncio.StreamWriter
    peer_host: str | None = None  # the remote IP address
    local: str | None = None  # our IP address on this connection (what the peer dialled)
    session: tuple[int, str] | None = None  # (replica_id, incarnation) registered here
    left: bool = False
    gone: asyncio.Future[None] | None = None  # resolved when the peer closes (StreamProtocol)
    relay: str | None = None  # the relay that speaks on this connection (relay.py)


@dataclass
class _Relay:
    """A relay's replicas (registered through it) and its connections: they live and die with it
    in our view (a relay's replicas heartbeat the relay, which holds their leases)."""

    sessions: set[tuple[int, str]]
    writers: set[asyncio.StreamWriter]


def _number(req: dict[str, Any], name: str) -> float:
    v: Any = req.get(name)  # a wire value of any type: checked here
    if not is_number(v) or not v >= 0:
        raise ProtocolError(f"field {name!r} must be a number >= 0, got {v!r}"[:200])
    return float(v)


class Connections(RulesDriver):
    """The answers to replicas' and relays' requests (see the module docstring)."""

    def __init__(
        self, options: CoordinatorOptions, *, host: str, advertise: str | None, **driver: Any
    ) -> None:
        super().__init__(options, **driver)
        self._host = host
        self._advertise = advertise.strip("[] ") if advertise is not None else None
        self._fixed_loopback = False  # the store's fixed host is loopback (set at start)
        self._store_address: tuple[str, int] | None = None
        self._sessions: dict[tuple[int, str], int] = {}
        # replica -> the newest view version a reply to it carried (on any connection), so a
        # heartbeat does not send again what the replica's rpc connection just got
        self._delivered: dict[int, int] = {}
        self._views = ViewCache()
        # Relays: their replicas and their leases (one per relay, kept by its held relay_beat).
        self._relays: dict[str, _Relay] = {}
        self._relay_leases: LeaseQueue[str] = LeaseQueue(options.lease_s)
        # Our own pauses (`_notice_pause`): when the loop last looked at the clock, and until
        # when a session that ends is no death (its replica gave up on us while we were paused).
        self._looked_at: float | None = None  # (set at the first tick)
        self._revalidated_until = 0.0

    def _store_for(self, conn: _Conn | None) -> list[str | int] | None:
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

    def _frame(self, reply: dict[str, Any], known: Any = None) -> bytes:
        """One reply frame; a `_VIEW` value is replaced by the current view, encoded once per
        version and sent relative to `known`, the view version the requester holds."""
        if reply.get("view") is not _VIEW:
            return frame(reply)
        st = self.state()
        if self._views.version != st.view_version:
            self._views.publish(view_of(st), microbatches=st.options.microbatches)
        reply = {k: v for k, v in reply.items() if k != "view"}
        return frame(reply, self._views.encoded(known))

    def _session_lost(self, conn: _Conn) -> None:
        if conn.session is None:  # (the server calls this for a session's connection only)
            raise RuntimeError(f"connection {conn.id} from {conn.peer} has no session")
        r, inc = conn.session
        if self._sessions.get((r, inc)) != conn.id:
            return  # the replica re-registered on a newer connection
        del self._sessions[(r, inc)]
        now = time.monotonic()
        self._notice_pause(now)
        if now < self._revalidated_until:
            log.info("replica %s: its session ended while we were paused; its lease judges it", r)
            return
        if not check_member(self.state(), r, inc)[0]:
            self._apply(ProcessExit(replica_id=r, incarnation=inc))

    async def _handle_heartbeat(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        msg = decode_message(req)
        if not isinstance(msg, Heartbeat):  # (the server routes kind "heartbeat" only here)
            raise ProtocolError(f"a heartbeat request decoded as {type(msg).__name__}")
        r, inc = msg.replica_id, msg.incarnation
        self._check_authority()
        st, now = self.state(), time.monotonic()
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
            and max(known, self._delivered.get(r, -1)) == self.state().view_version
        ):
            # A held session that the replica's death closes must end now, not after the hold:
            # its EOF is what declares the death.
            await self._held.park(min(float(hold), _MAX_HOLD_S), conn.gone)
            # While we held the reply the replica could not heartbeat: its lease runs from now.
            if not check_member(self.state(), r, inc)[0]:
                now = time.monotonic()
                self._beats.append((r, inc, now))
                self._leases.touch(r, now)
        if (
            not reply.get("ok")
            or max(known, self._delivered.get(r, -1)) != self.state().view_version
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
        if not isinstance(msg, Heartbeat) or req.get("view_version") != self.state().view_version:
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
            if not check_member(self.state(), r, inc)[0]:
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
            and known == self.state().view_version
        ):
            await self._relay_held.park(min(float(hold), _MAX_HOLD_S), conn.gone)
            if relay_id in self._relays:  # its lease runs from the reply
                self._relay_leases.touch(relay_id, time.monotonic())
        reply: dict[str, Any] = {"ok": True, "lease_s": self._options.lease_s}
        if known != self.state().view_version:
            reply["view"] = _VIEW
        return reply

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
        who = self._who(req) if "replica_id" in req else None

        def ready() -> dict[str, Any] | None:
            if who is not None and (refusal := self._refusal(*who)):
                return refusal
            s = self.state()
            if s.epoch > after or s.status in TERMINAL:
                return {"ok": True, "view": _VIEW}
            return None

        result = await self._wait_for(ready, deadline_s)
        return self._with_store(result or {"ok": True, "timeout": True, "view": _VIEW}, conn)

    async def _handle_wait_outcome(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        who = self._who(req)
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
            left_now = refusal and refusal["code"] == "left" and step <= self.state().committed_step
            if refusal and not left_now:
                return refusal
            out = attempt_outcome(self.state(), step, epoch)
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

    def _who(self, req: dict[str, Any]) -> tuple[int, str]:
        return check_field("replica_id", req.get("replica_id")), check_field(
            "incarnation", req.get("incarnation")
        )

    def _refusal(self, replica_id: int, incarnation: str) -> dict[str, Any] | None:
        code, why = check_member(self.state(), replica_id, incarnation)
        if not code:
            return None
        return {"ok": False, "code": code, "reason": f"refused ({code}): {why}"}
