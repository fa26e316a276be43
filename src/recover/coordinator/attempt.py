"""The rules of a step attempt: its reports, its judgment (commit, redo or verify), its plan.

Job: take the done and failed reports of the current attempt (t, a), judge the attempt once every
live member has reported, and commit it, redo it in a new epoch, or redo it to verify non-finite
parts; plan each new attempt, weighted by the replicas' measured throughput; and say what became
of any attempt (`attempt_outcome`, read by the server and the relays). Pure functions of a cloned
`CoordinatorState` that `decide` made (decide.py dispatches the reports here).

Rules (docs/design.md has the narrative):
- An attempt (t, a) is reduced by its members A (the live set when it began). When every member
  of A that is still live has reported: all done -> Committed(t); any failed -> Redo(t, e') where
  the ids held by the dead members of A are reassigned over the survivors and e' > a is the
  current epoch (bumped by a regroup if no membership change happened since a).
- A failed report regroups at once (bumps the epoch, same live set) if the epoch has not moved
  since the attempt began, so that peers blocked in the failed collective see the new epoch and
  abandon it. Who hung or died is for the lease and the session's end to say: a replica never
  names a suspect (an old client's `suspects` field is ignored by the decoder). A report that
  names unreachable members may defer that regroup (membership.py's unreachable rule).
- Joiners wait as pending and are admitted only at a commit (step boundary).
- Non-finite parts: when every survivor reported done but some (not all) said their own part of
  the sum was not finite, the step is not committed: a new attempt recomputes the suspects' ids on
  the others (the suspects drop their sums and compute nothing). If every part is finite then,
  the suspects computed wrongly: each is evicted (`suspect_hardware`, how="suspect") and the step
  commits without them. If not, the ids are not finite anywhere: the step commits as it is (every
  replica skips a non-finite step) and the suspects stay. Every part non-finite: it commits at once.
- A planned leave: a member whose done report asks to leave leaves when that step commits, and
  the next step is planned without it, so no attempt waits for it (membership._release_leavers).
- Each commit names the writer of the step's records (`_name_writer`); parameter hashes that
  differ among the survivors stop the run as diverged.
- Relays (relay.py): `ReportsDone` takes each report as if it came alone, then judges the
  attempt once.
- (t, a) reports that are not the current attempt are refused as "stale".

Invariants (tested): while running, the plan splits 0..M-1 among the attempt's members with every
id exactly once. Every function takes the clone `s` that `decide` made and changes a container
only through `s.own(name)` (copied on its first change) or by assigning a new one.
Costs: a done report, or a batch of them, copies the reports map once and checks the attempt
(O(R) in C; membership is a dict lookup); the attempt is judged in O(1) until every live member
has reported, then in O(R); a commit or a redo is O(R + M) (the plan).
Must not: import decide.py (it imports this module); read a clock or open a socket; change the
member set other than through membership.py's rules.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Protocol

from recover.coordinator.decisions import (
    Admitted,
    Committed,
    Decision,
    Diverged,
    EpochChanged,
    Redo,
)
from recover.coordinator.membership import (
    _alive_in_attempt,
    _awaiting_voters,
    _bump_epoch,
    _evict_suspects,
    _evict_unreachable,
    _lookup,
    _refuse,
    _release_leavers,
)
from recover.coordinator.messages import ReportDone, ReportFailed, ReportsDone
from recover.coordinator.state_store import (
    DIVERGED,
    LIVE,
    QUORUM_LOST,
    RUNNING,
    CoordinatorState,
    pending_ids,
)
from recover.policy import WORKLOADS, reassign

__all__ = ["AttemptProgress", "attempt_outcome"]

# ---------------------------------------------------------------- public entry point


class AttemptProgress(Protocol):
    """What `attempt_outcome` reads: the coordinator's state, or a view of it (a relay's copy)."""

    @property
    def status(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def committed_step(self) -> int: ...
    @property
    def attempt_epoch(self) -> int: ...


def attempt_outcome(state: AttemptProgress, step: int, epoch: int) -> tuple[str, str] | None:
    """The outcome of attempt (step, epoch): (committed|redo|stopped|stale, reason) or None.
    `state`: the coordinator's state, or a View of it (a relay answers from its copy)."""
    if state.status in (QUORUM_LOST, DIVERGED):
        return "stopped", state.reason
    if step <= state.committed_step:
        return "committed", f"step {step} is committed"
    if state.status != RUNNING:
        return "stopped", f"the run is {state.status}: {state.reason}"
    if step == state.step and epoch < state.attempt_epoch:
        return "redo", f"step {step} is redone in epoch {state.attempt_epoch}"
    if step == state.step and epoch == state.attempt_epoch:
        return None
    return "stale", (
        f"({step}, {epoch}) is not an attempt of the current step "
        f"({state.step}, {state.attempt_epoch})"
    )


# ---------------------------------------------------------------- reports


def _check_report(s: CoordinatorState, m: ReportDone | ReportFailed, out: list[Decision]) -> bool:
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        _refuse(out, m, code, why)
    elif s.status != RUNNING:
        _refuse(out, m, s.status, f"the run is {s.status}: {s.reason}")
    # The attempt's members are its plan's keys: a dict lookup, not a scan of the tuple (O(R)
    # per report was O(R^2) per step: 2 s at R = 12,500).
    elif not _is_current_attempt(s, m.step, m.epoch) or m.replica_id not in s.plan:
        _refuse(
            out,
            m,
            "stale",
            f"report of replica {m.replica_id} for ({m.step}, {m.epoch}) is stale: the current "
            f"attempt is ({s.step}, {s.attempt_epoch}) with members {list(s.attempt_members)}",
        )
    else:
        return True
    return False


def _take_done(s: CoordinatorState, m: ReportDone, out: list[Decision]) -> bool:
    """Record one done report (False: refused, with the refusal in `out`)."""
    if not _check_report(s, m, out):
        return False
    if s.reports.get(m.replica_id) != "failed":  # a failure within an attempt is sticky
        s.own("reports")[m.replica_id] = "done"
    if m.param_hash is not None:
        s.own("param_hashes")[m.replica_id] = m.param_hash
    _record_throughput(s, m.replica_id, m.throughput)
    _record_leaving(s, m.replica_id, m.leaving)
    _record_nonfinite(s, m.replica_id, m.finite)
    return True


def _on_done(s: CoordinatorState, now: float, m: ReportDone, out: list[Decision]) -> str:
    if not _take_done(s, m, out):
        return ""
    _evaluate_attempt(s, out)
    return f"replica {m.replica_id} reported done ({m.step}, {m.epoch})"


def _on_done_batch(s: CoordinatorState, now: float, m: ReportsDone, out: list[Decision]) -> str:
    """Each report as `_on_done` takes it (refusals per report), the attempt judged once."""
    taken = sum(_take_done(s, d, out) for d in m.reports)
    if taken:
        _evaluate_attempt(s, out)
    first = m.reports[0] if m.reports else None
    at = f" ({first.step}, {first.epoch})" if first else ""
    return f"{taken} of {len(m.reports)} batched done reports taken{at}"


def _on_failed(s: CoordinatorState, now: float, m: ReportFailed, out: list[Decision]) -> str:
    if not _check_report(s, m, out):
        return ""
    r = m.replica_id
    s.own("reports")[r] = "failed"
    why = f"replica {r} reported a failed collective in ({m.step}, {m.epoch}): {m.reason!r}"
    if m.unreachable:
        s.own("unreachable")[r] = m.unreachable
        why += f"; it cannot dial replicas {sorted({x for x, _ in m.unreachable})}"
    if s.epoch == s.attempt_epoch and not _awaiting_voters(s):
        _bump_epoch(s, out, f"{why}; regroup to redo step {s.step}")
    _evaluate_attempt(s, out)
    return why


def _is_current_attempt(s: CoordinatorState, step: int, epoch: int) -> bool:
    return s.status == RUNNING and step == s.step and epoch == s.attempt_epoch


def _record_nonfinite(s: CoordinatorState, r: int, finite: bool) -> None:
    if not finite and r not in s.nonfinite:
        s.nonfinite = (*s.nonfinite, r)


def _record_throughput(s: CoordinatorState, r: int, x: float | None) -> None:
    """Fold one step's sample into the replica's moving average (it weighs the next plans)."""
    if x is None or not math.isfinite(x) or x < 0:
        return
    tp = s.members[r].throughput
    alpha = s.options.throughput_ema_alpha
    tp = x if tp is None else alpha * x + (1 - alpha) * tp
    s.own("members")[r] = replace(s.members[r], throughput=tp)


def _record_leaving(s: CoordinatorState, r: int, leaving: bool) -> None:
    if leaving and not s.members[r].leaving:
        s.own("members")[r] = replace(s.members[r], leaving=True)


# ---------------------------------------------------------------- judgment


def _evaluate_attempt(s: CoordinatorState, out: list[Decision]) -> None:
    if s.status != RUNNING:
        return
    # The live set is the attempt's surviving members (joiners enter only at a commit), so
    # fewer reports than live members means someone live has not reported: O(1) per report.
    if len(s.reports) < len(s.live):
        return
    survivors = [r for r in s.attempt_members if _alive_in_attempt(s, r)]
    if not survivors or any(r not in s.reports for r in survivors):
        return
    if all(s.reports[r] == "done" for r in survivors):
        bad = [r for r in survivors if r in s.nonfinite]
        if bad and len(bad) < len(survivors) and not s.verifying and s.options.mode == "recover":
            _verify(s, out, survivors, bad)
            return
        if s.verifying and not bad:  # recomputed elsewhere, every part finite: they erred
            survivors = _evict_suspects(s, out, survivors)
            if s.status != RUNNING:
                return
        _commit(s, out, survivors)
    else:
        survivors = _evict_unreachable(s, out, survivors)
        if s.status != RUNNING:
            return
        _redo(s, out, survivors)


def _commit(s: CoordinatorState, out: list[Decision], survivors: list[int]) -> None:
    t, a = s.step, s.attempt_epoch
    alive = set(survivors)
    gone = [r for r in s.attempt_members if r not in alive]
    why = f"step {t} committed: all {len(survivors)} live members of epoch {a} reported done"
    if gone:
        why += f" (replicas {gone} left the epoch after the reduce; the sum is complete)"
    s.committed_step = t
    s.suspect_since = None  # a commit heard every member: the network works
    s.unreachable_strikes = {}  # a commit formed the group: every member could be dialled
    _name_writer(s, t, survivors)
    s.step = t + 1
    s.joined = ()  # a committed step proves every member held the committed state
    out.append(Committed(step=t, epoch=a, reason=why))
    hashes = {r: s.param_hashes[r] for r in survivors if r in s.param_hashes}
    if len(set(hashes.values())) > 1:
        by_hash: dict[str, list[int]] = {}
        for r, h in hashes.items():
            by_hash.setdefault(h, []).append(r)
        groups = "; ".join(f"replicas {rs} hold {h}" for h, rs in sorted(by_hash.items()))
        s.status = DIVERGED
        s.reports, s.param_hashes, s.unreachable = {}, {}, {}
        out.append(
            Diverged(
                step=t,
                hashes=hashes,
                reason=f"PARAMETERS DIVERGED at step {t}: {groups}. Stop; investigate; resume "
                "from the last checkpoint",
            )
        )
        return
    _release_leavers(s, out, survivors)
    joiners = pending_ids(s) if s.n_pending else ()
    if joiners:
        members = s.own("members")
        for r in joiners:
            members[r] = replace(members[r], state=LIVE, throughput=None)
        s.n_pending = 0
        s.live = tuple(sorted(set(s.live) | set(joiners)))
        s.epoch += 1
        s.joined = tuple(joiners)
        why = f"replicas {list(joiners)} admitted at the boundary of step {s.step}"
        out.append(Admitted(replica_ids=joiners, epoch=s.epoch, reason=why))
        out.append(EpochChanged(epoch=s.epoch, live=s.live, reason=why))
    _new_attempt(s)


def _name_writer(s: CoordinatorState, t: int, survivors: list[int]) -> None:
    """The writer of step t's records, decided here, once, with the commit: the lowest member of
    the attempt that is alive now. Replicas read it from the view; none infers it from a view
    that may have moved on (a member leaving right after its last step, a joiner).

    A writer writes its step's records before it reports the next step: when the writer of step
    t-1 is among t's survivors, everything before t is recorded. When it is not (it died or left
    after t-1's commit), the records from `records_from` on may be missing, and t's writer makes
    sure of them too. It must then have seen those commits: not a joiner of this step."""
    if s.committed_writer < 0 or s.committed_writer in survivors:
        s.records_from = t
    staying = [r for r in survivors if not s.members[r].leaving] or survivors
    seen = [r for r in staying if r not in s.joined] if s.records_from < t else staying
    s.committed_writer = min(seen or staying)


def _redo(s: CoordinatorState, out: list[Decision], survivors: list[int]) -> None:
    t, a = s.step, s.attempt_epoch
    alive = set(survivors)
    dead = [r for r in s.attempt_members if r not in alive]
    failed = [r for r in survivors if s.reports.get(r) == "failed"]
    if s.epoch == a:
        _bump_epoch(s, out, f"regroup to redo step {t}: replicas {failed} failed in epoch {a}")
    if tuple(survivors) != s.live:  # pragma: no cover - joiners only enter at commits
        raise AssertionError(f"survivors {survivors} != live {s.live}")
    lost = tuple(sorted(j for r in dead for j in s.plan[r]))
    weights = {r: s.weights[r] for r in survivors}
    workload = WORKLOADS[s.options.mode]
    extra = workload.lost(lost, survivors, weights)
    s.plan = {r: s.plan[r] + extra[r] for r in survivors}
    s.weights = weights
    s.attempt_epoch = s.epoch
    s.attempt_members = tuple(survivors)
    s.reports, s.param_hashes, s.unreachable = {}, {}, {}
    moved = {r: ids for r, ids in extra.items() if ids}
    why = (
        f"redo step {t} in epoch {s.epoch}: failed attempt epoch {a}, dead {dead}, "
        f"failed reports {failed}; {len(lost)} lost ids "
        + (f"reassigned as {moved}" if workload.keeps_batch else "dropped (shrink baseline)")
    )
    out.append(Redo(step=t, epoch=s.epoch, lost=lost, reassigned=moved, reason=why))


def _verify(s: CoordinatorState, out: list[Decision], survivors: list[int], bad: list[int]) -> None:
    """Replicas `bad` reported a non-finite part where the others' was finite: redo the step in a
    new epoch with their ids recomputed by the others (reassign, as for the dead), while they stay
    members holding nothing and drop their sums (the view's `discard`)."""
    t, a = s.step, s.attempt_epoch
    _bump_epoch(s, out, f"recompute step {t}'s ids of replicas {bad} on the others")
    good = [r for r in survivors if r not in bad]
    lost = tuple(sorted(j for r in bad for j in s.plan[r]))
    extra = reassign(lost, good, {r: s.weights[r] for r in good})
    s.plan = {r: () if r in bad else s.plan[r] + extra[r] for r in survivors}
    s.attempt_epoch = s.epoch
    s.attempt_members = tuple(survivors)
    s.reports, s.param_hashes, s.nonfinite = {}, {}, ()
    s.verifying = tuple(bad)
    moved = {r: ids for r, ids in extra.items() if ids}
    why = (
        f"redo step {t} in epoch {s.epoch}: in epoch {a} the parts of replicas {bad} were not "
        f"finite and the others' were; their {len(lost)} ids are recomputed as {moved}"
    )
    out.append(Redo(step=t, epoch=s.epoch, lost=lost, reassigned=moved, reason=why))


# ---------------------------------------------------------------- the plan


def _new_attempt(s: CoordinatorState) -> None:
    weights = _weights(s, s.live)
    if weights != s.weights:
        s.weights = weights
    plan = WORKLOADS[s.options.mode].plan(
        s.options.microbatches, s.live, s.weights, s.options.expected_replicas
    )
    # The same plan keeps its object (and plan_version): replies then leave it out (O(R) once
    # per attempt, against O(R + plan) bytes to every replica at every commit).
    if plan != s.plan:
        s.plan = plan
    s.attempt_epoch = s.epoch
    s.attempt_members = s.live
    s.reports, s.param_hashes, s.unreachable = {}, {}, {}
    s.nonfinite, s.verifying = (), ()


def _weights(s: CoordinatorState, ids: tuple[int, ...]) -> dict[int, float]:
    measured = {r: s.members[r].throughput for r in ids}
    known = [w for w in measured.values() if w is not None and w > 0]
    if not s.options.throughput_weights or not known:
        return {r: 1.0 for r in ids}
    median = statistics.median(known)
    floor = max(known) * 1e-3  # a stalled replica keeps a tiny positive share
    fresh = {r: max(w if w is not None and w > 0 else median, floor) for r, w in measured.items()}
    old = {r: s.weights[r] for r in ids if r in s.weights}
    if len(old) == len(ids) and not _moved(old, fresh, s.options.rebalance_threshold):
        return old  # same members, no material change: keep the plan's weights
    return fresh


def _moved(old: dict[int, float], new: dict[int, float], threshold: float) -> bool:
    """True when some replica's share of the total weight changed by more than `threshold`
    (relative to its old share)."""
    old_total, new_total = sum(old.values()), sum(new.values())
    return any(abs((new[r] / new_total) / (old[r] / old_total) - 1.0) > threshold for r in old)
