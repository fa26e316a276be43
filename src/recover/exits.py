"""The exit statuses of a replica process, in one place (torch-free: the launcher reads them).

Every process of a run ends with one of these, so that the launcher (and an operator reading
`echo $?`) can tell a finished replica from a stopped, fenced or failed one. `RUN_FAILURES` are
the statuses that mean the run itself cannot go on; `MEANINGS` words each one for the launcher's
last line.
"""

from __future__ import annotations

OK = 0  # trained to the end (or had nothing left to join)
QUORUM_LOST = 3  # fewer than min_replicas survive: the committed state is checkpointed
EVICTED = 4  # fenced by the coordinator (it hung and came back): restart it to rejoin
DIVERGED = 5  # replicas hold different parameters (or read different data)
REFUSED = 6  # refused at registration (a fingerprint field differs, a bad token...)
MATE_LOST = 7  # a rank of a replica of several ranks lost a replica-mate (recover.runtime.links)
STALLED = 8  # the training thread made no progress (recover.runtime.stall)
NONFINITE = 9  # max_nonfinite consecutive steps were not finite (none was applied)
STOPPED = 10  # left at a step boundary when asked to stop (SIGTERM or SIGINT)
COORDINATOR_LOST = 11  # the coordinator could not be reached any more
ADDRESS = 12  # at start: the address it would advertise cannot be dialled by its peers, or an
# interface asked for does not exist (recover.addresses); nothing was registered
STORAGE = 13  # the run folder cannot be written (the disk is full, or read-only): the run stops
# rather than go on with a record that lacks what it committed (recover.record.RecordUnwritable)
FAULT_EXIT = 17  # an injected `exit` fault (recover.runtime.faults)

RUN_FAILURES = {
    QUORUM_LOST: "quorum lost",
    DIVERGED: "replicas diverged",
    NONFINITE: "steps not finite",
    STORAGE: "the run folder cannot be written",
}

MEANINGS = {
    1: "crashed (status 1; see its output)",
    EVICTED: f"was evicted by the coordinator (status {EVICTED})",
    REFUSED: f"was refused by the coordinator (status {REFUSED})",
    MATE_LOST: f"stopped on a lost replica-mate (status {MATE_LOST})",
    STALLED: f"stalled (status {STALLED})",
    STOPPED: f"left at a step boundary when asked to stop (status {STOPPED})",
    COORDINATOR_LOST: f"lost the coordinator and stopped (status {COORDINATOR_LOST})",
    ADDRESS: f"has no address its peers can dial (status {ADDRESS}; see its line)",
    STORAGE: f"could not write the run folder (status {STORAGE}: full or read-only)",
    FAULT_EXIT: f"exited by an `exit` fault (status {FAULT_EXIT})",
}
