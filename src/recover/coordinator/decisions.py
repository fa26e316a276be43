"""The decisions that `decide()` returns: what the rules decided, each with its reason.

Job: one frozen dataclass per kind of decision (`EpochChanged`, `MemberDead`, `SuspectHardware`,
`Committed`, `Redo`, `QuorumLost`, `Reforming`, `Refused`, `Registered`, `Admitted`, `Diverged`,
`Revalidated`, `Finished`) and `Decision`, their union. Each carries a human-readable `reason`;
`to_dict()` is the JSON form the server keeps (`recover status`) and writes to the run's record
as the event `coordinator.<name>` (docs/metrics.md lists them).

Invariants: a decision is a value (frozen), made by the rules and never changed after.
Must not: decide anything or hold state; import the rules (decide.py, attempt.py and
membership.py import this module).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

__all__ = [
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
    "Reforming",
    "Refused",
    "Registered",
    "Revalidated",
]


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
