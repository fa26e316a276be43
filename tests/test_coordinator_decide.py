"""The coordinator's pure rules, driven with an injected clock: every rule and the listed races."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.coordinator.attempt import attempt_outcome
from recover.coordinator.decide import decide
from recover.coordinator.messages import (
    Heartbeat,
    Heartbeats,
    Leave,
    ProcessExit,
    Register,
    ReportDone,
    ReportFailed,
    Tick,
    decode_message,
)
from recover.coordinator.protocol import ProtocolError
from recover.coordinator.state_store import (
    CoordinatorOptions,
    InMemoryStateStore,
    initial_state,
    resume_state,
    state_from_json,
    state_to_json,
    view_of,
)
from recover.policy import assign

FP = {"model": "tiny", "seq_len": 64, "M": 8}


class Sim:
    """A coordinator state plus a clock that only moves when a test says so."""

    def __init__(self, **over):
        kw = dict(expected_replicas=4, microbatches=8, lease_s=1.0)
        kw.update(over)
        self.opts = CoordinatorOptions(start_deadline_s=10.0, **kw)
        self.now = 0.0
        self.state = initial_state(self.opts, self.now)
        self.inc = {}

    def send(self, msg, dt=0.0):
        self.now += dt
        self.state, ds, reason = decide(self.now, self.state, msg)
        check_invariants(self.state)
        self.last_reason = reason
        return ds

    def reg(self, r, inc=None, fp=FP, next_step=0):
        inc = inc or f"inc{r}"
        self.inc[r] = inc
        return self.send(
            Register(replica_id=r, incarnation=inc, fingerprint=fp, next_step=next_step)
        )

    def hb(self, r, epoch=None):
        e = self.state.epoch if epoch is None else epoch
        return self.send(Heartbeat(replica_id=r, incarnation=self.inc[r], epoch=e))

    def hb_all(self, but=()):
        for r in self.state.live:
            if r not in but:
                self.hb(r)

    def tick(self, dt):
        return self.send(Tick(), dt)

    def done(self, r, step=None, epoch=None, h=None, throughput=None):
        s = self.state
        return self.send(
            ReportDone(
                replica_id=r,
                incarnation=self.inc[r],
                step=s.step if step is None else step,
                epoch=s.attempt_epoch if epoch is None else epoch,
                param_hash=h,
                throughput=throughput,
            )
        )

    def failed(self, r, step=None, epoch=None, unreachable=()):
        s = self.state
        return self.send(
            ReportFailed(
                replica_id=r,
                incarnation=self.inc[r],
                step=s.step if step is None else step,
                epoch=s.attempt_epoch if epoch is None else epoch,
                reason="collective error",
                unreachable=tuple((x, f"cannot connect to 10.0.0.{x}:7: timed out")
                                  for x in unreachable),
            )
        )  # fmt: skip

    def exit(self, r):
        return self.send(ProcessExit(replica_id=r, incarnation=self.inc[r]))

    def formed(self, n=4, next_step=0):
        for r in range(n):
            self.reg(r, next_step=next_step)
        assert self.state.status == "running"
        return self


def names(ds):
    return [d.name for d in ds]


def one(ds, name):
    found = [d for d in ds if d.name == name]
    assert len(found) == 1, (name, names(ds))
    return found[0]


def check_invariants(s):
    if s.status == "running":
        assert set(s.plan) == set(s.attempt_members)
        flat = sorted(j for ids in s.plan.values() for j in ids)
        if s.options.mode == "shrink":  # the baseline drops ids: each at most once
            assert len(flat) == len(set(flat)) and set(flat) <= set(range(s.options.microbatches))
        else:
            assert flat == list(range(s.options.microbatches))  # every id exactly once
        assert set(s.live) <= set(s.attempt_members)
        assert s.epoch >= s.attempt_epoch
    assert list(s.live) == sorted(set(s.live))
    assert s.n_pending == sum(m.state == "pending" for m in s.members.values())
    assert state_from_json(state_to_json(s)) == s


# ---------------------------------------------------------------- forming


def test_forms_at_R_registrations_with_epoch_1_and_the_policy_plan():
    sim = Sim()
    for r in (3, 1, 2):
        ds = sim.reg(r, next_step=5)
        assert names(ds) == ["registered"] and sim.state.status == "forming"
    ds = sim.reg(0, next_step=5)
    assert names(ds) == ["registered", "admitted", "epoch_changed"]
    v = view_of(sim.state)
    assert (v.epoch, v.live, v.step, v.status) == (1, (0, 1, 2, 3), 5, "running")
    assert v.plan == assign(8, [0, 1, 2, 3]) and v.attempt_epoch == 1
    assert v.committed_step == -1


def test_mismatched_fingerprint_or_next_step_is_refused_naming_the_field():
    sim = Sim()
    sim.reg(0, next_step=3)
    d = one(sim.reg(1, fp={**FP, "seq_len": 128}, next_step=3), "refused")
    assert d.code == "mismatch" and "seq_len" in d.reason
    d = one(sim.reg(2, next_step=4), "refused")
    assert d.code == "mismatch" and "next_step" in d.reason
    assert sim.state.members.keys() == {0}


def test_a_joiner_must_match_the_pinned_fingerprint_but_not_next_step():
    sim = Sim().formed(next_step=3)
    d = one(sim.reg(9, fp={**FP, "model": "big"}), "refused")
    assert d.code == "mismatch" and "'model'" in d.reason
    assert d.code == one(sim.reg(8, fp={}), "refused").code  # missing fields differ too
    assert names(sim.reg(7, next_step=0)) == ["registered"]  # gets state by transfer
    assert one(sim.reg(1, inc="other"), "refused").code == "duplicate"


def test_start_deadline_with_too_few_is_quorum_lost_and_with_enough_starts():
    sim = Sim(min_replicas=2)
    sim.reg(0)
    sim.hb(0, epoch=0)
    sim.tick(9.5)
    sim.hb(0, epoch=0)
    assert sim.state.status == "forming"
    ds = sim.tick(0.6)
    assert "quorum_lost" in names(ds) and sim.state.status == "quorum_lost"
    # Nobody of that attempt is left (replica 0's lease ran out): a late replica forms it anew.
    assert "reforming" in names(sim.reg(1)) and sim.state.status == "forming"

    sim = Sim(min_replicas=2)
    sim.reg(0)
    sim.reg(1)
    for _ in range(11):
        sim.hb(0, epoch=0)
        sim.hb(1, epoch=0)
        sim.tick(0.95)
    assert sim.state.status == "running" and sim.state.live == (0, 1)
    assert sim.state.plan == assign(8, [0, 1])


# ---------------------------------------------------------------- liveness


def test_heartbeats_keep_a_lease_and_silence_expires_it():
    sim = Sim().formed()
    seen = []
    for _ in range(3):  # 0.9 s of silence from replica 2: still inside its lease
        sim.hb_all(but=(2,))
        seen += sim.tick(0.3)
    assert seen == [] and sim.state.members[2].state == "live"
    sim.hb_all(but=(2,))
    ds = sim.tick(0.3)
    dead = one(ds, "member_dead")
    assert (dead.replica_id, dead.how) == (2, "lease")
    assert sim.state.live == (0, 1, 3) and sim.state.epoch == 2


def test_a_batch_of_heartbeats_counts_each_from_when_it_was_read():
    sim = Sim(self_suspicion_s=0).formed()  # three of four silent: no self-suspicion here
    sim.now = 0.9
    seen = ((0, "inc0", 0.5), (1, "inc1", 0.9), (2, "old-incarnation", 0.9), (9, "x", 0.9))
    ds = sim.send(Heartbeats(seen=seen))
    assert ds == [] and sim.state.members[0].last_seen == 0.5
    ds = sim.tick(0.65)  # now 1.55: replica 0 was read at 0.5 (> 1 s ago), 2 and 3 at 0
    assert sorted(d.replica_id for d in ds if d.name == "member_dead") == [0, 2, 3]
    assert sim.state.live == (1,)


def test_tick_with_a_due_list_judges_only_those_replicas():
    sim = Sim(self_suspicion_s=0).formed()  # every lease ran out: no self-suspicion here
    ds = sim.send(Tick(due=(1,)), dt=1.5)  # every lease ran out, but only 1 is named
    assert [(d.name, d.replica_id) for d in ds if d.name == "member_dead"] == [("member_dead", 1)]
    assert sim.state.live == (0, 2, 3)


def test_a_pending_replica_that_expired_is_not_banned_and_registers_again():
    sim = Sim(expected_replicas=3, self_suspicion_s=0)
    sim.reg(0)
    sim.reg(1)
    ds = sim.tick(1.5)  # both pending replicas missed their lease: dead, but not fenced
    assert sorted(d.replica_id for d in ds if d.name == "member_dead") == [0, 1]
    assert one(sim.hb(0), "refused").code == "expired"
    assert sim.state.n_pending == 0 and not sim.state.fenced
    assert names(sim.reg(0)) == ["registered"]  # the same incarnation waits again
    sim.reg(1)
    sim.reg(2)
    assert sim.state.status == "running" and sim.state.live == (0, 1, 2)


def test_a_coordinator_whose_members_all_went_silent_suspects_itself_for_a_bounded_time():
    """The coordinator's own network cut: every lease runs out together. Nobody is judged;
    their leases restart (revalidated) until self_suspicion_s after the first suspicion. Heard
    again and a commit later, the suspicion is over; a silence past the bound is judged."""
    sim = Sim(self_suspicion_s=3.0).formed()
    epoch = sim.state.epoch
    ds = sim.tick(1.1)
    assert names(ds) == ["revalidated"] and one(ds, "revalidated").members == (0, 1, 2, 3)
    assert sim.state.live == (0, 1, 2, 3) and sim.state.epoch == epoch
    assert "suspects its own network" in one(ds, "revalidated").reason
    assert names(sim.tick(1.1)) == ["revalidated"]  # 1.1 s into the suspicion
    assert names(sim.tick(1.1)) == ["revalidated"]  # 2.2 s
    ds = sim.tick(1.1)  # 3.3 s: past the bound, the silence is theirs
    assert sorted(d.replica_id for d in ds if d.name == "member_dead") == [0, 1, 2, 3]
    assert sim.state.status == "quorum_lost"

    sim = Sim(self_suspicion_s=3.0).formed()
    assert names(sim.tick(1.1)) == ["revalidated"]
    sim.hb_all()  # the network is back: the in-flight step commits
    for r in range(4):
        sim.done(r)
    assert sim.state.committed_step == 0 and sim.state.suspect_since is None
    sim.tick(2.5)
    assert names(sim.tick(1.1)) == ["revalidated"]  # a later cut is suspected afresh
    assert sim.state.live == (0, 1, 2, 3)


def test_a_minority_that_goes_silent_is_judged_at_its_lease():
    """Two of four silent is no majority: they die at their lease, as always; so does the one
    replica of a one-replica job (its silence and the coordinator's cannot be told apart)."""
    sim = Sim(self_suspicion_s=3.0).formed()
    sim.now += 1.1
    sim.hb(2)
    sim.hb(3)
    ds = sim.tick(0.0)
    assert sorted(d.replica_id for d in ds if d.name == "member_dead") == [0, 1]
    assert "revalidated" not in names(ds)
    sim = Sim(expected_replicas=1, self_suspicion_s=3.0).formed(n=1)
    assert "member_dead" in names(sim.tick(1.1))


def test_process_exit_is_an_immediate_death_with_a_new_epoch():
    sim = Sim().formed()
    ds = sim.exit(1)
    assert one(ds, "member_dead").how == "exit"
    assert one(ds, "epoch_changed").live == (0, 2, 3)
    assert sim.state.epoch == 2


# ---------------------------------------------------------------- commit and redo


def test_all_done_commits_and_plans_the_next_step():
    sim = Sim().formed(next_step=7)
    for r in (0, 1, 2):
        assert sim.done(r) == []
    ds = sim.done(3)
    c = one(ds, "committed")
    assert (c.step, c.epoch) == (7, 1)
    s = sim.state
    assert (s.committed_step, s.step, s.epoch, s.attempt_epoch) == (7, 8, 1, 1)
    assert s.plan == assign(8, [0, 1, 2, 3]) and s.reports == {}


def test_death_while_commit_pending_commits_when_all_survivors_are_done():
    sim = Sim().formed()
    for r in (0, 1, 2):
        sim.done(r)
    ds = sim.exit(3)  # died after the reduce completed: the sum is complete
    assert names(ds) == ["member_dead", "epoch_changed", "committed"]
    s = sim.state
    assert (s.committed_step, s.step, s.epoch, s.attempt_epoch) == (0, 1, 2, 2)
    assert s.plan == assign(8, [0, 1, 2])


def test_death_while_commit_pending_redoes_when_a_survivor_failed():
    sim = Sim().formed()
    lost = sim.state.plan[3]
    sim.done(0)
    sim.done(1)
    assert one(sim.failed(2), "epoch_changed").epoch == 2  # a failure regroups at once
    ds = sim.exit(3)
    redo = one(ds, "redo")
    assert (redo.step, redo.epoch) == (0, 3) and redo.lost == lost
    assert sorted(j for ids in redo.reassigned.values() for j in ids) == list(lost)
    s = sim.state
    assert s.attempt_epoch == 3 and s.attempt_members == (0, 1, 2) and s.committed_step == -1
    assert s.plan[0][: len(assign(8, range(4))[0])] == assign(8, range(4))[0]
    assert attempt_outcome(s, 0, 1)[0] == "redo" and attempt_outcome(s, 0, 3) is None


def test_two_deaths_in_one_step_lose_the_union_of_their_ids():
    sim = Sim().formed()
    h = dict(sim.state.plan)
    sim.exit(1)
    sim.exit(3)
    assert sim.state.epoch == 3
    sim.failed(0)
    ds = sim.failed(2)
    redo = one(ds, "redo")
    assert redo.epoch == 3 and redo.lost == tuple(sorted(h[1] + h[3]))
    assert "epoch_changed" not in names(ds)  # the deaths already moved the epoch
    assert set(sim.state.plan) == {0, 2}


def test_death_during_recovery_redoes_the_redo_with_the_reassigned_ids():
    sim = Sim().formed()
    sim.exit(3)
    for r in (0, 1, 2):
        sim.failed(r)
    assert sim.state.attempt_epoch == 2
    held_by_1 = sim.state.plan[1]  # its own ids plus a share of 3's
    assert len(held_by_1) > 2
    sim.exit(1)  # dies during the redo
    sim.done(0)
    ds = sim.failed(2)
    redo = one(ds, "redo")
    assert redo.epoch == 3 and redo.lost == tuple(sorted(held_by_1))
    sim.done(0)
    ds = sim.done(2)
    assert one(ds, "committed").step == 0 and sim.state.plan == assign(8, [0, 2])


def test_join_during_a_failure_is_admitted_only_at_the_next_commit():
    sim = Sim().formed()
    sim.exit(3)
    ds = sim.reg(7)
    assert names(ds) == ["registered"] and sim.state.members[7].state == "pending"
    for r in (0, 1):
        sim.failed(r)
    ds = sim.failed(2)
    assert one(ds, "redo").epoch == 2 and 7 not in sim.state.plan
    sim.hb(7)
    sim.done(0)
    sim.done(1)
    ds = sim.done(2)
    assert names(ds) == ["committed", "admitted", "epoch_changed"]
    s = sim.state
    assert s.live == (0, 1, 2, 7) and s.epoch == 3 and s.attempt_epoch == 3
    assert s.plan == assign(8, [0, 1, 2, 7])


def test_hung_member_wakes_after_eviction_is_refused_and_may_rejoin_anew():
    sim = Sim().formed()
    for _ in range(4):
        sim.hb_all(but=(2,))
        sim.tick(0.3)
    assert sim.state.members[2].how == "lease"
    assert one(sim.hb(2), "refused").code == "evicted"
    assert one(sim.done(2, epoch=1), "refused").code == "evicted"
    assert one(sim.reg(2, inc="inc2"), "refused").code == "evicted"
    ds = sim.reg(2, inc="fresh-2")
    assert names(ds) == ["registered"] and sim.state.members[2].state == "pending"


def test_a_failed_report_regroups_at_once_and_the_attempt_is_redone_by_the_same_members():
    sim = Sim().formed()
    before = dict(sim.state.plan)
    ds = sim.failed(1)
    assert one(ds, "epoch_changed").live == (0, 1, 2, 3) and sim.state.epoch == 2
    sim.done(0)
    sim.failed(2)
    ds = sim.done(3)
    redo = one(ds, "redo")
    assert redo.epoch == 2 and "epoch_changed" not in names(ds)
    assert redo.lost == () and sim.state.plan == before and sim.state.live == (0, 1, 2, 3)


def test_an_older_clients_failed_report_naming_suspects_is_taken_and_evicts_nobody():
    """Clients from before the accusation rule was removed send `suspects`: the decoder ignores
    the field, the report counts as any failed report, and the named replica stays live."""
    sim = Sim().formed()
    req = {"kind": "failed", "replica_id": 0, "incarnation": "inc0", "step": 0, "epoch": 1}
    msg = decode_message({**req, "suspects": [3], "reason": "collective error"})
    assert msg == ReportFailed(replica_id=0, incarnation="inc0", step=0, epoch=1,
                               reason="collective error")  # fmt: skip
    assert one(sim.send(msg), "epoch_changed").epoch == 2
    sim.hb_all(but=(3,))
    assert "member_dead" not in names(sim.tick(0.9))  # within its lease: nobody is judged
    assert sim.state.members[3].state == "live" and sim.state.reports == {0: "failed"}


@settings(max_examples=100, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 0.999), min_size=1, max_size=20),
    ticks=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=40),
)
def test_no_member_is_evicted_within_a_lease_of_its_last_heartbeat(gaps, ticks):
    """The fence window (client.writes_allowed) is the lease: a replica that heard a heartbeat
    round answered may write for lease_s from when it sent it, so the rules must never declare a
    member dead (or fence it) less than lease_s after the coordinator read its last heartbeat
    (which is after it was sent), whatever the ticks and the others do; and must once it is
    silent for longer."""
    sim = Sim().formed()
    lease = sim.opts.lease_s
    heard = sim.now
    ticks = iter(ticks)
    for gap in gaps:  # replica 3 heartbeats `gap` after its last one, ticks in between
        target = heard + gap
        for dt in ticks:
            if sim.now + dt >= target:
                break
            sim.hb_all(but=(3,))
            sim.tick(dt)
            assert sim.state.members[3].state == "live", (sim.now - heard, sim.last_reason)
        sim.now = target
        sim.hb_all()
        heard = sim.now
    assert "member_dead" not in names(sim.tick(lease - 1e-6))  # just within its lease: live
    assert sim.state.members[3].incarnation not in sim.state.fenced
    sim.hb_all(but=(3,))
    dead = one(sim.tick(2e-3), "member_dead")
    assert (dead.replica_id, dead.how) == (3, "lease")


# ---------------------------------------------------------------- fencing, quorum, divergence


def test_stale_and_unknown_requests_are_refused_but_old_heartbeats_are_fine():
    sim = Sim().formed()
    sim.exit(3)
    for r in (0, 1, 2):
        sim.failed(r)
    assert sim.state.attempt_epoch == 2
    assert one(sim.done(0, epoch=1), "refused").code == "stale"
    assert one(sim.done(0, step=1), "refused").code == "stale"
    assert sim.hb(0, epoch=1) == []
    ds = sim.send(Heartbeat(replica_id=5, incarnation="nobody", epoch=1))
    assert one(ds, "refused").code == "unknown"
    assert attempt_outcome(sim.state, 5, 2)[0] == "stale"


def test_quorum_lost_says_to_resume_from_the_checkpoint():
    sim = Sim(min_replicas=3).formed()
    for r in range(4):
        sim.done(r)
    sim.exit(0)
    ds = sim.exit(1)
    q = one(ds, "quorum_lost")
    assert "checkpoint" in q.reason and q.committed_step == 0
    assert sim.state.status == "quorum_lost"
    assert attempt_outcome(sim.state, 1, sim.state.attempt_epoch)[0] == "stopped"
    assert one(sim.done(2), "refused").code == "quorum_lost"


def test_divergent_param_hashes_stop_the_run_loudly():
    sim = Sim().formed()
    for r, h in ((0, "aa"), (1, "aa"), (2, "bb"), (3, "aa")):
        ds = sim.done(r, h=h)
    d = one(ds, "diverged")
    assert d.step == 0 and d.hashes == {0: "aa", 1: "aa", 2: "bb", 3: "aa"}
    assert "[2]" in d.reason and "bb" in d.reason and "[0, 1, 3]" in d.reason
    assert sim.state.status == "diverged" and sim.state.committed_step == 0
    assert attempt_outcome(sim.state, 0, 1)[0] == "stopped"


def test_equal_hashes_commit_normally():
    sim = Sim().formed()
    for r in range(4):
        ds = sim.done(r, h="same")
    assert names(ds) == ["committed"] and sim.state.status == "running"


def test_everyone_leaving_finishes_without_quorum_loss():
    sim = Sim(min_replicas=4).formed()
    for r in range(4):
        sim.done(r)
    for r in range(3):
        ds = sim.send(Leave(replica_id=r, incarnation=sim.inc[r], step=1))
        assert "quorum_lost" not in names(ds)
    ds = sim.send(Leave(replica_id=3, incarnation=sim.inc[3], step=1))
    assert "finished" in names(ds) and sim.state.status == "finished"
    assert one(sim.hb(0), "refused").code == "left"


# ---------------------------------------------------------------- weights, purity, persistence


def test_throughput_weights_and_joiners_start_at_the_median():
    sim = Sim(
        expected_replicas=3, microbatches=12, balance="throughput", throughput_ema_alpha=0.3
    ).formed(n=3)
    sim.reg(5)
    for r, tp in ((0, 1.0), (1, 1.0), (2, 2.0)):
        sim.done(r, throughput=tp)  # one sample per replica per step, with its report
    s = sim.state
    assert s.weights == {0: 1.0, 1: 1.0, 2: 2.0, 5: 1.0}
    assert [len(s.plan[r]) for r in (0, 1, 2, 5)] == [3, 2, 5, 2]
    # The next samples fold into a moving average (alpha 0.3 here), not a replacement,
    # and the plan follows only a material change (rebalance_threshold 0.1 of a share): replica
    # 2's average falls to 1.7, its share from 0.40 to 0.36 (-10%): the plan stays.
    for r in (0, 1, 2, 5):
        sim.done(r, throughput=1.0)
    assert sim.state.weights == {0: 1.0, 1: 1.0, 2: 2.0, 5: 1.0}
    assert sim.state.members[2].throughput == pytest.approx(0.3 * 1.0 + 0.7 * 2.0)
    for r in (0, 1, 2, 5):  # 1.49: its share falls to 0.33 (-17%): re-planned
        sim.done(r, throughput=1.0)
    assert sim.state.weights[2] == pytest.approx(0.3 + 0.7 * 1.7)
    assert [len(sim.state.plan[r]) for r in (0, 1, 2, 5)] == [3, 3, 4, 2]


def test_decide_never_mutates_its_input():
    sim = Sim().formed()
    before = copy.deepcopy(sim.state)
    frozen = sim.state
    decide(5.0, frozen, ProcessExit(replica_id=1, incarnation="inc1"))
    decide(5.0, frozen, Tick())
    decide(5.0, frozen, Heartbeats(seen=((0, "inc0", 4.0),)))
    for r in range(4):
        decide(5.0, frozen, ReportDone(replica_id=r, incarnation=f"inc{r}", step=0, epoch=1))
    assert frozen == before


def test_store_round_trip_and_resume_restart_leases():
    sim = Sim().formed()
    sim.done(0)
    store = InMemoryStateStore()
    store.save(sim.state)
    loaded = store.load()
    assert loaded == sim.state
    resumed = resume_state(loaded, 1000.0)
    assert all(m.last_seen == 1000.0 for m in resumed.members.values())
    s2, ds, _ = decide(1000.5, resumed, Tick())
    assert ds == [] and s2.reports == {0: "done"}


OPS = st.lists(
    st.tuples(
        st.sampled_from(["hb", "done", "failed", "exit", "tick", "join", "silence", "round"]),
        st.integers(0, 5),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_random_histories_keep_every_invariant(ops):
    sim = Sim(expected_replicas=4, microbatches=7)
    sim.formed()
    gen = {}
    runs: list[list[int]] = [[]]  # the steps committed by each formation of the run
    epochs = [sim.state.epoch]
    for op, r in ops:
        m = sim.state.members.get(r)
        if op == "tick":
            ds = sim.tick(0.05 + 0.2 * r)
        elif op == "silence":
            ds = sim.tick(1.1)
        elif op == "round":  # every live member of the attempt reports; odd r: one fails
            ds = []
            for q in [q for q in sim.state.attempt_members if q in sim.state.live]:
                ds += sim.failed(q) if r % 2 and q == sim.state.live[0] else sim.done(q)
        elif op == "join":
            gen[r] = gen.get(r, 0) + 1
            ds = sim.reg(r, inc=f"inc{r}-{gen[r]}")
        elif m is None or r not in sim.inc:
            continue
        elif op == "hb":
            ds = sim.hb(r)
        elif op == "done":
            ds = sim.done(r)
        elif op == "failed":
            ds = sim.failed(r)
        else:
            ds = sim.exit(r)
        for d in ds:
            if d.name == "reforming":  # a join after a lost quorum: the run forms again,
                runs.append([])  # from the step its new replicas' checkpoints hold
            elif d.name == "committed":
                runs[-1].append(d.step)
        epochs.append(sim.state.epoch)
    assert runs[0] == list(range(len(runs[0])))  # steps commit once, in order
    for run in runs[1:]:  # (Sim registers every replica with next_step 0)
        assert run == list(range(len(run)))
    assert sim.state.committed_step == (runs[-1][-1] if runs[-1] else -1)
    assert epochs == sorted(epochs)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(expected_replicas=0), "expected_replicas"),
        (dict(microbatches=-1), "microbatches"),
        (dict(min_replicas=5), "--min-replicas"),  # a setting: named by its flag
        (dict(lease_s=0.0), "--lease"),
        (dict(start_deadline_s=float("nan")), "--start-deadline"),
        (dict(balance="fastest"), "--balance"),
        (dict(throughput_ema_alpha=2.0), "throughput_ema_alpha"),
    ],
)
def test_options_validation_names_the_field(kw, field):
    base = dict(expected_replicas=4, microbatches=8)
    with pytest.raises(ValueError, match=field):
        CoordinatorOptions(**{**base, **kw})


def test_a_coordinator_that_learns_m_may_take_over_a_state_that_learned_it():
    """A launcher's coordinators are not told M (the replicas declare it): a standby taking over
    a state whose M was learned must match it; a fixed M or another setting must not."""
    learned = CoordinatorOptions(expected_replicas=2, microbatches=6)
    assert CoordinatorOptions(expected_replicas=2).matches(learned)
    assert CoordinatorOptions(expected_replicas=2, microbatches=6).matches(learned)
    assert not CoordinatorOptions(expected_replicas=2, microbatches=4).matches(learned)
    assert not CoordinatorOptions(expected_replicas=2, lease_s=2.0).matches(learned)
    assert not CoordinatorOptions(expected_replicas=3).matches(learned)


def test_joiners_are_marked_for_state_transfer_until_their_first_step_commits():
    sim = Sim().formed()
    assert view_of(sim.state).joined == ()
    sim.reg(7)
    for r in range(4):
        sim.done(r)
    assert sim.state.live == (0, 1, 2, 3, 7) and view_of(sim.state).joined == (7,)
    # A death during the joiner's first step: the redo's epoch still marks it (the transfer may
    # have been cut short), without the dead.
    sim.exit(3)
    for r in (0, 1, 2, 7):
        sim.failed(r)
    assert one_view(sim).joined == (7,) and sim.state.attempt_epoch == sim.state.epoch
    for r in (0, 1, 2, 7):
        sim.done(r)
    assert view_of(sim.state).joined == ()  # the committed step proves it held the state
    state = state_from_json(state_to_json(sim.state))
    assert state.joined == ()


def test_when_only_joiners_without_the_state_are_left_the_quorum_is_lost():
    # Replicas 0..3 run; 7 joins and is admitted at a boundary; every old member dies before
    # the joiner's first step commits: nobody holds the committed state any more, so the run
    # stops (resume from the checkpoint) instead of going on with 7's untrained model.
    sim = Sim().formed()
    sim.reg(7)
    for r in range(4):
        sim.done(r)
    assert sim.state.live == (0, 1, 2, 3, 7)
    for r in (0, 1, 2):
        sim.exit(r)
    assert sim.state.status == "running"  # 3 still holds it
    ds = sim.exit(3)
    assert sim.state.status == "quorum_lost"
    assert "every replica that held the committed state is gone" in one(ds, "quorum_lost").reason
    # Once the joiner's first step has committed it holds the state: no such stop.
    sim = Sim().formed()
    sim.reg(7)
    for r in range(4):
        sim.done(r)
    for r in (0, 1, 2, 3, 7):
        sim.done(r)
    for r in (0, 1, 2, 3):
        sim.exit(r)
    assert sim.state.status == "running" and sim.state.live == (7,)


def test_a_state_saved_before_the_plan_was_named_plan_still_loads():
    sim = Sim().formed()
    sim.exit(3)
    for r in (0, 1, 2):
        sim.failed(r)
    assert sim.state.plan != assign(8, [0, 1, 2])  # a redo's plan: 3's ids reassigned
    saved = json.loads(state_to_json(sim.state))
    saved["holdings"] = saved.pop("plan")  # the previous version's key
    assert state_from_json(json.dumps(saved)) == sim.state


def test_a_state_saved_with_the_accusation_rule_still_loads():
    """A state saved (in etcd, say) by a version that had the accusation rule holds its
    `accusations` and the option `suspect_grace_s`: both are dropped on load, and the loaded
    state runs on (an open accusation is not carried over: the lease judges that replica)."""
    sim = Sim().formed()
    sim.done(0)
    saved = json.loads(state_to_json(sim.state))
    saved["accusations"] = {"3": {"suspect": 3, "accuser": 1, "at": 0.5, "step": 0, "epoch": 1}}
    saved["options"]["suspect_grace_s"] = 0.3
    loaded = state_from_json(json.dumps(saved))
    assert loaded == sim.state and loaded.options == sim.opts
    assert not hasattr(loaded, "accusations")
    resumed = resume_state(loaded, 100.0)
    for r in (1, 2, 3):
        resumed, ds, _ = decide(100.0, resumed, ReportDone(replica_id=r, incarnation=f"inc{r}",
                                                            step=0, epoch=1))  # fmt: skip
    assert names(ds) == ["committed"] and resumed.committed_step == 0


def one_view(sim):
    return view_of(sim.state)


def test_shrink_baseline_drops_the_dead_replicas_ids_and_keeps_fixed_slots():
    sim = Sim(mode="shrink").formed()
    full = assign(8, [0, 1, 2, 3])
    assert sim.state.plan == full
    sim.exit(3)
    for r in (0, 1, 2):
        sim.failed(r)
    assert sim.state.plan == {r: full[r] for r in (0, 1, 2)}  # nothing reassigned
    for r in (0, 1, 2):
        sim.done(r)
    assert sim.state.plan == {r: full[r] for r in (0, 1, 2)}  # the batch stays shrunk
    with pytest.raises(ValueError, match="mode"):
        CoordinatorOptions(expected_replicas=2, microbatches=4, mode="other")


def test_microbatches_learned_from_the_replicas_when_not_given():
    """M = 0 in the options: the run takes M from the fingerprints, and a replica that declares
    none (or another M) is refused with the field named."""
    opts = CoordinatorOptions(expected_replicas=2, microbatches=0)
    s = initial_state(opts, 0.0)
    s, out, reason = decide(
        0.0, s, Register(replica_id=0, incarnation="a", fingerprint={}, next_step=0)
    )
    assert "'microbatches' must be an int >= 1" in reason and 0 not in s.members
    fp = {"microbatches": 6}
    s = initial_state(opts, 0.0)
    s, _, _ = decide(0.0, s, Register(replica_id=0, incarnation="a", fingerprint=fp, next_step=0))
    s, _, _ = decide(0.0, s, Register(replica_id=1, incarnation="b", fingerprint=fp, next_step=0))
    assert s.status == "running"
    assert sorted(j for ids in s.plan.values() for j in ids) == list(range(6))
    s2, out, reason = decide(
        0.1,
        s,
        Register(replica_id=2, incarnation="c", fingerprint={"microbatches": 8}, next_step=0),
    )
    assert "'microbatches' differs" in reason


def test_the_commit_names_one_writer_alive_at_the_decision():
    """The writer of a step's records is decided with its commit: the lowest member of the
    attempt alive at the decision, published in the view until the next commit (a replica that
    leaves right after, or a joiner, changes nothing)."""
    sim = Sim().formed(4)
    for r in range(4):
        sim.done(r)
    assert view_of(sim.state).committed_step == 0 and view_of(sim.state).writer == 0
    # Step 1: replica 0 reports done, then dies before the others report: the sum is complete
    # (its part is in every survivor's reduce), the step commits, and replica 1 writes it.
    sim.done(0)
    sim.exit(0)
    for r in (1, 2, 3):
        sim.done(r)
    assert view_of(sim.state).committed_step == 1 and view_of(sim.state).writer == 1
    # The writer named at the commit stays, whatever moves later before the next commit.
    sim.send(Leave(replica_id=1, incarnation=sim.inc[1], step=2))
    assert view_of(sim.state).committed_step == 1 and view_of(sim.state).writer == 1


def test_a_writer_lost_before_the_next_step_hands_its_records_to_the_next_one():
    """The writer of step t writes its records before it reports step t+1. When it is not among
    t+1's survivors (died or left after t's commit), the writer of t+1 makes sure of the records
    from t on (records_from), and it is one that saw t's commit: not a joiner of t+1."""
    sim = Sim().formed(4)
    for r in range(4):
        sim.done(r)
    v = view_of(sim.state)
    assert (v.committed_step, v.writer, v.records_from) == (0, 0, 0)
    for r in range(4):  # the writer of step 0 reported step 1: step 0 is recorded
        sim.done(r)
    v = view_of(sim.state)
    assert (v.committed_step, v.writer, v.records_from) == (1, 0, 1)
    # Replica 0, the writer of step 1, dies after the commit; a new replica 0 registers and is
    # admitted at the commit of step 2, whose writer (replica 1) owes step 1's records too.
    sim.exit(0)
    sim.reg(0, inc="inc0b")
    for r in (1, 2, 3):  # (their reduce was complete before replica 0 died: no redo)
        sim.done(r)
    v = view_of(sim.state)
    assert (v.committed_step, v.writer, v.records_from) == (2, 1, 1)
    assert v.joined == (0,)
    # Replica 1 dies too before reporting step 3: the joiner 0 is the lowest survivor of step 3
    # but never saw the commits of steps 1 and 2, so replica 2 writes them.
    sim.exit(1)
    for r in (0, 2, 3):
        sim.done(r)
    v = view_of(sim.state)
    assert (v.committed_step, v.writer, v.records_from) == (3, 2, 1)
    for r in sorted(sim.state.live):  # replica 2 reported step 4: everything before is written
        sim.done(r)
    v = view_of(sim.state)
    assert (v.committed_step, v.writer, v.records_from) == (4, 0, 4)


def test_a_planned_leave_is_released_at_its_commit_without_a_redo():
    """A done report that asks to leave: the step commits with the leaver's part, the leaver is
    out of the live set at once (fenced as left), the next step is planned without it and never
    waits for it; it is not named writer. The last replicas (or min_replicas) are not released."""
    sim = Sim(expected_replicas=3, min_replicas=2).formed(3)
    sim.send(ReportDone(replica_id=0, incarnation=sim.inc[0], step=0, epoch=1, leaving=True))
    ds = sim.done(1) + sim.done(2)
    assert names(ds) == ["committed", "epoch_changed"]
    v = view_of(sim.state)
    assert v.live == (1, 2) and sorted(v.plan) == [1, 2] and v.writer == 1
    assert sorted(j for ids in v.plan.values() for j in ids) == list(range(8))
    assert sim.state.fenced[sim.inc[0]] == "left"
    assert attempt_outcome(sim.state, 0, 1)[0] == "committed"
    for r in (1, 2):
        ds = sim.done(r)
    assert "redo" not in names(ds) and sim.state.committed_step == 1
    # Two replicas and min_replicas=2: releasing one would lose the quorum; it leaves with Leave.
    sim.send(ReportDone(replica_id=1, incarnation=sim.inc[1], step=2, epoch=2, leaving=True))
    sim.done(2)
    assert sim.state.live == (1, 2) and sim.state.committed_step == 2


def done_part(sim, r, finite):
    s = sim.state
    return sim.send(
        ReportDone(
            replica_id=r, incarnation=sim.inc[r], step=s.step, epoch=s.attempt_epoch, finite=finite
        )
    )


def test_a_non_finite_part_is_recomputed_elsewhere_and_its_replica_evicted_if_it_erred():
    """Replica 1's part is not finite, the others' are: not committed; its ids are recomputed by
    the others while it holds nothing and drops its sum. Finite there: replica 1 is evicted as
    suspect hardware and the step commits without it. Not finite there either: the step commits
    as it is (every replica skips it) and replica 1 stays. Every part non-finite: commits at once."""
    sim = Sim(expected_replicas=3).formed(3)
    held = dict(sim.state.plan)
    for r in (0, 2):
        done_part(sim, r, True)
    ds = done_part(sim, 1, False)
    assert names(ds) == ["epoch_changed", "redo"] and sim.state.committed_step == -1
    v = view_of(sim.state)
    assert v.discard == (1,) and v.plan[1] == () and one(ds, "redo").lost == held[1]
    assert sorted(j for ids in v.plan.values() for j in ids) == list(range(8))
    for r in (0, 1, 2):
        ds = done_part(sim, r, True)
    assert names(ds)[:2] == ["suspect_hardware", "member_dead"] and "committed" in names(ds)
    assert one(ds, "member_dead").how == "suspect" and sim.state.fenced[sim.inc[1]] == "evicted"
    assert sim.state.live == (0, 2) and view_of(sim.state).discard == ()
    # Not finite on the others either: the ids themselves are not finite, nobody erred.
    sim = Sim(expected_replicas=3).formed(3)
    for r, ok in ((0, True), (1, False), (2, True)):
        done_part(sim, r, ok)
    for r, ok in ((0, False), (1, True), (2, True)):
        ds = done_part(sim, r, ok)
    assert "committed" in names(ds) and "member_dead" not in names(ds)
    assert sim.state.live == (0, 1, 2) and sim.state.verifying == ()
    for r in (0, 1, 2):  # every part non-finite (a diverging run): commits at once
        ds = done_part(sim, r, False)
    assert "committed" in names(ds) and "redo" not in names(ds)


# ---------------------------------------------------------------- unreachable members


def unreachable_attempt(sim, names, quiet=()):
    """One failed attempt: each reporter of `names` ({reporter: named ids}) reports in order,
    then the `quiet` members (whose builds the new epoch cut short) report naming nobody."""
    ds = []
    for r, named in names.items():
        ds += sim.failed(r, unreachable=named)
    for r in quiet:
        ds += sim.failed(r)
    return ds


def test_a_member_no_one_can_dial_is_evicted_after_two_attempts_and_the_step_goes_on():
    sim = Sim().formed()
    first = sim.state.epoch
    # The regroup waits for every voter: a new epoch would cut their builds (and probes) short.
    assert "epoch_changed" not in names(sim.failed(0, unreachable=[3]))
    assert "epoch_changed" not in names(sim.failed(1, unreachable=[3]))
    # Named by a majority, replica 3 is not waited for (it may be blocked in its build).
    assert one(sim.failed(2, unreachable=[3]), "epoch_changed").epoch == first + 1
    ds = sim.failed(3)
    assert "member_dead" not in names(ds) and one(ds, "redo").lost == ()
    assert sim.state.unreachable_strikes == {3: 1} and sim.state.live == (0, 1, 2, 3)
    ds = unreachable_attempt(sim, {0: [3], 1: [3], 2: [3]}, quiet=[3])
    dead = one(ds, "member_dead")
    assert (dead.replica_id, dead.how) == (3, "unreachable")
    assert "10.0.0.3:7" in dead.reason and "2 consecutive attempts" in dead.reason
    redo = one(ds, "redo")
    assert set(redo.lost) == set(assign(8, (0, 1, 2, 3))[3]) and sim.state.live == (0, 1, 2)
    for r in (0, 1, 2):
        ds = sim.done(r)
    assert one(ds, "committed").step == 0 and sim.state.unreachable_strikes == {}
    assert sim.state.fenced["inc3"] == "evicted"


def test_a_blip_between_commits_evicts_nobody():
    sim = Sim().formed()
    unreachable_attempt(sim, {0: [3], 1: [3], 2: [3]}, quiet=[3])
    assert sim.state.unreachable_strikes == {3: 1}
    for r in range(4):
        ds = sim.done(r)
    assert "committed" in names(ds) and sim.state.unreachable_strikes == {}
    ds = unreachable_attempt(sim, {0: [3], 1: [3], 2: [3]}, quiet=[3])
    assert "member_dead" not in names(ds) and sim.state.live == (0, 1, 2, 3)


def test_a_minority_that_cannot_dial_a_member_evicts_nobody():
    sim = Sim().formed()
    for _ in range(4):
        ds = unreachable_attempt(sim, {0: [3]}, quiet=[1, 2, 3])
        assert "member_dead" not in names(ds) and one(ds, "redo")
    assert sim.state.live == (0, 1, 2, 3) and sim.state.unreachable_strikes == {}


def test_two_members_that_cannot_dial_each_other_lose_the_higher_id_only():
    sim = Sim(expected_replicas=2).formed(2)
    for _ in range(2):
        ds = unreachable_attempt(sim, {0: [1], 1: [0]})
    dead = one(ds, "member_dead")
    assert dead.replica_id == 1 and sim.state.live == (0,) and sim.state.status == "running"


def test_the_replica_that_cannot_dial_anyone_is_the_one_evicted():
    """Its own probe names every peer; each peer names only it: the majority names it."""
    sim = Sim().formed()
    for _ in range(2):
        ds = unreachable_attempt(sim, {3: [0, 1, 2], 0: [3], 1: [3], 2: [3]})
    assert [(d.replica_id, d.how) for d in ds if d.name == "member_dead"] == [(3, "unreachable")]
    assert sim.state.live == (0, 1, 2)


def test_the_unreachable_field_is_decoded_and_checked():
    req = {"kind": "failed", "replica_id": 0, "incarnation": "inc0", "step": 0, "epoch": 1}
    msg = decode_message({**req, "unreachable": [[3, "no route"]]})
    assert msg.unreachable == ((3, "no route"),)
    with pytest.raises(ProtocolError, match="unreachable"):
        decode_message({**req, "unreachable": [["3", "no route"]]})


# ---------------------------------------------------------------- a quorum lost, then resumed


def test_a_run_that_lost_its_quorum_forms_again_from_resumed_replicas():
    sim = Sim(expected_replicas=2, min_replicas=2).formed(2)
    for r in (0, 1):
        sim.done(r)
    assert sim.state.committed_step == 0
    one(sim.exit(1), "quorum_lost")
    # Replica 0 is still live (it saves the last committed step): a restart must wait for it.
    ds = sim.reg(1, inc="inc1-b", next_step=1)
    refused = one(ds, "refused")
    assert refused.code == "quorum_lost" and "still live" in refused.reason
    sim.exit(0)  # it saved and exited
    epoch = sim.state.epoch
    ds = sim.reg(0, inc="inc0-b", next_step=1)
    reform = one(ds, "reforming")
    assert reform.lost_at == 0 and sim.state.status == "forming"
    assert sim.state.fenced["inc0"] == sim.state.fenced["inc1"] == "evicted"
    ds = sim.reg(1, inc="inc1-b", next_step=1)
    assert one(ds, "admitted").replica_ids == (0, 1)
    assert sim.state.step == 1 and sim.state.epoch > epoch and sim.state.status == "running"
    for r in (0, 1):
        ds = sim.done(r)
    assert one(ds, "committed").step == 1
    # An old incarnation is fenced for good.
    assert one(sim.reg(0, inc="inc0"), "refused").code == "evicted"
