"""The stall guard: a replica process whose training thread stops making progress ends itself.

Job: catch the hang that neither the coordinator nor the watchdog inside a replica can see: the
process is alive, its heartbeat and watchdog threads keep beating, but its training thread is
stuck (a deadlock, a kernel or collective that never returns on a broken GPU or link). Left alone,
such a replica holds its microbatches forever and every other replica waits for its report.

How: the training thread marks the stretches of a step in which it must keep moving (`busy`:
computing microbatches, the cross-replica reduce, the optimizer step) and ticks at every sign of
progress inside them (the phase hook of each microbatch's forward and backward, every poll of an
in-flight reduce). A daemon thread looks every `deadline_s / 5`; when the training thread has been
busy without a tick for `deadline_s`, it writes a `stalled` event, dumps every thread's stack to
stderr (`dump_stacks`: where the training thread is stuck) and ends the process with status 8. The coordinator then sees the session close (the process is gone) and the other
replicas recover as from a crash; in a replica of several ranks, the mates stop on the lost peer
or on their watchdog.

The windows are the stretches whose length is bounded by work, not by waiting on others: outside
them (waiting for the step's outcome, checkpoint writes, evaluation) nothing is watched, and a
training thread stuck there is only caught by the outcome deadline of the others. The deadline
must exceed the longest gap between two ticks of a healthy run: one microbatch's forward or
backward (or one pipeline stage's share of it) and one optimizer step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from recover import exits
from recover.checks import is_number

log = logging.getLogger(__name__)


def check_stall(seconds: float) -> None:
    """ValueError unless `--stall-timeout` is a number >= 0 (0 turns the guard off)."""
    if not is_number(seconds) or not seconds >= 0:
        raise ValueError(f"--stall-timeout must be >= 0 seconds (0: off), got {seconds!r}")


class StallGuard:
    """Ends this process when its training thread stays busy without progress for deadline_s
    (0: off; ticks and busy stretches then cost nothing and nothing is watched)."""

    def __init__(
        self,
        deadline_s: float,
        *,
        replica: int,
        rank: int = 0,
        emit: Callable[..., None] | None = None,
    ) -> None:
        check_stall(deadline_s)
        self.deadline_s = deadline_s
        self.replica, self.rank = replica, rank
        self.emit = emit or (lambda name, **fields: None)
        self._what: str | None = None  # the busy stretch the training thread is in, if any
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-guard", daemon=True)
        if deadline_s:
            self._thread.start()

    def tick(self) -> None:
        """The training thread made progress (cheap: one clock read)."""
        self._last = time.monotonic()

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """A stretch in which the training thread must keep ticking; nests (the outer wins)."""
        if self._what is not None or not self.deadline_s:
            yield
            return
        self._what = what
        self.tick()
        try:
            yield
        finally:
            self._what = None

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.deadline_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.deadline_s / 5):
            what, silent = self._what, time.monotonic() - self._last
            if what is not None and silent > self.deadline_s:
                self._stalled(what, silent)

    def _stalled(self, what: str, silent: float) -> None:
        reason = f"no progress for {silent:.2f} s while {what} (deadline {self.deadline_s:g} s)"
        self.emit("stalled", replica=self.replica, rank=self.rank, reason=reason)
        who = f"replica {self.replica}" + (f" rank {self.rank}" if self.rank else "")
        log.error(f"{who}: {reason}; ending this process")
        dump_stacks(who)
        os._exit(exits.STALLED)


def dump_stacks(who: str) -> None:
    """Write every thread's stack to stderr (the process's output, which the launcher keeps):
    called just before a guard ends a stuck process, so that its log says where it was stuck."""
    log.error(f"{who}: the stacks of all threads, most recent call first:")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
