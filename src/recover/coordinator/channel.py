"""One connection to whichever coordinator leads, and the two callers that need no session.

Job: `Leader` holds the coordinator addresses a client may reach (the first is tried first) and
the one it speaks to now. With standbys (docs/coordinator.md, "A standby that takes over") only
the leader of the current term listens, so a connection that fails moves on to the next address.
`Channel` is one persistent connection with a lock: it connects lazily to the current address,
sends a request and returns its reply (running `on_taken` for a `{"taken": true}` frame that comes
first: a report on record whose outcome is still to come). `request_once` is one request on a
fresh connection (tools, the CLI's `status`); `NodeLink` is a node agent's line to the
coordinator (recover.agent), a beat at a time to whichever address answers.

Invariants: every connect and every reply has a timeout (the channel's, or the caller's
`timeout_s` beyond the `wait_s` the server may hold the reply); a transport failure (OSError,
ProtocolError) raises `CoordinatorUnreachable` naming the address and leaves the channel closed,
so the next call reconnects; the channels that share a `Leader` move on together, once per
failure of the address they used (a failure reported for an older generation moves nothing).
Must not: retry or wait out a grace (the caller decides how long to keep asking: client.py and
heartbeats.py), hold a replica's state, or import torch.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from typing import Any

from recover.coordinator.outcomes import CoordinatorUnreachable, RequestRefused
from recover.coordinator.protocol import ProtocolError, recv_frame, send_frame

__all__ = ["Channel", "Leader", "NodeLink", "request_once"]


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


class Leader:
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


class Channel:
    """One persistent connection with a lock; reconnects lazily after an error."""

    def __init__(
        self, host: str, port: int, timeout_s: float, leader: Leader | None = None
    ) -> None:
        self.leader = leader or Leader([(host, port)])
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
        self.send(req, wait_s, timeout_s)
        reply = self.receive()
        while reply.get("taken") is True:
            if on_taken is not None:
                try:
                    on_taken()
                except BaseException:
                    self.close()  # its reply is still to come: nobody may read it
                    raise
            reply = self.receive()
        return reply

    def send(
        self, req: dict[str, Any], wait_s: float = 0.0, timeout_s: float | None = None
    ) -> None:
        """The first half of `call`: connect if need be and send `req`, whose frames `receive`
        then reads (the caller holds `lock` from here to its reply)."""
        patience = self.timeout_s if timeout_s is None else timeout_s
        try:
            if self.sock is None:
                self.host, self.port, self.generation = self.leader.current()
                self.sock = _connect(self.host, self.port, min(self.timeout_s, patience))
            self.sock.settimeout(wait_s + patience)
            send_frame(self.sock, req)
        except (OSError, ProtocolError) as e:
            raise self._failed(e) from e

    def receive(self) -> dict[str, Any]:
        """The next frame of the reply to the request `send` sent (a `{"taken": true}` frame
        first, for a report that waits for its outcome), within the timeout `send` set."""
        try:
            if self.sock is None:
                raise ProtocolError("no request in flight on this channel")
            return recv_frame(self.sock)
        except (OSError, ProtocolError) as e:
            raise self._failed(e) from e

    def readable(self) -> bool:
        """Whether a frame (or the connection's end) is waiting to be read, without waiting."""
        sock = self.sock
        if sock is None:
            return False
        try:
            return bool(select.select([sock], [], [], 0)[0])
        except (OSError, ValueError):  # closed meanwhile: `receive` reports it
            return True

    def _failed(self, e: BaseException) -> CoordinatorUnreachable:
        self.close()
        self.leader.failed(self.generation)
        return CoordinatorUnreachable(f"coordinator {self.host}:{self.port}: {e!r}")

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
        self._channel = Channel(*addresses[0], timeout_s, Leader(list(addresses)))
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
