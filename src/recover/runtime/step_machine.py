"""The step of docs/design.md as a state machine: one replica's part, from plan to commit.

Job: for every step, hand the caller the microbatch ids this rank must compute (the plan's share
of this replica, then any ids reassigned to it after a failure), take the snapshot of the local
sum, all-reduce a fresh copy of it over the epoch's group (the fault-tolerant collective), report
the outcome to the coordinator and wait for its decision; on a redo compute the newly held ids on
top of the kept sum and redo the reduce in the new epoch; on a commit hand back the sum over all
M ids. When the view marks joiners (admitted at this step boundary), every member first takes
part in the live state transfer to them (`recover.runtime.transfer`).

The machine depends on two small interfaces only, so it runs the same under `recover train`, a
user's script (`recover.runtime.api`) and an in-process test:
- `Work`: the replica's local sum and state (snapshot, clear, parameter hash, transfer state).
  Computing is the caller's: `run_step` is a generator that yields a `Todo` per attempt and
  resumes when the caller has added those ids' gradients to the local sum.
- `Link`: the coordinator as this rank sees it (`recover.runtime.links.SoloLink` for a replica of one
  rank, `ReplicaLink` for one of several).
Fault injection, the stall guard and event records plug in through `StepHooks` (no-ops by
default); nothing here knows the CLI's configs, the run folder or the model.

Invariants kept here:
- constant batch: the committed sum covers the M ids of the step whatever failed; a survivor never
  recomputes its own finished microbatches (it only computes `held - computed`);
- no corruption: the reduce works on a buffer made for that attempt only; after an abort the
  buffer is dropped and the local sum (never reduced in place) is the snapshot;
- agreement: every `check_every` steps the parameter hash travels with the done report and the
  coordinator stops the run on a mismatch;
- bounded waits: every call to the coordinator and every collective has a deadline.

What it must not do: decide membership or plans (the coordinator does), or apply the update (the
caller does, from the `CommittedStep` it gets back).

Size: one state machine (plan, compute, snapshot, reduce, vote, commit or redo, transfer) and the
two small interfaces it runs over.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch

from recover.coordinator.client import (
    Evicted,
    Outcome,
    QuorumLost,
    StepCommitted,
    StepRedo,
    Stopped,
)
from recover.coordinator.protocol import View
from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import CollectiveAborted, ShouldAbort
from recover.runtime.grads import GradientSum
from recover.runtime.group_cache import GroupCache
from recover.runtime.links import replica_hash
from recover.runtime.overlap import BucketPlan, EarlyReduce, GradHooks, StepReduce, step_buckets
from recover.runtime.transfer import transfer_state
from recover.runtime.tree_sum import TreeSum, ordered_reduce, set_determinism_switches
from recover.runtime.update_guard import all_finite


class DivergedError(RuntimeError):
    """Replicas hold different parameters: the run stopped; investigate, then resume."""


class Work(Protocol):
    """What the step machine needs of the replica's model side (this rank's part of it)."""

    def snapshot(self, device: torch.device | str | None = None) -> torch.Tensor:
        """A fresh flat fp32 copy of the local gradient sum, with the loss sum in its last slot,
        on `device` (None: where the gradients are)."""

    def clear(self) -> None:
        """Drop the local sum (the shrink baseline discards a failed attempt's work)."""

    def parameter_hash(self) -> str:
        """An exact fingerprint of this rank's parameters."""

    def nonfinite_ids(self) -> list[int]:
        """Ids of the step (computed here) whose loss was not finite."""

    def transfer_state_dict(self) -> dict[str, Any]:
        """The committed state a joiner receives (this rank's part of it)."""

    def load_transfer_state(self, state: dict[str, Any]) -> None:
        """Load what transfer_state_dict() of a live replica gave."""

    def overlap_grads(self) -> GradientSum | None:
        """The local sum when its `p.grad` may be followed by hooks, so that the step's reduce
        starts during the last backward pass (recover.runtime.overlap; the Work counts each
        microbatch with `GradientSum.add_loss` after its pass); None where it cannot be."""


class PendingVote(Protocol):
    """A done report sent, its answer read when asked (links.SoloVote, links.Answered)."""

    def wait_taken(self) -> None: ...  # until the report is on record, or the vote failed
    def may_commit(self) -> bool: ...  # False once what arrived says it will not commit
    def result(self) -> tuple[bool, Outcome]: ...  # the answer, or the vote's error raised


class Link(Protocol):
    """The coordinator as one rank of a replica sees it (see recover.runtime.links)."""

    @property
    def rank(self) -> int: ...  # this process's rank in its replica

    def register(
        self, *, fingerprint: dict[str, Any], next_step: int, deadline_s: float
    ) -> View: ...
    def step_view(self) -> View | None: ...  # None: before the registration
    def live_view(self) -> View | None: ...
    def report(
        self, *, step: int, epoch: int, failure: str | None, param_hash: str | None,
        throughput: float | None, leaving: bool = False, finite: bool = True,
        unreachable: dict[int, str] | None = None, deadline_s: float,
        on_taken: Callable[[], None] = ...,
    ) -> tuple[bool, Outcome]: ...  # fmt: skip
    def start_done(
        self, *, step: int, epoch: int, param_hash: str | None, throughput: float | None,
        leaving: bool = False, finite: bool = True, deadline_s: float,
        on_taken: Callable[[], None] = ...,
    ) -> PendingVote: ...  # fmt: skip
    def agree(self, ok: bool) -> bool: ...
    def gather(self, obj: Any) -> list[Any]: ...
    def leave(self, *, step: int) -> None: ...
    def close(self) -> None: ...

    @property
    def evicted(self) -> bool: ...

    @property
    def coordinator_lost(self) -> str | None: ...  # why none answered for the grace, or None

    @property
    def store_address(self) -> tuple[str, int] | None: ...


def _no_phase(phase: str, step: int, index: int | None) -> None:
    return None


def _no_event(name: str, **fields: Any) -> None:
    return None


class _Unwatched:
    """A stall guard that watches nothing (the default)."""

    def tick(self) -> None:
        return None

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class StepHooks:
    """Where the rest of the system plugs in. `phase(name, step, index)` is called at the declared
    points "transfer", "overlap" (during the last backward pass, once the step's reduce has
    started its first bucket), "reduce" (while the collective is in flight) and "commit" (after
    reporting done); `event(name, **fields)` records what happened; `guard` (recover.runtime.stall.StallGuard)
    watches the stretches that must make progress; `before_done()` runs before this rank reports a
    successful reduce (the writer of the last step finishes its records there: a writer that
    reported the next step has written everything of its own, which the coordinator relies on);
    `leaving()` says whether this replica asks to leave at the boundary of the step it reports
    (the same answer on every rank of the replica: agreed at the last boundary)."""

    phase: Callable[[str, int, int | None], None] = _no_phase
    event: Callable[..., None] = _no_event
    guard: Any = field(default_factory=_Unwatched)
    before_done: Callable[[], None] = lambda: None
    leaving: Callable[[], bool] = lambda: False
    # apply_early(step, reduced, count, finite) -> undo: apply the update of a step whose reduce
    # succeeded while the vote completes (from the moment this rank's done report is sent; a
    # fault declared in it waits for the report to be on record: StepMachine.wait_on_record),
    # and give back how to undo it. The commit then comes with `applied`; any other outcome runs the undo
    # first (a redo, a stop). Replicas of one rank only (a replica of several would have to
    # agree on it); None: the caller applies after the commit.
    apply_early: Callable[[int, torch.Tensor, int, bool], Callable[[], None]] | None = None
    # ahead(step, ids) -> bool: compute these microbatch ids of the next step `step` into the
    # local sum, which the update applied during the vote left empty (a replica of one rank, with
    # apply_early), numbered from 0 among the ids this rank computes in that step; False: it
    # declined (`step` is past the run's last). Runs while the vote is still in flight; a commit
    # keeps the work for the next step when its plan gives this rank those ids, any other
    # outcome drops it with the undo of the update (docs/design.md, "The next step's first
    # microbatch during the vote"). None: no work ahead.
    ahead: Callable[[int, tuple[int, ...]], bool] | None = None


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    replica_id: int
    check_every: int = 50  # compare parameter hashes across replicas every N steps (0: never)
    outcome_timeout_s: float = 120.0  # longest wait for the coordinator's decision on a step
    # The shrink baseline (torchft's semantics): a redo discards the local sum, and the committed
    # step averages what was computed. Never for real training.
    discard_on_redo: bool = False
    # The deterministic mode (recover.runtime.tree_sum): every microbatch's gradient is its own
    # leaf of a tree fixed by M, and the reduce forms the tree's root, so that the committed sum
    # is the same bits whatever the plan (failures, joins, replica count). Replicas of one rank.
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.replica_id < 0:
            raise ValueError(f"replica_id must be >= 0, got {self.replica_id}")
        if self.check_every < 0:
            raise ValueError(f"check_every must be >= 0, got {self.check_every}")
        if not self.outcome_timeout_s > 0:
            raise ValueError(f"outcome_timeout_s must be > 0, got {self.outcome_timeout_s}")


@dataclass(frozen=True)
class Todo:
    """What the caller computes in one attempt: `ids` of `step`, numbered from `first_index` among
    the ids this rank computed in the step (a fault may target "the K-th microbatch")."""

    step: int
    ids: tuple[int, ...]
    first_index: int


@dataclass(frozen=True)
class CommittedStep:
    """A step the coordinator committed, as this rank hands it to the optimizer."""

    step: int
    reduced: (
        torch.Tensor
    )  # the flat sum over the step's ids of every replica (Work.snapshot layout)
    count: int  # microbatches in the sum: M (fewer only in the shrink baseline)
    epoch: int
    shares: dict[int, int]  # microbatches each replica held in the committing attempt
    attempts: int
    recovered_s: float | None  # seconds from this rank's first sight of a failure, if any
    writer: bool  # this replica writes the step's records (the lowest live one at the commit)
    # Where this rank's time in the step went, in seconds over all its attempts (PARTS; the
    # optimizer step and the records come after the commit, the caller's to time).
    parts: dict[str, float] = field(default_factory=dict)
    # The update was applied already (StepHooks.apply_early), while the vote completed.
    applied: bool = False
    # The share of the committing attempt's buffer whose reduce started during the last backward
    # pass (recover.runtime.overlap): 0 where the reduce started after the compute.
    overlapped: float = 0.0
    # Microbatch ids of this step that this rank computed during the previous step's vote
    # (StepHooks.ahead) and kept in its sum; () where none were.
    ahead: tuple[int, ...] = ()
    # This replica asked to leave (StepHooks.leaving) and the commit released it: it is out of
    # the next step's plan, and leaves now.
    released: bool = False
    # The writer makes sure that the steps from here to `step` are recorded: below `step` when a
    # previous writer died or left before its records were known written (it writes what is
    # missing; docs/metrics.md).
    records_from: int = -1
    # Every value of the sum is finite (the same answer on every rank of every replica: they
    # hold the same sums). A non-finite step must not be applied: its update would poison the
    # parameters of every replica at once.
    finite: bool = True


@dataclass
class StepAttempt:
    """The record of one step in progress: which ids are in the local sum, and its timings."""

    step: int
    computed: set[int] = field(default_factory=set)
    redos: int = 0
    t_first_fault: float | None = None
    failure: str | None = None  # why this rank's part of the current attempt failed
    # The attempt's members this rank could not dial when its group would not form: id -> why.
    unreachable: dict[int, str] = field(default_factory=dict)
    compute_s: float = 0.0  # seconds spent computing this replica's microbatches of the step
    parts: dict[str, float] = field(default_factory=dict)  # seconds by part (PARTS), all attempts
    sum_finite: bool = True  # the last successful reduce's sum is finite (on this rank)
    overlapped: float = 0.0  # StepReduce.early_share() of the last attempt's reduce
    tree: TreeSum | None = None  # the deterministic mode's local sum (p.grad stays empty)
    nonfinite: list[int] = field(default_factory=list)  # the tree's ids with a non-finite loss
    ahead: tuple[int, ...] = ()  # ids of the step computed during the previous step's vote

    def throughput(self) -> float | None:
        """Microbatches per second over the step so far; None before any was computed."""
        return len(self.computed) / self.compute_s if self.computed and self.compute_s > 0 else None


@dataclass(frozen=True)
class Ahead:
    """Work of step `step` done during the previous step's vote (StepHooks.ahead): `ids` are in
    the local sum, computed in `seconds`."""

    step: int
    ids: tuple[int, ...]
    seconds: float


class StepMachine:
    """The step state machine of one rank of a replica (see the module docstring)."""

    def __init__(
        self,
        *,
        work: Work,
        link: Link,
        groups: GroupCache,
        options: StepOptions,
        hooks: StepHooks | None = None,
        has_state: bool = True,
    ) -> None:
        self.work, self.link, self.groups, self.options = work, link, groups, options
        self.hooks = hooks or StepHooks()
        self.has_state = has_state  # False for a joiner until the state transfer has reached it
        self._transferred_epoch = -1
        self._numel: int | None = None  # a flat buffer's length (the deterministic reduce's)
        self._buckets: BucketPlan | None = None  # the step buffer's buckets (built at first use)
        self._grad_hooks: GradHooks | None = None  # the overlapped reduce's (registered once)
        self._ahead: Ahead | None = None  # the next step's work done during the last vote
        self._vote: PendingVote | None = None  # the vote in flight while an update applies
        if options.deterministic:
            set_determinism_switches()

    @property
    def me(self) -> int:
        return self.options.replica_id

    def replica_hash(self) -> str:
        """The parameter fingerprint of the whole replica (a collective with several ranks)."""
        return replica_hash(self.link.gather(self.work.parameter_hash()))

    def run(self, step: int, compute: Callable[[Todo], None]) -> CommittedStep:
        """Run step `step` to its commit, computing each attempt's ids with `compute`."""
        attempts = self.run_step(step)
        try:
            todo = next(attempts)
            while True:
                compute(todo)
                try:
                    todo = attempts.send(None)
                except StopIteration as done:
                    committed: CommittedStep = done.value  # (run_step's return value)
                    return committed
        finally:
            attempts.close()  # left mid-attempt: run_step drops what it started

    def _view(self) -> View:
        """The view of the step in progress: the step machine runs once the replica registered."""
        view = self.link.step_view()
        if view is None:
            raise RuntimeError("the step machine runs only after the replica registered")
        return view

    def run_step(self, step: int) -> Generator[Todo, None, CommittedStep]:
        """Run step `step` until it commits: yields one `Todo` per attempt (possibly with no ids;
        in the deterministic mode one per id, or one without ids) and resumes when the caller has
        added their gradients to the local sum; returns the commit. The recovery loop lives
        here."""
        attempt = StepAttempt(step=step)
        view = self._view()
        hooks = self.hooks
        self._take_ahead(view, step, attempt)
        while True:
            if view.status in ("quorum_lost", "diverged", "finished"):
                _stop(view.status, view.reason)
            epoch = view.attempt_epoch
            reduced: torch.Tensor | None = None
            attempt.failure, attempt.unreachable = None, {}
            transferred = self._transfer_if_needed(view, step, attempt)
            if view.joined:  # every rank of the replica goes on only if all of them got it
                transferred = self.link.agree(transferred)
            if transferred:
                todo = [j for j in view.plan.get(self.me, ()) if j not in attempt.computed]
                early = self._early_reduce(view, step, len(todo))
                t0 = time.perf_counter()
                try:
                    with hooks.guard.busy("computing microbatches"):
                        # Deterministic: one leaf per id, so a Todo per id. An empty share still
                        # yields its one empty Todo (every attempt yields at least once: a plan
                        # may give a straggler no id, and the caller's loop starts with next()).
                        if self.options.deterministic and todo:
                            for i, j in enumerate(sorted(todo), start=len(attempt.computed)):
                                yield Todo(step=step, ids=(j,), first_index=i)
                                self._add_leaf(attempt, view, j)
                        else:
                            first = len(attempt.computed)
                            yield Todo(step=step, ids=tuple(todo), first_index=first)
                except BaseException:  # the caller left the attempt (a stop, an error)
                    if early is not None:
                        early.drop(f"step {step} was left during its compute")
                    raise
                attempt.computed.update(todo)
                t1 = time.perf_counter()
                _add(attempt, "compute", t1 - t0)
                if todo:  # reported with `done`: feeds the coordinator's throughput-aware plans
                    attempt.compute_s += t1 - t0
                if self.options.deterministic:
                    reduced = self._reduce_ordered(view, step, attempt)
                    _add(attempt, "reduce", time.perf_counter() - t1)
                else:
                    # The attempt's one buffer: a copy of the local sum (p.grad, never reduced)
                    # made where the cross-replica group reduces it, in place; its first buckets
                    # may be in flight already (started during the last backward pass).
                    if early is not None:
                        step_reduce: StepReduce = early
                        early.finish()
                    else:
                        buffer = self.work.snapshot(self.groups.device)
                        step_reduce = StepReduce(buffer, self._reduce_order(buffer.numel()))
                    t2 = time.perf_counter()
                    _add(attempt, "snapshot", t2 - t1)
                    reduced = self._reduce(step_reduce, view, step, attempt)
                    attempt.overlapped = step_reduce.early_share()
                    _add(attempt, "reduce", time.perf_counter() - t2)
            t3 = time.perf_counter()
            check = reduced is not None and self.options.check_every
            check = check and step % self.options.check_every == 0
            phash = self.work.parameter_hash() if check else None
            failure = None if reduced is not None else attempt.failure or "a replica-mate failed"
            part_finite = True
            if reduced is not None:  # (failure is None)
                part_finite = self._part_finite(step, reduced, attempt)
                hooks.before_done()
            t4 = time.perf_counter()
            _add(attempt, "check", t4 - t3)
            # One round trip: the report, answered with the attempt's outcome. The "commit"
            # point is between the two: this replica's done report is on record.
            on_record = functools.partial(hooks.phase, "commit", step, None)
            undo: Callable[[], None] | None = None
            applying_s = 0.0
            ahead: Ahead | None = None
            if reduced is not None and hooks.apply_early is not None:
                vote = self.link.start_done(
                    step=step, epoch=epoch, param_hash=phash, throughput=attempt.throughput(),
                    leaving=hooks.leaving(), finite=part_finite,
                    deadline_s=self.options.outcome_timeout_s, on_taken=on_record,
                )  # fmt: skip
                apply = functools.partial(
                    hooks.apply_early, step, reduced,
                    sum(len(ids) for ids in view.plan.values()), attempt.sum_finite,
                )  # fmt: skip
                agreed, outcome, undo, applying_s, ahead = self._vote_applying(
                    vote, apply, self._work_ahead(view, step)
                )
            else:
                agreed, outcome = self.link.report(
                    step=step, epoch=epoch, failure=failure, param_hash=phash,
                    throughput=attempt.throughput(), leaving=hooks.leaving(),
                    finite=part_finite, unreachable=attempt.unreachable,
                    deadline_s=self.options.outcome_timeout_s, on_taken=on_record,
                )  # fmt: skip
            if ahead is not None:  # (the next step's compute, done during this vote)
                _add(attempt, "ahead", ahead.seconds)
            # (the vote's time not hidden behind an update applied, or work done, meanwhile)
            _add(attempt, "vote", time.perf_counter() - t4 - applying_s - _seconds(ahead))
            if not agreed:
                reduced = None  # some rank of this replica failed: nobody's result counts
            if isinstance(outcome, StepCommitted):
                if reduced is None:
                    raise RuntimeError(
                        f"step {step} committed although this replica's reduce failed"
                    )
                finite = self.link.agree(attempt.sum_finite)  # every rank checked its part
                self._ahead = ahead  # (its ids are in the local sum: the next step's start)
                return self._committed(
                    step, view, epoch, reduced, attempt, finite, applied=undo is not None
                )
            if undo is not None:  # the update applied during the vote never happened (and the
                undo()  # local sum is this step's again: the work ahead is dropped with it)
            if ahead is not None:
                hooks.event(
                    "ahead_dropped", replica=self.me, step=ahead.step, ids=list(ahead.ids),
                    reason=f"step {step} was not committed in epoch {epoch}",
                )  # fmt: skip
            if isinstance(outcome, StepRedo):
                # The local sum (p.grad) was never touched by the reduce: it is the snapshot.
                # Dropped: the shrink baseline's in-flight step; or this replica's part, not finite
                # where the others' was (the others recompute its ids in this attempt).
                if self.options.discard_on_redo or self.me in outcome.view.discard:
                    self.work.clear()
                    attempt.computed.clear()
                    attempt.compute_s = 0.0
                    attempt.tree, attempt.nonfinite = None, []
                if attempt.t_first_fault is None:
                    attempt.t_first_fault = time.perf_counter()
                attempt.redos += 1
                view = outcome.view
                continue
            if isinstance(outcome, Stopped):
                _stop(outcome.status, outcome.reason)
            raise RuntimeError(f"unexpected outcome {outcome!r}")

    def _vote_applying(
        self,
        vote: PendingVote,
        apply: Callable[[], Callable[[], None]],
        ahead: Callable[[], Ahead | None] | None = None,
    ) -> tuple[bool, Outcome, Callable[[], None] | None, float, Ahead | None]:
        """The vote with the update applied while it completes (StepHooks.apply_early): the
        done report is sent (`vote`), and at once `apply()` runs and gives the undo of what it
        did (a declared fault inside it waits until this replica's done is on record:
        `wait_on_record`); then, unless what has arrived of the answer says the step will not
        commit, `ahead()` computes the next step's first microbatch into the local sum, emptied
        first (StepHooks.ahead); then the answer is read. All on this thread: the answer waits
        in the connection meanwhile (a helper thread that waited for it cost 0.32-0.36 ms of CPU
        a replica-step on 2 shared cores, 1.5% of a small script's job).
        (The update waited for the done to be on record before: 1.5-2.5 ms of every step, the
        round trip to the coordinator, on 2 shared cores.) Returns the vote's answer, the undo
        (None: nothing was applied), the apply's seconds and the work ahead (None: none). The
        undo puts the step's local sum back, which drops the work ahead too. A vote that raises
        (quorum lost, evicted, the coordinator lost) undoes the update before the raise, so the
        model holds the last committed state."""
        undo: Callable[[], None] | None = None
        applying_s = 0.0
        done_ahead: Ahead | None = None
        self._vote = vote
        try:
            t0 = time.perf_counter()
            undo = apply()
            applying_s = time.perf_counter() - t0
            if ahead is not None and vote.may_commit():
                done_ahead = ahead()
        except BaseException:  # (the update or the work ahead raised: neither happened)
            self._vote = None
            try:  # (what the answer says no longer matters: read, so that the link is free;
                with contextlib.suppress(Exception):  # the update's own error is raised)
                    vote.result()
            finally:
                if undo is not None:
                    undo()
            raise
        self._vote = None
        try:
            agreed, outcome = vote.result()
        except BaseException:
            if undo is not None:
                undo()
            raise
        return agreed, outcome, undo, applying_s, done_ahead

    def _work_ahead(self, view: View, step: int) -> Callable[[], Ahead | None] | None:
        """What to compute of step `step + 1` during this step's vote (StepHooks.ahead): the
        middle id of this rank's share of the committing attempt's plan, the id most likely to
        be this rank's in the next step's plan too (shares are contiguous runs of ids that
        move by a few ids at their ends when the coordinator rebalances). None: no work ahead
        (no hook, the deterministic mode, or a share of fewer than 2 ids: the step's own
        compute keeps a microbatch, whose backward pass the reduce overlaps; a replica that
        holds one id is not the one the others wait for)."""
        hook = self.hooks.ahead
        mine = sorted(view.plan.get(self.me, ()))
        if hook is None or self.options.deterministic or len(mine) < 2:
            return None
        ids = (mine[len(mine) // 2],)

        def work() -> Ahead | None:
            t0 = time.perf_counter()
            # From an empty local sum: the update's undo puts the step's own back by reference
            # (whatever .grad tensors the update left, the work ahead must not add into them).
            self.work.clear()
            with self.hooks.guard.busy("computing the next step's first microbatch"):
                if not hook(step + 1, ids):
                    return None
            return Ahead(step=step + 1, ids=ids, seconds=time.perf_counter() - t0)

        return work

    def wait_on_record(self) -> None:
        """During a vote with an early update (`_vote_applying`): wait until this replica's
        done report is on record at the coordinator (or the vote ended), so that a fault
        declared in the update acts at the point it names; at once elsewhere."""
        vote = self._vote
        if vote is not None:
            vote.wait_taken()

    def holds_ahead(self, step: int) -> bool:
        """Whether the local sum holds work of step `step` done during the last vote (kept
        or dropped when the step starts, by its plan)."""
        return self._ahead is not None and self._ahead.step == step

    def _take_ahead(self, view: View, step: int, attempt: StepAttempt) -> None:
        """At the start of step `step`: keep the work done ahead during the last vote as the
        step's first computed ids where its plan gives them to this rank, else drop it (the
        local sum is emptied: it held only that work)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        held = set(view.plan.get(self.me, ())) if view.status == "running" else set()
        if ahead.step == step and set(ahead.ids) <= held:
            attempt.computed.update(ahead.ids)
            attempt.compute_s += ahead.seconds
            attempt.ahead = ahead.ids
            return
        self.work.clear()
        self.hooks.event(
            "ahead_dropped", replica=self.me, step=step, ids=list(ahead.ids),
            reason="the step's plan gives this replica other ids",
        )  # fmt: skip

    def _part_finite(self, step: int, reduced: torch.Tensor, attempt: StepAttempt) -> bool:
        """Whether this rank's own part of the attempt's sum is finite (reported with `done`, so
        that the coordinator can tell the replicas' parts apart). One pass over the reduced sum;
        only when it is not finite, one over a fresh copy of the local sum. A non-finite part
        names what this
        rank contributed: the ids whose loss was not finite, or, when every loss was finite, its
        ids of the step (its local gradient sum was not)."""
        attempt.sum_finite = all_finite([reduced])
        if attempt.sum_finite or self._local_finite(attempt, reduced.device):
            return True
        bad = attempt.nonfinite if self.options.deterministic else self.work.nonfinite_ids()
        self.hooks.event(
            "nonfinite_microbatches", replica=self.me, rank=self.link.rank, step=step,
            ids=sorted(bad) if bad else sorted(attempt.computed),
            what="loss" if bad else "gradient",
        )  # fmt: skip
        return False

    def _local_finite(self, attempt: StepAttempt, device: torch.device) -> bool:
        """Whether this rank's local sum is finite (the tree's nodes in the deterministic mode)."""
        if self.options.deterministic:
            nodes = attempt.tree.nodes.values() if attempt.tree is not None else ()
            return all_finite(nodes)
        return all_finite([self.work.snapshot(device)])

    def _add_leaf(self, attempt: StepAttempt, view: View, j: int) -> None:
        """Move microbatch j's gradient (what the caller added to the local sum since the last
        leaf) into the attempt's tree, and empty the local sum for the next id."""
        if attempt.tree is None:
            attempt.tree = TreeSum(_step_size(view))
        attempt.nonfinite.extend(self.work.nonfinite_ids())
        leaf = self.work.snapshot()
        self.work.clear()
        attempt.tree.add_leaf(j, leaf)

    def _reduce_ordered(self, view: View, step: int, attempt: StepAttempt) -> torch.Tensor | None:
        """The deterministic reduce: the root of the tree over the attempt's plan, in a fresh
        buffer (the attempt's tree is never touched); None if it aborted."""
        epoch = view.attempt_epoch
        should_abort = self._should_abort(epoch)
        should_abort_reduce = self._with_fault("reduce", step, should_abort)
        t0 = time.perf_counter()
        mine = set(view.plan.get(self.me, ()))
        tree = attempt.tree if attempt.tree is not None else TreeSum(_step_size(view))
        if tree.ids() != mine:  # a bug, not a fault: the sum would miss or repeat ids
            raise RuntimeError(
                f"step {step}: the local tree holds ids {sorted(tree.ids())}, the plan gives "
                f"this replica {sorted(mine)}"
            )
        try:
            with self.hooks.guard.busy("in the cross-replica reduce"):
                group, members = self._group(view, should_abort)
                if len(members) == 1:
                    should_abort_reduce()
                    return tree.root().clone().to(self.groups.device)
                if self._numel is None:
                    nodes = list(tree.nodes.values())
                    self._numel = nodes[0].numel() if nodes else self.work.snapshot().numel()
                plan = [view.plan[m] for m in members]
                return ordered_reduce(
                    group, tree, plan, numel=self._numel, should_abort=should_abort_reduce
                )
        except CollectiveAborted as e:
            self._failed(step, epoch, e, t0, "reduce", attempt, view)
            return None

    def _committed(
        self,
        step: int,
        view: View,
        epoch: int,
        reduced: torch.Tensor,
        attempt: StepAttempt,
        finite: bool,
        *,
        applied: bool = False,
    ) -> CommittedStep:
        recovered = None
        if attempt.t_first_fault is not None:
            recovered = time.perf_counter() - attempt.t_first_fault
        latest = self._view()
        named = latest.committed_step == step and latest.records_from >= 0
        return CommittedStep(
            step=step,
            reduced=reduced,
            count=sum(len(ids) for ids in view.plan.values()),
            epoch=epoch,
            shares={r: len(ids) for r, ids in sorted(view.plan.items())},
            attempts=attempt.redos + 1,
            recovered_s=recovered,
            writer=self.me == _writer(step, view, latest),
            records_from=latest.records_from if named else step,
            parts={k: round(v, 6) for k, v in attempt.parts.items()},
            overlapped=round(attempt.overlapped, 4),
            applied=applied,
            ahead=attempt.ahead,
            released=named and self.me not in latest.live and latest.status == "running",
            finite=finite,
        )

    def _with_fault(self, phase: str, step: int, should_abort: ShouldAbort) -> ShouldAbort:
        """`should_abort`, plus the `phase` hook fired at its first call: while the collective
        of that phase is in flight (the callback is polled during it)."""
        fired = False

        def wrapped() -> str | None:
            nonlocal fired
            if not fired:
                fired = True
                self.hooks.phase(phase, step, None)
            return should_abort()

        return wrapped

    def _should_abort(self, epoch: int) -> ShouldAbort:
        link, guard = self.link, self.hooks.guard

        def should_abort() -> str | None:
            guard.tick()  # polled all along an in-flight collective: progress
            if link.evicted:
                return "this replica was evicted"
            lost = link.coordinator_lost
            if lost:  # nothing in flight may outlive the grace (the coordinator-lost bounds)
                return f"the coordinator is lost: {lost}"
            newer = link.live_view()
            if newer is None:  # (not registered: nothing is in flight)
                return None
            if newer.epoch > epoch or newer.status != "running":
                return f"epoch {newer.epoch} announced ({newer.reason})"
            return None

        return should_abort

    def _group(self, view: View, should_abort: ShouldAbort) -> tuple[EpochGroup, list[int]]:
        # The attempt's members are its plan's keys (the view's live set can
        # already lack one that died during the attempt).
        members = sorted(view.plan)
        group = self.groups.get(
            epoch=view.attempt_epoch,
            rank=members.index(self.me),
            world_size=len(members),
            should_abort=should_abort,
        )
        return group, members

    def _failed(
        self, step: int, epoch: int, error: CollectiveAborted, t0: float, what: str,
        attempt: StepAttempt, view: View,
    ) -> None:  # fmt: skip
        if attempt.t_first_fault is None:
            attempt.t_first_fault = t0
        self.hooks.event(
            "failure_detected", replica=self.me, step=step, epoch=epoch, how=error.kind,
            during=what, detail=str(error.detail)[:200],
            after_s=round(time.perf_counter() - t0, 4),
        )  # fmt: skip
        # gloo's text ends in advice for its own users; the first sentence is the fact.
        detail = str(error.detail).split(". This is typically")[0]
        attempt.failure = f"{what}: {error.kind}: {detail}"[:200]  # reported by run_step
        # Ranks of the attempt's group -> replica ids (the group's ranks are the plan's sorted
        # keys): the peers this rank could not dial, for the coordinator to judge.
        members = sorted(view.plan)
        attempt.unreachable = {members[k]: why for k, why in error.unreachable.items()}

    def _transfer_if_needed(self, view: View, step: int, attempt: StepAttempt) -> bool:
        """Take part in the state transfer to this epoch's joiners; False if it failed."""
        epoch = view.attempt_epoch
        joined = [r for r in view.joined if r in view.plan]
        if not self.has_state and self.me not in joined:
            raise RuntimeError(f"replica {self.me} joined but the view no longer offers it state")
        if not joined or self._transferred_epoch == epoch:
            return True
        t0 = time.perf_counter()
        should_abort = self._should_abort(epoch)
        try:
            group, members = self._group(view, should_abort)
            stats = transfer_state(
                group, self.work, members=members, joined=joined, me=self.me,
                should_abort=self._with_fault("transfer", step, should_abort),
            )  # fmt: skip
        except CollectiveAborted as e:
            self._failed(step, epoch, e, t0, "state transfer", attempt, view)
            return False
        finally:
            _add(attempt, "transfer", time.perf_counter() - t0)
        self._transferred_epoch = epoch
        self.has_state = True
        if self.me in joined:
            self.hooks.event(
                "state_transfer", replica=self.me, rank=self.link.rank, step=step, epoch=epoch,
                source=stats.source, sources=list(stats.sources),
                bytes=stats.bytes, seconds=round(stats.seconds, 4),
                header_s=round(stats.header_s, 4), load_s=round(stats.load_s, 4),
            )  # fmt: skip
        elif stats.sent:
            self.hooks.event(
                "state_served", replica=self.me, rank=self.link.rank, step=step, epoch=epoch,
                sent=stats.sent, seconds=round(stats.seconds, 4),
                prepare_s=round(stats.prepare_s, 4),
            )  # fmt: skip
        return True

    def _reduce_order(self, numel: int) -> list[tuple[int, int]]:
        """The buckets of a buffer reduced after the compute: the same as where they start
        during it (whole parameters, where the Work's gradients can be followed: the same on
        every rank of a run), so that every rank issues the same sizes in the same order."""
        grads = self.work.overlap_grads()
        if grads is not None:
            return self._bucket_plan(grads).order
        return step_buckets(numel, self.groups.config.step_bucket_bytes)

    def _bucket_plan(self, grads: GradientSum) -> BucketPlan:
        if self._buckets is None:
            self._buckets = BucketPlan(grads, self.groups.config.step_bucket_bytes)
        return self._buckets

    def _early_reduce(self, view: View, step: int, microbatches: int) -> EarlyReduce | None:
        """The attempt's reduce, armed to start its buckets during the last backward pass, where
        that can be (recover.runtime.overlap): the Work's gradients can be followed, the
        attempt's group is built already (this epoch's earlier attempts built it), and it is a
        gloo group of several replicas. None: every bucket starts after the compute."""
        grads = self.work.overlap_grads()
        if grads is None or self.options.deterministic or microbatches == 0:
            return None
        group = self.groups.current
        members = sorted(view.plan)
        if (
            group is None
            or group.poisoned is not None
            or group.device.type != "cpu"
            or group.epoch != view.attempt_epoch
            or len(members) < 2
            or self.me not in members
            or (group.rank, group.world_size) != (members.index(self.me), len(members))
        ):
            return None
        if self._grad_hooks is None:
            self._grad_hooks = GradHooks(grads)
        return EarlyReduce(
            grads, self._bucket_plan(grads), group, microbatches=microbatches,
            on_start=lambda: self.hooks.phase("overlap", step, None), hooks=self._grad_hooks,
        )  # fmt: skip

    def close(self) -> None:
        """The end of the run on this replica: the overlapped reduce's hooks leave the parameters
        (idempotent)."""
        if self._grad_hooks is not None:
            self._grad_hooks.remove()
            self._grad_hooks = None

    def _reduce(
        self, step_reduce: StepReduce, view: View, step: int, attempt: StepAttempt
    ) -> torch.Tensor | None:
        """All-reduce the attempt's buffer in place in its epoch, bucket by bucket in the step's
        order (some may have started during the compute); None if it aborted (the buffer is
        then dropped: what it holds is unusable)."""
        epoch = view.attempt_epoch
        should_abort = self._should_abort(epoch)
        should_abort_reduce = self._with_fault("reduce", step, should_abort)
        t0 = time.perf_counter()
        buffer = step_reduce.buffer
        try:
            with self.hooks.guard.busy("in the cross-replica reduce"):  # its polls are the ticks
                group, members = self._group(view, should_abort)
                if len(members) > 1:
                    group.finish_allreduce(
                        buffer, issue_rest=lambda: step_reduce.start_rest(group),
                        should_abort=should_abort_reduce,
                    )  # fmt: skip
                else:
                    should_abort_reduce()
            return buffer
        except CollectiveAborted as e:
            self._failed(step, epoch, e, t0, "reduce", attempt, view)
            return None


# The parts of a step on one rank, in the order they happen (CommittedStep.parts):
# transfer  receiving or serving the state of a joiner (only in a step that admits one);
# compute   the forward and backward passes of this rank's microbatches (the caller's work);
# snapshot  copying the local sum into the attempt's buffer for the reduce (only what the hooks
#           of the last backward pass did not copy, where the reduce overlaps it);
# reduce    the cross-replica reduce after the compute: the buckets not started during the last
#           backward pass, and the wait for all of them (and forming its group in a new epoch);
# check     the parameter hash every --check-every steps, and a part's finiteness;
# vote      the report and the coordinator's answer, the wait for the others' reports included,
#           less the time an update applied meanwhile took (StepHooks.apply_early), and less
# ahead     the next step's first microbatch, computed meanwhile (StepHooks.ahead; the next
#           step's compute is that much shorter when its plan keeps the work).
PARTS = ("transfer", "compute", "snapshot", "reduce", "check", "vote", "ahead")


def _seconds(ahead: Ahead | None) -> float:
    return ahead.seconds if ahead is not None else 0.0


def _add(attempt: StepAttempt, part: str, seconds: float) -> None:
    attempt.parts[part] = attempt.parts.get(part, 0.0) + seconds


def _step_size(view: View) -> int:
    """M, from an attempt's plan: it covers the ids 0..M-1, each once (constant batch,
    which the deterministic mode relies on; ValueError otherwise)."""
    ids = sorted(j for held in view.plan.values() for j in held)
    if ids != list(range(len(ids))) or not ids:
        raise ValueError(
            "the deterministic mode needs plans that cover every id of the step once "
            f"(--mode recover); this attempt's plan holds {ids[:20]}"
        )
    return len(ids)


def _writer(step: int, attempt: View, latest: View) -> int:
    """The replica that writes a committed step's records: the one the coordinator named with the
    commit (the lowest attempt member alive at the decision; every replica reads the same name
    from its view, which is at least as new as the commit). Only a coordinator that names none
    (an older one) leaves it to the replica: then the lowest member of the committing attempt,
    the same on every committing replica, since they all reduced in that attempt's group."""
    if latest.committed_step == step and latest.writer >= 0:
        return latest.writer
    return min(attempt.plan)


def _stop(status: str, reason: str) -> NoReturn:
    if status == "quorum_lost":
        raise QuorumLost(f"quorum lost: {reason}. Resume from the last checkpoint")
    if status == "diverged":
        raise DivergedError(f"REPLICAS DIVERGED, training stopped: {reason}")
    # Finished while this replica is still in a step: the run went on and ended without it (it
    # was declared dead while it was frozen, and woke after the end), so it is fenced.
    raise Evicted(f"the run finished without this replica ({reason})")


__all__ = [
    "CommittedStep",
    "DivergedError",
    "Link",
    "StepAttempt",
    "StepHooks",
    "StepMachine",
    "StepOptions",
    "Todo",
    "Work",
]
