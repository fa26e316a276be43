"""etcd as the coordinator's durable store: a small v3 client and the fenced `EtcdStateStore`.

Job: speak to etcd (3.4 or newer) through its v3 JSON gateway (HTTP POST of JSON to
`/v3/kv/range`, `/v3/kv/txn`, `/v3/lease/grant`, ...; keys and values base64) with the standard
library, so the coordinator needs no new dependency; and keep the coordinator's state under one
key, written only by the leader of the current term.

Why the gateway and the standard library (docs/coordinator.md, "The control plane in etcd"): the
coordinator makes a handful of requests per step (one state write per durable change, a lease
keep-alive every third of the lease), so HTTP/1.1 on a kept-alive connection costs well under a
millisecond of CPU per request; the gateway ships inside every etcd server; and the maintained
asyncio client (aetcd) speaks gRPC, which would bring grpcio and protobuf into the coordinator
and its calls onto the event loop that serves the replicas (these blocking calls run on the
saver and election threads). Watches would need a streaming response: the standby polls the leader key instead (a
range every `poll_s`, ~10 requests/s; see election.py).

Invariants:
- `EtcdStateStore.save` writes only inside a transaction that compares the term key with this
  leader's term: a leader whose term was superseded writes nothing (`Fenced`), whatever it
  believes.
- Every request has a deadline (`timeout_s`) and tries each endpoint once; failure raises
  `EtcdUnavailable` naming the endpoints and the last error.
- The state is stored zlib-compressed JSON (the members compress ~10x; etcd refuses requests
  above 1.5 MiB by default, --max-request-bytes).
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recover.coordinator.state_store import CoordinatorState, state_from_json, state_to_json

__all__ = [
    "EtcdClient",
    "EtcdStateStore",
    "EtcdUnavailable",
    "Fenced",
    "StateUrl",
    "parse_state_url",
]


class EtcdUnavailable(RuntimeError):
    """No endpoint of the etcd cluster answered within the deadline."""


class Fenced(RuntimeError):
    """This coordinator's term was superseded: another leader holds the state now."""


@dataclass(frozen=True)
class StateUrl:
    endpoints: tuple[tuple[str, int], ...]
    prefix: str  # every key of this run starts with it (one prefix per run)

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd://{hosts}{self.prefix}"


def parse_state_url(url: str) -> StateUrl:
    """`etcd://HOST:PORT[,HOST:PORT...][/PREFIX]` (default prefix /recover/default)."""
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ValueError(
            f"--state must look like etcd://HOST:PORT[,HOST:PORT...][/PREFIX], got {url!r}"
        )
    rest = url[len("etcd://") :]
    hosts, _, path = rest.partition("/")
    endpoints = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--state: {part!r} is not HOST:PORT (in {url!r})")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = "/" + path.strip("/") if path.strip("/") else "/recover/default"
    return StateUrl(endpoints=tuple(endpoints), prefix=prefix)


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdClient:
    """Blocking v3 requests over the JSON gateway; one kept-alive connection, thread-safe.

    Endpoints are tried in turn, starting at the one that answered last.
    """

    def __init__(self, endpoints: tuple[tuple[str, int], ...], *, timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("endpoints must name at least one HOST:PORT")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._at = 0  # the endpoint that answered last
        self._conn: http.client.HTTPConnection | None = None
        self.requests = 0  # every request sent (the benchmark reads it)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to `path` (e.g. "/v3/kv/range"); the decoded reply, or EtcdUnavailable."""
        data = json.dumps(body).encode()
        errors = []
        with self._lock:
            for i in range(len(self.endpoints)):
                at = (self._at + i) % len(self.endpoints)
                host, port = self.endpoints[at]
                try:
                    if self._conn is None or at != self._at:
                        self._close()
                        self._conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
                        self._at = at
                    self.requests += 1
                    self._conn.request("POST", path, data, {"Content-Type": "application/json"})
                    reply = self._conn.getresponse()
                    text = reply.read()
                except (OSError, http.client.HTTPException) as e:
                    self._close()
                    errors.append(f"{host}:{port}: {e!r}")
                    continue
                out = json.loads(text) if text else {}
                if reply.status != 200:
                    # etcd answered: an error of the request, not of the endpoint, unless it has
                    # no leader, failed (5xx) or timed out (408: its gateway says "the client
                    # connection is closing" while the server shuts down); (without either
                    # field: the body itself, shown as bytes: b'...')
                    why = out.get("error") or out.get("message") or repr(text[:200])
                    if "no leader" in str(why) or reply.status >= 500 or reply.status == 408:
                        errors.append(f"{host}:{port}: {reply.status} {why}")
                        continue
                    raise ValueError(f"etcd {path}: {reply.status} {why}")
                return out.get("result", out) if path.endswith("keepalive") else out
        raise EtcdUnavailable(f"etcd {path}: no endpoint answered: {'; '.join(errors)}"[:600])

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---- the few operations used here -------------------------------------------------------

    def get(self, key: str) -> tuple[bytes, int, int] | None:
        """(value, mod_revision, lease) of `key`, or None."""
        out = self.call("/v3/kv/range", {"key": _b64(key)})
        kvs = out.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return _unb64(kv.get("value", "")), int(kv["mod_revision"]), int(kv.get("lease", 0))

    def put(self, key: str, value: bytes | str, *, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
    ) -> bool:
        return self.txn_at(compare, success, failure)[0]

    def txn_at(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
    ) -> tuple[bool, int]:
        """(succeeded, the store's revision after it)."""
        body = {"compare": compare, "success": success, "failure": list(failure)}
        out = self.call("/v3/kv/txn", body)
        return bool(out.get("succeeded")), int(out.get("header", {}).get("revision", 0))

    def put_under_term(
        self, term_key: str, term: int, key: str, value: bytes | str, *, lease: int = 0
    ) -> tuple[bool, int]:
        """A leader's fenced write: put `key` only while `term_key` holds `term`, in one
        transaction. (written, the store's revision after it)."""
        return self.txn_at([value_is(term_key, str(term))], [put_op(key, value, lease)])

    def compact(self, revision: int) -> None:
        """Drop the history older than `revision` (etcd keeps every version until compacted)."""
        self.call("/v3/kv/compaction", {"revision": str(revision)})

    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """(lease id, granted TTL in seconds; etcd may raise a TTL below its minimum)."""
        out = self.call("/v3/lease/grant", {"TTL": int(ttl_s)})
        if out.get("error"):
            raise ValueError(f"etcd lease grant: {out['error']}")
        return int(out["ID"]), int(out["TTL"])

    def lease_keepalive(self, lease: int) -> int:
        """The lease's remaining TTL after the refresh; 0 when it has expired."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": str(lease)})


# ---------------------------------------------------------------- compare/put builders


def value_is(key: str, value: str) -> dict[str, Any]:
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def absent(key: str) -> dict[str, Any]:
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def modified_at(key: str, revision: int) -> dict[str, Any]:
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def put_op(key: str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


# ---------------------------------------------------------------- the state store


class EtcdStateStore:
    """The coordinator's state under `PREFIX/state`, written only under the term in `PREFIX/term`.

    `load()` reads it (any process); `save(state)` needs `term` (set by the leader once elected,
    `fence(term)`) and raises `Fenced` when the stored term is another. Saves count in `saves`
    and their bytes in `saved_bytes` (the benchmark reports both).
    """

    durable = True  # the server holds back replies until the state that they reveal is saved
    # etcd keeps every version of a key until its history is compacted: a state of ~57 KB
    # (R = 1,024) written once a step would fill etcd's default 2 GB quota in about ten hours.
    # Every this many saves, the history before the last one is compacted away.
    COMPACT_EVERY = 100

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix.rstrip("/")
        self.term: int | None = None
        self.saves = 0
        self.saved_bytes = 0

    @property
    def state_key(self) -> str:
        return f"{self.prefix}/state"

    @property
    def term_key(self) -> str:
        return f"{self.prefix}/term"

    def fence(self, term: int) -> None:
        self.term = term

    def load(self) -> CoordinatorState | None:
        got = self.client.get(self.state_key)
        return None if got is None else state_from_json(zlib.decompress(got[0]).decode())

    def save(self, state: CoordinatorState) -> None:
        if self.term is None:
            raise Fenced("this coordinator holds no term: it was never elected")
        blob = zlib.compress(state_to_json(state).encode(), 1)
        ok, revision = self.client.put_under_term(self.term_key, self.term, self.state_key, blob)
        if not ok:
            now = self.client.get(self.term_key)
            raise Fenced(
                f"term {self.term} was superseded (the store's term is "
                f"{now[0].decode() if now else 'gone'}): this coordinator writes nothing more"
            )
        self.saves += 1
        self.saved_bytes += len(blob)
        if self.saves % self.COMPACT_EVERY == 0 and revision > 0:
            try:
                self.client.compact(revision)
            except ValueError:  # compacted already (another leader): nothing to drop
                pass
