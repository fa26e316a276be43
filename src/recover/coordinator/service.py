"""What the coordinator's server and a relay share: an asyncio loop on a thread of its own.

Job: `LoopService` runs a subclass's `_main()` on its own thread with its own event loop;
`start()` returns once `_main` says it listens (`_ready`) and raises what stopped it otherwise;
`stop()` asks the loop to end (`_stop_event`) and joins it. It also holds what both servers do
with a request: the read loop of a connection (`_serve_requests`: frame, token, answer, in
order), the token check, and the park of a long-poll until a predicate holds (`_wait_for`).
Nothing here decides anything or touches the state.

Invariants: every wait has a deadline (`start`'s, `stop`'s, a frame body's `body_timeout_s`, and
a long-poll's, capped at `_max_wait_s`); a bad frame or a wrong token gets an error reply where
possible and ends that connection only; a subclass's `_main` sets `_address` before `_ready`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from recover.coordinator.pacing import Waiters
from recover.coordinator.protocol import ProtocolError, read_frame_async
from recover.coordinator.views import frame

__all__ = ["LoopService"]

log = logging.getLogger("recover.coordinator")

_T = TypeVar("_T")  # what a long-poll's predicate returns once it holds


class LoopService:
    """Base of `CoordinatorServer` and `RelayServer` (see the module docstring)."""

    _what = "service"  # the name in errors and the thread's name

    def __init__(self, *, token: str | None, max_wait_s: float, body_timeout_s: float) -> None:
        self._token = token.encode() if token else None
        self._max_wait_s = max_wait_s
        self._body_timeout_s = body_timeout_s
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
        if (
            self._loop is not None
            and self._stop_event is not None
            and self._thread is not None  # (always, with a loop: the thread made it)
            and self._thread.is_alive()
        ):
            self._loop.call_soon_threadsafe(self._stop_event.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("%s thread did not stop within %s s", self._what, timeout_s)

    def _request_stop(self) -> None:
        """Ask the loop to end, from the loop's own thread (`_main` made `_stop_event`)."""
        if self._stop_event is None:
            raise RuntimeError(f"{self._what}: a stop asked for before its loop started")
        self._stop_event.set()

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

    async def _serve_requests(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        answer: Callable[[dict[str, Any]], Awaitable[bytes | None]],
        peer: str,
    ) -> None:
        """Read one connection's requests until its EOF, our stop, a bad frame or a wrong token,
        and write each one's answer (`answer(req)`: the reply's bytes; None ends the
        connection), in order. Connection errors are the caller's, who also closes it."""
        while not self._stopping:
            try:
                req = await read_frame_async(reader, self._body_timeout_s)
                if req is None:
                    return
                if not self._token_ok(req):
                    log.warning("%s: refused a request from %s: wrong or missing token",
                                self._what, peer)  # fmt: skip
                    await reply_and_close(writer, "unauthorized", "wrong or missing token")
                    return
                data = await answer(req)
            except ProtocolError as e:
                log.warning("%s: closing connection from %s: %s", self._what, peer, e)
                await reply_and_close(writer, "bad_request", str(e))
                return
            if data is None:
                return
            writer.write(data)
            await writer.drain()

    async def _wait_for(self, pred: Callable[[], _T | None], deadline_s: float) -> _T | None:
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


async def reply_and_close(writer: asyncio.StreamWriter, code: str, why: str) -> None:
    """An error reply, sent if the peer still reads (the caller then closes the connection)."""
    try:
        writer.write(frame({"ok": False, "code": code, "reason": why[:500]}))
        await asyncio.wait_for(writer.drain(), 1.0)
    except (ConnectionError, OSError, TimeoutError):
        pass
