"""The step machine in-process: replicas as threads, each with its own coordinator session, gloo
groups and model, against an in-process coordinator. No subprocess, no CLI: this tier drives
`recover.runtime.step_machine` through its two interfaces (a Work and a Link) alone.

The fault here is a replica that leaves mid-reduce by dropping its coordinator session (the
coordinator sees the connection close, as it does when a process dies) and abandoning its
in-flight collective. Real-process kills of the same machine are in test_multireplica.py and
test_api.py; this tier is for the machine's logic: the redo loop, the reassigned ids, the plan
and the writer named with the commit.
"""

from __future__ import annotations

import copy
import datetime
import threading

import pytest
import torch

from recover.coordinator import CoordinatorOptions, CoordinatorServer
from recover.coordinator.client import CoordinatorClient
from recover.runtime.collective_config import CollectiveConfig
from recover.runtime.grads import GradientSum
from recover.runtime.group_cache import GroupCache
from recover.runtime.links import Answered, SoloLink
from recover.runtime.step_machine import StepHooks, StepMachine, StepOptions

M = 6
STEPS = 5
# Buckets of two values: the model's five gradient values in three, so that the reduce can start
# during the last backward pass (gradients that fit in one bucket go in one op after it).
BUCKETS = CollectiveConfig(step_bucket_bytes=8)
_INIT = threading.Lock()


class _Gone(Exception):
    """Ends a replica's thread (the in-process stand-in for its process ending)."""


class LinearWork:
    """The step machine's Work for a tiny linear model; microbatch (step, j) is pure."""

    def __init__(self) -> None:
        with _INIT:  # the global RNG is shared by the threads: seed and draw at once
            torch.manual_seed(0)
            self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.grads = GradientSum(self.model.parameters(), device="cpu")
        self.applied: list[int] = []  # steps whose update apply_early applied ...
        self.undone: list[int] = []  # ... and undid (a redo)
        self.ahead_steps: list[int] = []  # steps whose first microbatch ran during a vote

    def loss(self, step: int, j: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + j)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
        return (self.model(x) - y).pow(2).mean()

    def compute(self, todo) -> None:
        for j in todo.ids:
            loss = self.loss(todo.step, j)
            loss.backward()
            self.grads.add_loss(j, float(loss.detach()))

    def ahead(self, step: int, ids: tuple[int, ...]) -> bool:
        """StepHooks.ahead: ids of the next step into the local sum the update emptied (none
        past the run's last step, as the trainer declines)."""
        if step >= STEPS:
            return False
        assert self.grads.counted == 0 and all(p.grad is None for p in self.model.parameters())
        self.compute(type("Todo", (), {"step": step, "ids": ids})())
        self.ahead_steps.append(step)
        return True

    def apply(self, reduced: torch.Tensor, count: int) -> None:
        self.grads.load(reduced, divide_by=count)
        self.optimizer.step()
        self.grads.clear()

    def apply_early(self, step: int, reduced: torch.Tensor, count: int, finite: bool):
        """StepHooks.apply_early: the update applied during the vote, and its undo (the state
        before it, and the local sum held by reference)."""
        assert finite
        held = self.grads.hold()
        saved = copy.deepcopy((self.model.state_dict(), self.optimizer.state_dict()))
        self.apply(reduced, count)
        self.applied.append(step)

        def undo() -> None:
            self.model.load_state_dict(saved[0])
            self.optimizer.load_state_dict(saved[1])
            self.grads.put_back(held)
            self.undone.append(step)

        return undo

    # Work
    def snapshot(self, device=None) -> torch.Tensor:
        return self.grads.snapshot(device)

    def clear(self) -> None:
        self.grads.clear()

    def parameter_hash(self) -> str:
        return self.grads.parameter_hash()

    def nonfinite_ids(self) -> list[int]:
        return []  # every loss here is finite

    def overlap_grads(self) -> GradientSum:
        return self.grads

    def transfer_state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_transfer_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def reference_parameters() -> torch.Tensor:
    """One process summing all M ids of every step: the trajectory every run must follow."""
    work = LinearWork()
    for step in range(STEPS):
        work.compute(type("Todo", (), {"step": step, "ids": range(M)})())
        work.apply(work.snapshot(), M)
    return work.grads.flat_parameters()


class _FailingReport(SoloLink):
    """A replica's link whose first report of `step` says the attempt failed, sent once `wait`
    other replicas' done reports of that step are on record (`others` is released at their
    "commit" point), so that every other replica has applied its update when the redo comes."""

    def __init__(
        self, client: CoordinatorClient, step: int, others: threading.Semaphore, wait: int
    ):
        super().__init__(client)
        self.step, self.others, self.wait = step, others, wait

    def report(self, *, step: int, failure=None, **rest):
        if step == self.step and failure is None:
            for _ in range(self.wait):
                assert self.others.acquire(timeout=20), "the others never reported done"
            self.step, failure = -1, "a replica-mate's reduce failed (injected by the test)"
        return super().report(step=step, failure=failure, **rest)

    def start_done(self, *, step: int, **rest):
        """(With an update during the vote: the same failed report, answered before the
        update applies, which the redo then undoes.)"""
        if step != self.step:
            return super().start_done(step=step, **rest)
        fields = {k: rest[k] for k in ("epoch", "param_hash", "throughput", "deadline_s")}
        return Answered(*self.report(step=step, failure=None, **fields))


def run_replica(
    r: int, server, results: dict, leave_at: tuple[int, str] | None, gate=None, det=False,
    early=False, reported=None, failing_step=None, ahead=False,
) -> None:  # fmt: skip
    """Replica r's thread: register, run STEPS steps through the machine, record each commit.
    `gate` (step, event): the others wait for the leaver at that step's compute until it has
    left, so its collective is still in flight when it goes. `early`: apply each update during
    the vote (StepHooks.apply_early). At the point "report" the replica does not leave: its
    reduce succeeded, and it reports that attempt failed (as a rank of a replica of several
    does when a replica-mate's reduce failed), once the others' done reports of that step are on
    record (`reported`: a semaphore they release at their "commit" point of `failing_step`, and
    how many they are)."""
    client = CoordinatorClient(*server.address, replica_id=r, heartbeat_s=0.05)
    link = SoloLink(client)
    if leave_at is not None and leave_at[1] == "report":
        link = _FailingReport(client, leave_at[0], *reported)
        leave_at = None
    work = LinearWork()

    def phase(name: str, step: int, index) -> None:
        if reported is not None and name == "commit" and step == failing_step and not ahead:
            reported[0].release()  # (its done report is on record: see _FailingReport)
        if leave_at == (step, name):  # drop the session, abandon the thread
            client.close()
            if gate is not None:
                gate[1].set()
            raise _Gone

    def work_ahead(step: int, ids: tuple[int, ...]) -> bool:
        computed = work.ahead(step, ids)
        others = not isinstance(link, _FailingReport)  # (the failing one waits for the others)
        if (
            others
            and reported is not None
            and failing_step is not None
            and step == failing_step + 1
        ):
            reported[0].release()  # (and its work ahead is done: the redo comes after it)
        return computed

    def compute(todo) -> None:
        phase("compute", todo.step, None)
        if gate is not None and leave_at is None and todo.step == gate[0]:
            assert gate[1].wait(20), "the leaver never left"
        work.compute(todo)

    commits = []
    try:
        view = link.register(fingerprint={"microbatches": M}, next_step=0, deadline_s=20)
        store = torch.distributed.TCPStore(
            *link.store_address, is_master=False, timeout=datetime.timedelta(seconds=20)
        )
        machine = StepMachine(
            work=work,
            link=link,
            groups=GroupCache(store, config=BUCKETS, device="cpu"),
            options=StepOptions(
                replica_id=r, check_every=2, outcome_timeout_s=20, deterministic=det
            ),
            hooks=StepHooks(
                phase=phase,
                apply_early=work.apply_early if early else None,
                ahead=work_ahead if ahead else None,
            ),  # fmt: skip
        )
        for step in range(view.step, STEPS):
            commit = machine.run(step, compute)
            assert commit.applied == early
            if not commit.applied:
                work.apply(commit.reduced, commit.count)
            commits.append(commit)
        link.leave(step=STEPS)
        results[r] = {
            "commits": commits, "params": work.grads.flat_parameters(),
            "applied": work.applied, "undone": work.undone, "ahead": work.ahead_steps,
        }  # fmt: skip
    except _Gone:
        results[r] = {"commits": commits, "gone": True}
    except Exception as e:  # reported by the test, which would otherwise see a missing result
        results[r] = e
    finally:
        link.close()


def run_job(
    replicas: int, leave_at: dict[int, tuple[int, str]], *, gate_step=None, det=False, early=False,
    ahead=False,
) -> dict:  # fmt: skip
    opts = CoordinatorOptions(
        expected_replicas=replicas, microbatches=0, lease_s=2.0, balance="equal"
    )  # equal shares: the tests name who holds which ids
    results: dict = {}
    gate = None if gate_step is None else (gate_step, threading.Event())
    failing = [at[0] for at in leave_at.values() if at[1] == "report"]
    reported = (threading.Semaphore(0), replicas - 1)  # (used where a replica's report fails)
    with CoordinatorServer(opts, store_port=0) as server:
        threads = [
            threading.Thread(
                target=run_replica,
                args=(
                    r,
                    server,
                    results,
                    leave_at.get(r),
                    gate,
                    det,
                    early,
                    reported,
                    failing[0] if failing else None,
                    ahead,
                ),
            )
            for r in range(replicas)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a replica's thread is stuck"
    return results


def check_commits(results: dict, survivors: list[int]) -> None:
    """Every step committed with all M ids on every survivor, and exactly one writer per step
    among every replica that saw its commit."""
    for r in survivors:
        commits = results[r]["commits"]
        assert [c.step for c in commits] == list(range(STEPS))
        assert all(c.count == M for c in commits), [c.count for c in commits]
    for step in range(STEPS):
        writers = [r for r in results for c in results[r]["commits"] if c.step == step and c.writer]
        assert len(writers) == 1, (step, writers)


@pytest.mark.timeout(90)
def test_three_replicas_follow_the_one_process_trajectory():
    results = run_job(3, {})
    assert all(isinstance(results.get(r), dict) for r in range(3)), results
    check_commits(results, [0, 1, 2])
    ref = reference_parameters()
    for r in range(3):
        assert torch.allclose(results[r]["params"], ref, rtol=1e-5, atol=1e-7), r
    # Each commit says where this rank's step went: its compute, the snapshot, the reduce and the
    # vote, each timed (the first step's reduce forms the group too).
    for r in range(3):
        for c in results[r]["commits"]:
            assert {"compute", "snapshot", "reduce", "check", "vote"} <= set(c.parts), c.parts
            assert all(v >= 0 for v in c.parts.values()) and c.parts["compute"] > 0, c.parts
            assert "transfer" not in c.parts  # nobody joined
    # The first step's group is built after its compute; from then on the reduce starts during
    # the last backward pass (all but the loss slot: 5 of the buffer's 6 values).
    for r in range(3):
        assert [c.overlapped for c in results[r]["commits"]] == [0.0] + [0.8333] * (STEPS - 1)


@pytest.mark.timeout(90)
def test_a_replica_leaving_mid_step_is_recomputed_by_the_survivors():
    """Replica 0 (the writer) drops out while computing step 2: the survivors redo step 2 with its
    ids reassigned, commit it with all M, and the writer of the later steps is replica 1."""
    results = run_job(3, {0: (2, "compute")})
    assert results[0].get("gone") and isinstance(results[1], dict), results
    check_commits(results, [1, 2])
    step2 = results[1]["commits"][2]
    assert step2.attempts >= 2 and sorted(step2.shares) == [1, 2], step2
    assert sum(step2.shares.values()) == M
    assert [c.writer for c in results[1]["commits"]] == [False, False, True, True, True]
    ref = reference_parameters()
    for r in (1, 2):
        assert torch.allclose(results[r]["params"], ref, rtol=1e-5, atol=1e-7), r


@pytest.mark.timeout(90)
def test_a_replica_leaving_mid_reduce_never_breaks_the_step():
    """Replica 0 drops out while its reduce of step 2 is in flight (the others wait at step 2's
    compute until it has gone, so the reduce cannot complete first and the fault point, polled
    during the collective, always fires): every step sums M ids once, one replica writes it, and
    the survivors agree."""
    results = run_job(3, {0: (2, "reduce")}, gate_step=2)
    assert results[0].get("gone") and isinstance(results[1], dict), results
    check_commits(results, [1, 2])
    ref = reference_parameters()
    for r in (1, 2):
        assert torch.allclose(results[r]["params"], ref, rtol=1e-5, atol=1e-7), r


@pytest.mark.timeout(90)
def test_a_replica_leaving_inside_its_overlapped_backward_is_recomputed():
    """Replica 0 drops out inside its last backward pass of step 2, once its reduce has started a
    bucket there (the "overlap" point): the survivors, whose own buckets are in flight, abandon
    them, redo the step in a new epoch (its reduce starts after the compute: the group is new)
    and stay on the one-process trajectory."""
    results = run_job(3, {0: (2, "overlap")})
    assert results[0].get("gone") and isinstance(results[1], dict), results
    check_commits(results, [1, 2])
    for r in (1, 2):
        commits = results[r]["commits"]
        assert commits[2].attempts >= 2 and sorted(commits[2].shares) == [1, 2], commits[2]
        assert [c.overlapped for c in commits] == [0.0, 0.8333, 0.0, 0.8333, 0.8333]
    ref = reference_parameters()
    for r in (1, 2):
        assert torch.allclose(results[r]["params"], ref, rtol=1e-5, atol=1e-7), r


@pytest.mark.timeout(90)
@pytest.mark.parametrize("ahead", [False, True])
def test_an_update_applied_during_the_vote_is_undone_by_a_redo(ahead):
    """Each update is applied while the vote completes (once the replica's done report is on
    record). At step 2 replica 0's reduce succeeds but it reports the attempt failed: the
    others' done reports are on record and their update of step 2 applied (with `ahead`: and
    their first microbatch of step 3 computed), and the coordinator
    decides a redo. Replicas 1 and 2 undo the update (the state and the local sum put back), redo
    the reduce in the new epoch and commit: the one-process trajectory, every step applied once.
    With `ahead`, each also computed its first microbatch of step 3 during that vote, on the
    updated parameters: the undo drops it, it never enters the redone step 2, and step 3
    starts with the one computed during the redo's vote."""
    results = run_job(3, {0: (2, "report")}, early=True, ahead=ahead)
    assert all(isinstance(results.get(r), dict) for r in range(3)), results
    check_commits(results, [0, 1, 2])
    # (Replica 0 applied its update too: it starts as the report is sent, and the report said
    # the attempt failed only later.)
    for r in range(3):
        commits = results[r]["commits"]
        assert commits[2].attempts == 2 and sum(commits[2].shares.values()) == M, commits[2]
        assert results[r]["undone"] == [2], results[r]["undone"]  # undone once, at the redo
        assert results[r]["applied"] == [0, 1, 2, 2, 3, 4]  # step 2: its redo applied again
    if ahead:  # steps 1 to 4 began during the last vote; step 3 twice on 1 and 2 (the redo)
        # (replica 0's work ahead in the failed attempt races its own report's answer)
        assert results[0]["ahead"] in ([1, 2, 3, 4], [1, 2, 3, 3, 4]), results[0]["ahead"]
        for r in (1, 2):
            assert results[r]["ahead"] == [1, 2, 3, 3, 4], results[r]["ahead"]
        for r in range(3):
            commits = results[r]["commits"]
            assert commits[0].ahead == () and all(len(c.ahead) == 1 for c in commits[1:]), r
            assert all(c.parts["compute"] > 0 for c in commits), r  # (shares of 2: one left)
    ref = reference_parameters()
    for r in range(3):
        assert torch.allclose(results[r]["params"], ref, rtol=1e-5, atol=1e-7), r
    # Without a failure, nothing is undone and every replica is on the same trajectory.
    results = run_job(2, {}, early=True)
    assert [results[r]["undone"] for r in (0, 1)] == [[], []]
    assert torch.allclose(results[0]["params"], results[1]["params"], rtol=0, atol=0)


@pytest.mark.timeout(90)
def test_a_deterministic_replica_whose_share_is_empty_commits_every_step():
    """Seven replicas for M = 6 ids: the plan gives one replica no id at every step (a straggler's
    share can be empty too). In the deterministic mode its attempt still yields one (empty) Todo
    and takes part in the ordered reduce; with no yield at all, its step loop crashed."""
    was = torch.are_deterministic_algorithms_enabled()  # the mode sets it process-wide
    try:
        results = run_job(7, {}, det=True)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(isinstance(results.get(r), dict) for r in range(7)), results
    check_commits(results, list(range(7)))
    empty = [r for r in range(7) if all(c.shares.get(r, 0) == 0 for c in results[r]["commits"])]
    assert len(empty) == 1, [c.shares for c in results[0]["commits"]]
    params = [results[r]["params"] for r in range(7)]
    assert all(torch.equal(p, params[0]) for p in params)  # the same bits on every replica
    assert torch.allclose(params[0], reference_parameters(), rtol=1e-5, atol=1e-7)


def test_work_ahead_is_kept_only_where_the_steps_plan_gives_its_ids():
    """The next step's microbatch computed during a vote starts that step only where its plan
    gives the id to this replica; elsewhere the local sum is emptied (it held only that work)
    and `ahead_dropped` says why."""
    from types import SimpleNamespace

    from recover.runtime.step_machine import Ahead, StepAttempt

    said: list[tuple[str, dict]] = []
    work = LinearWork()
    machine = StepMachine(
        work=work, link=None, groups=None, options=StepOptions(replica_id=1),
        hooks=StepHooks(event=lambda name, **fields: said.append((name, fields))),
    )  # fmt: skip
    for plan, kept in (({1: (2, 3)}, True), ({0: (0, 1, 2), 1: (3, 4, 5)}, False)):
        work.compute(type("Todo", (), {"step": 3, "ids": (2,)})())
        machine._ahead = Ahead(step=3, ids=(2,), seconds=0.25)
        attempt = StepAttempt(step=3)
        machine._take_ahead(SimpleNamespace(plan=plan, status="running"), 3, attempt)
        assert machine._ahead is None
        if kept:
            assert attempt.computed == {2} and attempt.ahead == (2,) and work.grads.counted == 1
            assert attempt.compute_s == 0.25 and not said
            work.clear()
        else:
            assert attempt.computed == set() and attempt.ahead == () and work.grads.counted == 0
            assert all(p.grad is None for p in work.model.parameters())
            ((name, fields),) = said
            assert name == "ahead_dropped" and fields["step"] == 3 and fields["ids"] == [2]
