"""Property tests of the workload policy: every id exactly once, fair shares, contiguity."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.policy import assign, compute_shares, reassign

replica_sets = st.lists(st.integers(0, 64), min_size=1, max_size=12, unique=True)


@st.composite
def weighted(draw):
    live = draw(replica_sets)
    if draw(st.booleans()):
        return live, None
    ws = draw(st.lists(st.floats(1e-3, 1e3), min_size=len(live), max_size=len(live)))
    return live, dict(zip(live, ws, strict=True))


def _share_ok(counts: dict[int, int], n: int, weights: dict[int, float] | None) -> None:
    w = {r: 1.0 for r in counts} if weights is None else {r: weights[r] for r in counts}
    total = math.fsum(w.values())
    for r, c in counts.items():
        assert abs(c - n * w[r] / total) < 1 + 1e-9, (r, c, n, w)


@settings(max_examples=300, deadline=None)
@given(M=st.integers(1, 500), lw=weighted())
def test_assign_exactly_once_fair_contiguous_deterministic(M, lw):
    live, weights = lw
    plan = assign(M, live, weights)
    assert sorted(plan) == sorted(live)
    flat = [j for r in sorted(plan) for j in plan[r]]
    assert flat == list(range(M))  # every id once, contiguous ranges in replica id order
    _share_ok({r: len(ids) for r, ids in plan.items()}, M, weights)
    assert assign(M, list(reversed(live)), weights) == plan  # input order does not matter
    if M >= len(live) and weights is None:
        assert all(plan[r] for r in live)


@settings(max_examples=300, deadline=None)
@given(
    lost=st.lists(st.integers(0, 1000), unique=True, max_size=200),
    lw=weighted(),
)
def test_reassign_covers_exactly_the_lost_ids(lost, lw):
    survivors, weights = lw
    extra = reassign(lost, survivors, weights)
    assert sorted(extra) == sorted(survivors)
    flat = [j for r in sorted(extra) for j in extra[r]]
    assert flat == sorted(lost)
    _share_ok({r: len(ids) for r, ids in extra.items()}, len(lost), weights)
    assert reassign(list(reversed(lost)), survivors, weights) == extra


def test_largest_remainder_ties_go_to_smaller_ids():
    assert compute_shares(5, [3, 1, 2]) == {1: 2, 2: 2, 3: 1}
    assert assign(5, [3, 1, 2]) == {1: (0, 1), 2: (2, 3), 3: (4,)}
    assert assign(2, [0, 1, 2]) == {0: (0,), 1: (1,), 2: ()}


def test_weights_shift_the_shares():
    plan = assign(8, [0, 1], {0: 3.0, 1: 1.0})
    assert plan == {0: (0, 1, 2, 3, 4, 5), 1: (6, 7)}


def test_reassign_example():
    assert reassign([9, 4, 5], [2, 0]) == {0: (4, 5), 2: (9,)}
    assert reassign([], [0, 1]) == {0: (), 1: ()}


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: assign(0, [0]), "M"),
        (lambda: assign(4, []), "live"),
        (lambda: assign(4, [1, 1]), "live"),
        (lambda: assign(4, [0, 1], {0: 1.0}), "weights"),
        (lambda: assign(4, [0, 1], {0: 1.0, 1: 0.0}), "weights"),
        (lambda: assign(4, [0, 1], {0: 1.0, 1: float("inf")}), "weights"),
        (lambda: assign(4, [0, 1], {0: 1.0, 1: float("nan")}), "weights"),
        (lambda: reassign([1, 1], [0]), "lost"),
        (lambda: reassign([1], []), "survivors"),
    ],
)
def test_validation_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


@given(st.lists(st.integers(0, 99), unique=True, max_size=20), st.integers(1, 5))
def test_dealing_inside_a_replica_computes_each_id_once_in_lockstep(ids, ways):
    """deal_round_robin: the real passes of the ranks cover the ids once each, and every rank
    makes the same number of passes (FSDP2 needs them all in every forward and backward)."""
    from recover.policy import deal_round_robin

    dealt = [deal_round_robin(ids, ways, k) for k in range(ways)]
    real = sorted(j for passes in dealt for j, is_real in passes if is_real)
    assert real == sorted(ids)
    assert len({len(passes) for passes in dealt}) <= 1


def test_the_workload_of_a_mode_is_policy_not_branches():
    """recover keeps the batch: a new attempt splits all M ids over the live replicas, and the
    ids a failure lost go to the survivors. shrink (the baseline) keeps each replica's slot of a
    full job and drops what the dead held, and a redo drops the failed attempt's sums."""
    from recover.policy import WORKLOADS

    recover, shrink = WORKLOADS["recover"], WORKLOADS["shrink"]
    assert recover.plan(8, [0, 2], {0: 1.0, 2: 1.0}, 3) == assign(8, [0, 2])
    assert shrink.plan(8, [0, 2], {0: 1.0, 2: 1.0}, 3) == {0: (0, 1, 2), 2: (6, 7)}
    assert recover.lost((3, 4, 5), [0, 2], {0: 1.0, 2: 1.0}) == reassign((3, 4, 5), [0, 2])
    assert shrink.lost((3, 4, 5), [0, 2], {0: 1.0, 2: 1.0}) == {0: (), 2: ()}
    assert (recover.keeps_batch, recover.discards) == (True, False)
    assert (shrink.keeps_batch, shrink.discards) == (False, True)
