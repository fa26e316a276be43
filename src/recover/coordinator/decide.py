"""The coordinator's rules: a pure function from (now, state, message) to (state, decisions, reason).

Job: the entry point `decide` and its dispatch of every message, the rules of the messages about
membership (registration and forming, heartbeats and leases, process exits, clean leaves, a
relay's lease verdicts, the coordinator's own pause, a new leader's takeover), and whether the
published view and the durable state changed. The rules of a step attempt (reports, commit, redo,
verify, the plan) are in attempt.py; epochs, fencing, eviction, the quorum and self-suspicion in
membership.py. No sockets, threads or clocks: the caller passes `now` (a monotonic clock), so
tests drive every race with an injected clock.

Rules (docs/design.md has the narrative):
- Forming: the run forms at epoch 1 when `expected_replicas` registrations with one fingerprint
  and one `next_step` are there (or, at `start_deadline_s`, with >= min_replicas of them).
- Re-forming: a registration after the quorum was lost, once no old member is still live, starts
  the forming again (membership._reform).
- Every membership change (death, clean leave, regroup, admission) bumps the epoch by one.
- Joiners wait as pending and are admitted only at a commit (step boundary; attempt.py).
- A lease that runs out kills its member, unless the coordinator suspects its own network
  (membership._suspects_itself). Relays (relay.py): `LeaseExpired` (a lease judged at a relay)
  kills as an expiry judged here.
- A dead or left incarnation is fenced forever; its messages are refused.

Invariants (tested): `decide` never mutates its input; while running, the plan splits
0..M-1 among the attempt's members with every id exactly once; epochs never decrease.
Costs: a heartbeat, or a batch of them, copies the members map once (O(R) in C, no sort); a
done report, or a batch of them, copies the reports map once and checks the attempt (O(R) in
C; membership is a dict lookup); a registration is O(1) apart
from that copy. Change detection compares a few scalars and container identities, never whole
keys. A commit or a redo is O(R + M) (the plan). Lease expiry (`Tick(due=...)`) looks only at the
replicas the caller names (the server keeps them in deadline order); `due=None` scans them all.
Must not: read a clock, open a socket, or mutate the state it is given (handlers work on a clone).

Size: one dispatch table and, beside it, the short rule of each membership message; a quarter of
the file is this docstring and the imports. The attempt's rules and the member-set transitions
already live apart; splitting the handlers further would part a message's rule from its route.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from recover.coordinator.attempt import (
    _evaluate_attempt,
    _new_attempt,
    _on_done,
    _on_done_batch,
    _on_failed,
    _redo,
)
from recover.coordinator.decisions import (
    Admitted,
    Decision,
    EpochChanged,
    Finished,
    MemberDead,
    Refused,
    Registered,
    Revalidated,
)
from recover.coordinator.membership import (
    _NO_STATE_LEFT,
    _alive_in_attempt,
    _bump_epoch,
    _lookup,
    _lose_quorum,
    _mismatch,
    _no_state_left,
    _reform,
    _refuse,
    _suspects_itself,
)
from recover.coordinator.messages import (
    Heartbeat,
    Heartbeats,
    LeaseExpired,
    Leave,
    Message,
    ProcessExit,
    Register,
    ReportDone,
    ReportFailed,
    ReportsDone,
    Resumed,
    Takeover,
    Tick,
)
from recover.coordinator.state_store import (
    DEAD,
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

__all__ = [
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


# ---------------------------------------------------------------- handlers


def _on_register(s: CoordinatorState, now: float, m: Register, out: list[Decision]) -> str:
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


def _on_heartbeat(s: CoordinatorState, now: float, m: Heartbeat, out: list[Decision]) -> str:
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        return _refuse(out, m, code, why)
    return _heard(s, m.replica_id, member, now)


def _on_heartbeats(s: CoordinatorState, now: float, m: Heartbeats, out: list[Decision]) -> str:
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


def _on_process_exit(s: CoordinatorState, now: float, m: ProcessExit, out: list[Decision]) -> str:
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        return _refuse(out, m, code, why)
    _kill(s, m.replica_id, "exit", f"replica {m.replica_id} process exited", out)
    return ""


def _on_lease_expired(s: CoordinatorState, now: float, m: LeaseExpired, out: list[Decision]) -> str:
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


def _on_leave(s: CoordinatorState, now: float, m: Leave, out: list[Decision]) -> str:
    member, code, why = _lookup(s, m.replica_id, m.incarnation)
    if member is None:
        return _refuse(out, m, code, why)
    s.leaving = True
    when = f"after step {m.step - 1}" if m.step > 0 else "before its first step"
    _kill(s, m.replica_id, "leave", f"replica {m.replica_id} left cleanly {when}", out)
    return f"replica {m.replica_id} left"


def _on_tick(s: CoordinatorState, now: float, m: Tick, out: list[Decision]) -> str:
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


def _on_takeover(s: CoordinatorState, now: float, m: Takeover, out: list[Decision]) -> str:
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


def _on_resumed(s: CoordinatorState, now: float, m: Resumed, out: list[Decision]) -> str:
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


# Each handler takes the message of its own type (the key): `Any` stands for "that type".
_HANDLERS: dict[type, Callable[[CoordinatorState, float, Any, list[Decision]], str]] = {
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


def _form(s: CoordinatorState, out: list[Decision], why: str) -> None:
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


def _kill(s: CoordinatorState, r: int, how: str, why: str, out: list[Decision]) -> None:
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


# ---------------------------------------------------------------- change detection


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
