"""The coordinator's rules: a pure function from (now, state, message) to (state, decisions, reason).

Job: membership (pending -> live -> dead/left), epochs, the plan of every step attempt, commit and
redo decisions and lease expiry. No sockets, threads or clocks: the caller passes
`now` (a monotonic clock), so tests drive every race with an injected clock.

Rules (docs/design.md has the narrative):
- Re-forming (`_reform`): a registration after the quorum was lost, once no old member is
  still live (the survivors save the last committed step first), starts the forming again, as a
  fresh coordinator would; the old incarnations are fenced, epochs keep increasing.
- Forming: the run forms at epoch 1 when `expected_replicas` registrations with one fingerprint
  and one `next_step` are there (or, at `start_deadline_s`, with >= min_replicas of them).
- Every membership change (death, clean leave, regroup, admission) bumps the epoch by one.
- An attempt (t, a) is reduced by its members A (the live set when it began). When every member
  of A that is still live has reported: all done -> Committed(t); any failed -> Redo(t, e') where
  the ids held by the dead members of A are reassigned over the survivors and e' > a is the
  current epoch (bumped by a regroup if no membership change happened since a).
- A failed report regroups at once (bumps the epoch, same live set) if the epoch has not moved
  since the attempt began, so that peers blocked in the failed collective see the new epoch and
  abandon it. Who hung or died is for the lease and the session's end to say: a replica never
  names a suspect (an old client's `suspects` field is ignored by the decoder).
- Unreachable members (`_evict_unreachable`): a replica whose group would not form may name the
  members its probe could not dial (a TCP connect to the address they advertise: a network
  verdict, not a guess about hangs; recover.runtime.reach). Such a report defers the regroup
  until every survivor has reported but those a majority of the others named (each may then
  probe; see `_awaiting_voters`). A member named by
  a majority of the others in `unreachable_attempts` consecutive failed attempts of a step is
  evicted (how="unreachable", the probe's reason in the record); ties evict the higher id
  first, never the last member. A commit clears the count.
- Joiners wait as pending and are admitted only at a commit (step boundary).
- Non-finite parts: when every survivor reported done but some (not all) said their own part of
  the sum was not finite, the step is not committed: a new attempt recomputes the suspects' ids on
  the others (the suspects drop their sums and compute nothing). If every part is finite then,
  the suspects computed wrongly: each is evicted (`suspect_hardware`, how="suspect") and the step
  commits without them. If not, the ids are not finite anywhere: the step commits as it is (every
  replica skips a non-finite step) and the suspects stay. Every part non-finite: it commits at once.
- A planned leave: a member whose done report asks to leave is removed from the live set when
  that step commits (its part is in the sum), and the next step is planned without it, so no
  attempt waits for it; unless that would leave no member or fewer than min_replicas (the last
  replicas leave with `Leave` as before).
- Relays (relay.py): `ReportsDone` takes each report as if it came alone, then judges the
  attempt once; `LeaseExpired` (a lease judged at a relay) kills as an expiry judged here.
- Self-suspicion (`_suspects_itself`): a lease that runs out while more than half of the
  members are silent restarts their leases instead (the coordinator's own network is the likelier
  fault), for at most `self_suspicion_s` from the first suspicion until a commit.
- A dead or left incarnation is fenced forever; (t, a) reports that are not the current attempt
  are refused as "stale".

Invariants (tested): `decide` never mutates its input; while running, the plan splits
0..M-1 among the attempt's members with every id exactly once; epochs never decrease.
Costs: a heartbeat, or a batch of them, copies the members map once (O(R) in C, no sort); a
done report, or a batch of them, copies the reports map once and checks the attempt (O(R) in
C; membership is a dict lookup); a registration is O(1) apart
from that copy. Change detection compares a few scalars and container identities, never whole
keys. A commit or a redo is O(R + M) (the plan). Lease expiry (`Tick(due=...)`) looks only at the
replicas the caller names (the server keeps them in deadline order); `due=None` scans them all.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from recover.checks import is_int
from recover.coordinator.protocol import (
    Admitted,
    Committed,
    Decision,
    Diverged,
    EpochChanged,
    Finished,
    Heartbeat,
    Heartbeats,
    LeaseExpired,
    Leave,
    MemberDead,
    Message,
    ProcessExit,
    QuorumLost,
    Redo,
    Reforming,
    Refused,
    Register,
    Registered,
    ReportDone,
    ReportFailed,
    ReportsDone,
    Resumed,
    Revalidated,
    SuspectHardware,
    Takeover,
    Tick,
)
from recover.coordinator.state_store import (
    DEAD,
    DIVERGED,
    FINISHED,
    FORMING,
    LEFT,
    LIVE,
    PENDING,
    QUORUM_LOST,
    RUNNING,
    TERMINAL,
    CoordinatorState,
    Member,
    check_member,
    initial_state,
    pending_ids,
    resume_state,
    view_of,
)
from recover.policy import WORKLOADS, reassign

__all__ = [
    "attempt_outcome",
    "check_member",
    "decide",
    "initial_state",
    "resume_state",
    "tick",
    "view_of",
]

# ---------------------------------------------------------------- public entry points


def decide(
    now: float, state: CoordinatorState, msg: Message
) -> tuple[CoordinatorState, list[Decision], str]:
    """Apply one message. Returns the new state, the decisions taken, and a human reason."""
    s = state.clone()
    out: list[Decision] = []
    note = _HANDLERS[type(msg)](s, now, msg, out) or ""
    view_changed = _view_changed(state, s)
    if view_changed:
        s.view_version += 1
        if not (_same(state.plan, s.plan) and _same(state.weights, s.weights)):
            s.plan_version = s.view_version
        s.reason = "; ".join(d.reason for d in out if not isinstance(d, Refused)) or note
    if view_changed or _durable_changed(state, s, msg):
        s.revision += 1
    reason = "; ".join(d.reason for d in out) or note
    return s, out, reason


def tick(now: float, state: CoordinatorState) -> tuple[CoordinatorState, list[Decision], str]:
    return decide(now, state, Tick())


def attempt_outcome(state: CoordinatorState, step: int, epoch: int) -> tuple[str, str] | None:
    """The outcome of attempt (step, epoch): (committed|redo|stopped|stale, reason) or None."""
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


# ---------------------------------------------------------------- handlers


def _on_register(s: CoordinatorState, now: float, m: Register, out: list) -> str:
    r, inc = m.replica_id, m.incarnation
    fence = s.fenced.get(inc)
    if fence:
        return _refuse(out, m, fence, check_member(s, r, inc)[1])
    cur = s.members.get(r)
    if cur is not None and cur.incarnation == inc and cur.state != DEAD:
        s.own("members")[r] = replace(cur, last_seen=now)
        return f"replica {r} registered again (new session, same incarnation)"
    if s.status == QUORUM_LOST:
        still = [
            x for x, mb in s.members.items()
            if mb.state in (PENDING, LIVE) and now - mb.last_seen <= s.options.lease_s
        ]  # fmt: skip
        if still:
            why = (
                f"the run lost its quorum ({s.reason}); replicas {sorted(still)} of the old run "
                "are still live (saving the last committed step): start this replica again "
                "once they have exited"
            )
            return _refuse(out, m, s.status, why)
        _reform(s, now, out, r)
    if s.status in TERMINAL:
        return _refuse(out, m, s.status, f"the run is {s.status}: {s.reason}")
    if s.leaving:  # no step boundary will come any more: nothing to join
        return _refuse(out, m, FINISHED, "the run is finishing: its replicas are leaving")
    if cur is not None and cur.state in (PENDING, LIVE):
        why = f"replica id {r} is held by live incarnation {cur.incarnation}"
        return _refuse(out, m, "duplicate", why)
    if why := _mismatch(s, m):
        return _refuse(out, m, "mismatch", why)
    # A new member, or (same incarnation) one whose lease expired while pending: it was never
    # admitted into an epoch, so it is not fenced and waits again.
    s.n_pending += 1
    s.own("members")[r] = Member(
        replica_id=r,
        incarnation=inc,
        state=PENDING,
        last_seen=now,
        fingerprint=dict(m.fingerprint),
        next_step=m.next_step,
    )
    wait = "the run forms" if s.status == FORMING else f"the commit of step {s.step}"
    out.append(
        Registered(replica_id=r, incarnation=inc, reason=f"replica {r} registered, pending {wait}")
    )
    if s.status == FORMING and s.n_pending >= s.options.expected_replicas:
        _form(s, out, f"all {s.options.expected_replicas} expected replicas registered")
    return ""


def _mismatch(s: CoordinatorState, m: Register) -> str:
    """Why `m` cannot join this run ("" if it can): its fingerprint or next_step differ."""
    if s.options.microbatches == 0:  # M comes from the replicas: each must declare it
        declared = m.fingerprint.get("microbatches")
        if not is_int(declared) or declared < 1:
            return f"fingerprint field 'microbatches' must be an int >= 1, got {declared!r}"
    first = _first_pending(s) if s.status != RUNNING else None
    peers = [first] if first is not None else []
    ref = s.fingerprint if s.status == RUNNING else (peers[0].fingerprint if peers else None)
    for key in sorted(set(ref) | set(m.fingerprint)) if ref is not None else ():
        if ref.get(key) != m.fingerprint.get(key):
            theirs, mine = ref.get(key), m.fingerprint.get(key)
            return f"fingerprint field {key!r} differs: run has {theirs!r}, replica has {mine!r}"
    if s.status == FORMING and peers and peers[0].next_step != m.next_step:
        return f"next_step differs: replica {first.replica_id} has {first.next_step}, not {m.next_step}"
    return ""


def _on_heartbeat(s: CoordinatorState, now: float, m: Heartbeat, out: list) -> str:
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        return _refuse(out, m, code, why)
    return _heard(s, m.replica_id, member, now)


def _on_heartbeats(s: CoordinatorState, now: float, m: Heartbeats, out: list) -> str:
    """Heartbeats the transport read since its last batch, each at the time it was read. Not a
    current member any more: skipped (it was answered already; its next heartbeat is refused)."""
    for r, inc, at in m.seen:
        member = s.members.get(r)
        if member is None or member.incarnation != inc or member.state not in (PENDING, LIVE):
            continue
        if s.fenced.get(inc) or at <= member.last_seen:
            continue
        _heard(s, r, member, at)
    return f"{len(m.seen)} heartbeats"


def _heard(s: CoordinatorState, r: int, member: Member, at: float) -> str:
    s.own("members")[r] = replace(member, last_seen=max(at, member.last_seen))
    return "heartbeat"


def _on_process_exit(s: CoordinatorState, now: float, m: ProcessExit, out: list) -> str:
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        return _refuse(out, m, code, why)
    _kill(s, m.replica_id, "exit", f"replica {m.replica_id} process exited", out)
    return ""


def _check_report(s: CoordinatorState, m: ReportDone | ReportFailed, out: list) -> bool:
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


def _take_done(s: CoordinatorState, m: ReportDone, out: list) -> bool:
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


def _on_done(s: CoordinatorState, now: float, m: ReportDone, out: list) -> str:
    if not _take_done(s, m, out):
        return ""
    _evaluate_attempt(s, out)
    return f"replica {m.replica_id} reported done ({m.step}, {m.epoch})"


def _on_done_batch(s: CoordinatorState, now: float, m: ReportsDone, out: list) -> str:
    """Each report as `_on_done` takes it (refusals per report), the attempt judged once."""
    taken = sum(_take_done(s, d, out) for d in m.reports)
    if taken:
        _evaluate_attempt(s, out)
    first = m.reports[0] if m.reports else None
    at = f" ({first.step}, {first.epoch})" if first else ""
    return f"{taken} of {len(m.reports)} batched done reports taken{at}"


def _on_lease_expired(s: CoordinatorState, now: float, m: LeaseExpired, out: list) -> str:
    """A relay judged the lease (its replicas heartbeat the relay, not us): as a Tick would."""
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        return _refuse(out, m, code, why)
    lease = s.options.lease_s
    _kill(
        s,
        m.replica_id,
        "lease",
        f"replica {m.replica_id} lease expired at its relay: no heartbeat for > lease_s={lease}",
        out,
    )
    return ""


def _on_failed(s: CoordinatorState, now: float, m: ReportFailed, out: list) -> str:
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


def _on_leave(s: CoordinatorState, now: float, m: Leave, out: list) -> str:
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        return _refuse(out, m, code, why)
    s.leaving = True
    _kill(s, m.replica_id, "leave", f"replica {m.replica_id} left cleanly at step {m.step}", out)
    return f"replica {m.replica_id} left"


def _on_tick(s: CoordinatorState, now: float, m: Tick, out: list) -> str:
    opts = s.options
    due = sorted(s.members) if m.due is None else sorted(set(m.due))
    if _suspects_itself(s, now, due, out):
        return "every member went silent at once: the coordinator suspects its own network"
    for r in due:
        member = s.members.get(r)
        if member is None:
            continue
        if member.state in (PENDING, LIVE) and now - member.last_seen > opts.lease_s:
            why = (
                f"replica {r} lease expired: no heartbeat for {now - member.last_seen:.3f} s "
                f"> lease_s={opts.lease_s}"
            )
            _kill(s, r, "lease", why, out)
    if s.status == FORMING and now >= s.start_deadline:
        n = s.n_pending
        head = f"start deadline passed with {n} of {opts.expected_replicas} replicas registered"
        if n >= opts.min_replicas:
            _form(s, out, f"{head}; starting with them")
        else:
            _lose_quorum(s, out, f"{head}; check that every replica can reach the coordinator")
    return ""


def _suspects_itself(s: CoordinatorState, now: float, due: list[int], out: list) -> bool:
    """The self-suspicion rule. When a lease runs out while more than half of the watched members
    (live or pending; at least two) have been silent for over half a lease, the likelier fault is
    the coordinator's own network (or host), not theirs: each silent member's lease restarts now
    (`Revalidated`, as after the coordinator's own pause) and nobody is judged. Bounded: from the
    first such suspicion, for `self_suspicion_s` at most (0: never suspect); past it, leases are
    judged as usual (the replicas, which cannot reach a coordinator for `coordinator_grace`, have
    given up by then). The suspicion ends at the next commit. Costs O(R), only when a lease ran
    out. Judged here only: a lease judged at a relay comes as `LeaseExpired`."""
    opts = s.options
    if not opts.self_suspicion_s or s.status in (QUORUM_LOST, FINISHED, DIVERGED):
        return False
    expired = [
        r for r in due
        if (mb := s.members.get(r)) is not None and mb.state in (PENDING, LIVE)
        and now - mb.last_seen > opts.lease_s
    ]  # fmt: skip
    if not expired:
        return False
    watched = [(r, mb) for r, mb in s.members.items() if mb.state in (PENDING, LIVE)]
    silent = sorted(r for r, mb in watched if now - mb.last_seen > opts.lease_s / 2)
    if len(watched) < 2 or 2 * len(silent) <= len(watched):
        return False
    if s.suspect_since is None:
        s.suspect_since = now
    elif now - s.suspect_since > opts.self_suspicion_s:
        return False  # suspected long enough: the silence is theirs
    members = s.own("members")
    silence = max(now - members[r].last_seen for r in silent)
    for r in silent:
        members[r] = replace(members[r], last_seen=now)
    why = (
        f"replicas {silent} of {len(watched)} went silent together ({len(expired)} leases ran "
        f"out): the coordinator suspects its own network, not them; their leases restart now "
        f"(for {now - s.suspect_since:.1f} s of at most self_suspicion_s={opts.self_suspicion_s})"
    )
    out.append(Revalidated(reason=why, paused_s=round(silence, 3), members=tuple(silent)))
    return True


def _on_takeover(s: CoordinatorState, now: float, m: Takeover, out: list) -> str:
    """A new leader's first rule: nobody is dead for the coordinator's absence (each member's
    lease runs `grace_s` from now, time to find the new leader), and the in-flight attempt is
    resolved by the commit rule. Reports are not durable, so an attempt is committed here only
    if every live member's done is on record; otherwise it is redone in a new epoch, whose
    process group the replicas build on the new leader's store."""
    members = s.own("members")
    seen = now + max(m.grace_s, s.options.lease_s) - s.options.lease_s
    for r, member in members.items():
        if member.state in (PENDING, LIVE):
            members[r] = replace(member, last_seen=seen)
    why = f"coordinator term {m.term} took over at step {s.step}"
    if s.status != RUNNING:
        return f"{why} (run {s.status})"
    survivors = [r for r in s.attempt_members if _alive_in_attempt(s, r)]
    if survivors and all(s.reports.get(r) == "done" for r in survivors):
        _evaluate_attempt(s, out)
        return why
    _bump_epoch(s, out, f"{why}; its attempt in epoch {s.attempt_epoch} is redone")
    _redo(s, out, survivors)
    return why


def _on_resumed(s: CoordinatorState, now: float, m: Resumed, out: list) -> str:
    """The coordinator itself was not running for `paused_s`: a silence nobody else caused. Each
    live or pending member's lease restarts from now, so the
    leases judged next judge only what happens after the pause (a member that died meanwhile
    misses its fresh lease and dies then). Nothing else changes: no epoch, no death."""
    members = s.own("members")
    renewed = []
    for r, member in sorted(members.items()):
        if member.state in (PENDING, LIVE):
            members[r] = replace(member, last_seen=max(now, member.last_seen))
            renewed.append(r)
    why = (
        f"the coordinator did not run for {m.paused_s:.1f} s (stopped or stalled): the leases "
        f"of replicas {renewed} restart now; nobody is judged for that gap"
    )
    out.append(Revalidated(reason=why, paused_s=round(m.paused_s, 3), members=tuple(renewed)))
    return why


_HANDLERS = {
    Register: _on_register,
    Heartbeat: _on_heartbeat,
    Heartbeats: _on_heartbeats,
    ProcessExit: _on_process_exit,
    ReportDone: _on_done,
    ReportsDone: _on_done_batch,
    LeaseExpired: _on_lease_expired,
    ReportFailed: _on_failed,
    Leave: _on_leave,
    Tick: _on_tick,
    Resumed: _on_resumed,
    Takeover: _on_takeover,
}

# ---------------------------------------------------------------- state transitions


def _form(s: CoordinatorState, out: list, why: str) -> None:
    ids = pending_ids(s)
    s.fingerprint = dict(s.members[ids[0]].fingerprint)
    if s.options.microbatches == 0:  # learned from the replicas (checked at registration)
        s.options = replace(s.options, microbatches=s.fingerprint["microbatches"])
    s.step = s.members[ids[0]].next_step
    members = s.own("members")
    for r in ids:
        members[r] = replace(members[r], state=LIVE)
    s.n_pending = 0
    s.status = RUNNING
    s.live = ids
    s.epoch += 1
    _new_attempt(s)
    out.append(Admitted(replica_ids=ids, epoch=s.epoch, reason=f"{why}: run formed"))
    out.append(EpochChanged(epoch=s.epoch, live=s.live, reason=f"epoch {s.epoch}: {why}"))


def _kill(s: CoordinatorState, r: int, how: str, why: str, out: list) -> None:
    member = s.members[r]
    was_live = member.state == LIVE
    left = how == "leave"
    s.own("members")[r] = replace(member, state=LEFT if left else DEAD, how=how)
    if member.state == PENDING:
        s.n_pending -= 1
    # A pending incarnation that only missed its lease was never in an epoch: nothing to fence,
    # it may register again. Anything else is fenced forever.
    if not (member.state == PENDING and how == "lease"):
        s.own("fenced")[member.incarnation] = "left" if left else "evicted"
    if not left:
        out.append(MemberDead(replica_id=r, incarnation=member.incarnation, how=how, reason=why))
    if not was_live:
        return
    s.live = tuple(x for x in s.live if x != r)
    _bump_epoch(s, out, why)
    if s.status != RUNNING:
        return
    if not s.live and s.leaving:
        s.status = FINISHED
        out.append(Finished(reason="every replica has left (or died after others left)"))
    elif len(s.live) < s.options.min_replicas and not s.leaving:
        why = f"only {len(s.live)} live replicas remain, below min_replicas"
        _lose_quorum(s, out, f"{why}: stop and resume from the last checkpoint")
    elif _no_state_left(s):
        _lose_quorum(s, out, _NO_STATE_LEFT.format(live=list(s.live)))
    else:
        _evaluate_attempt(s, out)


def _reform(s: CoordinatorState, now: float, out: list, r: int) -> None:
    """A run that lost its quorum forms again, as a fresh coordinator would, from the replicas
    that register now (restarted with --resume: their checkpoints say where it goes on). Every
    incarnation of the old run is fenced; epochs and versions go on increasing."""
    lost_at = s.committed_step
    members, fenced = s.own("members"), s.own("fenced")
    for x, mb in list(members.items()):
        if mb.state in (PENDING, LIVE):
            members[x] = replace(mb, state=DEAD, how="quorum")
            fenced[mb.incarnation] = "evicted"
    s.status, s.reason = FORMING, "waiting for registrations"
    s.live, s.attempt_members, s.joined, s.nonfinite, s.verifying = (), (), (), (), ()
    s.plan, s.weights, s.reports, s.param_hashes = {}, {}, {}, {}
    s.unreachable, s.unreachable_strikes = {}, {}
    s.step, s.committed_step, s.committed_writer, s.records_from = 0, -1, -1, 0
    s.fingerprint, s.leaving, s.n_pending, s.suspect_since = None, False, 0, None
    s.start_deadline = now + s.options.start_deadline_s
    why = (
        f"replica {r} registered after the run lost its quorum (last committed step {lost_at}): "
        f"the run forms again from the replicas that register (every old incarnation is fenced)"
    )
    out.append(Reforming(replica_id=r, lost_at=lost_at, reason=why))


def _lose_quorum(s: CoordinatorState, out: list, why: str) -> None:
    s.status = QUORUM_LOST
    m, c = s.options.min_replicas, s.committed_step
    why = f"{why} (min_replicas={m}, last committed step {c})"
    out.append(QuorumLost(live=s.live, min_replicas=m, committed_step=c, reason=why))


def _evaluate_attempt(s: CoordinatorState, out: list) -> None:
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


def _awaiting_voters(s: CoordinatorState) -> bool:
    """True while a failed report of this attempt named unreachable members and a survivor has
    not reported that a majority of the others has not named: the regroup waits for it, so that
    its probe runs (a new epoch would cut its build, and its probe, short). Who is named by a
    majority is not waited for (it may be blocked in its build until build_timeout_s); the
    others report within their probe's time, or their build's timeout. O(R + named)."""
    if not s.unreachable:
        return False
    alive = [r for r in s.attempt_members if _alive_in_attempt(s, r)]
    votes = _votes(s, set(alive))
    return any(r not in s.reports and 2 * len(votes.get(r, ())) <= len(alive) - 1 for r in alive)


def _votes(s: CoordinatorState, alive: set[int]) -> dict[int, set[int]]:
    """Member -> the reporters of this attempt (alive, other than it) that cannot dial it."""
    votes: dict[int, set[int]] = {}
    for reporter, pairs in s.unreachable.items():
        if reporter in alive:
            for x, _ in pairs:
                if x in alive and x != reporter:
                    votes.setdefault(x, set()).add(reporter)
    return votes


def _evict_unreachable(s: CoordinatorState, out: list, survivors: list[int]) -> list[int]:
    """Judge the failed attempt's unreachable reports (the rule in the module docstring) and
    return the survivors without the members evicted now. O(R + named) per failed attempt."""
    alive = set(survivors)
    votes = _votes(s, alive)
    reason = {
        x: f"replica {reporter}: {why}"
        for reporter, pairs in sorted(s.unreachable.items(), reverse=True)
        for x, why in pairs
    }  # the lowest reporter's words
    judged: list[int] = []
    while len(alive) > 1:  # greedily, most-named first: a voter judged loses its votes
        cands = [(len(v & alive), x) for x, v in votes.items() if x in alive]
        cands = [(n, x) for n, x in cands if 2 * n > len(alive) - 1]
        if not cands:
            break
        _, x = max(cands)
        judged.append(x)
        alive.discard(x)
    s.unreachable_strikes = {x: s.unreachable_strikes.get(x, 0) + 1 for x in judged}
    evict = [x for x in judged if s.unreachable_strikes[x] >= s.options.unreachable_attempts]
    if not evict:
        return survivors
    whys = {
        x: f"replica {x} cannot be dialled by {len(votes[x])} of the other "
        f"{len(survivors) - 1} members in {s.unreachable_strikes.pop(x)} consecutive attempts "
        f"of step {s.step} ({reason[x]}); evicted: check the address it advertises (--ifname)"
        for x in evict
    }
    return _evict(s, out, survivors, "unreachable", whys, "evicted: they cannot be dialled")


def _commit(s: CoordinatorState, out: list, survivors: list[int]) -> None:
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


def _release_leavers(s: CoordinatorState, out: list, survivors: list[int]) -> None:
    """Members whose done report of the committed step asked to leave leave now, at the step
    boundary: fenced as left (they write their last records and exit), the epoch moves, and the
    next step is planned without them, so no attempt waits for them (no redo). Not when that
    would leave no member or fewer than min_replicas: those leave with `Leave`."""
    leavers = [r for r in survivors if s.members[r].leaving]
    if not leavers or len(s.live) - len(leavers) < max(1, s.options.min_replicas):
        return
    members, fenced = s.own("members"), s.own("fenced")
    for r in leavers:
        members[r] = replace(members[r], state=LEFT, how="leave")
        fenced[members[r].incarnation] = "left"
    s.live = tuple(r for r in s.live if r not in leavers)
    _bump_epoch(s, out, f"replicas {leavers} left at the boundary of step {s.step}, as they asked")


def _redo(s: CoordinatorState, out: list, survivors: list[int]) -> None:
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


def _verify(s: CoordinatorState, out: list, survivors: list[int], bad: list[int]) -> None:
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


def _evict_suspects(s: CoordinatorState, out: list, survivors: list[int]) -> list[int]:
    """The suspects of this attempt computed wrongly (their ids were finite elsewhere): evict each
    (fenced for good, a new incarnation may join) and return the survivors without them."""
    t, suspects = s.step, s.verifying
    whys = {
        r: f"replica {r}'s part of step {t} was not finite, and its microbatches recomputed on "
        "other replicas were: it computes wrongly (suspect hardware); evicted"
        for r in suspects
    }
    for r, why in whys.items():
        inc = s.members[r].incarnation
        out.append(SuspectHardware(replica_id=r, incarnation=inc, step=t, reason=why))
    s.verifying = ()
    return _evict(s, out, survivors, "suspect", whys, "evicted as suspect hardware")


def _evict(
    s: CoordinatorState, out: list, survivors: list[int], how: str, whys: dict[int, str],
    what: str,
) -> list[int]:  # fmt: skip
    """Evict the live members `whys` names at once (dead, fenced for good: a new incarnation may
    join), one epoch for all of them; return the survivors without them."""
    members, fenced = s.own("members"), s.own("fenced")
    for r, why in whys.items():
        m = members[r]
        members[r] = replace(m, state=DEAD, how=how)
        fenced[m.incarnation] = "evicted"
        out.append(MemberDead(replica_id=r, incarnation=m.incarnation, how=how, reason=why))
    s.live = tuple(r for r in s.live if r not in whys)
    _bump_epoch(s, out, f"replicas {list(whys)} {what}")
    if len(s.live) < s.options.min_replicas:
        _lose_quorum(s, out, f"only {len(s.live)} live replicas remain, below min_replicas")
    elif _no_state_left(s):
        _lose_quorum(s, out, _NO_STATE_LEFT.format(live=list(s.live)))
    return [r for r in survivors if r not in whys]


_NO_STATE_LEFT = (
    "every replica that held the committed state is gone: the live ones ({live}) joined at this "
    "step and had not received it yet; stop and resume from the last checkpoint"
)


def _no_state_left(s: CoordinatorState) -> bool:
    """The live members are all joiners whose state transfer has not completed (a step commits
    before `joined` is cleared): nobody holds the committed state, so no step can go on."""
    return s.status == RUNNING and bool(s.live) and all(r in s.joined for r in s.live)


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


# ---------------------------------------------------------------- small helpers


def _bump_epoch(s: CoordinatorState, out: list, why: str) -> None:
    s.epoch += 1
    # Joiners keep getting the state transfer at the start of every attempt of their first step
    # (a failure may have cut the first transfer short) until that step commits.
    s.joined = tuple(r for r in s.joined if r in s.live)
    out.append(EpochChanged(epoch=s.epoch, live=s.live, reason=f"epoch {s.epoch}: {why}"))


def _refuse(out: list, m: Message, code: str, why: str) -> str:
    r, inc = m.replica_id, m.incarnation
    out.append(Refused(replica_id=r, incarnation=inc, code=code, reason=f"refused ({code}): {why}"))
    return ""


def _lookup(s: CoordinatorState, r: int, inc: str) -> tuple[Member | None, str, str]:
    code, why = check_member(s, r, inc)
    return (None, code, why) if code else (s.members[r], "", "")


def _alive_in_attempt(s: CoordinatorState, r: int) -> bool:
    m = s.members.get(r)
    return m is not None and m.state == LIVE


def _is_current_attempt(s: CoordinatorState, step: int, epoch: int) -> bool:
    return s.status == RUNNING and step == s.step and epoch == s.attempt_epoch


def _first_pending(s: CoordinatorState) -> Member | None:
    """A pending member (the earliest registered still pending), or None. Members keep their
    registration order, and forming runs have few non-pending members, so this stops early."""
    if s.n_pending == 0:
        return None
    return next((m for m in s.members.values() if m.state == PENDING), None)


def _same(a: object, b: object) -> bool:
    return a is b or a == b


def _view_changed(old: CoordinatorState, new: CoordinatorState) -> bool:
    """Did the published view change? Scalars, then container identity (a container that a
    handler did not touch is the very same object, so the O(R) comparison runs only when one
    was touched). A registration alone is not a change: the view's `pending` list is as of the
    last version (`recover coordinator status` shows the current one), so R registrations while
    forming do not send R views to every waiting replica."""
    return not (
        old.epoch == new.epoch
        and old.step == new.step
        and old.status == new.status
        and old.committed_step == new.committed_step
        and old.attempt_epoch == new.attempt_epoch
        and _same(old.live, new.live)
        and _same(old.plan, new.plan)
        and _same(old.weights, new.weights)
    )


def _durable_changed(old: CoordinatorState, new: CoordinatorState, msg: Message) -> bool:
    """Did something other than lease bookkeeping (last_seen) change?"""
    if old.leaving != new.leaving or len(old.fenced) != len(new.fenced):
        return True
    # Per-attempt reports are not durable (docs/coordinator.md, "Durability": after a restart
    # the replicas time out on wait_outcome and report again), so a burst of R done reports
    # costs no saves of the whole state (82 ms each at R = 12,500) while it is being judged.
    if old.members is new.members:
        return False
    if isinstance(msg, Heartbeat | Heartbeats):  # only last_seen
        return False
    if isinstance(msg, Register) and len(old.members) == len(new.members):
        cur = old.members.get(msg.replica_id)
        return not (cur is not None and cur.incarnation == msg.incarnation and cur.state != DEAD)
    return True
