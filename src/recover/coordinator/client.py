"""The replica's side of the coordinator: register, report, wait. Thread-safe.

Job: give each replica's training loop a small blocking API over two TCP connections. The
*session* connection carries register, heartbeats (every `heartbeat_s`, from a daemon thread) and
leave; closing it without `leave()` tells the coordinator this process is gone. The *rpc*
connection carries reports and long-polls from the training thread. The session, its heartbeats,
the view they keep and the fence are heartbeats.py's (`HeartbeatSession`, the base of
`CoordinatorClient`); the connections, and the following of the leader among standbys,
channel.py's; the outcomes and errors, outcomes.py's.

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

Invariants:
- every call has a deadline; no call blocks longer than its `deadline_s` (+ `rpc_timeout_s` for
  the last reply) and failures raise named exceptions: `Evicted` (fenced: restart the process to
  rejoin as a new member), `CoordinatorUnreachable` (none answered for `coordinator_grace_s`:
  until then a call reconnects and asks again), `DeadlineExceeded`, `QuorumLost` (resume from
  the last checkpoint), `RequestRefused` (e.g. code "stale").
- when the heartbeat thread learns that this incarnation was evicted, the next call of the
  training thread raises `Evicted`.
- fencing (`writes_allowed`): heartbeats.py.

With standbys (`standbys=[(host, port), ...]`, docs/coordinator.md, "A standby that takes
over"): a connection that fails moves on to the next address (channel.py), the session
re-attaches under the new leader (heartbeats.py), and the training thread's calls retry through
the takeover (as through any gap, within the grace). A report refused as stale because the new
leader already moved the attempt on (its takeover redoes the in-flight step) is not an error:
the outcome says what to do.

This is the module the runtime imports the coordinator's client side from (with protocol.py;
tests/test_architecture.py): it re-exports the outcomes and errors, the view, and the channel
and leader the runtime's view watcher uses, so that the runtime need not know the modules above.
Must not: import torch (replica helpers and tests start fast).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# Re-exported: the runtime imports these from here (see the module docstring), and the names
# below were this module's before the channel, the session and the outcomes moved out.
from recover.coordinator.channel import Channel, Leader, NodeLink, request_once
from recover.coordinator.heartbeats import HeartbeatSession
from recover.coordinator.outcomes import (
    CoordinatorError,
    CoordinatorUnreachable,
    DeadlineExceeded,
    Evicted,
    Outcome,
    QuorumLost,
    RequestRefused,
    StepCommitted,
    StepRedo,
    Stopped,
)
from recover.coordinator.protocol import View

__all__ = [
    "Channel",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnreachable",
    "DeadlineExceeded",
    "Evicted",
    "Leader",
    "NodeLink",
    "Outcome",
    "PendingReport",
    "QuorumLost",
    "RequestRefused",
    "StepCommitted",
    "StepRedo",
    "Stopped",
    "View",
    "request_once",
]

_POLL_CHUNK_S = 5.0  # a long-poll is split into server waits of at most this long


class _Once:
    """`fn` (or nothing), called at most once however often this is called."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class PendingReport:
    """A report sent on the client's rpc connection whose answer is read later, on the thread
    that sent it (CoordinatorClient.start_report_done; a blocking report is one whose answer is
    read at once). Meanwhile the connection is the report's (its lock is held from the send to
    the answer), and:
    - `wait_taken()` blocks until the report is on record (its `{"taken": true}` frame, or the
      answer itself when this report decided the outcome), or the report failed;
    - `may_commit()` reads, without waiting, what has arrived: False once the answer says the
      attempt will not commit, or the report failed;
    - `outcome()` reads the rest and goes on as a blocking report always did: a connection that
      fails is asked again through the grace (reports are idempotent), a stale refusal or a
      chunk of the wait that passed go on with `wait_outcome`.
    `on_taken` runs once, when the report is on record and before `outcome()` returns, on
    whichever of these reads that. Not thread-safe: one thread sends, waits and reads."""

    def __init__(
        self,
        client: CoordinatorClient,
        req: dict[str, Any],
        step: int,
        epoch: int,
        deadline_s: float,
        on_taken: Callable[[], None] | None,
    ) -> None:
        self._client, self._step, self._epoch = client, step, epoch
        self._end = time.monotonic() + deadline_s
        self._on_taken = _Once(on_taken)
        self._on_record = False  # the taken frame, or the answer, was read
        self._wait = max(0.0, min(deadline_s, _POLL_CHUNK_S))
        self._req = client._member({**req, "deadline_s": self._wait})
        self._reply: dict[str, Any] | None = None  # the answer, once read (and absorbed)
        self._error: BaseException | None = None  # raised by outcome()
        self._in_flight = False  # sent on the rpc connection, whose lock this report holds
        rpc = client._rpc
        try:
            client._check()
            if not rpc.lock.acquire(timeout=self._wait + 2 * client._rpc_timeout_s):
                raise DeadlineExceeded("another thread holds the coordinator connection")
        except CoordinatorError as e:
            self._error = e
            return
        try:
            rpc.send(self._req, self._wait)
        except CoordinatorUnreachable:  # asked again when the answer is wanted
            rpc.lock.release()
            return
        except BaseException:
            rpc.lock.release()
            raise
        self._in_flight = True

    def wait_taken(self) -> None:
        while self._in_flight and not self._on_record:
            self._read()
        if not self._on_record and self._error is None:
            self._ask_again()
        self._taken()

    def may_commit(self) -> bool:
        while self._in_flight and self._client._rpc.readable():
            self._read()
        self._taken()
        reply = self._reply
        if self._error is not None:
            return False
        return reply is None or (
            bool(reply.get("ok")) and reply.get("outcome") in ("committed", "timeout", None)
        )

    def outcome(self) -> Outcome:
        while self._in_flight:
            self._read()
        if self._reply is None and self._error is None:
            self._ask_again()
        if self._error is not None:
            raise self._error
        client, reply = self._client, self._reply
        if reply is None:  # (_ask_again sets one or the other)
            raise RuntimeError("a report with neither an answer nor an error")
        moved_past = client._raise_report_refusal(reply, self._step, self._epoch)
        # Once per report, before this replica acts on any outcome: when the outcome came with
        # the answer (this report decided it; or an older coordinator's plain answer), now.
        self._on_record = True
        self._taken()
        if not moved_past:
            outcome = client._outcome(reply, self._step)
            if outcome is not None:
                return outcome
        return client.wait_outcome(
            step=self._step, epoch=self._epoch, deadline_s=self._end - time.monotonic()
        )

    def _read(self) -> None:
        """One frame of the answer: the taken frame, or the answer, which ends the flight."""
        rpc = self._client._rpc
        try:
            frame = rpc.receive()
        except CoordinatorUnreachable:  # (the channel closed itself) asked again when wanted
            self._release()
            return
        except BaseException:
            rpc.close()  # inside a frame, perhaps: nobody may read the rest
            self._release()
            raise
        if frame.get("taken") is True:
            self._on_record = True
            return
        self._release()
        self._client._absorb(frame, self._req.get("view_version"))
        self._reply, self._on_record = frame, True

    def _ask_again(self) -> None:
        """The report again on a fresh connection, through the grace (the first one failed)."""
        try:
            self._reply = self._client._rpc_call(self._req, self._wait, self._on_taken)
            self._on_record = True
        except CoordinatorError as e:
            self._error = e

    def _taken(self) -> None:
        """`on_taken`, once, when the report is on record: before its answer is read, the
        connection is closed if it raises (its answer still to come: nobody may read it)."""
        if not self._on_record:
            return
        try:
            self._on_taken()
        except BaseException:
            if self._in_flight:
                self._client._rpc.close()
                self._release()
            raise

    def _release(self) -> None:
        if self._in_flight:
            self._in_flight = False
            self._client._rpc.lock.release()


class CoordinatorClient(HeartbeatSession):
    """The coordinator as one replica sees it (see the module docstring). Built as its base,
    HeartbeatSession: `CoordinatorClient(host, port, *, replica_id, token, heartbeat_s,
    rpc_timeout_s, coordinator_grace_s, incarnation, standbys)`."""

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
            view = self._held_view()
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
                return self._raise_status(self._held_view())

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
        return self.start_report_done(
            step=step, epoch=epoch, param_hash=param_hash, throughput=throughput,
            leaving=leaving, finite=finite, deadline_s=deadline_s, on_taken=on_taken,
        ).outcome()  # fmt: skip

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
        return PendingReport(self, req, step, epoch, deadline_s, None).outcome()

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

    def start_report_done(
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
    ) -> PendingReport:
        """`report_done`'s report sent, its answer read when the caller asks for it
        (`PendingReport`): the same thread does other work meanwhile (the step's update, while
        the vote completes), with no helper thread. The rpc connection is the report's until
        `PendingReport.outcome()`."""
        req = {"kind": "done", "step": step, "epoch": epoch, "param_hash": param_hash}
        if throughput is not None:
            req["throughput"] = float(throughput)
        if leaving:
            req["leaving"] = True
        if not finite:
            req["finite"] = False
        return PendingReport(self, req, step, epoch, deadline_s, on_taken)

    def _outcome(self, reply: dict[str, Any], step: int) -> Outcome | None:
        """The outcome an accepted reply carries; None when it carries none yet (a chunk of
        the wait passed, or an older coordinator's plain answer to a report)."""
        outcome = reply.get("outcome")
        if outcome == "committed":
            return StepCommitted(step)
        if outcome == "redo":
            return StepRedo(step, self._held_view())
        if outcome == "stopped":
            return Stopped(self._held_view().status, str(reply.get("reason", "")))
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
        # A call blocked on the rpc connection fails at once and lets it go; a report whose
        # answer was never read (PendingReport: its thread gave up on it) holds it for good.
        self._rpc.interrupt()
        if self._rpc.lock.acquire(timeout=1.0):
            try:
                self._rpc.close()
            finally:
                self._rpc.lock.release()
        else:
            self._rpc.close()

    # ------------------------------------------------------------ internals

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

    def _check(self) -> None:
        if self._evicted is not None:
            raise Evicted(self._evicted)
        if self._unreachable is not None:
            raise CoordinatorUnreachable(self._unreachable)

    def _held_view(self) -> View:
        """The view, once a reply carried one: the accepted reply to register does, and so does
        every reply that ends a wait or gives an outcome (a newer view of ours is kept)."""
        view = self.view
        if view is None:
            raise RuntimeError(f"replica {self.replica_id}: the coordinator sent no view yet")
        return view

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
