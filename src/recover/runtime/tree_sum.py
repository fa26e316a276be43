"""The deterministic sum of a step's gradients (`--deterministic`): one fixed tree over the ids.

Job: make the committed sum of the M microbatch gradients of a step the same bits whoever
computed which ids, whatever failed or joined, and whatever the replica count. fp32 addition is
not associative, so the sum must be formed in one order fixed by M alone. That order is a
binary tree over the ids 0..M-1: node (level l, index k) covers the ids
[k * 2**l, min((k + 1) * 2**l, M)); a leaf (0, j) is microbatch j's own gradient (and loss);
an inner node is left + right (fp32, elementwise), or, when its right child covers no id, its
left child itself. The root (L, 0), 2**L >= M, is the step's sum.

Any set of ids a replica holds splits into a unique set of whole nodes (`decompose`): the
largest nodes inside the set. A replica adds each microbatch's gradient as a leaf to its
`TreeSum`, which merges sibling nodes as soon as both are there, so it holds exactly those
nodes, each already summed by the tree's own rule; the plan's shares do not need to line up
with the tree. The cross-replica step (`ordered_reduce`) then forms the root from every
replica's nodes by the same rule: each replica owns a fixed shard (1/R) of the flat buffer,
receives that shard of every node of every replica (one all-to-all), combines them, and an
all-gather of the combined shards gives every replica the whole root. Since a node's value
does not depend on where or in which order it was formed, nor on how the flat buffer is cut
into shards (the additions are elementwise), the sum is the same bits for any plan, any R,
given leaves that are the same bits wherever they are computed: the same parameters
(agreement), the same kernels and thread count (`set_determinism_switches`).

Invariants: a node is formed from exactly its ids, each once (constant batch); the local nodes
are never touched by a collective (no corruption: the all-to-all sends a fresh copy); every
replica computes every other replica's node list from the attempt's plan alone.

Costs: one flat copy per microbatch (the leaf, taken from `.grad`), and up to about log2(M)
node buffers held per contiguous run of ids (the normal mode holds one buffer). Traffic: a
replica whose share is one whole node sends (R-1)/R of a buffer and receives as much (the
all-to-all), then the same again in the all-gather: a ring all-reduce's. A share that is not
one node (R not a power of two, weighted plans, reassigned ids after a failure) is several
nodes: up to about 2 log2(M) per contiguous run of ids, each sent as its shard.

What it must not do: choose which ids a replica computes (the plan does), or apply anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from recover.checks import is_int

if TYPE_CHECKING:
    from recover.runtime.collective import EpochGroup

Node = tuple[int, int]  # (level, index): the ids [index * 2**level, (index + 1) * 2**level) < M


def tree_levels(M: int) -> int:
    """L, the root's level: the smallest L with 2**L >= M."""
    if not is_int(M) or M < 1:
        raise ValueError(f"M must be an int >= 1, got {M!r}")
    return (M - 1).bit_length()


def node_ids(node: Node, M: int) -> range:
    """The microbatch ids a node covers."""
    level, index = node
    return range(index << level, min((index + 1) << level, M))


class TreeSum:
    """Whole nodes of the tree over 0..M-1, each summed by the tree's rule (module docstring).

    `add` takes ownership of the buffer it is given (it may be summed into in place)."""

    def __init__(self, M: int) -> None:
        self.M = M
        self.levels = tree_levels(M)
        self.nodes: dict[Node, torch.Tensor] = {}

    def add(self, node: Node, value: torch.Tensor) -> None:
        """Add a whole node (a leaf: `(0, j)`), merging it with its sibling while there is one."""
        level, index = node
        if not 0 <= level <= self.levels or not 0 <= index << level < self.M:
            raise ValueError(f"node {node} is not in the tree over {self.M} ids")
        while level < self.levels:
            if index % 2 == 0 and (index + 1) << level >= self.M:
                level, index = level + 1, index >> 1  # no right child: the parent is this node
                continue
            sibling = self.nodes.pop((level, index ^ 1), None)
            if sibling is None:
                break
            if sibling is value:
                raise ValueError(f"node {node} was added twice")
            left, right = (value, sibling) if index % 2 == 0 else (sibling, value)
            value = left.add_(right)  # the one addition that forms the parent
            level, index = level + 1, index >> 1
        if (level, index) in self.nodes:
            raise ValueError(f"ids of node {(level, index)} were added twice")
        self.nodes[(level, index)] = value

    def add_leaf(self, j: int, value: torch.Tensor) -> None:
        self.add((0, j), value)

    def ids(self) -> set[int]:
        return {j for node in self.nodes for j in node_ids(node, self.M)}

    def ordered(self) -> list[tuple[Node, torch.Tensor]]:
        """The nodes held, by their first id (the order `decompose` gives)."""
        return sorted(self.nodes.items(), key=lambda item: item[0][1] << item[0][0])

    def root(self) -> torch.Tensor:
        """The sum over all M ids; ValueError unless they are all here."""
        value = self.nodes.get((self.levels, 0))
        if value is None:
            missing = sorted(set(range(self.M)) - self.ids())
            raise ValueError(f"the sum lacks ids {missing[:10]} of 0..{self.M - 1}")
        return value

    def clear(self) -> None:
        self.nodes.clear()


def decompose(ids: Iterable[int], M: int) -> list[Node]:
    """Pure: the nodes a `TreeSum` holds once it has the leaves `ids`, by their first id.
    ValueError on an id out of 0..M-1 or repeated."""
    shape = TreeSum(M)
    marker = torch.empty(0)
    for j in ids:
        if not is_int(j) or not 0 <= j < M:
            raise ValueError(f"microbatch id {j!r} is not in 0..{M - 1}")
        shape.add_leaf(j, marker.new_empty(0))  # empty tensors: only the shape is computed
    return [node for node, _ in shape.ordered()]


def shard_bounds(numel: int, world_size: int) -> tuple[int, int]:
    """(shard length, padded length): the flat buffer cut into `world_size` equal shards."""
    chunk = max(1, math.ceil(numel / world_size))
    return chunk, chunk * world_size


def ordered_reduce(
    group: EpochGroup,
    local: TreeSum,
    plan: Sequence[Sequence[int]],
    *,
    numel: int,
    should_abort: Callable[[], str | None],
) -> torch.Tensor:
    """The root of the tree over every member's ids, on every member (module docstring).

    `group` is the epoch's `recover.runtime.collective.EpochGroup`; `plan[r]` the ids that
    group rank r holds, `local` this rank's nodes (exactly `plan[group.rank]`), `numel` the
    length of a node's flat buffer (every rank's: a rank may hold no ids). Returns a fresh
    flat buffer on the group's device; raises `CollectiveAborted` as the group's ops do (the
    local nodes are untouched either way)."""
    world, me = group.world_size, group.rank
    if len(plan) != world:
        raise ValueError(f"plan names {len(plan)} ranks, the group has {world}")
    shapes = [decompose(ids, local.M) for ids in plan]
    mine = local.ordered()
    if [node for node, _ in mine] != shapes[me]:
        raise ValueError(
            f"this rank holds nodes {[n for n, _ in mine]}, its plan says {shapes[me]}"
        )
    chunk, padded = shard_bounds(numel, world)
    device = group.device
    # What goes to owner o: the o-th shard of each of this rank's nodes, in node order.
    send = torch.empty(world, len(mine), chunk, dtype=torch.float32, device=device)
    for o in range(world):  # the padding past numel (last shards) is zeros
        send[o, :, max(0, min(chunk, numel - o * chunk)) :].zero_()
    for i, (_, value) in enumerate(mine):
        flat = value.to(device)
        for o in range(world):
            start, stop = o * chunk, min((o + 1) * chunk, numel)
            if start < stop:
                send[o, i, : stop - start].copy_(flat[start:stop])
    counts = [len(s) for s in shapes]
    received = torch.empty(sum(counts) * chunk, dtype=torch.float32, device=device)
    group.alltoall(
        received, send.view(-1),
        out_splits=[n * chunk for n in counts], in_splits=[len(mine) * chunk] * world,
        should_abort=should_abort,
    )  # fmt: skip
    combined = TreeSum(local.M)
    offset = 0
    for nodes in shapes:
        for node in nodes:
            combined.add(node, received[offset : offset + chunk])
            offset += chunk
    out = torch.empty(padded, dtype=torch.float32, device=device)
    group.allgather(out, combined.root().contiguous(), should_abort=should_abort)
    return out[:numel]


def set_determinism_switches() -> None:
    """The process-wide switches the deterministic mode needs (the step machine sets them):
    torch's deterministic kernels (an op without one raises instead of varying; on a GPU, cuBLAS
    then needs a fixed workspace, CUBLAS_WORKSPACE_CONFIG, set here unless already given before
    its first use). A microbatch's gradient must also be the same bits on every replica: the
    intra-op thread count must be the same in every process of the runs compared (recover's
    workers use one thread; a script of `recover run` keeps its own count)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
