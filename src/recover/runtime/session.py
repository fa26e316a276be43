"""A replica process's session with its job: what both drivers of the step machine share.

Job: everything between "this process is replica R of a job" and "the step loop runs", and the
ways out of that loop, written once for the two drivers: the script API (`recover.runtime.api`,
a user's own loop) and the built-in GPT trainer (`recover.training.worker`). A `ReplicaSession`

- builds the coordinator client (on a replica's first rank) and the link the replica's ranks
  share (`SoloLink` for one rank, `ReplicaLink` for several), and fences the run's record with
  the client's membership: an evicted incarnation writes nothing;
- registers (`join`) within the spec's register deadline;
- builds the cross-replica groups (one per epoch, on the coordinator's TCPStore, which a standby
  coordinator moves) and the `StepMachine` (`start`);
- turns SIGTERM and SIGINT into a stop request (`stop_on_signals`), and serves it at a step
  boundary as a planned leave (`boundary`): the first boundary after the request asks the
  coordinator to plan the next step without this replica, the next one leaves;
- names how a job stops a replica (`stop_of`): each exception the coordinator's client, the step
  machine or the record raise, with its exit status and its line. Each driver then does what is
  its own (the trainer saves a checkpoint and returns the status; the API raises for the script).
- in a script's process, turns an uncaught named stop (`end_quietly_on`) or a lost replica-mate
  (`stop_on_lost_mate`) into one line and the exit status, instead of a traceback.

What it must not do: decide anything (the coordinator does), run a step (the step machine does), or
know the model (the drivers' work objects do).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from recover import exits
from recover.coordinator.client import (
    CoordinatorClient,
    CoordinatorUnreachable,
    Evicted,
    QuorumLost,
    RequestRefused,
    View,
)
from recover.record import RecordUnwritable
from recover.runtime.env import ReplicaEnv
from recover.runtime.group_cache import GroupCache, StoreFollower
from recover.runtime.links import IntraReplica, ReplicaLink, SoloLink
from recover.runtime.step_machine import DivergedError, StepHooks, StepMachine, StepOptions

log = logging.getLogger(__name__)

# Every exception by which a job stops a replica (`ReplicaSession.stop_of` names each).
STOPS = (
    Evicted,
    QuorumLost,
    RequestRefused,
    DivergedError,
    CoordinatorUnreachable,
    RecordUnwritable,
)


@dataclass(frozen=True)
class Stop:
    """How the job stopped this replica: `kind` (evicted, finished, refused, diverged,
    coordinator_lost, quorum_lost, storage), the exit status the launcher and schedulers read
    (recover.exits), the line that says why, the error's own words (`cause`), and
    `nothing_held`: the replica joined and had not received the committed state, so it has
    nothing to save."""

    kind: str
    status: int
    line: str
    cause: str = ""
    nothing_held: bool = False


class ReplicaSession:
    """This process's part of replica `env.replica_id` in the job `env` names (see the module
    docstring). `intra`: the replica's own group when it has several ranks; `writer`: the run's
    record (a MetricsWriter), fenced by the membership when this rank holds the client."""

    def __init__(
        self, env: ReplicaEnv, *, intra: IntraReplica | None = None, writer: Any = None
    ) -> None:
        self.env, self.intra = env, intra
        self.replica_id = env.replica_id
        self.rank = intra.rank if intra is not None else 0
        host, port = env.coordinator
        self.link: SoloLink | ReplicaLink
        if intra is None:
            self.client: CoordinatorClient | None = self._connect(writer)
            self.link = SoloLink(self.client)
        else:  # the replica's first rank holds the client; the link relays it to the others
            self.client = self._connect(writer) if intra.leader else None
            self.link = ReplicaLink(
                intra, client=self.client, host=host, port=port, token=env.token,
                standbys=env.standbys,
            )  # fmt: skip
        self.machine: StepMachine | None = None
        self.groups: GroupCache | None = None
        self.stop_requested = threading.Event()  # SIGTERM/SIGINT once training runs
        # Set at the boundary where a stop was agreed: the next done report asks to leave, so
        # the coordinator plans the step after without this replica (nobody redoes anything).
        self.asked_to_leave = threading.Event()

    def _connect(self, writer: Any) -> CoordinatorClient:
        env = self.env
        host, port = env.coordinator
        client = CoordinatorClient(
            host,
            port,
            replica_id=env.replica_id,
            token=env.token,
            heartbeat_s=env.spec.heartbeat_s,
            coordinator_grace_s=env.spec.coordinator_grace_s,
            standbys=env.standbys,
        )
        if writer is not None:  # fencing: nothing from an evicted incarnation, any thread
            writer.fence = client.writes_allowed
        return client

    # ---- set-up --------------------------------------------------------------------------------
    def join(self, fingerprint: dict[str, Any], *, next_step: int) -> View:
        """Register with the job (within the spec's register deadline); the view says whether
        this replica joins a running job (`replica_id in view.joined`)."""
        return self.link.register(
            fingerprint=fingerprint,
            next_step=next_step,
            deadline_s=self.env.spec.register_timeout_s,
        )

    def start(
        self,
        work: Any,
        *,
        peer: Any,
        options: StepOptions,
        hooks: StepHooks,
        has_state: bool,
        cross_device: str = "cpu",
    ) -> StepMachine:
        """The step machine of this replica, its cross-replica groups built on the coordinator's
        store (moved by a coordinator takeover) with this process's gloo devices (`peer`). With
        several ranks per replica, the ranks at position k of every replica form the group of
        position k (HSDP's replicate dimension)."""
        link = self.link
        store = StoreFollower(lambda: link.store_address, self.env.spec.register_timeout_s)
        scope = f"position{self.rank}/" if self.intra is not None else ""
        self.groups = GroupCache(
            store, config=self.env.spec.collective(peer), scope=scope, device=cross_device
        )
        self.machine = StepMachine(
            work=work,
            link=link,
            groups=self.groups,
            options=options,
            hooks=replace(hooks, leaving=self.asked_to_leave.is_set),
            has_state=has_state,
        )
        return self.machine

    def stop_on_signals(self) -> None:
        """From now on SIGTERM (a preemption, `kill`, the launcher or agent stopping the job) and
        SIGINT mean: leave at the next step boundary with the committed state kept, instead of
        dying mid-step. (Before, nothing is committed to keep: they end the process.)"""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop_requested.set())

    # ---- the loop ------------------------------------------------------------------------------
    def confirm_member(self) -> None:
        """Before a step: a process woken after a freeze acts on no stale view before the
        coordinator confirmed it is still a member (the replica's first rank holds it)."""
        if self.client is not None:
            self.client.confirm_member()

    def boundary(self) -> bool:
        """At a step boundary before the last step: True when this replica leaves now. A stop
        request (any rank of the replica got one) is agreed by the ranks; the first boundary
        after it asks the coordinator to plan the next step without this replica (the done
        report carries it), and the replica leaves at the one after. When the coordinator keeps
        it (the last replicas, or min_replicas), it leaves all the same. A joiner that never
        received the run's state leaves at once."""
        if self.link.agree(not self.stop_requested.is_set()):
            return False
        if not self.asked_to_leave.is_set() and self.has_state:
            self.asked_to_leave.set()
            return False
        return True

    @property
    def has_state(self) -> bool:
        """This replica holds the run's committed state (a joiner: once its transfer is done)."""
        return self.machine is not None and self.machine.has_state

    def lowest_live(self) -> bool:
        """This replica is the lowest of the last view (or no view is known): the one that
        keeps the committed state when the run cannot go on."""
        view = self.link.step_view()
        live = view.live if view is not None else ()
        return not live or self.replica_id == min(live)

    def leave(self, *, step: int) -> None:
        self.link.leave(step=step)

    def close(self) -> None:
        """Stop the heartbeats, the view watcher and the replica's watchdog (idempotent)."""
        self.link.close()

    # ---- the ways out --------------------------------------------------------------------------
    def stop_of(self, error: BaseException) -> Stop:
        """How `error` (one of `STOPS`) stops this replica."""
        joiner = self.machine is not None and not self.machine.has_state
        return stop_of(error, joined_without_state=joiner)


def stop_of(error: BaseException, *, joined_without_state: bool = False) -> Stop:
    """How `error` (one of `STOPS`) stops a replica; `joined_without_state`: it joined a running
    job and had not received the committed state yet."""
    cause = str(error)
    if isinstance(error, Evicted):
        return Stop("evicted", exits.EVICTED, f"evicted by the coordinator ({cause})", cause)
    if isinstance(error, RequestRefused):
        if error.code == "finished":
            return Stop("finished", exits.OK, f"nothing to join: {cause}", cause)
        return Stop("refused", exits.REFUSED, f"refused by the coordinator: {cause}", cause)
    if isinstance(error, DivergedError):
        return Stop("diverged", exits.DIVERGED, cause, cause)
    if isinstance(error, CoordinatorUnreachable):
        line = f"the coordinator is lost: {cause}"
        return Stop("coordinator_lost", exits.COORDINATOR_LOST, line, cause)
    if isinstance(error, QuorumLost):
        if joined_without_state:
            return Stop(
                "quorum_lost", exits.QUORUM_LOST,
                f"{cause}; this replica joined and had not received the committed state: it "
                "holds nothing to save", cause, nothing_held=True,
            )  # fmt: skip
        return Stop("quorum_lost", exits.QUORUM_LOST, cause, cause)
    if isinstance(error, RecordUnwritable):
        return Stop("storage", exits.STORAGE, cause, cause)
    raise TypeError(f"not a way a job stops a replica: {error!r}")


def stop_on_lost_mate(intra: IntraReplica) -> None:
    """An uncaught error in a replica of several ranks goes to the watchdog first: a lost
    replica-mate ends the process with its status and one line, wherever it surfaced."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if isinstance(error, Exception):
            intra.on_error(error)  # exits (status 7) when a mate is lost; returns otherwise
        previous(kind, error, tb)

    sys.excepthook = hook


def end_quietly_on(kind: type[BaseException], status: int) -> None:
    """An uncaught `kind` ends the script with its message as one line and `status`, instead
    of a traceback (the script may catch it to save first; see CoordinatorLost)."""
    previous = sys.excepthook

    def hook(
        error_kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        if not isinstance(error, kind):
            previous(error_kind, error, tb)
            return
        log.error(str(error))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    sys.excepthook = hook


__all__ = ["STOPS", "ReplicaSession", "Stop", "end_quietly_on", "stop_of", "stop_on_lost_mate"]
