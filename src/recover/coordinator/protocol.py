"""How replicas and the coordinator talk: the frame, the published view, and their errors.

Job: the frame format (a 4-byte big-endian length, then that many bytes of a UTF-8 JSON
object), the published `View` with its wire form (`to_dict`, `from_dict`, `merge_view`), the
protocol's errors, and the environment names where a process finds the coordinator. One request
frame gets one reply frame, in order, on one TCP connection; the one exception is a report that
waits for its outcome (a done or failed report with `deadline_s`): a `{"ok": true, "taken":
true}` frame may come before its reply. What a request says: messages.py (the inputs of
`decide()`, their strict decoding); what the rules answer: decisions.py.

Invariants:
- A frame longer than MAX_FRAME (1 MiB) is never read into memory: `FrameTooLarge`.
- A malformed frame or view raises `ProtocolError`; nothing half-read is returned.
- Every request may carry `token`; the server, not this module, checks it.

Wire additions for scale (docs/coordinator.md): a view's plan travels as `plan_runs`
(replica -> flat [start, stop, ...] runs; `from_dict` still reads the plain `plan_ids`); a
heartbeat may carry `hold_s` (the server holds the reply until the epoch or status changes, at
most that long). Every request may carry `view_version`, the view its sender holds; the view in
the reply is then relative to it (`merge_view`): without the plan (`"pulse": true`) when the
plan is the one of that version (`plan_version`), and with `live_from` (the ids gone and new since
that version's epoch) instead of `live`. The whole view travels compact (views.py):
`live_runs` for `live`, and `plan` for the plan and its weights: the rule {"assign": M,
"members", "weight"} that `assign` recomputes, or {"plan_runs", "weights"}. Relays (relay.py)
add `done_batch` and `lease_expired` (messages.py).

Wire additions for the record (docs/metrics.md): the register reply carries `lease_s` (the
replica's fence window); a done report may carry
`leaving: true` (a planned leave at the boundary of that step); the view carries `records_from`
(the first step the named writer makes sure is recorded).

This module holds no sockets and no clocks: the framing helpers take a socket or an asyncio
stream from the caller. Costs: one json.dumps/loads per message.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass, replace
from typing import Any

from recover.policy import assign

__all__ = [
    "COORDINATOR_ENV",
    "MAX_FRAME",
    "TOKEN_ENV",
    "FrameTooLarge",
    "ProtocolError",
    "View",
    "merge_view",
    "read_frame_async",
    "write_frame_async",
    "recv_frame",
    "send_frame",
]

# Where every process of a job finds the coordinator and the job's shared secret when no flag
# says it (the launcher sets both for its children; `coordinator serve` and `status` read them).
COORDINATOR_ENV = "RECOVER_COORDINATOR"  # HOST:PORT
TOKEN_ENV = "RECOVER_TOKEN"
# A replica (or relay) silent this long is declared dead (how="lease"), unless the coordinator
# is told another (--lease); the coordinator tells every replica its lease when it registers.
DEFAULT_LEASE_S = 1.0

MAX_FRAME = 1 << 20
_HEADER = struct.Struct(">I")


class ProtocolError(ValueError):
    """A peer sent something that is not a valid request or reply."""


class FrameTooLarge(ProtocolError):
    """A frame header announced more than MAX_FRAME bytes."""


# ---------------------------------------------------------------- the published view


@dataclass(frozen=True, kw_only=True)
class View:
    """What the coordinator publishes after every change (see docs/design.md).

    `plan` is the current attempt's (step, attempt_epoch): its keys are the
    attempt's members, i.e. the group that reduces in attempt_epoch. `live` can already lack a
    member that died during the attempt (then epoch > attempt_epoch, and a Redo follows unless
    every survivor reports done).
    """

    epoch: int
    live: tuple[int, ...]
    step: int  # the step being worked on now (committed_step + 1 while running)
    plan: dict[int, tuple[int, ...]]  # replica -> microbatch ids of (step, attempt_epoch)
    weights: dict[int, float]
    status: str  # forming | running | quorum_lost | finished | diverged
    committed_step: int  # -1 before any commit
    attempt_epoch: int  # the epoch in which the current attempt of `step` reduces
    pending: tuple[int, ...] = ()  # registered, admitted at the next commit
    joined: tuple[int, ...] = ()  # admitted into this epoch: they get the state before the step
    version: int = 0
    reason: str = ""
    # The replica that writes committed_step's records, named by the commit decision (the lowest
    # attempt member alive then): one writer per step, the same on every replica. -1: none yet.
    writer: int = -1
    # The first step whose records the writer makes sure of (those it finds missing, it writes):
    # committed_step, or older when the previous writer died before its records were known written.
    records_from: int = -1
    # Replicas whose part of the current attempt's step was not finite while others' was: their
    # ids are recomputed by the others in this attempt, and they drop their own sum (compute none).
    discard: tuple[int, ...] = ()
    # The view version at which this plan (and its weights) was made: a replica that holds a
    # view with the same plan_version holds this plan, so replies may leave it out.
    plan_version: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The wire form. The plan travels as runs ("plan_runs": replica -> flat [start, stop,
        ...] pairs of consecutive ids): a plan is a few contiguous blocks per replica, so the view
        grows with R, not with M."""
        return {
            **self.scalars(),
            "live": list(self.live),
            "plan_runs": {str(r): id_runs(ids) for r, ids in self.plan.items()},
            "weights": {str(r): w for r, w in self.weights.items()},
        }

    def scalars(self) -> dict[str, Any]:
        """The wire form without the live set and the plan (views.py sends those apart)."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "status": self.status,
            "committed_step": self.committed_step,
            "attempt_epoch": self.attempt_epoch,
            "pending": list(self.pending),
            "joined": list(self.joined),
            "version": self.version,
            "reason": self.reason,
            "writer": self.writer,
            "records_from": self.records_from,
            "discard": list(self.discard),
            "plan_version": self.plan_version,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> View:
        try:
            return cls(
                epoch=int(d["epoch"]),
                live=_live_of(d),
                step=int(d["step"]),
                plan=_plan_of(d),
                weights=_weights_of(d),
                status=str(d["status"]),
                committed_step=int(d["committed_step"]),
                attempt_epoch=int(d["attempt_epoch"]),
                pending=tuple(int(r) for r in d.get("pending", ())),
                joined=tuple(int(r) for r in d.get("joined", ())),
                version=int(d.get("version", 0)),
                reason=str(d.get("reason", "")),
                writer=int(d.get("writer", -1)),
                records_from=int(d.get("records_from", -1)),
                discard=tuple(int(r) for r in d.get("discard", ())),
                plan_version=int(d.get("plan_version", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"malformed view: {e!r}") from e


def merge_view(old: View | None, raw: dict[str, Any]) -> View | None:
    """The view that `raw` (a reply's view, relative to `old`) describes, or None when it is
    older than `old` or leaves out a part that `old` cannot fill.

    A reply leaves out the plan (`"pulse": true`) when the requester's view has the same
    `plan_version`, and gives `live_from` {"epoch", "gone", "new"} instead of `live` when the
    requester's view is of that epoch. Both are checked against `old` here, so a view that was
    meant for an older one of our views is dropped, never merged wrongly."""
    try:
        if old is not None and int(raw.get("version", 0)) < old.version:
            return None
        d = raw
        if "live" not in d and "live_runs" not in d:
            delta = d.get("live_from")
            if old is None or not isinstance(delta, dict) or delta.get("epoch") != old.epoch:
                return None
            gone = set(delta.get("gone", ()))
            live = [r for r in old.live if r not in gone]
            live = sorted(live + [int(r) for r in delta.get("new", ())])
            d = {**d, "live": live}
        if d.get("pulse"):
            if old is None or old.plan_version != int(d.get("plan_version", -1)):
                return None
            d = {k: v for k, v in d.items() if k != "plan"}
            view = View.from_dict({**d, "plan_ids": {}, "weights": {}})
            return replace(view, plan=old.plan, weights=old.weights)
        return View.from_dict(d)
    except (TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(f"malformed view: {e!r}") from e


def id_runs(ids: tuple[int, ...]) -> list[int]:
    """(3, 4, 5, 9) -> [3, 6, 9, 10]: start, stop of each run of consecutive ids, in order."""
    if ids and ids == tuple(range(ids[0], ids[0] + len(ids))):  # the usual plan: one block
        return [ids[0], ids[0] + len(ids)]
    out: list[int] = []
    for j in ids:
        if out and out[-1] == j:
            out[-1] = j + 1
        else:
            out += [j, j + 1]
    return out


def _ids_of_runs(runs: list[int]) -> list[int]:
    if len(runs) % 2:
        raise ValueError("runs must have an even length")
    ids: list[int] = []
    for a, b in zip(runs[::2], runs[1::2], strict=True):
        ids.extend(range(int(a), int(b)))
    return ids


def _live_of(d: dict[str, Any]) -> tuple[int, ...]:
    """`live`, or `live_runs` (the compact form views.py sends: [start, stop, ...])."""
    if "live" in d:
        return tuple(int(r) for r in d["live"])
    return tuple(_ids_of_runs(d["live_runs"]))


def _weights_of(d: dict[str, Any]) -> dict[int, float]:
    compact = d.get("plan")
    if isinstance(compact, dict) and "assign" in compact:  # one weight for every attempt member
        return {r: float(compact["weight"]) for r in _ids_of_runs(compact["members"])}
    weights = compact["weights"] if isinstance(compact, dict) else d["weights"]
    return {int(r): float(w) for r, w in weights.items()}


def _plan_of(d: dict[str, Any]) -> dict[int, tuple[int, ...]]:
    compact = d.get("plan")
    if isinstance(compact, dict):  # the compact form (views.encode_plan)
        if "assign" in compact:  # the plan is the pure rule's, for these members and weights
            members = _ids_of_runs(compact["members"])
            weights = {r: float(compact["weight"]) for r in members}
            return assign(int(compact["assign"]), members, weights)
        d = compact
    if "plan_runs" not in d:  # the plain form: replica -> every id
        return {int(r): tuple(int(j) for j in ids) for r, ids in d["plan_ids"].items()}
    return {int(r): tuple(_ids_of_runs(runs)) for r, runs in d["plan_runs"].items()}


# ---------------------------------------------------------------- framing


def _encode_frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


def _decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"frame is not UTF-8 JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must hold a JSON object, got {type(obj).__name__}")
    return obj


def _reject_constant(name: str) -> float:
    raise ProtocolError(f"non-finite number {name} is not allowed")


def _check_length(n: int) -> None:
    if n > MAX_FRAME:
        raise FrameTooLarge(f"frame header announces {n} bytes, the limit is {MAX_FRAME}")


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(_encode_frame(obj))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the coordinator")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """One frame from a blocking socket; the socket's own timeout bounds the wait."""
    (n,) = _HEADER.unpack(_recv_exactly(sock, 4))
    _check_length(n)
    return _decode_body(_recv_exactly(sock, n))


async def read_frame_async(
    reader: asyncio.StreamReader, body_timeout_s: float
) -> dict[str, Any] | None:
    """One frame, or None on a clean EOF between frames. The body must follow its header
    within `body_timeout_s` (a stalled sender cannot hold a half-read frame forever)."""
    try:
        header = await reader.readexactly(4)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError("connection closed inside a frame header") from e
    (n,) = _HEADER.unpack(header)
    _check_length(n)
    try:
        async with asyncio.timeout(body_timeout_s):  # no extra task per frame, unlike wait_for
            body = await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError("connection closed inside a frame body") from e
    except TimeoutError as e:
        raise ProtocolError(f"frame body did not arrive within {body_timeout_s} s") from e
    return _decode_body(body)


async def write_frame_async(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(_encode_frame(obj))
    await writer.drain()
