"""Can this rank's peers be dialled? A probe for groups that cannot form (docs/design.md,
"Across machines": a member that cannot be connected to is named and evicted).

Job: tell "peer X cannot be reached over the network" apart from "peer X is slow, hung or dead",
which a failed rendezvous alone cannot. Each rank that builds cross-replica groups owns one
`ReachListener`: a listening TCP socket on the address its gloo device advertises (so the probe
travels the path gloo's full-mesh connect takes), answered by a daemon thread that writes one
line, ``recover-reach <token>``, and closes. Before each group build the rank publishes
``host:port:token`` under the epoch's store prefix; when the build is still waiting after a
second (a healthy rendezvous takes milliseconds), `probe_peers` dials the peers that published.

Verdicts, per peer: the TCP connect fails (refused, no route, timed out) -> unreachable; it
connects and the line names another token -> unreachable (a different process answers at that
address: the peer advertised an address that is not its own from here, e.g. loopback); it
connects and no line comes within the timeout -> reachable (the kernel accepted the connection:
the peer's process may be stopped or busy, which is for its lease to judge, not for this probe).
A peer that never published is not judged (it has not reached the build: slow or dead).

What it must not do: accuse a peer that the network can reach; block a build (it runs on the
build's waiting thread, bounded by `timeout_s` per peer, the connects in parallel); read the
environment (the entry point resolved the address: recover.addresses).
Cost: nothing while every build completes within the first second; one connect per published
peer, once per slow build. Limits: IPv4 and hostnames only; a firewall that lets gloo's ports
through but not this one (or the reverse) makes the verdict wrong for that pair.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

KEY = "recover_reach/"  # + rank, under the epoch's store prefix
_GREETING = b"recover-reach "


class ReachListener:
    """The listening end of the probe, on `host` (the address this rank's gloo device binds).

    `endpoint` is what peers dial (``host:port:token``); None when the socket could not be bound
    (the probe is then off for this rank: its peers do not judge it). `close()` stops it."""

    def __init__(self, host: str) -> None:
        self.token = secrets.token_hex(8)
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self.endpoint: str | None = None
        try:
            sock = socket.create_server((host, 0), backlog=64)
        except OSError as e:
            logger.debug("reach listener on %s not bound (%s): the probe is off here", host, e)
            return
        sock.settimeout(0.5)  # so close() ends the thread within half a second
        self._sock = sock
        self.endpoint = f"{host}:{sock.getsockname()[1]}:{self.token}"
        threading.Thread(target=self._serve, name="reach-listener", daemon=True).start()

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        line = _GREETING + self.token.encode() + b"\n"
        while not self._closed.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(0.5)
                    conn.sendall(line)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            try:  # wakes a blocked accept() and stops listening now (close alone waits for it)
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def parse_endpoint(text: str) -> tuple[str, int, str]:
    """``host:port:token`` -> (host, port, token); ValueError if malformed."""
    host, port, token = text.rsplit(":", 2)
    if not host or not token:
        raise ValueError(f"malformed reach endpoint {text!r}")
    return host, int(port), token


def probe_one(endpoint: str, timeout_s: float) -> str | None:
    """None if the peer at `endpoint` can be reached, else why not (one short phrase)."""
    try:
        host, port, token = parse_endpoint(endpoint)
    except ValueError as e:
        return str(e)
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:  # refused, no route, timed out
        return f"cannot connect to {host}:{port}: {e.strerror or e.__class__.__name__}"
    with conn:
        try:
            conn.settimeout(timeout_s)
            got = conn.recv(len(_GREETING) + len(token) + 1)
        except OSError:
            return None  # connected: the network reaches it (a stopped process answers late)
    if got and got.strip() != _GREETING + token.encode():
        return f"{host}:{port} is answered by another process (not this peer's address from here)"
    return None


def probe_peers(endpoints: dict[int, str], timeout_s: float) -> dict[int, str]:
    """{rank: why} for the peers of `endpoints` ({rank: endpoint}) that cannot be reached; the
    connects run in parallel, so the call takes about `timeout_s` at most."""
    if not endpoints:
        return {}
    ranks = sorted(endpoints)
    with ThreadPoolExecutor(max_workers=min(16, len(ranks))) as pool:
        verdicts = list(pool.map(lambda k: probe_one(endpoints[k], timeout_s), ranks))
    return {k: why for k, why in zip(ranks, verdicts, strict=True) if why is not None}
