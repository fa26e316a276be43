"""A replica incarnation's session with the coordinator: heartbeats, the view, the fence.

Job: `HeartbeatSession` is the base of `CoordinatorClient` (client.py adds the training loop's
calls). It holds the two connections to the leading coordinator (channel.py: the *session* one,
and the *rpc* one the training thread uses), the current view, the store address, and the daemon
thread that heartbeats on the session connection every `heartbeat_s`. Each heartbeat asks the
coordinator to hold its reply for up to `heartbeat_s` (`hold_s`): a new epoch (or step, or
status) is then pushed to the replica the moment it is decided, not at its next heartbeat. The
next heartbeat goes `heartbeat_s` after the previous one was sent, or at once when a held reply
came back (an older coordinator that does not hold gets one per heartbeat_s). A pending replica
whose lease expired before admission (code "expired") registers again.

Every request says which view version it holds (`view_version`, `_member`), and the view in the
reply is relative to it (protocol.merge_view, `_absorb`): a commit or an epoch change costs
O(change) bytes, not O(R + plan). With standbys, the session re-attaches under the new leader
with the same incarnation (a `register` of a live member: nobody is declared dead) and learns
the new leader's TCPStore (the next epoch's process group is built there); a call of the
training thread parked on the old leader is woken to move on.

Invariants:
- fencing (`writes_allowed`): this incarnation writes to the run folder only while it is a
  confirmed member: a heartbeat round sent less than the fence window W ago (the coordinator's
  `lease_s`, told at registration) was answered without "evicted", and no silence longer than W
  came after the last answer. W may be the whole lease: a silent member is evicted only when its
  lease runs out, and the lease runs from when the coordinator (or relay) read a heartbeat, which
  is after it was sent. Evictions of a member that is not silent (its session ended while it
  lives; its part of a step was not finite, `suspect_hardware`) are not bounded by W: see the
  limits in docs/design.md, "Fencing the run folder". A process that was frozen (SIGSTOP,
  a stalled host) may have been evicted meanwhile: it waits for a fresh answer before it writes.
  A coordinator that refuses connections (its process is gone) evicts nobody, so a round that
  fails fast keeps the confirmation of a process that was not silent (a network partition looks
  the same: a known limit, docs/design.md); likewise a silence that began when none was
  listening any more, none listening since (the lowest replica's save, coordinator lost).
- the coordinator is lost once none answered, on either connection, for `coordinator_grace_s`
  (`lost`); the heartbeat thread then records why and wakes the training thread's long poll.
- when the heartbeat thread learns that this incarnation was evicted, it records it, opens no
  fence any more and ends; the training thread raises `Evicted` at its next call (client.py).

Must not: make the training loop's calls (register, reports, waits, leave: client.py), or
import torch (replica helpers and tests start fast).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from recover.checks import is_int
from recover.coordinator.channel import Channel, Leader
from recover.coordinator.outcomes import (
    CoordinatorError,
    CoordinatorUnreachable,
    Evicted,
    QuorumLost,
    RequestRefused,
)
from recover.coordinator.protocol import DEFAULT_LEASE_S, View, merge_view

__all__ = ["HeartbeatSession"]

_RECENT_VIEWS = 8  # views kept by version: a reply's view is relative to the one asked with
# The fence window when the coordinator does not tell its lease (every coordinator of this project
# does): short, so that a replica rather waits for a confirmation than writes late.
_DEFAULT_FENCE_S = 0.3


class HeartbeatSession:
    """A replica incarnation's session: heartbeats, view and fence (see the module docstring).
    The base of client.CoordinatorClient, which starts the heartbeats at its `register`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        replica_id: int,
        token: str | None = None,
        heartbeat_s: float = 0.1,
        rpc_timeout_s: float = 5.0,
        coordinator_grace_s: float = 10.0,
        incarnation: str | None = None,
        standbys: Sequence[tuple[str, int]] = (),
    ) -> None:
        if not is_int(replica_id) or replica_id < 0:
            raise ValueError(f"replica_id must be an int >= 0, got {replica_id!r}")
        for name, v in (
            ("heartbeat_s", heartbeat_s),
            ("rpc_timeout_s", rpc_timeout_s),
            ("coordinator_grace_s", coordinator_grace_s),
        ):
            if not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        self.replica_id = replica_id
        # Fresh per process start. A launcher may choose it (to send process_exit for its child);
        # it must never reuse one.
        self.incarnation = incarnation or uuid.uuid4().hex
        self._token = token
        self._heartbeat_s = heartbeat_s
        self._rpc_timeout_s = rpc_timeout_s
        # The coordinator is lost once none answered for this long (see CoordinatorUnreachable);
        # until then calls reconnect and ask again, and nothing commits.
        self._grace_s = coordinator_grace_s
        self._answered_at = time.monotonic()  # the last reply of a coordinator, any connection
        # Where the leader may be: this address, then the standbys' (see the module docstring).
        self._leader = Leader([(host, port), *[(str(h), int(p)) for h, p in standbys]])
        self._standbys = len(self._leader.addresses) > 1
        self._session = Channel(host, port, rpc_timeout_s, self._leader)
        self._rpc = Channel(host, port, rpc_timeout_s, self._leader)
        self._lease_s = DEFAULT_LEASE_S  # the coordinator's lease (told at registration)
        self._lock = threading.Lock()  # guards the fields below
        self._view: View | None = None
        self._recent: dict[int, View] = {}  # the last few views we held, by version
        self._store_address: tuple[str, int] | None = None
        self._evicted: str | None = None
        self._unreachable: str | None = None
        self._fingerprint: dict[str, Any] = {}
        self._next_step = 0
        self._stop = threading.Event()
        self._heartbeats: threading.Thread | None = None
        # Fencing (see writes_allowed): when this incarnation was last known to be a member.
        self._fence_s = _DEFAULT_FENCE_S
        self._beat = threading.Condition()  # notified after every heartbeat round
        self._confirmed_at: float | None = None  # send time of the last confirming round
        self._last_sent: float | None = None  # send time of the last round
        self._silent = False  # a silence longer than the fence window; an answer clears it
        # Whether no coordinator was listening (connections refused) since the last answer, and
        # already when the silence began: then no coordinator could have evicted this
        # incarnation meanwhile (see writes_allowed).
        self._refused_since_answer: bool | None = None  # None: no failed round since
        self._silent_while_gone = False

    # ------------------------------------------------------------ properties

    @property
    def view(self) -> View | None:
        with self._lock:
            return self._view

    @property
    def store_address(self) -> tuple[str, int] | None:
        return self._store_address

    @property
    def evicted(self) -> bool:
        return self._evicted is not None

    @property
    def lost(self) -> str | None:
        """Why the coordinator counts as lost (none answered for the grace), or None."""
        if self._unreachable is None and not self._coordinator_lost():
            return None
        return self._unreachable or self._lost_reason(RuntimeError("no answer"))

    def confirm_member(self) -> None:
        """Return once the coordinator confirmed this incarnation is still a member (the fence,
        `writes_allowed`); a process woken after a freeze acts on no stale view before that.
        CoordinatorUnreachable when none answered for the grace (not an eviction), else
        Evicted."""
        if self.writes_allowed():
            return
        if self.lost is not None:
            raise CoordinatorUnreachable(self.lost)
        raise Evicted(f"replica {self.replica_id} is not a confirmed member any more")

    def writes_allowed(self, *, wait_s: float | None = None) -> bool:
        """Whether this incarnation may write to the run folder now (the fence; see the module
        docstring). Without a fresh confirmation it waits for the next heartbeat round, at most
        `wait_s` (default: the coordinator's grace, or one rpc timeout if longer, and one
        heartbeat: a frozen coordinator may answer yet); False when evicted, or when no
        confirmation came in time. Before registration and after leave(), nothing is fenced."""
        if self._heartbeats is None:
            return self._evicted is None
        patience = max(self._rpc_timeout_s, self._grace_s) + self._heartbeat_s
        if self.lost:  # none answered for the grace: one fence window more, not another grace
            patience = self._fence_s + self._heartbeat_s
        end = time.monotonic() + (patience if wait_s is None else wait_s)
        with self._beat:
            while True:
                if self._evicted is not None:
                    return False
                if self._stop.is_set():  # left (or closing): it was a member up to here
                    return True
                now = time.monotonic()
                confirmed = self._confirmed_at
                if not self._silent and confirmed is not None and now - confirmed <= self._fence_s:
                    return True
                if self._silent and self._silent_while_gone and self._refused_since_answer:
                    # A silence (a starved thread, say) that began after the last coordinator
                    # stopped listening, none listening since: nobody can have evicted it. This
                    # lets the lowest replica save when the coordinator is lost (worker.py).
                    return True
                if now >= end:
                    return False
                self._beat.wait(min(end - now, self._heartbeat_s))

    # ------------------------------------------------------------ internals

    def _member(self, req: dict[str, Any]) -> dict[str, Any]:
        req = {**req, "replica_id": self.replica_id, "incarnation": self.incarnation}
        view = self.view
        req.setdefault("view_version", view.version if view is not None else -1)
        if self._token is not None:
            req["token"] = self._token
        return req

    def _register_session(self, patience: float | None = None) -> dict[str, Any]:
        req = {"kind": "register", "fingerprint": self._fingerprint, "next_step": self._next_step}
        req = self._member(req)
        with self._session.lock:
            generation = self._session.generation
            reply = self._session.call(req, timeout_s=patience)
        self._absorb(reply, req["view_version"])
        if self._session.generation != generation:
            self._rpc.interrupt()  # a call parked on the old leader moves on at once
        return reply

    def _absorb(self, reply: dict[str, Any], known: Any) -> None:
        """Take a reply's store address and view. The view is relative to the version `known`
        that the request named (a delta of the live set, no plan when that one's is the same),
        so it is merged with that view, held among the last few, even when another reply (a
        held heartbeat) moved ours on meanwhile; it replaces ours only if it is not older."""
        self._answered_at = time.monotonic()  # every reply passes here
        store = reply.get("store")
        if reply.get("ok") and store:  # a new leader hosts a new store: the next epoch uses it
            self._store_address = (str(store[0]), int(store[1]))
        raw = reply.get("view")
        if raw is None:
            return
        with self._lock:
            base = self._recent.get(known, self._view) if isinstance(known, int) else self._view
            view = merge_view(base, raw)
            if view is not None and (self._view is None or view.version >= self._view.version):
                self._view = view
                self._recent[view.version] = view
                while len(self._recent) > _RECENT_VIEWS:
                    del self._recent[min(self._recent)]

    def _raise_refusal(self, reply: dict[str, Any]) -> None:
        if reply.get("ok"):
            return
        code, why = str(reply.get("code", "")), str(reply.get("reason", ""))
        if code in ("evicted", "unknown"):
            self._evicted = self._evicted or (
                f"replica {self.replica_id} incarnation {self.incarnation}: {why}"
            )
            raise Evicted(self._evicted)
        if code == "quorum_lost":
            raise QuorumLost(why)
        raise RequestRefused(code, why)

    def _coordinator_lost(self) -> bool:
        """No coordinator answered for longer than the grace."""
        return self._grace_left() < 0

    def _grace_left(self) -> float:
        """Seconds until the grace since the last answer of a coordinator runs out."""
        return self._grace_s - (time.monotonic() - self._answered_at)

    def _lost_reason(self, error: BaseException) -> str:
        return (
            f"no coordinator answered for {time.monotonic() - self._answered_at:.1f} s, longer "
            f"than the grace of {self._grace_s:g} s (--coordinator-grace); last error: "
            f"{str(error)[:160]}"
        )

    def _heartbeat_loop(self) -> None:
        next_at = time.monotonic() + self._heartbeat_s
        while True:
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return
            sent = time.monotonic()
            next_at = sent + self._heartbeat_s
            with self._beat:
                if self._last_sent is not None and sent - self._last_sent > self._fence_s:
                    gone = self._refused_since_answer is True  # (the rounds before the gap)
                    self._silent_while_gone = gone and (self._silent_while_gone or not self._silent)
                    self._silent = True  # frozen or starved this long: evicted meanwhile?
                self._last_sent = sent
            view = self.view
            req = {"kind": "heartbeat", "epoch": view.epoch if view else 0}
            req["view_version"] = view.version if view else -1
            req["hold_s"] = self._heartbeat_s  # a new epoch is pushed while the reply is held
            # With standbys, a leader that does not answer within a lease (frozen, or deposed)
            # is left for the next address. Never past the grace: a cut-off coordinator (frames
            # vanish, nothing is refused) is found lost when the grace ends, not a timeout later.
            patience = 2 * self._lease_s if self._standbys else self._rpc_timeout_s
            patience = min(patience, max(0.05, self._grace_left()))
            try:
                with self._session.lock:
                    if self._stop.is_set():
                        return
                    fresh = self._session.sock is None
                    if not fresh:
                        reply = self._session.call(self._member(req), self._heartbeat_s, patience)
                if fresh:  # a new session must start with a (same-incarnation) register
                    reply = self._register_session(patience)
                self._absorb(reply, req["view_version"])
                self._unreachable = None
            except CoordinatorUnreachable as e:
                if self._coordinator_lost():
                    self._unreachable = self._lost_reason(e)
                    # The training thread may be parked in a long poll on the rpc connection,
                    # which would wait out its own timeout: it fails now and finds us lost.
                    self._rpc.interrupt()
                with self._beat:  # refused: nothing listens there (a timeout: frozen, or cut off)
                    refused = isinstance(e.__cause__, ConnectionRefusedError)
                    before = self._refused_since_answer
                    self._refused_since_answer = refused and before is not False
                self._heard_back(sent, answered=False)
                continue
            if reply.get("code") not in ("evicted", "unknown"):
                self._heard_back(sent, answered=True)
            if not reply.get("ok") and reply.get("code") == "expired":
                try:  # expired while pending (never admitted, not fenced): wait again
                    reply = self._register_session()
                except CoordinatorUnreachable:
                    continue
            if not reply.get("ok"):
                try:
                    self._raise_refusal(reply)
                except Evicted:
                    with self._beat:
                        self._beat.notify_all()  # a writer waiting at the fence: it is closed
                    return  # the training thread sees it at its next call
                except CoordinatorError:
                    pass  # e.g. the run stopped: the view says so

    def _heard_back(self, sent: float, *, answered: bool) -> None:
        """A heartbeat round sent at `sent` ended without "evicted": answered by the coordinator,
        or failed to reach it (a gone coordinator fences nobody, but cannot end a silence)."""
        with self._beat:
            if answered:
                self._silent = False
                self._refused_since_answer, self._silent_while_gone = None, False
            if not self._silent:
                self._confirmed_at = max(sent, self._confirmed_at or sent)
            self._beat.notify_all()

    def _join_heartbeats(self) -> None:
        if self._heartbeats is not None and self._heartbeats is not threading.current_thread():
            self._heartbeats.join(timeout=self._rpc_timeout_s + self._heartbeat_s + 1.0)
