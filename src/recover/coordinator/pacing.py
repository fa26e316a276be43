"""The server's clocks and wake-ups: leases in deadline order, parked waiters, peer EOF.

Job: the three small mechanisms that keep the coordinator's work per message independent of R.
- `LeaseQueue`: replica -> when its last heartbeat was read, kept in that order (an ordered map,
  moved to the end at every heartbeat). All leases have one length, so the front holds the
  earliest deadline: `due(now)` walks only the replicas whose lease ran out. O(1) per heartbeat.
- `Waiters`: futures parked until the next wake or a timeout (one timer each, no task): the
  long-polls and the held heartbeat replies. A wake resolves them all at once.
- `StreamProtocol`: asyncio's stream protocol with `gone`, a future resolved at the peer's EOF or
  connection loss even while no one reads the stream (a held reply must end when its replica dies:
  its EOF is what declares the death).

Everything here runs on the coordinator's event loop thread; nothing here decides anything (the
rules in decide.py judge every lease the queue names).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

__all__ = ["LeaseQueue", "StreamProtocol", "Waiters", "resolve"]

K = TypeVar("K")  # what holds a lease: a replica id (int), a relay id or a node name (str)


def resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class LeaseQueue(Generic[K]):
    """Replica -> coordinator clock of its last heartbeat read, in that order. The same for
    the other holders of a lease, by their key `K` (relays, node agents)."""

    def __init__(self, lease_s: float, seen: Iterable[tuple[K, float]] = ()) -> None:
        self.lease_s = lease_s
        self._at: OrderedDict[K, float] = OrderedDict()
        for r, at in sorted(seen, key=lambda x: x[1]):
            self._at[r] = at

    def touch(self, r: K, at: float) -> None:
        self._at[r] = at
        self._at.move_to_end(r)

    def get(self, r: K, default: float) -> float:
        return self._at.get(r, default)

    def deadline(self) -> float | None:
        """When the first lease runs out (the front of the map), None when it holds none."""
        for at in self._at.values():
            return at + self.lease_s
        return None

    def due(self, now: float) -> list[K]:
        """Replicas whose lease ran out by `now`: the front of the map, nothing else."""
        out: list[K] = []
        for r, at in self._at.items():
            if now - at <= self.lease_s:
                break
            out.append(r)
        return out

    def settle(self, due: list[K], alive: dict[K, float | None]) -> None:
        """After the rules judged `due`: forget the dead (alive[r] is None), re-queue the rest
        at the time the rules hold for them."""
        for r in due:
            at = alive.get(r)
            if at is None:
                self._at.pop(r, None)
            else:
                self.touch(r, at)


class Waiters:
    """Futures parked until `wake()` or their own timeout."""

    def __init__(self) -> None:
        self._parked: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._parked)

    def wake(self) -> None:
        parked, self._parked = self._parked, set()
        for fut in parked:
            resolve(fut)

    async def park(self, timeout_s: float, gone: asyncio.Future[None] | None = None) -> None:
        """Until the next wake, timeout_s, or (given `gone`) the peer closing its connection."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._parked.add(fut)
        timer = loop.call_later(timeout_s, resolve, fut)

        def wake(_: asyncio.Future[None]) -> None:
            resolve(fut)

        if gone is not None:
            gone.add_done_callback(wake)
        try:
            await fut
        finally:
            timer.cancel()
            self._parked.discard(fut)
            if gone is not None:
                gone.remove_done_callback(wake)


class StreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, plus `gone` (see the module docstring)."""

    def __init__(self, reader: asyncio.StreamReader, cb: Any, *, loop: Any) -> None:
        super().__init__(reader, cb, loop=loop)
        self.gone: asyncio.Future[None] = loop.create_future()

    def eof_received(self) -> bool | None:
        resolve(self.gone)
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        resolve(self.gone)
        super().connection_lost(exc)
