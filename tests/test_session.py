"""The replica session both drivers share (recover.runtime.session): how each way a job stops a
replica is named, and the planned leave at a step boundary. The drivers run the same faults through
it end to end in test_graceful (the built-in trainer) and test_api (a script): SIGTERM to one
replica, a lost coordinator, a refused joiner."""

from __future__ import annotations

import threading

import pytest

from recover import exits
from recover.coordinator.client import (
    CoordinatorUnreachable,
    Evicted,
    QuorumLost,
    RequestRefused,
)
from recover.record import RecordUnwritable
from recover.runtime.session import STOPS, ReplicaSession, stop_of
from recover.runtime.step_machine import DivergedError


@pytest.mark.parametrize(
    ("error", "kind", "status"),
    [
        (Evicted("lease expired"), "evicted", exits.EVICTED),
        (RequestRefused("finished", "the run finished"), "finished", exits.OK),
        (RequestRefused("fingerprint", "lr differs"), "refused", exits.REFUSED),
        (DivergedError("replicas hold a, b"), "diverged", exits.DIVERGED),
        (CoordinatorUnreachable("no answer for 10 s"), "coordinator_lost", exits.COORDINATOR_LOST),
        (QuorumLost("1 of 2 replicas live"), "quorum_lost", exits.QUORUM_LOST),
        (RecordUnwritable("metrics.jsonl: No space left on device"), "storage", exits.STORAGE),
    ],
)
def test_every_way_a_job_stops_a_replica_has_its_status_and_line(error, kind, status):
    assert isinstance(error, STOPS)
    stop = stop_of(error)
    assert (stop.kind, stop.status) == (kind, status)
    assert str(error) in stop.line and stop.cause == str(error)
    assert not stop.nothing_held


def test_a_joiner_without_state_is_told_it_holds_nothing_to_save():
    stop = stop_of(QuorumLost("1 of 2 replicas live"), joined_without_state=True)
    assert stop.nothing_held and "holds nothing to save" in stop.line
    with pytest.raises(TypeError):
        stop_of(ValueError("not a stop"))


class _Link:
    """A replica of one rank: agreement is its own answer."""

    def agree(self, ok: bool) -> bool:
        return ok


class _Machine:
    def __init__(self, has_state: bool) -> None:
        self.has_state = has_state


def _session(has_state: bool) -> ReplicaSession:
    session = ReplicaSession.__new__(ReplicaSession)  # no coordinator: only the boundary's rule
    session.link, session.machine = _Link(), _Machine(has_state)
    session.stop_requested, session.asked_to_leave = threading.Event(), threading.Event()
    return session


def test_a_stop_request_asks_to_leave_at_one_boundary_and_leaves_at_the_next():
    session = _session(has_state=True)
    assert not session.boundary() and not session.asked_to_leave.is_set()
    session.stop_requested.set()
    assert not session.boundary(), "it leaves before the coordinator planned without it"
    assert session.asked_to_leave.is_set()  # the next done report carries the request
    assert session.boundary()


def test_a_joiner_that_never_held_the_state_leaves_at_once():
    session = _session(has_state=False)
    session.stop_requested.set()
    assert session.boundary() and not session.asked_to_leave.is_set()
