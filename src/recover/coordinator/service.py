"""What the coordinator's server and a relay share: an asyncio loop on a thread of its own.

Job: `LoopService` runs a subclass's `_main()` on its own thread with its own event loop;
`start()` returns once `_main` says it listens (`_ready`) and raises what stopped it otherwise;
`stop()` asks the loop to end (`_stop_event`) and joins it. It also checks a request's token and
parks a long-poll until a predicate holds (`_wait_for`), the two request-side helpers both
servers use. Nothing here decides anything or touches the state.

Invariants: every wait has a deadline (`start`'s, `stop`'s, and a long-poll's, capped at
`_max_wait_s`); a subclass's `_main` sets `_address` before `_ready`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from recover.coordinator.pacing import Waiters

__all__ = ["LoopService"]

log = logging.getLogger("recover.coordinator")


class LoopService:
    """Base of `CoordinatorServer` and `RelayServer` (see the module docstring)."""

    _what = "service"  # the name in errors and the thread's name

    def __init__(self, *, token: str | None, max_wait_s: float) -> None:
        self._token = token.encode() if token else None
        self._max_wait_s = max_wait_s
        self._address: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stopping = False
        self._waiters = Waiters()  # long-polls

    async def _main(self) -> None:  # pragma: no cover - every subclass has one
        raise NotImplementedError

    def _start_loop(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.start() called twice")
        self._thread = threading.Thread(target=self._run, name=self._what, daemon=True)
        self._thread.start()

    def _wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self._what} did not start listening within {timeout_s} s")
        if self._error is not None:
            self.stop()
            raise RuntimeError(f"{self._what} failed to start: {self._error!r}") from self._error

    def _stop_loop(self, timeout_s: float) -> None:
        if self._loop is not None and self._stop_event is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop_event.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("%s thread did not stop within %s s", self._what, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_loop(timeout_s)

    def __enter__(self) -> Any:
        self.start()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError(f"{self._what} not started")
        return self._address

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # recorded; start() or the owner reads self.failed
            log.exception("%s loop failed", self._what)
            self._error = e
            self._ready.set()

    def _token_ok(self, req: dict[str, Any]) -> bool:
        if self._token is None:
            return True
        got = req.get("token")
        return isinstance(got, str) and hmac.compare_digest(got.encode(), self._token)

    async def _wait_for(self, pred: Callable[[], Any], deadline_s: float) -> Any:
        """Poll `pred` at every wake of the long-polls until it returns non-None or the
        deadline (capped at max_wait_s) passes; None then."""
        end = time.monotonic() + min(deadline_s, self._max_wait_s)
        while True:
            result = pred()
            if result is not None:
                return result
            remaining = end - time.monotonic()
            if remaining <= 0 or self._stopping:
                return None
            await self._waiters.park(remaining)
