"""The coordinator's rules driver: the one place that feeds `decide()` and keeps what it decided.

Job: `RulesDriver`, the bottom layer of `CoordinatorServer` (server.py), owns the coordinator's
state. It loads it at start (a new term takes a saved state over: `Takeover`), runs every
message through the pure rules (`_apply`: decide.py), wakes the parked replies that a change
concerns, hands the heartbeats read to the rules in `Heartbeats` batches (`_flush_beats`)
and keeps the members' leases in deadline order, logs each decision (the last `log_size` in
memory, the notable ones kept apart; every one as a JSON line in `events_path`), saves the state
through a `StateStore` (in a background thread, batched), and stands down when its term ends
(`_depose`).

Design (docs/design.md, "Coordinator transport"; docs/coordinator.md has the measurements):
- `_apply` runs on the event loop, so the rules see strictly one message at a time, without
  locks. A change of (epoch, attempt, step, status) wakes the long-polls and the relays' held
  beats; a change of (epoch, status) also the held heartbeats (`_key`).
- Leases (`_leases`, pacing.LeaseQueue): replica -> the coordinator clock of its last heartbeat
  read, moved to the end at each one, so a tick looks only at the members whose deadline passed
  (`Tick(due=...)`); `_requeue` settles them after the rules judged them.
- Saving: a background thread saves the newest revision at most every `save_interval_s`, and
  once more at stop. With a durable store (etcd) a reply that shows the state waits until the
  revision it shows is saved (`_saved`), a decision's event is written only once its revision is
  saved, and a leader that loses its term (`Fenced`, or `authority()` False) decides, reveals and
  writes nothing more.

Invariants: only `_apply` (and, once before serving, a takeover) calls `decide` and replaces
the state; a published state is never mutated (safe to read from any thread); an event that
cannot be written stops the coordinator (`_write_event`: it decides nothing it cannot record).
Limits: event writes run on the event loop (a local file). The saved state can be up to
save_interval_s older than what replicas saw. The only store today (`InMemoryStateStore`) does
not outlive the process and gets a final save at stop, so nothing is lost; a store that outlives
a crash (etcd) must also hold back the replies that reveal a commit until its revision is saved
(docs/coordinator.md, "Durability").
Must not: touch a socket or a connection, or read a request (connections.py and server.py do);
decide anything itself (decide.py does).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVarTuple

from recover.coordinator.decide import decide, initial_state, resume_state
from recover.coordinator.decisions import Decision
from recover.coordinator.etcd import Fenced
from recover.coordinator.messages import Heartbeats, Takeover
from recover.coordinator.options import CoordinatorOptions
from recover.coordinator.pacing import LeaseQueue, Waiters
from recover.coordinator.service import LoopService
from recover.coordinator.state_store import (
    LIVE,
    PENDING,
    CoordinatorState,
    InMemoryStateStore,
    StateStore,
)
from recover.record import unwritable

__all__ = ["RulesDriver"]

log = logging.getLogger("recover.coordinator")

_Ts = TypeVarTuple("_Ts")
# What long-polls wait for (`_key`): (epoch, status, attempt_epoch, step, committed_step).
_WakeKey = tuple[int, str, int, int, int]

# Decisions made at every step of a healthy run; the others are worth a person's look.
ROUTINE_DECISIONS = frozenset({"committed", "registered"})
# Decisions that lose a member or stop the run: logged as warnings.
WARNING_DECISIONS = frozenset({"member_dead", "quorum_lost", "diverged"})


class RulesDriver(LoopService):
    """The state, the rules' feed, the record and the saving of `CoordinatorServer` (see the
    module docstring); the server validates the arguments."""

    def __init__(
        self,
        options: CoordinatorOptions,
        *,
        token: str | None,
        max_wait_s: float,
        body_timeout_s: float,
        events_path: str | os.PathLike[str] | None,
        state_store: StateStore | None,
        log_size: int,
        save_interval_s: float,
        term: int | None,
        authority: Callable[[], bool] | None,
        takeover_grace_s: float,
    ) -> None:
        super().__init__(token=token, max_wait_s=max_wait_s, body_timeout_s=body_timeout_s)
        self._options = options
        self._events_path = events_path
        self._state_store = state_store if state_store is not None else InMemoryStateStore()
        self._log: deque[dict[str, Any]] = deque(maxlen=log_size)
        # The decisions that are not routine (not a commit or a registration): deaths, redos,
        # epochs, joins, stops. Kept apart, so that a death is still shown (`recover status`)
        # after thousands of commits have pushed it out of the log.
        self._notable: deque[dict[str, Any]] = deque(maxlen=log_size)
        self._log_lock = threading.Lock()
        self._state: CoordinatorState | None = None  # None until start() loads it (`state()`)
        self._events_fd: int | None = None
        self._save_interval_s = save_interval_s
        self._saver: threading.Thread | None = None
        self._save_stop = threading.Event()
        # Leases in deadline order: replica -> coordinator clock of its last heartbeat (read).
        self._leases: LeaseQueue[int] = LeaseQueue(options.lease_s)
        self._beats: list[tuple[int, str, float]] = []  # read, not yet applied (_flush_beats)
        self._beats_flushed = 0.0
        self._held = Waiters()  # held heartbeats: woken by epoch or status changes only
        self._wake_key: _WakeKey | tuple[()] = ()
        # Relays' held beats (connections.py): woken at every view change.
        self._relay_held = Waiters()
        # High availability (docs/coordinator.md, "The control plane in etcd"). `term`: this
        # leader's term; a loaded state is then taken over (`Takeover`). `authority()`: whether
        # it still leads (election.py); once False it decides nothing and serves nothing more.
        # A durable store (etcd) holds every reply that shows the state back until the revision
        # it shows is saved, so no replica acts on a decision a successor would not know.
        self._term, self._authority = term, authority
        self._takeover_grace_s = takeover_grace_s
        self._durable = bool(getattr(self._state_store, "durable", False))
        self._saved_revision = -1
        self._save_waiters: list[tuple[int, asyncio.Future[bool]]] = []
        self._dirty = threading.Event()
        self._deposed: str | None = None
        self.last_tick = time.monotonic()  # the loop's liveness (election.py stops renewing)
        self._pending_records: list[Decision] = []
        self._unsaved_events: list[tuple[int, bytes]] = []  # (revision, line), durable stores
        self._last_saved = -1  # the saver thread's last saved revision
        self._view_revision = 0  # the revision at which the published view last changed

    # ------------------------------------------------------------ start and stop

    def _load_state(self) -> None:
        """The saved state (resumed) or a fresh one; a new term takes a saved one over."""
        now = time.monotonic()
        loaded = self._state_store.load()
        if loaded is not None and not self._options.matches(loaded.options):
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

    def _open_record(self) -> None:
        """Open the run's events file and record what the takeover decided (before serving)."""
        if self._events_path is not None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            try:
                self._events_fd = os.open(self._events_path, flags, 0o644)
            except OSError as e:  # a read-only or full run folder: one line, status STORAGE
                raise unwritable(os.fspath(self._events_path), e) from e
        for d in self._pending_records:
            self._record(d)

    def _start_saver(self) -> None:
        self._saver = threading.Thread(target=self._save_loop, name="coordinator-save", daemon=True)
        self._saver.start()

    def _close_record(self, timeout_s: float) -> None:
        """After the loop ended: the final save, the events it makes durable, the file closed."""
        self._save_stop.set()
        if self._saver is not None:
            self._saver.join(timeout_s)
        if self._durable and self._deposed is None:  # the final save's events (the loop has
            self._flush_events(self._last_saved)  # ended: it would have written them)
        if self._events_fd is not None:
            os.close(self._events_fd)
            self._events_fd = None

    @property
    def deposed(self) -> str | None:
        """Why this leader stopped leading (its term was superseded or its lease lost), or None."""
        return self._deposed

    def state(self) -> CoordinatorState:
        """The current state (never mutated after publication: safe to read from any thread).
        Loaded by start() before it serves; RuntimeError before that."""
        state = self._state
        if state is None:
            raise RuntimeError(f"{self._what}: its state is read before start() loaded it")
        return state

    def decisions(self) -> list[dict[str, Any]]:
        with self._log_lock:
            return list(self._log)

    def notable_decisions(self) -> list[dict[str, Any]]:
        """The last decisions that are not routine (ROUTINE_DECISIONS), oldest first."""
        with self._log_lock:
            return list(self._notable)

    # ------------------------------------------------------------ the rules

    def _check_authority(self) -> None:
        if self._deposed is not None or (self._authority is not None and not self._authority()):
            self._depose("its lease ran out (it was stalled or lost etcd)")
            raise _Deposed(self._deposed)

    def _apply(self, msg: Any, now: float | None = None) -> tuple[list[Decision], str]:
        self._check_authority()
        old = self.state()
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
    def _key(s: CoordinatorState) -> _WakeKey:
        """What long-polls wait for: a new epoch, attempt, step or status. Held heartbeats wait
        for the first two fields only: commits and redos reach a replica as the answer to its
        report (a redo moves the epoch too), so a commit does not send every replica its view twice."""
        return (s.epoch, s.status, s.attempt_epoch, s.step, s.committed_step)

    # ------------------------------------------------------------ leases and saving

    def _flush_beats(self, now: float, *, needed: bool) -> None:
        """Hand the heartbeats read since the last batch to the rules (only last_seen moves):
        when a judgement reads them (`needed`: a lease ran out, or the run is forming), else at
        most every lease_s / 4. A rule of one tick costs a copy of the state, and beats arrive
        20 times a second per replica: folding them at each tick (50 a second) cost the
        coordinator about 10 ms of CPU a second at R = 3. The lease a tick judges is kept at
        each heartbeat read (`_leases`); a member's last_seen lags it by lease_s / 4 at most
        where no judgement reads it, so a live member never looks silent for half a lease."""
        if self._beats and (needed or now - self._beats_flushed >= self._options.lease_s / 4):
            beats, self._beats = tuple(self._beats), []
            self._beats_flushed = now
            self._apply(Heartbeats(seen=beats), now)

    def _requeue(self, due: list[int]) -> None:
        members = self.state().members
        alive: dict[int, float | None] = {}
        for r in due:
            m = members.get(r)
            alive[r] = m.last_seen if m is not None and m.state in (PENDING, LIVE) else None
        self._leases.settle(due, alive)

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

    def _call_in_loop(self, fn: Callable[[*_Ts], object], *args: *_Ts) -> None:
        loop = self._loop
        if loop is None:  # set by `_main` once the loop thread runs (started before the saver)
            raise RuntimeError(f"{self._what}: its loop has not started")
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has ended (stop): nobody waits any more
            pass

    def _on_saved(self, revision: int) -> None:
        self._saved_revision = max(self._saved_revision, revision)
        self._flush_events(self._saved_revision)
        keep: list[tuple[int, asyncio.Future[bool]]] = []
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
        # (the service's loop: we run on it)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
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
        self._request_stop()

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
            fields.setdefault("step", self.state().step)
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
                self._unsaved_events.append((self.state().revision, data))
            else:
                self._write_event(data)

    def _write_event(self, data: bytes) -> None:
        """One whole line to the run's record. When it cannot be written (a full disk, a
        read-only folder) the coordinator stops: it decides nothing more that it cannot record
        (the replicas then stop as for a lost coordinator; the process exits exits.STORAGE)."""
        path = self._events_path  # (set whenever the file is open)
        if self._events_fd is None or path is None or self._error is not None:
            return
        try:
            written = os.write(self._events_fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            self._error = unwritable(os.fspath(path), e)
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


class _Deposed(Exception):
    """Raised inside the loop when this leader may no longer decide (see `_depose`)."""
