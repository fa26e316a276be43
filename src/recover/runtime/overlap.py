"""The step's cross-replica reduce in buckets, started during the last backward pass (as DDP does).

Job: build the attempt's buffer (the local gradient sum and the loss sum, recover.runtime.grads's
layout) and hand its buckets to the epoch's group in one fixed order, starting each as early as
its values are final, so that most of the reduce runs while the last backward pass still computes.

The order (`step_buckets`): the gradient values, all but the buffer's last slot, in buckets of
`CollectiveConfig.step_bucket_bytes` from the end of the buffer backwards (a backward pass produces
the last parameters' gradients first), then the loss slot alone (known once the pass is over).
Where the parameters' ranges in the buffer are known (a Work whose gradients can be followed), a
bucket holds whole parameters, as DDP's do, and a parameter larger than a bucket is one bucket of
its own: cut into buckets of the size, a 25 MB embedding took 25 collectives, 54 ms against one
collective's 26 ms for the same values over 3 local gloo ranks (its gradient is final only at the
end of the pass, so its reduce is all after it).
Gradients that fit in one bucket go in one op with the loss slot: their bucket could start only
at the very end of the pass, and a second op would cost a collective's latency every step.
Every rank issues the same sizes in the same order whether a bucket starts during the compute
(`EarlyReduce`) or after it (`StepReduce`): the two paths differ in time only, so ranks that took
different paths in one attempt still sum correctly, and the sum's bits do not depend on the path.

When a bucket starts early: a post-accumulate-grad hook on each parameter fires in the attempt's
last backward pass once the pass has added its gradient: that parameter's `p.grad` is then final
for the attempt and is copied into the buffer. The hooks are registered once for the run
(`GradHooks`, the step machine's) and pointed at the attempt's `EarlyReduce` while it is armed.
Measured on a 2-core EPYC, 28 parameters: registering and removing them at every attempt costs
72 us, a pass through hooks left on 13 us (0.5 us a call), so hooks left on are the cheaper up
to about five passes a replica per attempt (the usual share is one to a few microbatches). A
bucket starts when every parameter it covers is copied and every bucket before it in the order
has started (the order is the same on every rank, whatever order the hooks fire in).

Which pass is the last: the one that runs while the n-th microbatch of the attempt is not counted
yet (`GradientSum.add_loss` counts them after each pass; n is the attempt's ids). A hook that fires
for a parameter already copied, or after the n-th microbatch was counted, means a pass after the
last one (a caller that counted wrong, or a script's extra backward pass): the started buckets
hold values that are not the sum; `finish` raises and nothing is reduced.

Invariants: `p.grad` is never touched (the buffer is a copy made for the attempt); a fault or a
stop abandons the started buckets with the group (its graveyard, recover.runtime.collective);
nothing starts before the attempt's group exists (in the first attempt of an epoch the group is
built after the compute, and every bucket starts then).

Where buckets never start early (the step machine decides): the deterministic mode (one leaf
per id), replicas of several ranks (FSDP2 and tensor parallelism write `p.grad` themselves), and
an NCCL group (the overlap has not run on GPUs).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import compute_buckets
from recover.runtime.grads import GradientSum


def step_buckets(
    numel: int, bucket_bytes: int, ranges: list[tuple[int, int]] | None = None
) -> list[tuple[int, int]]:
    """Pure: the `(start, stop)` ranges of a step buffer of `numel` fp32 values (the last the loss
    sum) in the order they are reduced: the gradient values' buckets from the end, then the loss
    slot. `ranges`: each parameter's values in the buffer, in order (whole parameters a bucket);
    None: buckets of the size wherever they cut."""
    if numel < 1:
        raise ValueError(f"a step buffer holds at least its loss slot, got {numel} values")
    if ranges is None:
        grads = compute_buckets(numel - 1, 4, bucket_bytes)
    else:
        grads = parameter_buckets(ranges, numel - 1, bucket_bytes)
    if len(grads) <= 1:
        # The gradients' one bucket could start only at the very end of the pass: one op for the
        # whole buffer, loss slot included, costs one collective's latency instead of two.
        return [(0, numel)]
    return [*reversed(grads), (numel - 1, numel)]


def parameter_buckets(
    ranges: list[tuple[int, int]], numel: int, bucket_bytes: int
) -> list[tuple[int, int]]:
    """Pure: buckets of whole parameters covering `0..numel` in ascending order, filled from the
    last parameter backwards up to `bucket_bytes` of fp32 values (0: one bucket); a parameter
    larger than that is a bucket of its own. `ranges` must cover `0..numel` contiguously."""
    covered = 0
    for start, stop in ranges:
        if start != covered or stop < start:
            raise ValueError(f"parameter ranges must cover 0..{numel} in order, got {ranges}")
        covered = stop
    if covered != numel:
        raise ValueError(f"parameter ranges cover 0..{covered}, the buffer holds {numel} values")
    per_bucket = numel if bucket_bytes == 0 else max(1, bucket_bytes // 4)
    buckets: list[tuple[int, int]] = []
    start = stop = numel  # the bucket being filled is start..stop
    for first, _ in reversed(ranges):
        if first == start:
            continue  # (a parameter of no values)
        if start < stop and stop - first > per_bucket:
            buckets.append((start, stop))
            stop = start
        start = first
    if start < stop:
        buckets.append((start, stop))
    return list(reversed(buckets))


class BucketPlan:
    """The buckets of one rank's step buffer in the reduce order, and which parameters each
    covers: the same for every attempt of a run, so built once."""

    def __init__(self, grads: GradientSum, bucket_bytes: int) -> None:
        numel = grads.numel + 1
        self.numel = numel
        self.order = step_buckets(numel, bucket_bytes, grads.ranges)
        spans = sorted((start, stop, k) for k, (start, stop) in enumerate(self.order))
        starts = [start for start, _, _ in spans]
        self.ranges = grads.ranges  # each parameter's values in the buffer
        self.buckets_of: list[list[int]] = []  # each parameter's buckets (positions in order)
        self.waits = [0] * len(self.order)  # how many parameters each bucket waits for
        for start, stop in self.ranges:
            ks = []
            i = bisect.bisect_right(starts, start) - 1
            while start < stop and i < len(spans) and spans[i][0] < stop:
                ks.append(spans[i][2])
                i += 1
            self.buckets_of.append(ks)
            for k in ks:
                self.waits[k] += 1
        # The bucket of the loss slot waits for the end of the compute too (`finish`).
        loss = spans[bisect.bisect_right(starts, numel - 1) - 1][2]
        self.waits[loss] += 1


class StepReduce:
    """An attempt's buffer and its buckets in the reduce order, started with `start_rest`."""

    def __init__(self, buffer: torch.Tensor, order: list[tuple[int, int]]) -> None:
        self.buffer, self.order = buffer, order
        self.started = 0  # buckets of the order handed to the group
        self.early = 0  # of which during the compute
        self.error: RuntimeError | None = None  # the group refused a bucket started early

    def start_rest(self, group: EpochGroup) -> None:
        """Start every bucket not started yet, in order (the `issue_rest` of finish_allreduce)."""
        if self.error is not None:
            raise self.error
        while self.started < len(self.order):
            start, stop = self.order[self.started]
            group.start_allreduce(self.buffer[start:stop])
            self.started += 1

    def early_share(self) -> float:
        """The share of the buffer's values whose reduce started during the compute."""
        done = sum(stop - start for start, stop in self.order[: self.early])
        return done / self.buffer.numel()


class GradHooks:
    """One post-accumulate-grad hook on each parameter of a `GradientSum`, registered once and
    handed to the `EarlyReduce` armed at the time (`arm`, `disarm`); unarmed, a hook returns at
    once. `remove` takes them off the parameters (the end of the run)."""

    def __init__(self, grads: GradientSum) -> None:
        self.target: EarlyReduce | None = None
        self._handles: list[Any] = [
            p.register_post_accumulate_grad_hook(self._hook(i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(grads.params)
        ]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad(p: torch.Tensor) -> None:
            target = self.target
            if target is not None:
                target.on_grad(i)

        return on_grad

    def arm(self, target: EarlyReduce) -> None:
        self.target = target

    def disarm(self, target: EarlyReduce) -> None:
        if self.target is target:
            self.target = None

    def remove(self) -> None:
        self.target = None
        for handle in self._handles:
            handle.remove()
        self._handles = []


class EarlyReduce(StepReduce):
    """A `StepReduce` whose buckets start from gradient hooks during the attempt's last backward
    pass (see the module docstring). Call `finish` after the compute, or `drop` if the attempt is
    left before it."""

    def __init__(
        self,
        grads: GradientSum,
        plan: BucketPlan,
        group: EpochGroup,
        *,
        microbatches: int,
        on_start: Callable[[], None],
        hooks: GradHooks,
    ) -> None:
        """`hooks`: the run's `GradHooks` over `grads`, armed with this attempt until `finish` or
        `drop` (their owner removes them at the end of the run)."""
        if microbatches < 1:
            raise ValueError(
                f"an early reduce needs the attempt's microbatches, got {microbatches}"
            )
        buffer = torch.empty(plan.numel, dtype=torch.float32, device=group.device)
        super().__init__(buffer, plan.order)
        self.grads, self.plan, self.group, self.on_start = grads, plan, group, on_start
        self.last = grads.counted + microbatches - 1  # counted while the last pass runs
        self.stale = False  # a pass ran after the last one (see the module docstring)
        self._waiting = list(plan.waits)
        self._copied = [False] * len(grads.params)
        self._hooks = hooks
        hooks.arm(self)

    def on_grad(self, i: int) -> None:
        """Parameter `i`'s gradient was accumulated by a backward pass (its hook)."""
        if self.grads.counted < self.last:
            return  # an earlier microbatch's pass: p.grad will grow
        if self.grads.counted > self.last or self._copied[i]:
            self.stale = True  # a pass after the last one: what was copied is not the sum
            return
        self._copy(i)
        for k in self.plan.buckets_of[i]:
            self._waiting[k] -= 1
        self._start_ready()

    def _copy(self, i: int) -> None:
        self.grads.write_part(self.buffer, i)
        self._copied[i] = True

    def _start_ready(self) -> None:
        while (
            self.error is None
            and self.started < len(self.order)
            and self._waiting[self.started] == 0
        ):
            start, stop = self.order[self.started]
            try:
                self.group.start_allreduce(self.buffer[start:stop])
            except RuntimeError as e:  # (CollectiveAborted too) seen by finish_allreduce
                self.error = e
                return
            self.started += 1
            self.early += 1
            if self.early == 1:
                self.on_start()  # the "overlap" point of a step (a declared fault may act here)

    def finish(self) -> torch.Tensor:
        """After the compute: copy what no hook copied, write the loss sum, and hand back the
        buffer (its remaining buckets start in finish_allreduce)."""
        self._hooks.disarm(self)
        if self.stale:
            self.group.drop_in_flight("a backward pass ran after the attempt's last microbatch")
            raise RuntimeError(
                "a backward pass ran after the step's last microbatch: the step's reduce had "
                "started on gradients that were not final, so nothing of it is used. Every "
                "backward pass of a step belongs to one microbatch (in a script: "
                "replica.backward(loss), once per microbatch, and no other backward)"
            )
        for i in range(len(self.grads.params)):
            if not self._copied[i]:
                self._copy(i)
        self.buffer[-1] = self.grads.loss_sum
        return self.buffer

    def drop(self, reason: str) -> None:
        """The attempt was left before its compute ended: no hook fires any more, and the buckets
        started are abandoned with the group."""
        self._hooks.disarm(self)
        self.group.drop_in_flight(reason)


__all__ = [
    "BucketPlan",
    "EarlyReduce",
    "GradHooks",
    "StepReduce",
    "parameter_buckets",
    "step_buckets",
]
