"""What replicas and the coordinator say to each other, and how it travels.

Job: the message types that `decide()` consumes, the published `View`, their JSON codec with
strict validation, and the frame format: a 4-byte big-endian length, then that many bytes of a
UTF-8 JSON object. One request frame gets one reply frame, in order, on one TCP connection;
the one exception is a report that waits for its outcome (a done or failed report with
`deadline_s`): a `{"ok": true, "taken": true}` frame may come before its reply.

Invariants:
- A frame longer than MAX_FRAME (1 MiB) is never read into memory: `FrameTooLarge`.
- Decoding either returns a well-typed message or raises `ProtocolError` naming the field; no
  partially valid message reaches the rules.
- Every request may carry `token`; the server, not this module, checks it.

Wire additions for scale (docs/coordinator.md): a view's plan travels as `plan_runs`
(replica -> flat [start, stop, ...] runs; `from_dict` still reads the plain `plan_ids`); a
heartbeat may carry `hold_s` (the server holds the reply until the epoch or status changes, at
most that long). Every request may carry `view_version`, the view its sender holds; the view in
the reply is then relative to it (`merge_view`): without the plan (`"pulse": true`) when the
plan is the one of that version (`plan_version`), and with `live_from` (the ids gone and new since
that version's epoch) instead of `live`. The whole view travels compact (views.py):
`live_runs` for `live`, and `plan` for the plan and its weights: the rule {"assign": M,
"members", "weight"} that `assign` recomputes, or {"plan_runs", "weights"}. `Heartbeats` and
`Tick(due=...)` are not wire messages: the server builds them for the rules. Relays (relay.py) add `done_batch` (`ReportsDone`: the done
reports of several replicas in one message) and `lease_expired` (`LeaseExpired`: a lease judged
at the relay).

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
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any, ClassVar

from recover.policy import assign

__all__ = [
    "COORDINATOR_ENV",
    "MAX_FRAME",
    "TOKEN_ENV",
    "FrameTooLarge",
    "ProtocolError",
    "Register",
    "Heartbeat",
    "Heartbeats",
    "ProcessExit",
    "ReportDone",
    "ReportFailed",
    "Leave",
    "LeaseExpired",
    "ReportsDone",
    "Tick",
    "Resumed",
    "Takeover",
    "Message",
    "View",
    "Decision",
    "Admitted",
    "Committed",
    "Diverged",
    "EpochChanged",
    "Finished",
    "MemberDead",
    "SuspectHardware",
    "QuorumLost",
    "Redo",
    "Refused",
    "Registered",
    "decode_message",
    "decode_done_batch",
    "merge_view",
    "encode_message",
    "read_frame_async",
    "write_frame_async",
    "recv_frame",
    "send_frame",
]

# Where every process of a job finds the coordinator and the job's shared secret when no flag
# says it (the launcher sets both for its children; `coordinator serve` and `status` read them).
COORDINATOR_ENV = "RECOVER_COORDINATOR"  # HOST:PORT
TOKEN_ENV = "RECOVER_TOKEN"

MAX_FRAME = 1 << 20
_HEADER = struct.Struct(">I")


class ProtocolError(ValueError):
    """A peer sent something that is not a valid request or reply."""


class FrameTooLarge(ProtocolError):
    """A frame header announced more than MAX_FRAME bytes."""


# ---------------------------------------------------------------- messages (inputs of decide)


@dataclass(frozen=True, kw_only=True)
class Register:
    replica_id: int
    incarnation: str
    fingerprint: dict[str, Any]
    next_step: int


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    replica_id: int
    incarnation: str
    epoch: int  # the epoch the replica knows (older is fine: it gets the new view)


@dataclass(frozen=True, kw_only=True)
class ProcessExit:
    replica_id: int
    incarnation: str


@dataclass(frozen=True, kw_only=True)
class ReportDone:
    replica_id: int
    incarnation: str
    step: int
    epoch: int
    param_hash: str | None = None
    # Microbatches per second this replica measured while computing its share of the attempt:
    # one sample per step, so the next step's plan always sees it (a heartbeat could lag).
    throughput: float | None = None
    # The replica asks to leave at the boundary of this step (a planned leave: SIGTERM); the
    # coordinator plans the next step without it when this step commits.
    leaving: bool = False
    # Its own part of the sum (its local gradient and loss sums) is finite. Sent false only when
    # the reduced sum is not finite: the coordinator then has the replicas' parts told apart.
    finite: bool = True


@dataclass(frozen=True, kw_only=True)
class ReportFailed:
    replica_id: int
    incarnation: str
    step: int
    epoch: int
    reason: str = ""
    # The members this replica could not dial when the attempt's group would not form, with why
    # (recover.runtime.reach): ((replica_id, why), ...). The coordinator evicts a member that a
    # majority of the others cannot dial, in consecutive attempts (membership._evict_unreachable).
    unreachable: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Leave:
    replica_id: int
    incarnation: str
    step: int


@dataclass(frozen=True, kw_only=True)
class LeaseExpired:
    """A relay judged this replica's lease (no heartbeat for lease_s at the relay)."""

    replica_id: int
    incarnation: str


@dataclass(frozen=True)
class ReportsDone:
    """Done reports of several replicas, as one message (a relay batches its replicas' reports
    of one attempt). The rules treat each report as if it came alone, then judge the attempt
    once: a batch changes the cost, never what a commit means."""

    reports: tuple[ReportDone, ...]


@dataclass(frozen=True)
class Heartbeats:
    """Heartbeats the transport read since its last batch: (replica_id, incarnation, read at).

    Not a wire message: the server answers each heartbeat at once (a refusal through `decide`)
    and hands the rest to the rules in one batch per tick, each judged from when it was read."""

    seen: tuple[tuple[int, str, float], ...]


@dataclass(frozen=True)
class Resumed:
    """The coordinator's own loop did not run for `paused_s` (its process was stopped, its host
    stalled or swapped): nobody could have been heard meanwhile. Every live or pending member
    gets a fresh lease from now before any lease is judged.

    Not a wire message: the server applies it when it notices the gap."""

    paused_s: float


@dataclass(frozen=True)
class Tick:
    """The clock moved: expire leases, check the start deadline.

    `due`: the replicas whose lease may have run out (the server keeps leases in deadline
    order); None checks every member."""

    due: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Takeover:
    """A new leader (term `term`) took the state over from a saved one: every member gets a
    lease of `grace_s` from now to find it, and the in-flight attempt is resolved as after any
    fault (committed if every live member's done is on record, else redone in a new epoch).

    Not a wire message: the server of a new term applies it once, before it serves."""

    term: int
    grace_s: float


Message = (
    Register
    | Heartbeat
    | Heartbeats
    | ProcessExit
    | LeaseExpired
    | ReportDone
    | ReportsDone
    | ReportFailed
    | Leave
    | Tick
    | Resumed
    | Takeover
)

MESSAGE_KINDS: dict[str, type] = {
    "register": Register,
    "heartbeat": Heartbeat,
    "process_exit": ProcessExit,
    "done": ReportDone,
    "failed": ReportFailed,
    "leave": Leave,
    "lease_expired": LeaseExpired,
}
_KIND_OF = {cls: kind for kind, cls in MESSAGE_KINDS.items()}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    "replica_id": (_int, "an int"),
    "incarnation": (lambda v: isinstance(v, str) and 0 < len(v) <= 128, "a non-empty string"),
    "fingerprint": (lambda v: isinstance(v, dict), "an object"),
    "next_step": (lambda v: _int(v) and v >= 0, "an int >= 0"),
    "epoch": (_int, "an int"),
    "step": (_int, "an int"),
    "throughput": (
        lambda v: v is None or (isinstance(v, int | float) and not isinstance(v, bool)),
        "a number or null",
    ),
    "param_hash": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "reason": (lambda v: isinstance(v, str), "a string"),
    "leaving": (lambda v: isinstance(v, bool), "a boolean"),
    "finite": (lambda v: isinstance(v, bool), "a boolean"),
    "unreachable": (
        lambda v: (
            isinstance(v, list | tuple)
            and len(v) <= 4096
            and all(
                isinstance(p, list | tuple) and len(p) == 2 and _int(p[0]) and isinstance(p[1], str)
                for p in v
            )
        ),
        "a list of [replica_id, reason] pairs",
    ),
}


def check_field(name: str, value: Any) -> Any:
    ok, what = _CHECKS[name]
    if not ok(value):
        raise ProtocolError(f"field {name!r} must be {what}, got {value!r}"[:300])
    return value


def decode_message(req: dict[str, Any]) -> Message:
    """A request dict -> a typed message, or ProtocolError naming the bad field. Fields the
    message does not have are ignored: `token`, `view_version`, and what older clients still
    send (a failed report's `suspects`, from before the accusation rule was removed)."""
    kind = req.get("kind")
    cls = MESSAGE_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}"[:200])
    args = {}
    for f in fields(cls):
        if f.name in req:
            args[f.name] = check_field(f.name, req[f.name])
        elif f.default is not MISSING:  # optional field
            continue
        else:
            raise ProtocolError(f"{kind}: missing field {f.name!r}")
    if "unreachable" in args:
        args["unreachable"] = tuple((int(r), why) for r, why in args["unreachable"])
    if isinstance(args.get("throughput"), int):
        args["throughput"] = float(args["throughput"])
    return cls(**args)


def decode_done_batch(req: dict[str, Any]) -> ReportsDone:
    """{"kind": "done_batch", "step", "epoch", "reports": [[replica_id, incarnation, param_hash,
    throughput], ...]} -> ReportsDone, or ProtocolError naming the bad field."""
    step, epoch = check_field("step", req.get("step")), check_field("epoch", req.get("epoch"))
    rows = req.get("reports")
    if not isinstance(rows, list) or not all(isinstance(x, list) and len(x) == 4 for x in rows):
        raise ProtocolError(
            "field 'reports' must be a list of [replica_id, incarnation, param_hash, throughput]"
        )
    out = []
    for r, inc, h, tp in rows:
        tp = check_field("throughput", tp)
        out.append(
            ReportDone(
                replica_id=check_field("replica_id", r),
                incarnation=check_field("incarnation", inc),
                step=step,
                epoch=epoch,
                param_hash=check_field("param_hash", h),
                throughput=float(tp) if tp is not None else None,
            )
        )
    return ReportsDone(tuple(out))


def encode_message(msg: Message) -> dict[str, Any]:
    d = asdict(msg)
    d["kind"] = _KIND_OF[type(msg)]
    return d


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


# ---------------------------------------------------------------- decisions (outputs of decide)


@dataclass(frozen=True, kw_only=True)
class _Decision:
    name: ClassVar[str] = "decision"
    reason: str

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict deep-copies: slow
        for k, v in list(d.items()):
            if isinstance(v, dict):
                d[k] = {str(r): (list(x) if isinstance(x, tuple) else x) for r, x in v.items()}
            elif isinstance(v, tuple):
                d[k] = list(v)
        return {"decision": self.name, **d}


@dataclass(frozen=True, kw_only=True)
class EpochChanged(_Decision):
    name: ClassVar[str] = "epoch_changed"
    epoch: int
    live: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class MemberDead(_Decision):
    name: ClassVar[str] = "member_dead"
    replica_id: int
    incarnation: str
    how: str  # exit | lease | report


@dataclass(frozen=True, kw_only=True)
class SuspectHardware(_Decision):
    """A replica whose part of a step was not finite, where the same microbatch ids recomputed on
    other replicas were: it computed wrongly (a silent data corruption). It is evicted."""

    name: ClassVar[str] = "suspect_hardware"
    replica_id: int
    incarnation: str
    step: int  # the step whose ids it computed wrongly (the preceding redo lists them)


@dataclass(frozen=True, kw_only=True)
class Committed(_Decision):
    name: ClassVar[str] = "committed"
    step: int
    epoch: int


@dataclass(frozen=True, kw_only=True)
class Redo(_Decision):
    name: ClassVar[str] = "redo"
    step: int
    epoch: int  # the new attempt epoch
    lost: tuple[int, ...]  # ids the dead members of the failed attempt held
    reassigned: dict[int, tuple[int, ...]]  # survivor -> lost ids it now also holds


@dataclass(frozen=True, kw_only=True)
class QuorumLost(_Decision):
    name: ClassVar[str] = "quorum_lost"
    live: tuple[int, ...]
    min_replicas: int
    committed_step: int


@dataclass(frozen=True, kw_only=True)
class Reforming(_Decision):
    """A run that lost its quorum forms again: a replica registered (restarted with --resume)
    once no member of the old run was still live. The old incarnations are fenced."""

    name: ClassVar[str] = "reforming"
    replica_id: int
    lost_at: int  # the last committed step before the quorum was lost


@dataclass(frozen=True, kw_only=True)
class Refused(_Decision):
    name: ClassVar[str] = "refused"
    replica_id: int | None
    incarnation: str | None
    code: str  # evicted | left | unknown | stale | mismatch | duplicate | <status>


@dataclass(frozen=True, kw_only=True)
class Registered(_Decision):
    name: ClassVar[str] = "registered"
    replica_id: int
    incarnation: str


@dataclass(frozen=True, kw_only=True)
class Admitted(_Decision):
    name: ClassVar[str] = "admitted"
    replica_ids: tuple[int, ...]
    epoch: int


@dataclass(frozen=True, kw_only=True)
class Diverged(_Decision):
    name: ClassVar[str] = "diverged"
    step: int
    hashes: dict[int, str]


@dataclass(frozen=True, kw_only=True)
class Revalidated(_Decision):
    """The coordinator noticed its own pause (`Resumed`) and gave every member a fresh lease."""

    name: ClassVar[str] = "revalidated"
    paused_s: float
    members: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Finished(_Decision):
    name: ClassVar[str] = "finished"


Decision = (
    EpochChanged
    | MemberDead
    | SuspectHardware
    | Committed
    | Redo
    | QuorumLost
    | Refused
    | Registered
    | Admitted
    | Diverged
    | Finished
    | Revalidated
    | Reforming
)

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
