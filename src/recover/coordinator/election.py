"""Leader election by etcd lease: one leader per term, a standby that waits, and the leader's
own view of whether it still leads.

Job: `Election.campaign()` blocks until this process leads and returns its term; `holds()`
says, from the local clock only, whether it still may act as leader; `publish()` puts the
leader's addresses under the leader key; `resign()` lets go.

Keys (under the run's prefix): `leader` (this leader's identity and addresses, attached to its
lease: it vanishes when the lease expires) and `term` (a number that grows by one per
leadership, written in the same transaction that creates `leader`).

Invariants:
- At most one process wins a term: the winning transaction requires `leader` absent and `term`
  unchanged since it was read, and writes both.
- `holds()` is False from the moment the lease may have expired at etcd: it is computed from the
  send time of the last keep-alive that etcd answered, plus the TTL etcd granted. A process
  frozen past its lease (SIGSTOP, a stalled host) wakes with `holds()` False, before it can do
  anything, and a keep-alive cannot revive an expired lease (etcd answers TTL 0).
- The keep-alive stops when the process's own service stalls (`alive()` False for longer than
  the lease), so a stalled leader's lease runs out and the standby takes over.

Costs: the standby polls `leader` every `poll_s` (one range request, ~10/s); the leader sends one
keep-alive every TTL/3. Takeover after a leader dies takes at most the TTL plus `poll_s`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from recover.checks import is_int
from recover.coordinator.etcd import (
    EtcdClient,
    EtcdUnavailable,
    absent,
    modified_at,
    put_op,
)

__all__ = ["Election"]

log = logging.getLogger("recover.coordinator")


class Election:
    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        identity: str,
        ttl_s: int = 2,
        poll_s: float = 0.1,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        if not is_int(ttl_s) or ttl_s < 1:
            raise ValueError(
                f"ttl_s must be an int >= 1 (etcd leases are whole seconds), got {ttl_s!r}"
            )
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
        self.client = client
        self.prefix = prefix.rstrip("/")
        self.identity = identity
        self.ttl_s, self.poll_s = ttl_s, poll_s
        self.alive = alive
        self.term: int | None = None
        self.granted_ttl_s: int | None = None
        self._lease = 0
        self._valid_until = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def leader_key(self) -> str:
        return f"{self.prefix}/leader"

    @property
    def term_key(self) -> str:
        return f"{self.prefix}/term"

    # ------------------------------------------------------------ standby and leader

    def leader(self) -> dict[str, Any] | None:
        """What the current leader published (identity, term, addresses), or None."""
        got = self.client.get(self.leader_key)
        return None if got is None else json.loads(got[0])

    def campaign(self, stop: threading.Event | None = None) -> int | None:
        """Block until this process leads; its term. None if `stop` was set first."""
        waited = False
        while stop is None or not stop.is_set():
            try:
                term = self._try_once()
            except EtcdUnavailable as e:
                log.warning("election: etcd unavailable (%s); retrying", str(e)[:200])
                term = None
            if term is not None:
                return term
            if not waited:
                log.info("standby: another coordinator leads; waiting to take over")
                waited = True
            (stop or self._stop).wait(self.poll_s)
        return None

    def _try_once(self) -> int | None:
        if self.client.get(self.leader_key) is not None:
            return None
        got = self.client.get(self.term_key)
        old = int(got[0]) if got is not None else 0
        lease, ttl = self.client.lease_grant(self.ttl_s)
        term = old + 1
        value = json.dumps({"identity": self.identity, "term": term})
        unchanged = modified_at(self.term_key, got[1]) if got is not None else absent(self.term_key)
        sent = time.monotonic()
        won = self.client.txn(
            [absent(self.leader_key), unchanged],
            [put_op(self.leader_key, value, lease), put_op(self.term_key, str(term))],
        )
        if not won:
            self.client.lease_revoke(lease)
            return None
        self.term, self._lease, self.granted_ttl_s = term, lease, ttl
        self._valid_until, self._lost = sent + ttl, None
        self._stop.clear()
        self._keeper = threading.Thread(target=self._keep, name="election-keepalive", daemon=True)
        self._keeper.start()
        log.info("elected leader of term %d (lease %d s)", term, ttl)
        return term

    def holds(self) -> bool:
        """Whether this process may still act as the leader of its term (local clock only)."""
        return self._lost is None and self.term is not None and time.monotonic() < self._valid_until

    @property
    def lost_reason(self) -> str | None:
        if self._lost is None and self.term is not None and time.monotonic() >= self._valid_until:
            return f"the lease of term {self.term} was not renewed in time"
        return self._lost

    def publish(self, info: dict[str, Any]) -> bool:
        """Put `info` (addresses) under the leader key, if this term still holds it."""
        value = json.dumps({"identity": self.identity, "term": self.term, **info})
        key, term = self.leader_key, self.term
        if term is None:  # never elected: no term of ours holds the key
            return False
        return self.client.put_under_term(self.term_key, term, key, value, lease=self._lease)[0]

    def resign(self) -> None:
        """Stop the keep-alive and revoke the lease (the leader key goes with it)."""
        self._stop.set()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(timeout=self.client.timeout_s + 1)
        if self._lease and self._lost is None:
            try:
                self.client.lease_revoke(self._lease)
            except (EtcdUnavailable, ValueError):
                pass  # it expires on its own
        self._lost = self._lost or "resigned"

    def _keep(self) -> None:
        ttl = self.granted_ttl_s or self.ttl_s
        stalled_since: float | None = None
        while not self._stop.wait(ttl / 3):
            now = time.monotonic()
            if self.alive is not None and not self.alive():
                stalled_since = stalled_since or now
                if now - stalled_since >= ttl:  # let the lease run out: the standby takes over
                    self._lost = "the coordinator's service stalled; letting the lease expire"
                    log.error("%s (term %d)", self._lost, self.term)
                    return
                continue
            stalled_since = None
            try:
                left = self.client.lease_keepalive(self._lease)
            except (EtcdUnavailable, ValueError) as e:
                log.warning("lease keep-alive failed: %s", str(e)[:200])
                continue  # holds() turns False by itself when the lease may have run out
            if left <= 0:
                self._lost = f"the lease of term {self.term} expired at etcd"
                log.error("%s", self._lost)
                return
            self._valid_until = now + left
