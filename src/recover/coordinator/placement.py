"""Which node hosts which replica ids: the rule the coordinator applies for node agents.

Job: given the job's R replica ids and the nodes that are alive now (each with its free slots,
the order it joined in, and the ids it holds), the ids each node hosts from now on. The server
(nodes.py) keeps the node table and the nodes' leases; a node agent (recover.agent) starts and
stops replica processes to match what this rule gives it.

Rules:
- a live node keeps the ids it holds, up to its slots: a replica is never moved off a node that
  lives (its process holds live state). A node that lowers its slots (draining sets them to 0)
  gives back its highest ids first;
- an id that no live node holds goes to the live node with a free slot that joined first, the
  lowest id first. A node that joins when every id is held hosts nothing: a standby node, the
  first to be given the ids of a node that is lost;
- an id is held by at most one node. Two nodes that claim one (a coordinator that took over
  hears every agent's claim afresh) are settled in join order: the first keeps it.

Pure: no clock, no sockets, no state of its own. Cost: O(R + nodes) per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NodeClaim", "place"]


@dataclass(frozen=True)
class NodeClaim:
    """A live node as the rule sees it."""

    name: str
    slots: int  # how many replicas it may host now (0: draining, or full of broken slots)
    joined: int  # the order it joined in (lower: earlier)
    holds: tuple[int, ...] = ()  # the ids it hosts now

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or self.slots < 0:
            raise ValueError(f"node {self.name!r}: slots must be an int >= 0, got {self.slots!r}")


def place(replicas: int, nodes: Sequence[NodeClaim]) -> dict[str, tuple[int, ...]]:
    """The ids (sorted) each node hosts: every node of `nodes` has an entry, maybe empty."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    order = sorted(nodes, key=lambda n: (n.joined, n.name))
    taken: set[int] = set()
    kept: dict[str, list[int]] = {}
    for node in order:
        mine = sorted(r for r in set(node.holds) if 0 <= r < replicas and r not in taken)
        mine = mine[: node.slots]  # (the highest given back first)
        taken.update(mine)
        kept[node.name] = mine
    free = [r for r in range(replicas) if r not in taken]
    for node in order:
        room = node.slots - len(kept[node.name])
        if room > 0 and free:
            kept[node.name] += free[:room]
            free = free[room:]
    return {name: tuple(sorted(ids)) for name, ids in kept.items()}
