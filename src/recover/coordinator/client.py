"""The replica's side of the coordinator: register, heartbeat, report, wait. Thread-safe.

Job: give each replica's training loop a small blocking API over two TCP connections. The
*session* connection carries register, heartbeats (every `heartbeat_s`, from a daemon thread) and
leave; closing it without `leave()` tells the coordinator this process is gone. The *rpc*
connection carries reports and long-polls from the training thread.

A step costs one round trip on the rpc connection: a report (`report_done`, `report_failed`)
is itself a long poll, answered with the attempt's outcome (committed, redo with the new view,
stopped) once the coordinator decided it. When the outcome is not decided at once, the
coordinator first sends a short `{"taken": true}` frame: the report is on record (`on_taken`
runs then: the fault point "commit"). The wait is the one `wait_outcome` makes (a refusal, an
eviction, a stop or a new leader end it), in chunks of at most 5 s: after a chunk passes, or a
report is refused as stale because a new leader moved the attempt on, the client goes on with
`wait_outcome`, as it does with an older coordinator that answers a report alone. Measured side
by side (benchmarks/coordinator_round_trip.py: 2 replicas and the coordinator, a process each,
loopback, nothing but reports; 60 interleaved block pairs at load 11.1-12.7 on 2 shared cores):
a step takes 2.36 ms against 3.78 ms for report then wait_outcome, ratio 0.58 [0.49, 0.68].

Every request says which view version it holds (`view_version`), and the view in the reply is
relative to it (protocol.merge_view): a commit or an epoch change costs O(change) bytes, not
O(R + plan). Each heartbeat asks the coordinator to hold its reply for up to `heartbeat_s` (`hold_s`): a new
epoch (or step, or status) is then pushed to the replica the moment it is decided, not at its
next heartbeat. The next heartbeat goes `heartbeat_s` after the previous one was sent, or at once
when a held reply came back (an older coordinator that does not hold gets one per heartbeat_s).
A pending replica whose lease expired before admission (code "expired") registers again.

Invariants:
- every call has a deadline; no call blocks longer than its `deadline_s` (+ `rpc_timeout_s` for
  the last reply) and failures raise named exceptions: `Evicted` (fenced: restart the process to
  rejoin as a new member), `CoordinatorUnreachable` (none answered for `coordinator_grace_s`:
  until then a call reconnects and asks again), `DeadlineExceeded`, `QuorumLost` (resume from
  the last checkpoint), `RequestRefused` (e.g. code "stale").
- when the heartbeat thread learns that this incarnation was evicted, the next call of the
  training thread raises `Evicted`.
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

With standbys (`standbys=[(host, port), ...]`, docs/coordinator.md, "A standby that takes
over"): only the leader of the current term listens, so a connection that fails moves on to
the next address. The session re-attaches under the new leader with the same incarnation (a
`register` of a live member: nobody is declared dead), learns the new leader's TCPStore (the next
epoch's process group is built there), and the training thread's calls retry through the
takeover (as through any gap, within the grace). A report refused as stale because the new leader already
moved the attempt on (its takeover redoes the in-flight step) is not an error: the outcome says
what to do.
This module imports no torch, so replica helpers and tests start fast.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recover.checks import is_int
from recover.coordinator.protocol import (
    ProtocolError,
    View,
    merge_view,
    recv_frame,
    send_frame,
)

__all__ = [
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnreachable",
    "DeadlineExceeded",
    "Evicted",
    "Outcome",
    "QuorumLost",
    "NodeLink",
    "RequestRefused",
    "StepCommitted",
    "StepRedo",
    "Stopped",
    "request_once",
]

_POLL_CHUNK_S = 5.0  # a long-poll is split into server waits of at most this long
_RECENT_VIEWS = 8  # views kept by version: a reply's view is relative to the one asked with
# The fence window when the coordinator does not tell its lease (every coordinator of this project
# does): short, so that a replica rather waits for a confirmation than writes late.
_DEFAULT_FENCE_S = 0.3


class CoordinatorError(RuntimeError):
    """Base class of the coordinator client's errors."""


class Evicted(CoordinatorError):
    """This incarnation was declared dead and is fenced; restart the process to rejoin."""


class CoordinatorUnreachable(CoordinatorError):
    """No coordinator answered for longer than the client's grace (`coordinator_grace_s`),
    reconnecting all along: it is gone, or frozen, and no standby took over."""


class DeadlineExceeded(CoordinatorError):
    """The awaited view or outcome did not come before the caller's deadline."""


class QuorumLost(CoordinatorError):
    """Too few replicas are live; stop and resume from the last checkpoint."""


class RequestRefused(CoordinatorError):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code


# The outcome of a step attempt, as a report or `wait_outcome` returns it to a replica (the coordinator's
# decisions behind the first two are protocol.Committed and protocol.Redo).
@dataclass(frozen=True)
class StepCommitted:
    step: int


@dataclass(frozen=True)
class StepRedo:
    step: int
    view: View  # the plan for the survivors, attempt_epoch = the epoch to reduce in


@dataclass(frozen=True)
class Stopped:
    status: str  # quorum_lost | diverged | finished
    reason: str


Outcome = StepCommitted | StepRedo | Stopped


class _Once:
    """`fn` (or nothing), called at most once however often this is called."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request_once(
    host: str, port: int, req: dict[str, Any], *, token: str | None = None, timeout_s: float = 5.0
) -> dict[str, Any]:
    """One request on a fresh connection (tools, the CLI's `status`)."""
    try:
        with _connect(host, port, timeout_s) as sock:
            send_frame(sock, {**req, "token": token} if token else req)
            return recv_frame(sock)
    except (OSError, ProtocolError) as e:
        raise CoordinatorUnreachable(f"coordinator {host}:{port}: {e}") from e


class _Leader:
    """The coordinator addresses a client may reach (the first is tried first) and the one it
    speaks to now. A failure on the current one moves every channel on to the next."""

    def __init__(self, addresses: list[tuple[str, int]]) -> None:
        self.addresses = addresses
        self._at = 0
        self.generation = 0  # grows at every move
        self._lock = threading.Lock()

    def current(self) -> tuple[str, int, int]:
        with self._lock:
            host, port = self.addresses[self._at]
            return host, port, self.generation

    def failed(self, generation: int) -> None:
        with self._lock:
            if generation == self.generation and len(self.addresses) > 1:
                self._at = (self._at + 1) % len(self.addresses)
                self.generation += 1


class _Channel:
    """One persistent connection with a lock; reconnects lazily after an error."""

    def __init__(
        self, host: str, port: int, timeout_s: float, leader: _Leader | None = None
    ) -> None:
        self.leader = leader or _Leader([(host, port)])
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.generation = 0
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def call(
        self,
        req: dict[str, Any],
        wait_s: float = 0.0,
        timeout_s: float | None = None,
        on_taken: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Send one request, return its reply; caller holds `lock`. `timeout_s`: how long the
        reply may take beyond `wait_s` (default: the channel's; it bounds the connect too). A
        `{"taken": true}` frame before the reply (a report that waits for its outcome) runs
        `on_taken`."""
        patience = self.timeout_s if timeout_s is None else timeout_s
        try:
            if self.sock is None:
                self.host, self.port, self.generation = self.leader.current()
                self.sock = _connect(self.host, self.port, min(self.timeout_s, patience))
            self.sock.settimeout(wait_s + patience)
            send_frame(self.sock, req)
            reply = recv_frame(self.sock)
            while reply.get("taken") is True:
                if on_taken is not None:
                    try:
                        on_taken()
                    except BaseException:
                        self.close()  # its reply is still to come: nobody may read it
                        raise
                reply = recv_frame(self.sock)
            return reply
        except (OSError, ProtocolError) as e:
            self.close()
            self.leader.failed(self.generation)
            raise CoordinatorUnreachable(f"coordinator {self.host}:{self.port}: {e!r}") from e

    def interrupt(self) -> None:
        """Wake a call blocked on this channel (from another thread): it fails and reconnects."""
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


class NodeLink:
    """A node agent's line to the coordinator (recover.agent): one beat at a time, to whichever
    of `addresses` answers (a standby coordinator after a takeover). `beat` raises
    CoordinatorUnreachable when none answers within `timeout_s`; RequestRefused when refused."""

    def __init__(
        self, addresses: list[tuple[str, int]], *, token: str | None, timeout_s: float = 2.0
    ) -> None:
        if not addresses:
            raise ValueError("a node link needs at least one coordinator address")
        self._channel = _Channel(*addresses[0], timeout_s, _Leader(list(addresses)))
        self._token = token

    def beat(self, **fields: Any) -> dict[str, Any]:
        req = {"kind": "node_beat", **fields}
        if self._token:
            req["token"] = self._token
        with self._channel.lock:
            reply = self._channel.call(req)
        if not reply.get("ok"):
            raise RequestRefused(str(reply.get("code")), str(reply.get("reason")))
        return reply

    def close(self) -> None:
        with self._channel.lock:
            self._channel.close()


class CoordinatorClient:
    """The coordinator as one replica sees it (see the module docstring)."""

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
        standbys: list[tuple[str, int]] | tuple = (),
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
        self._leader = _Leader([(host, port), *[(str(h), int(p)) for h, p in standbys]])
        self._standbys = len(self._leader.addresses) > 1
        self._session = _Channel(host, port, rpc_timeout_s, self._leader)
        self._rpc = _Channel(host, port, rpc_timeout_s, self._leader)
        self._lease_s = 1.0  # the coordinator's lease (told at registration)
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

    # ------------------------------------------------------------ API of the training loop

    def register(self, *, fingerprint: dict[str, Any], next_step: int, deadline_s: float) -> View:
        """Join; block until admitted into a running epoch. Starts the heartbeat thread."""
        if self._heartbeats is not None:
            raise RuntimeError("register() called twice; make a new client (new incarnation)")
        end = time.monotonic() + deadline_s
        self._fingerprint, self._next_step = dict(fingerprint), next_step
        while True:  # the coordinator may still be starting
            try:
                sent = time.monotonic()
                reply = self._register_session()
                break
            except CoordinatorUnreachable:
                if time.monotonic() + 0.05 >= end:
                    raise
                time.sleep(0.05)
        self._raise_refusal(reply)
        lease = reply.get("lease_s")
        if isinstance(lease, int | float) and not isinstance(lease, bool) and lease > 0:
            self._lease_s = self._fence_s = float(lease)
        self._heard_back(sent, answered=True)
        self._heartbeats = threading.Thread(
            target=self._heartbeat_loop, name=f"heartbeat-{self.replica_id}", daemon=True
        )
        self._heartbeats.start()
        while True:
            view = self.view
            if view.status == "running" and self.replica_id in view.live:
                return view
            if view.status not in ("forming", "running"):
                self._raise_status(view)
                raise RequestRefused(view.status, f"the run is {view.status}: {view.reason}")
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"replica {self.replica_id} not admitted within {deadline_s} s "
                    f"(status {view.status}, live {list(view.live)})"
                )
            try:
                self.wait_view(newer_than_epoch=view.epoch, deadline_s=remaining)
            except DeadlineExceeded:
                continue
            except RequestRefused as e:
                if e.code != "expired":  # expired while pending: wait again, same incarnation
                    raise
                self._raise_refusal(self._register_session())

    def wait_view(self, *, newer_than_epoch: int, deadline_s: float) -> View:
        """The first view with epoch > newer_than_epoch (or a terminal status)."""
        end = time.monotonic() + deadline_s
        while True:
            self._check()
            view = self.view
            if view is not None and view.epoch > newer_than_epoch:
                return self._raise_status(view)
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"no view newer than epoch {newer_than_epoch} in time")
            wait = min(remaining, _POLL_CHUNK_S)
            req = {"kind": "wait_view", "newer_than_epoch": newer_than_epoch, "deadline_s": wait}
            reply = self._rpc_call(self._member(req), wait)
            self._raise_refusal(reply)
            if not reply.get("timeout"):
                return self._raise_status(self.view)

    def report_done(
        self,
        *,
        step: int,
        epoch: int,
        param_hash: str | None = None,
        throughput: float | None = None,
        leaving: bool = False,
        finite: bool = True,
        deadline_s: float,
        on_taken: Callable[[], None] | None = None,
    ) -> Outcome:
        """Report a successful reduce of attempt (step, epoch) and wait (at most `deadline_s`)
        for the attempt's outcome, in one round trip (see the module docstring). `on_taken()`
        runs once, when the report is on record and before this returns: before the outcome
        is known, unless this report decided it (then the outcome came with the answer).
        `throughput`: microbatches per second measured in this attempt (feeds the weights).
        `leaving`: leave at the boundary of this step (the next one is planned without it).
        `finite`: this replica's own part of the attempt's sum is finite."""
        req = {"kind": "done", "step": step, "epoch": epoch, "param_hash": param_hash}
        if throughput is not None:
            req["throughput"] = float(throughput)
        if leaving:
            req["leaving"] = True
        if not finite:
            req["finite"] = False
        return self._report(req, step, epoch, deadline_s, on_taken)

    def report_failed(
        self,
        *,
        step: int,
        epoch: int,
        reason: str,
        deadline_s: float,
        unreachable: dict[int, str] | None = None,
    ) -> Outcome:
        """Report a failed reduce of attempt (step, epoch) and wait for its outcome (a redo,
        or a stop), as report_done. `unreachable`: the members this replica could not dial
        (id -> why), when its group would not form (the coordinator judges them)."""
        req: dict[str, Any] = {
            "kind": "failed", "step": step, "epoch": epoch, "reason": str(reason)[:1000]
        }  # fmt: skip
        if unreachable:
            req["unreachable"] = [
                [int(r), str(why)[:200]] for r, why in sorted(unreachable.items())
            ]
        return self._report(req, step, epoch, deadline_s, None)

    def wait_outcome(self, *, step: int, epoch: int, deadline_s: float) -> Outcome:
        """StepCommitted(step), StepRedo(step, view) or Stopped(status, reason) for attempt
        (step, epoch)."""
        end = time.monotonic() + deadline_s
        while True:
            self._check()
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"no outcome for step {step} epoch {epoch} in time")
            wait = min(remaining, _POLL_CHUNK_S)
            req = {"kind": "wait_outcome", "step": step, "epoch": epoch, "deadline_s": wait}
            reply = self._rpc_call(self._member(req), wait)
            self._raise_refusal(reply)
            if "outcome" not in reply:
                raise CoordinatorUnreachable(f"unexpected outcome reply {reply!r}"[:300])
            outcome = self._outcome(reply, step)
            if outcome is not None:
                return outcome

    def _report(
        self,
        req: dict[str, Any],
        step: int,
        epoch: int,
        deadline_s: float,
        on_taken: Callable[[], None] | None,
    ) -> Outcome:
        end = time.monotonic() + deadline_s
        taken = _Once(on_taken)
        wait = max(0.0, min(deadline_s, _POLL_CHUNK_S))
        reply = self._rpc_call(self._member({**req, "deadline_s": wait}), wait, taken)
        moved_past = self._raise_report_refusal(reply, step, epoch)
        # Once per report, before this replica acts on any outcome: when the outcome came with
        # the answer (this report decided it; or an older coordinator's plain answer), now.
        taken()
        if not moved_past:
            outcome = self._outcome(reply, step)
            if outcome is not None:
                return outcome
        return self.wait_outcome(step=step, epoch=epoch, deadline_s=end - time.monotonic())

    def _outcome(self, reply: dict[str, Any], step: int) -> Outcome | None:
        """The outcome an accepted reply carries; None when it carries none yet (a chunk of
        the wait passed, or an older coordinator's plain answer to a report)."""
        outcome = reply.get("outcome")
        if outcome == "committed":
            return StepCommitted(step)
        if outcome == "redo":
            return StepRedo(step, self.view)
        if outcome == "stopped":
            return Stopped(self.view.status, str(reply.get("reason", "")))
        if outcome not in ("timeout", None):
            raise CoordinatorUnreachable(f"unexpected outcome reply {reply!r}"[:300])
        return None

    def leave(self, *, step: int) -> None:
        """Clean exit after the last step: not a failure. Stops the heartbeats."""
        self._stop.set()
        with self._session.lock:
            reply = self._session.call(self._member({"kind": "leave", "step": step}))
        self._join_heartbeats()
        self._session.close()
        if not reply.get("ok") and reply.get("code") not in ("left",):
            self._raise_refusal(reply)

    def close(self) -> None:
        """Drop both connections. Without a prior leave() the coordinator counts this as the
        process exiting (a death, how="exit")."""
        self._stop.set()
        self._join_heartbeats()
        with self._session.lock:
            self._session.close()
        with self._rpc.lock:
            self._rpc.close()

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

    def _rpc_call(
        self,
        req: dict[str, Any],
        wait_s: float = 0.0,
        on_taken: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        self._check()
        if not self._rpc.lock.acquire(timeout=wait_s + 2 * self._rpc_timeout_s):
            raise DeadlineExceeded("another thread holds the coordinator connection")
        try:
            try:
                reply = self._rpc.call(req, wait_s, on_taken=on_taken)
            except CoordinatorUnreachable:  # gone, or a takeover: the channel tries the next
                reply = self._call_within_grace(req, wait_s, on_taken)
        finally:
            self._rpc.lock.release()
        self._absorb(reply, req.get("view_version"))
        return reply

    def _raise_report_refusal(self, reply: dict[str, Any], step: int, epoch: int) -> bool:
        """True for a report the leader has moved past (a takeover redid or committed its
        attempt): refused as stale, and wait_outcome then gives the attempt's real outcome.
        False for an accepted report; any other refusal raises."""
        if not reply.get("ok") and reply.get("code") == "stale":
            view = self.view
            if view is not None and (
                view.step > step or (view.step == step and view.attempt_epoch > epoch)
            ):
                return True
        self._raise_refusal(reply)
        return False

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

    def _check(self) -> None:
        if self._evicted is not None:
            raise Evicted(self._evicted)
        if self._unreachable is not None:
            raise CoordinatorUnreachable(self._unreachable)

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

    def _raise_status(self, view: View) -> View:
        if view.status == "quorum_lost":
            raise QuorumLost(f"quorum lost: {view.reason}")
        return view

    def _call_within_grace(
        self, req: dict[str, Any], wait_s: float, on_taken: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """The rpc call again (requests are idempotent), reconnecting every heartbeat interval,
        until a coordinator answers or none did for the grace: then CoordinatorUnreachable."""
        while True:
            try:
                patience = min(self._rpc_timeout_s, max(0.05, self._grace_left()))
                return self._rpc.call(req, wait_s, patience, on_taken=on_taken)
            except CoordinatorUnreachable as e:
                if self._evicted is not None:
                    raise
                if self._coordinator_lost():
                    raise CoordinatorUnreachable(self._lost_reason(e)) from None
                time.sleep(self._heartbeat_s)

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
