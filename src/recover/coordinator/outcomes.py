"""What a replica's call to the coordinator ends in: a step attempt's outcome, or a named error.

Job: the vocabulary that the coordinator client (client.py), its connections (channel.py) and its
session (heartbeats.py) raise and return, and that the runtime catches: `CoordinatorError` and
its subclasses, each saying what the caller does next (`Evicted`: restart the process to rejoin;
`QuorumLost`: resume from the last checkpoint; `CoordinatorUnreachable`: none answered for the
grace; `DeadlineExceeded`; `RequestRefused` with the coordinator's code), and the outcome of a
step attempt (`StepCommitted`, `StepRedo`, `Stopped`).

Invariants: plain values; an outcome is frozen; every error is a `CoordinatorError`.
Must not: import any other module of the client (they import this one), open a socket, or
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from recover.coordinator.protocol import View

__all__ = [
    "CoordinatorError",
    "CoordinatorUnreachable",
    "DeadlineExceeded",
    "Evicted",
    "Outcome",
    "QuorumLost",
    "RequestRefused",
    "StepCommitted",
    "StepRedo",
    "Stopped",
]


class CoordinatorError(RuntimeError):
    """Base class of the coordinator client's errors."""


class Evicted(CoordinatorError):
    """This incarnation was declared dead and is fenced; restart the process to rejoin."""


class CoordinatorUnreachable(CoordinatorError):
    """No coordinator answered for longer than the client's grace (`coordinator_grace_s`),
    reconnecting all along: it is gone, or frozen, and no standby took over."""


class DeadlineExceeded(CoordinatorError):
    """The awaited view or outcome did not come before the caller's deadline."""


class QuorumLost(CoordinatorError):
    """Too few replicas are live; stop and resume from the last checkpoint."""


class RequestRefused(CoordinatorError):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code


# The outcome of a step attempt, as a report or `wait_outcome` returns it to a replica (the coordinator's
# decisions behind the first two are protocol.Committed and protocol.Redo).
@dataclass(frozen=True)
class StepCommitted:
    step: int


@dataclass(frozen=True)
class StepRedo:
    step: int
    view: View  # the plan for the survivors, attempt_epoch = the epoch to reduce in


@dataclass(frozen=True)
class Stopped:
    status: str  # quorum_lost | diverged | finished
    reason: str


Outcome = StepCommitted | StepRedo | Stopped
