"""The messages that `decide()` consumes, and their strict decoding from a request.

Job: the typed inputs of the rules (decide.py). The wire messages a replica or a relay sends:
`Register`, `Heartbeat`, `ProcessExit`, `ReportDone`, `ReportFailed`, `Leave`, and from relays
(relay.py) `LeaseExpired` (a lease judged at the relay) and `ReportsDone` (the done reports of
several replicas in one message, `done_batch` on the wire). The ones the server builds for the
rules, never on the wire: `Heartbeats` (a tick's batch), `Tick(due=...)`, `Resumed`, `Takeover`.
`MESSAGE_KINDS` maps a request's `kind` to its type; `decode_message` and `decode_done_batch`
turn a request dict into a message, `check_field` checks one field (the server and the relay
check the fields of their other requests with it), `encode_message` is the reverse.

Invariants: decoding either returns a well-typed message or raises `ProtocolError` naming the
field; no partially valid message reaches the rules. Fields a message does not have (`token`,
`view_version`, `hold_s`) are ignored here: the server reads them.
Must not: hold sockets or clocks, or frame anything (protocol.py frames, the server checks the
token); decide anything (the rules do). Costs: one dict walk per message.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from recover.coordinator.protocol import ProtocolError

__all__ = [
    "MESSAGE_KINDS",
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
    "check_field",
    "decode_message",
    "decode_done_batch",
    "encode_message",
]


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

MESSAGE_KINDS: dict[str, type[Message]] = {
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
