"""The coordinator's state: its shape, its JSON form, and where it is kept.

Job: define the `CoordinatorState` that the pure rules in
`decide.py` (with attempt.py and membership.py) map to a new state, and the `StateStore` interface
the server saves it through, with an in-memory implementation. A later etcd-backed store implements
the same two methods.

Invariants:
- `decide()` never mutates a state it is given. `clone()` is shallow (O(1)): `decide` copies a
  container the first time it changes it (copy on write), so a heartbeat does not copy the whole
  state. Members are frozen records, replaced and never edited.
- `state_from_json(state_to_json(s)) == s` for every reachable state (tested), so a store that
  keeps JSON loses nothing; a state saved by an older version still loads (fields it had that
  are gone now, such as the accusations of the removed accusation rule, are dropped).
- `revision` grows whenever something durable changes (membership, the plan, reports, commits;
  not lease bookkeeping); the server saves the newest revision in the background, batched.
  `view_version` grows whenever the published view does.

Costs: a clone is O(1); a container's first change in one `decide` copies it, O(R). The JSON form
is O(R + M) and is built off the coordinator's event loop. Limits: `fenced` keeps every dead
incarnation for the life of the run (a few dozen bytes each).
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, Protocol, overload

# CoordinatorOptions lives in options.py; importable from here too, its home before.
from recover.coordinator.options import CoordinatorOptions, options_from_stored
from recover.coordinator.protocol import View

__all__ = [
    "CoordinatorOptions",
    "CoordinatorState",
    "InMemoryStateStore",
    "Member",
    "StateStore",
    "check_member",
    "initial_state",
    "pending_ids",
    "resume_state",
    "view_of",
    "state_from_json",
    "state_to_json",
]

PENDING, LIVE, DEAD, LEFT = "pending", "live", "dead", "left"
FORMING, RUNNING, QUORUM_LOST, FINISHED, DIVERGED = (
    "forming",
    "running",
    "quorum_lost",
    "finished",
    "diverged",
)
TERMINAL = (QUORUM_LOST, FINISHED, DIVERGED)


@dataclass(frozen=True, kw_only=True)
class Member:
    replica_id: int
    incarnation: str  # a fresh uuid per process start; dead incarnations are fenced forever
    state: str  # pending | live | dead | left
    last_seen: float  # coordinator clock (monotonic) of the last message from this incarnation
    fingerprint: dict[str, Any]  # the replica's config fingerprint
    next_step: int  # from its checkpoint, at registration
    throughput: float | None = None  # moving average of microbatches/s from done reports
    how: str | None = None  # how it stopped: exit | lease | suspect | unreachable | quorum | leave
    leaving: bool = False  # asked to leave at the next commit (a planned leave)


@dataclass(kw_only=True)
class CoordinatorState:
    options: CoordinatorOptions
    status: str = FORMING
    epoch: int = 0
    live: tuple[int, ...] = ()
    step: int = 0
    committed_step: int = -1
    committed_writer: int = -1  # who writes committed_step's records (named at its commit)
    # The first committed step whose records committed_writer must make sure of: committed_step,
    # or older when the writer of a step died or left before it reported the next step done
    # (its records may be missing: docs/metrics.md, "Who writes").
    records_from: int = 0
    # This attempt's members whose done report said their part was not finite.
    nonfinite: tuple[int, ...] = ()
    # Suspects whose ids this attempt recomputes on the others (see attempt._verify).
    verifying: tuple[int, ...] = ()
    attempt_epoch: int = 0  # the epoch in which the current attempt of `step` reduces
    attempt_members: tuple[int, ...] = ()  # live set when this attempt began (the dead stay)
    plan: dict[int, tuple[int, ...]] = field(default_factory=dict)  # the attempt's plan
    weights: dict[int, float] = field(default_factory=dict)  # weights used for `plan`
    reports: dict[int, str] = field(default_factory=dict)  # replica -> done | failed
    param_hashes: dict[int, str] = field(default_factory=dict)
    members: dict[int, Member] = field(default_factory=dict)  # latest incarnation per id
    fenced: dict[str, str] = field(default_factory=dict)  # incarnation -> evicted | left
    fingerprint: dict[str, Any] | None = None  # the run's fingerprint, pinned when it forms
    start_deadline: float = 0.0  # coordinator clock by which the run must have formed
    leaving: bool = False  # a member left cleanly: the run is winding down
    # Replicas admitted into the current epoch at a step boundary: before the step, every member
    # of the epoch takes part in the state transfer to them. Cleared at the next epoch change.
    joined: tuple[int, ...] = ()
    n_pending: int = 0  # members in state pending (kept by decide: no O(R) count per register)
    view_version: int = 0
    plan_version: int = 0  # the view_version at which plan or weights last changed
    revision: int = 0
    reason: str = "waiting for registrations"  # why the view last changed
    # Coordinator clock of the first self-suspicion since the last commit (decide), else None.
    suspect_since: float | None = None
    # This attempt's failed reports that named members they could not dial: reporter ->
    # ((named id, why), ...); and, per member judged unreachable, how many consecutive failed
    # attempts judged it so (cleared at a commit). See membership._evict_unreachable.
    unreachable: dict[int, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    unreachable_strikes: dict[int, int] = field(default_factory=dict)

    def clone(self) -> CoordinatorState:
        """A shallow copy that shares its containers with `self` (O(1)). Change a container of
        the copy only through `own(name)`, which copies it first."""
        out = copy.copy(self)
        out.__dict__["_owned"] = set()
        return out

    # One overload per container field: `own` returns that field's own type.
    @overload
    def own(self, name: Literal["plan"]) -> dict[int, tuple[int, ...]]: ...
    @overload
    def own(self, name: Literal["weights"]) -> dict[int, float]: ...
    @overload
    def own(self, name: Literal["reports", "param_hashes"]) -> dict[int, str]: ...
    @overload
    def own(self, name: Literal["members"]) -> dict[int, Member]: ...
    @overload
    def own(self, name: Literal["fenced"]) -> dict[str, str]: ...
    @overload
    def own(self, name: Literal["unreachable"]) -> dict[int, tuple[tuple[int, str], ...]]: ...
    @overload
    def own(self, name: Literal["unreachable_strikes"]) -> dict[int, int]: ...

    def own(self, name: str) -> dict[Any, Any]:
        """Container `name` of this (cloned) state, copied on its first change since the clone."""
        owned: set[str] = self.__dict__.setdefault("_owned", set())
        if name not in owned:
            setattr(self, name, dict(getattr(self, name)))
            owned.add(name)
        container: dict[Any, Any] = getattr(self, name)
        return container


_INT_KEYED = (
    "plan", "weights", "reports", "param_hashes", "members", "unreachable", "unreachable_strikes"
)  # fmt: skip
_MEMBER_FIELDS = tuple(f.name for f in fields(Member))
# What a state saved by an older version may hold that this one has no use for: the accusation
# rule's open accusations and its grace (removed: no replica ever named a suspect).
_DROPPED_FIELDS = ("accusations",)


def _record(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(obj, n) for n in names}  # no deep copy: json.dumps only reads


def state_to_json(state: CoordinatorState) -> str:
    """The whole state as one JSON document (int keys become strings)."""
    d: dict[str, Any] = {}
    for f in fields(state):
        v = getattr(state, f.name)
        if f.name == "options":
            v = asdict(v)
        elif f.name == "members":
            v = {str(k): _record(m, _MEMBER_FIELDS) for k, m in v.items()}
        elif f.name in _INT_KEYED:
            v = {str(k): (list(x) if isinstance(x, tuple) else x) for k, x in v.items()}
        elif isinstance(v, tuple):
            v = list(v)
        d[f.name] = v
    return json.dumps(d, sort_keys=True)


def state_from_json(text: str) -> CoordinatorState:
    d = json.loads(text)
    for name in _DROPPED_FIELDS:
        d.pop(name, None)
    d["options"] = options_from_stored(d["options"])
    d["members"] = {int(k): Member(**m) for k, m in d["members"].items()}
    # "holdings": the plan's key in a state saved before it was named `plan`; still read, so a
    # state kept in etcd outlives the upgrade.
    plan = d.pop("plan") if "plan" in d else d.pop("holdings")
    d["plan"] = {int(k): tuple(v) for k, v in plan.items()}
    for name in ("weights", "reports", "param_hashes", "unreachable_strikes"):
        d[name] = {int(k): v for k, v in d.get(name, {}).items()}
    d["unreachable"] = {
        int(k): tuple((int(r), why) for r, why in v) for k, v in d.get("unreachable", {}).items()
    }
    d["live"] = tuple(d["live"])
    d["attempt_members"] = tuple(d["attempt_members"])
    d["joined"] = tuple(d.get("joined", ()))
    for name in ("nonfinite", "verifying"):
        d[name] = tuple(d.get(name, ()))
    d.setdefault("plan_version", 0)
    d.setdefault("n_pending", sum(m.state == PENDING for m in d["members"].values()))
    return CoordinatorState(**d)


class StateStore(Protocol):
    """Where the coordinator keeps its state so that a restarted coordinator loses nothing."""

    def load(self) -> CoordinatorState | None: ...

    def save(self, state: CoordinatorState) -> None: ...


class InMemoryStateStore:
    """Keeps the last saved state as JSON text in this process (exercises the JSON form).

    Survives a `CoordinatorServer` restart inside one process (tests), not a process crash.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._text: str | None = None
        self.saves = 0

    def load(self) -> CoordinatorState | None:
        with self._lock:
            return None if self._text is None else state_from_json(self._text)

    def save(self, state: CoordinatorState) -> None:
        text = state_to_json(state)
        with self._lock:
            self._text = text
            self.saves += 1


# ---------------------------------------------------------------- small queries


def pending_ids(state: CoordinatorState) -> tuple[int, ...]:
    return tuple(sorted(r for r, m in state.members.items() if m.state == PENDING))


def check_member(state: CoordinatorState, replica_id: int, incarnation: str) -> tuple[str, str]:
    """("", "") for a current member, else (refusal code, reason). Code "expired": a pending
    incarnation whose lease expired before it was admitted; it is not fenced and may register
    again (same incarnation)."""
    fence = state.fenced.get(incarnation)
    if fence:
        return fence, (
            f"replica {replica_id} incarnation {incarnation} was {fence}; it is fenced forever, "
            "a new process must register with a new incarnation"
        )
    m = state.members.get(replica_id)
    if m is None or m.incarnation != incarnation:
        return "unknown", f"replica {replica_id} incarnation {incarnation} is not a member"
    if m.state == DEAD:  # only a never-admitted (pending) incarnation dies unfenced
        return "expired", (
            f"replica {replica_id} incarnation {incarnation} expired while pending; "
            "register again to wait for admission"
        )
    return "", ""


def initial_state(options: CoordinatorOptions, now: float) -> CoordinatorState:
    return CoordinatorState(options=options, start_deadline=now + options.start_deadline_s)


def resume_state(state: CoordinatorState, now: float) -> CoordinatorState:
    """A loaded state on a new clock: leases and the start deadline restart now."""
    s = state.clone()
    s.members = {r: replace(m, last_seen=now) for r, m in s.members.items()}
    s.suspect_since = None  # a time on the old clock
    if s.status == FORMING:
        s.start_deadline = now + s.options.start_deadline_s
    return s


def view_of(state: CoordinatorState) -> View:
    return View(
        epoch=state.epoch,
        live=state.live,
        step=state.step,
        plan=dict(state.plan),
        weights=dict(state.weights),
        status=state.status,
        committed_step=state.committed_step,
        attempt_epoch=state.attempt_epoch,
        pending=pending_ids(state),
        joined=state.joined,
        version=state.view_version,
        reason=state.reason,
        writer=state.committed_writer,
        records_from=state.records_from,
        discard=state.verifying,
        plan_version=state.plan_version,
    )
