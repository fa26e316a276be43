"""The versatile-workload policy: who computes which microbatch ids in a step.

Job: split the M microbatch ids of a step over the live replicas (`assign`), and split the ids a
dead replica held over the survivors (`reassign`). Both are pure functions of their arguments, so
every replica and the coordinator compute the very same plan.

Algorithm: replica i (ids sorted ascending) gets a share n_i proportional to its weight w_i, by the
largest-remainder method: n_i = floor(N * w_i / W), and the N - sum(n_i) ids left over go one each
to the largest remainders, ties broken by the smaller replica id. Then the ids are cut into
contiguous chunks in replica id order.

Invariants (property-tested in tests/test_policy.py):
- every id is given out exactly once;
- |n_i - N * w_i / W| < 1 for every replica;
- the result depends only on the arguments (no randomness, no hidden state);
- each replica's ids are contiguous in the (sorted) input order.

Costs: O(R log R + N) time and memory. Limits: weights are floats, so a share that lies within
floating-point rounding of an integer may round either way; the result is still deterministic.
A replica gets 0 ids when N is smaller than the number of replicas or its weight is tiny.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from recover.checks import is_int, is_number

__all__ = ["WORKLOADS", "Workload", "assign", "compute_shares", "reassign"]


def _check_replicas(replicas: Sequence[int], name: str) -> list[int]:
    ids = list(replicas)
    if not ids:
        raise ValueError(f"{name} must name at least one replica, got an empty sequence")
    for r in ids:
        if not is_int(r):
            raise ValueError(f"{name} must hold int replica ids, got {r!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} holds duplicate replica ids: {sorted(ids)}")
    return sorted(ids)


def _check_weights(ids: Sequence[int], weights: Mapping[int, float] | None) -> list[float]:
    if weights is None:
        return [1.0] * len(ids)
    out = []
    for r in ids:
        if r not in weights:
            raise ValueError(f"weights has no entry for replica {r}")
        w = weights[r]
        if not is_number(w):
            raise ValueError(f"weights[{r}] must be a number, got {w!r}")
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"weights[{r}] must be positive and finite, got {w!r}")
        out.append(float(w))
    return out


def compute_shares(
    n: int, replicas: Sequence[int], weights: Mapping[int, float] | None = None
) -> dict[int, int]:
    """Number of ids each replica gets out of `n`, by largest remainder (ties: smaller id)."""
    if not is_int(n) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    ids = _check_replicas(replicas, "replicas")
    w = _check_weights(ids, weights)
    total = math.fsum(w)
    exact = [n * wi / total for wi in w]
    counts = [math.floor(q) for q in exact]
    # Rounding can only push the floors' sum below n by less than len(ids); clamp for safety.
    left = max(0, min(len(ids), n - sum(counts)))
    order = sorted(range(len(ids)), key=lambda k: (-(exact[k] - counts[k]), ids[k]))
    for k in order[:left]:
        counts[k] += 1
    if sum(counts) != n:  # pragma: no cover - guarded by the clamp above
        raise AssertionError(f"shares {counts} do not add up to {n}")
    return dict(zip(ids, counts, strict=True))


def _cut(items: Sequence[int], shares: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
    out: dict[int, tuple[int, ...]] = {}
    start = 0
    for r in sorted(shares):
        out[r] = tuple(items[start : start + shares[r]])
        start += shares[r]
    return out


def assign(
    M: int, live: Sequence[int], weights: Mapping[int, float] | None = None
) -> dict[int, tuple[int, ...]]:
    """The plan of one step: live replica -> its contiguous range of microbatch ids in 0..M-1.

    `weights` (replica -> positive finite weight; default equal) sets each replica's share.
    Raises ValueError naming the bad argument (M < 1, empty or duplicate `live`, bad weights).
    """
    if not is_int(M) or M < 1:
        raise ValueError(f"M must be an int >= 1, got {M!r}")
    ids = _check_replicas(live, "live")
    return _cut(range(M), compute_shares(M, ids, weights))


def reassign(
    lost: Iterable[int], survivors: Sequence[int], weights: Mapping[int, float] | None = None
) -> dict[int, tuple[int, ...]]:
    """Split the `lost` microbatch ids over `survivors` the same way `assign` splits 0..M-1.

    The lost ids are sorted and cut into contiguous chunks of that sorted list, in survivor id
    order. Every survivor appears in the result (possibly with no ids).
    """
    items = sorted(lost)
    for j in items:
        if not is_int(j) or j < 0:
            raise ValueError(f"lost must hold microbatch ids (ints >= 0), got {j!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"lost holds duplicate microbatch ids: {items}")
    ids = _check_replicas(survivors, "survivors")
    return _cut(items, compute_shares(len(items), ids, weights))


def deal_round_robin(ids: Sequence[int], ways: int, mine: int) -> list[tuple[int, bool]]:
    """Inside one replica: deal an attempt's ids over the `ways` ranks that shard its model copy.
    Rank `mine` computes ids[mine], ids[mine + ways], ... as (id, True). FSDP2 needs every rank in
    every forward and backward, so a rank with one id fewer gets a padding pass (id, False) on a
    real microbatch, whose gradient the caller scales by 0 (exactly zero, no loss counted)."""
    out = []
    for start in range(0, len(ids), ways):
        chunk = ids[start : start + ways]
        out.append((chunk[mine], True) if mine < len(chunk) else (chunk[0], False))
    return out


# ---- the workload of a mode: how a step is planned, and what happens to the ids a failure lost -


@dataclass(frozen=True)
class Workload:
    """The two choices that tell ReCoVer from a shrinking baseline, as policy rather than
    branches in the rules: `plan` gives a new attempt its ids, `lost` says what becomes of the ids
    a failure lost, and `discards` whether a survivor drops the sum of a failed attempt."""

    name: str
    keeps_batch: bool  # every committed step sums all M microbatches

    def plan(
        self, M: int, live: Sequence[int], weights: Mapping[int, float], expected: int
    ) -> dict[int, tuple[int, ...]]:
        if self.keeps_batch:
            return assign(M, live, weights)
        # shrink: the fixed slots of a full job (all `expected` replicas); a dead slot's ids are
        # simply not computed, as when torchft drops a replica
        slots = assign(M, range(expected))
        return {r: slots.get(r, ()) for r in live}

    def lost(
        self, lost: Iterable[int], survivors: Sequence[int], weights: Mapping[int, float]
    ) -> dict[int, tuple[int, ...]]:
        if self.keeps_batch:
            return reassign(lost, survivors, weights)
        return {r: () for r in survivors}  # dropped: the step's batch shrinks

    @property
    def discards(self) -> bool:
        """Whether a failed attempt's local sums are dropped (recomputed from nothing)."""
        return not self.keeps_batch


# recover: the constant-batch invariant (reassign what was lost); shrink: torchft's semantics, a
# baseline for comparison (drop what was lost, and the failed attempt's partial sums).
WORKLOADS = {"recover": Workload("recover", True), "shrink": Workload("shrink", False)}
