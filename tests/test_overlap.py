"""The step's reduce started during the last backward pass (recover.runtime.overlap), in-process.

The bucket order is pure and checked against a brute-force reading of the buffer; the hooks and
the early start run on real gloo groups (two ranks in one process, or one). The same machinery in
the step machine, with replicas and a fault inside the overlapped backward, is in
test_step_machine.py (threads) and test_multireplica.py (processes, SIGKILL).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import CollectiveAborted, CollectiveConfig
from recover.runtime.grads import GradientSum
from recover.runtime.overlap import (
    BucketPlan,
    EarlyReduce,
    GradHooks,
    StepReduce,
    parameter_buckets,
    step_buckets,
)

CONFIG = CollectiveConfig(build_timeout_s=5, op_deadline_s=5, pg_timeout_s=20)
BUCKET = 256  # bytes: 64 values, so the model below spans several buckets


@given(numel=st.integers(1, 5000), bucket=st.integers(0, 4096))
def test_the_buckets_cover_the_buffer_once_from_the_end_then_the_loss_slot(numel, bucket):
    order = step_buckets(numel, bucket)
    covered = [i for start, stop in order for i in range(start, stop)]
    assert sorted(covered) == list(range(numel))  # every value once
    if len(order) == 1:  # the gradients fit in one bucket: one op, the loss slot with them
        assert order == [(0, numel)]
        return
    assert order[-1] == (numel - 1, numel)  # the loss slot alone, last
    starts = [start for start, _ in order[:-1]]
    assert starts == sorted(starts, reverse=True)  # from the end of the gradients backwards


@given(sizes=st.lists(st.integers(0, 400), min_size=1, max_size=10), bucket=st.integers(0, 1200))
def test_a_bucket_holds_whole_parameters_and_a_large_one_alone(sizes, bucket):
    """As DDP's: whole parameters from the last backwards, up to the size; a parameter larger
    than a bucket is one bucket (never cut: its values would take several collectives)."""
    ranges, at = [], 0
    for n in sizes:
        ranges.append((at, at + n))
        at += n
    buckets = parameter_buckets(ranges, at, bucket)
    assert [i for a, b in buckets for i in range(a, b)] == list(range(at))  # once, in order
    edges = {a for a, _ in ranges} | {at}
    per = at if bucket == 0 else max(1, bucket // 4)
    for a, b in buckets:
        assert a in edges and b in edges  # whole parameters
        inside = [(x, y) for x, y in ranges if a <= x and y <= b and x < y]
        assert b - a <= per or len(inside) == 1  # within the size, or one large parameter
    # filled greedily from the end: a bucket could not have taken the parameter before it
    for (a, _b), (_, b2) in zip(buckets, buckets[1:], strict=False):
        assert b2 - a > per, (buckets, ranges)
    with pytest.raises(ValueError, match="cover"):
        parameter_buckets([(0, 3), (4, 6)], 6, bucket)


def test_the_step_buffer_is_cut_at_parameters_where_they_are_known():
    ranges = [(0, 10), (10, 1000), (1000, 1010)]  # an embedding-sized parameter in the middle
    order = step_buckets(1011, 4 * 64, ranges)
    assert order == [(1000, 1010), (10, 1000), (0, 10), (1010, 1011)]
    assert len(step_buckets(1011, 4 * 64)) == 17  # cut by size: 16 buckets of gradients


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8), bucket=st.integers(4, 800))
def test_each_bucket_waits_for_exactly_the_parameters_it_covers(sizes, bucket):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    if not any(sizes):
        params.append(torch.nn.Parameter(torch.zeros(1)))
    plan = BucketPlan(GradientSum(params, device="cpu"), bucket)
    numel = plan.numel
    for k, (start, stop) in enumerate(plan.order):
        covering = [i for i, (a, b) in enumerate(plan.ranges) if a < b and a < stop and start < b]
        loss = start <= numel - 1 < stop  # this bucket holds the loss slot: it waits for finish
        assert plan.waits[k] == len(covering) + loss, (k, plan.order, plan.ranges)
        assert all(k in plan.buckets_of[i] for i in covering)
        assert sorted(i for i, ks in enumerate(plan.buckets_of) if k in ks) == covering


def _model(seed: int) -> tuple[torch.nn.Module, GradientSum]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, GradientSum(model.parameters(), device="cpu")


def _microbatch(model: torch.nn.Module, grads: GradientSum, j: int) -> None:
    g = torch.Generator().manual_seed(j)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    grads.add_loss(j, float(loss.detach()))


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _pair(store: dist.Store) -> tuple[EpochGroup, EpochGroup]:
    box: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: box.setdefault(
            "g", EpochGroup.build(store, epoch=1, rank=0, world_size=2, config=CONFIG)
        ),
        daemon=True,
    )
    thread.start()
    g1 = EpochGroup.build(store, epoch=1, rank=1, world_size=2, config=CONFIG)
    thread.join(10)
    return box["g"], g1


@pytest.mark.timeout(30)
def test_a_rank_that_starts_early_and_one_that_starts_late_sum_the_same_bits():
    """Rank 0 starts its buckets from the hooks of its last backward pass, rank 1 after its
    compute: the ops match one to one, and both hold the same sum, bit for bit, which is the sum
    of the two ranks' snapshots."""
    g0, g1 = _pair(_store())
    started: list[int] = []
    results: dict[int, Any] = {}
    try:

        def early_rank() -> None:
            model, grads = _model(0)
            early = EarlyReduce(
                grads, BucketPlan(grads, BUCKET), g0, microbatches=3,
                on_start=lambda: started.append(grads.counted), hooks=GradHooks(grads),
            )  # fmt: skip
            for j in range(3):
                _microbatch(model, grads, j)
                results[f"early_after_{j}"] = early.early
            buffer = early.finish()
            results["snapshot0"] = grads.snapshot()
            g0.finish_allreduce(
                buffer, issue_rest=lambda: early.start_rest(g0), should_abort=lambda: None
            )
            results[0], results["share"] = buffer, early.early_share()

        thread = threading.Thread(target=early_rank, daemon=True)
        thread.start()
        model, grads = _model(1)
        for j in range(3, 5):
            _microbatch(model, grads, j)
        # (the step machine's order after the compute: the same plan, StepMachine._reduce_order)
        late = StepReduce(grads.snapshot(), BucketPlan(grads, BUCKET).order)
        expected_mine = late.buffer.clone()
        g1.finish_allreduce(late.buffer, issue_rest=lambda: late.start_rest(g1),
                            should_abort=lambda: None)  # fmt: skip
        thread.join(20)
        assert not thread.is_alive()
        results[1] = late.buffer
    finally:
        g0.abandon(), g1.abandon()
    # Nothing started during the first two passes; buckets started during the third.
    assert results["early_after_0"] == results["early_after_1"] == 0
    assert results["early_after_2"] >= 2, results
    assert started == [2], started  # the "overlap" point fired once, in the third pass
    assert 0.5 < results["share"] < 1.0
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], results["snapshot0"] + expected_mine)


def _armed_alone() -> tuple[EpochGroup, torch.nn.Module, GradientSum, EarlyReduce]:
    """A group of one rank, a model, and its reduce armed for an attempt of one microbatch."""
    group = EpochGroup.build(_store(), epoch=0, rank=0, world_size=1, config=CONFIG)
    model, grads = _model(0)
    early = EarlyReduce(
        grads, BucketPlan(grads, BUCKET), group, microbatches=1, on_start=lambda: None,
        hooks=GradHooks(grads),
    )  # fmt: skip
    return group, model, grads, early


@pytest.mark.timeout(30)
def test_a_pass_after_the_last_counted_microbatch_is_refused_and_nothing_is_reduced():
    group, model, grads, early = _armed_alone()
    g = torch.Generator().manual_seed(0)
    model(torch.randn(2, 8, generator=g)).sum().backward()  # the last pass, not counted yet
    assert early.early > 0
    model(torch.randn(2, 8, generator=g)).sum().backward()  # one more: the copies are stale
    with pytest.raises(RuntimeError, match="not final"):
        early.finish()
    assert group.poisoned is not None  # the started buckets were abandoned with the group
    with pytest.raises(CollectiveAborted):
        group.finish_allreduce(early.buffer, issue_rest=lambda: None, should_abort=lambda: None)


@pytest.mark.timeout(30)
def test_a_pass_after_the_last_microbatch_was_counted_is_refused_too():
    """A script's extra backward pass after its last replica.backward(): its gradient would be
    missing from a reduce that already read p.grad, so the step stops instead."""
    group, model, grads, early = _armed_alone()
    _microbatch(model, grads, 0)  # the last microbatch, counted
    model(torch.randn(2, 8)).sum().backward()  # one more pass
    with pytest.raises(RuntimeError, match="replica.backward"):
        early.finish()


@pytest.mark.timeout(30)
def test_leaving_during_the_compute_disarms_the_hooks_and_abandons_the_started_buckets():
    group, model, grads, early = _armed_alone()
    _microbatch(model, grads, 0)
    started = early.early
    assert started > 0
    early.drop("the step was left")
    assert group.poisoned is not None and "left" in group.poisoned.detail
    grads.counted -= 1  # as if the last pass ran again: no hook is left to see it
    _microbatch(model, grads, 0)
    assert early.early == started and not early.stale


@pytest.mark.timeout(30)
def test_the_runs_hooks_are_registered_once_and_serve_the_attempt_armed():
    """The step machine's GradHooks stay on the parameters for the run: each attempt's
    EarlyReduce is armed on them (its buckets start from them, its sum is the snapshot's) and
    disarmed at its finish, after which a pass reaches no reduce; `remove` takes them off."""
    group = EpochGroup.build(_store(), epoch=0, rank=0, world_size=1, config=CONFIG)
    model, grads = _model(0)
    before = [len(p._post_accumulate_grad_hooks or {}) for p in grads.params]
    hooks = GradHooks(grads)
    plan = BucketPlan(grads, BUCKET)
    on = [n + 1 for n in before]
    for attempt in range(3):
        early = EarlyReduce(grads, plan, group, microbatches=2, on_start=lambda: None, hooks=hooks)
        assert hooks.target is early
        for j in range(2):
            _microbatch(model, grads, 2 * attempt + j)
        assert early.early > 0  # started from the run's hooks in the last pass
        buffer = early.finish()
        assert hooks.target is None
        assert torch.equal(buffer, grads.snapshot())  # (one rank: the sum is its own)
        group.finish_allreduce(
            buffer, issue_rest=lambda e=early: e.start_rest(group), should_abort=lambda: None
        )
        model(torch.randn(2, 8)).sum().backward()  # a pass after the attempt: nothing armed
        assert not early.stale
        assert [len(p._post_accumulate_grad_hooks) for p in grads.params] == on
        grads.clear()
    hooks.remove()
    assert [len(p._post_accumulate_grad_hooks or {}) for p in grads.params] == before
    group.abandon()
