"""Membership rules of the coordinator: epochs, fencing, eviction, the quorum and self-suspicion.

Job: the state transitions that change who is a member, shared by the message rules (decide.py)
and the attempt's judgment (attempt.py): bumping the epoch, losing the quorum, evicting members
(suspect hardware, unreachable), releasing planned leavers at a step boundary, re-forming a run
that lost its quorum, the admission check of a registration, and the coordinator's suspicion of
its own network. Pure functions of a cloned `CoordinatorState` that `decide` made.

Rules (docs/design.md has the narrative):
- Every membership change (death, clean leave, regroup, admission, eviction) bumps the epoch by
  one (`_bump_epoch`); epochs never decrease.
- A dead, evicted or left incarnation is fenced forever; a new incarnation of the replica may
  join. Fewer live members than min_replicas, or live members that are all joiners whose state
  transfer has not completed (`_no_state_left`), lose the quorum.
- Re-forming (`_reform`): a registration after the quorum was lost, once no old member is
  still live (the survivors save the last committed step first), starts the forming again, as a
  fresh coordinator would; the old incarnations are fenced, epochs keep increasing.
- Unreachable members (`_evict_unreachable`): a replica whose group would not form may name the
  members its probe could not dial (a TCP connect to the address they advertise: a network
  verdict, not a guess about hangs; recover.runtime.reach). Such a report defers the regroup
  until every survivor has reported but those a majority of the others named (each may then
  probe; see `_awaiting_voters`). A member named by
  a majority of the others in `unreachable_attempts` consecutive failed attempts of a step is
  evicted (how="unreachable", the probe's reason in the record); ties evict the higher id
  first, never the last member. A commit clears the count.
- Suspect hardware (`_evict_suspects`): a suspect whose ids came out finite when the others
  recomputed them computed wrongly: it is evicted (how="suspect", with `SuspectHardware`).
- A planned leave (`_release_leavers`): a member whose done report asks to leave is removed from
  the live set when that step commits (its part is in the sum), unless that would leave no member
  or fewer than min_replicas (the last replicas leave with `Leave` as before).
- Self-suspicion (`_suspects_itself`): a lease that runs out while more than half of the
  members are silent restarts their leases instead (the coordinator's own network is the likelier
  fault), for at most `self_suspicion_s` from the first suspicion until a commit.

Invariants: every function takes the clone `s` that `decide` made and changes a container only
through `s.own(name)` (copied on its first change) or by assigning a new one.
Must not: import attempt.py or decide.py (they import this module); read a clock or open a
socket; plan or judge an attempt (attempt.py does; this module only changes the member set).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from recover.checks import is_int
from recover.coordinator.decisions import (
    Decision,
    EpochChanged,
    MemberDead,
    QuorumLost,
    Reforming,
    Refused,
    Revalidated,
    SuspectHardware,
)
from recover.coordinator.messages import (
    Heartbeat,
    LeaseExpired,
    Leave,
    ProcessExit,
    Register,
    ReportDone,
    ReportFailed,
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
    CoordinatorState,
    Member,
    check_member,
)

# The messages a replica sends about itself: each names its replica_id and incarnation (what a
# refusal names; the batches, ticks and takeovers that the server makes name no replica).
FromReplica = Register | Heartbeat | ProcessExit | LeaseExpired | ReportDone | ReportFailed | Leave

# ---------------------------------------------------------------- admission


def _mismatch(s: CoordinatorState, m: Register) -> str:
    """Why `m` cannot join this run ("" if it can): its fingerprint or next_step differ."""
    if s.options.microbatches == 0:  # M comes from the replicas: each must declare it
        declared: Any = m.fingerprint.get("microbatches")  # what the replica sent: checked here
        if not is_int(declared) or declared < 1:
            return f"fingerprint field 'microbatches' must be an int >= 1, got {declared!r}"
    first = _first_pending(s) if s.status != RUNNING else None
    ref = (
        s.fingerprint if s.status == RUNNING else (first.fingerprint if first is not None else None)
    )
    if ref is not None:
        for key in sorted(set(ref) | set(m.fingerprint)):
            if ref.get(key) != m.fingerprint.get(key):
                theirs, mine = ref.get(key), m.fingerprint.get(key)
                return (
                    f"fingerprint field {key!r} differs: run has {theirs!r}, replica has {mine!r}"
                )
    if s.status == FORMING and first is not None and first.next_step != m.next_step:
        return f"next_step differs: replica {first.replica_id} has {first.next_step}, not {m.next_step}"
    return ""


def _first_pending(s: CoordinatorState) -> Member | None:
    """A pending member (the earliest registered still pending), or None. Members keep their
    registration order, and forming runs have few non-pending members, so this stops early."""
    if s.n_pending == 0:
        return None
    return next((m for m in s.members.values() if m.state == PENDING), None)


def _reform(s: CoordinatorState, now: float, out: list[Decision], r: int) -> None:
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


# ---------------------------------------------------------------- leases


def _suspects_itself(s: CoordinatorState, now: float, due: list[int], out: list[Decision]) -> bool:
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


# ---------------------------------------------------------------- epochs, eviction and the quorum


def _bump_epoch(s: CoordinatorState, out: list[Decision], why: str) -> None:
    s.epoch += 1
    # Joiners keep getting the state transfer at the start of every attempt of their first step
    # (a failure may have cut the first transfer short) until that step commits.
    s.joined = tuple(r for r in s.joined if r in s.live)
    out.append(EpochChanged(epoch=s.epoch, live=s.live, reason=f"epoch {s.epoch}: {why}"))


def _lose_quorum(s: CoordinatorState, out: list[Decision], why: str) -> None:
    s.status = QUORUM_LOST
    m, c = s.options.min_replicas, s.committed_step
    why = f"{why} (min_replicas={m}, last committed step {c})"
    out.append(QuorumLost(live=s.live, min_replicas=m, committed_step=c, reason=why))


def _evict(
    s: CoordinatorState, out: list[Decision], survivors: list[int], how: str, whys: dict[int, str],
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


def _evict_suspects(s: CoordinatorState, out: list[Decision], survivors: list[int]) -> list[int]:
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


def _evict_unreachable(s: CoordinatorState, out: list[Decision], survivors: list[int]) -> list[int]:
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


def _release_leavers(s: CoordinatorState, out: list[Decision], survivors: list[int]) -> None:
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


# ---------------------------------------------------------------- small helpers


def _refuse(out: list[Decision], m: FromReplica, code: str, why: str) -> str:
    r, inc = m.replica_id, m.incarnation
    out.append(Refused(replica_id=r, incarnation=inc, code=code, reason=f"refused ({code}): {why}"))
    return ""


def _lookup(s: CoordinatorState, r: int, inc: str) -> tuple[Member | None, str, str]:
    code, why = check_member(s, r, inc)
    return (None, code, why) if code else (s.members[r], "", "")


def _alive_in_attempt(s: CoordinatorState, r: int) -> bool:
    m = s.members.get(r)
    return m is not None and m.state == LIVE
