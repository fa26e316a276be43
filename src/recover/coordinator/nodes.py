"""Node agents as the coordinator keeps them: how many replicas each may host, which it hosts.

Job: `NodeAgents`, the layer of `CoordinatorServer` above its connections (connections.py),
answers a node agent's beat (recover.agent; `node_beat` on the wire): its name, its free slots
now, the ids it runs. The reply is the ids it hosts from now on (placement.place over every live
node), the run's status and R. It keeps one lease per node (`node_lease_s`, kept by its beats),
frees the ids of a node that leaves or falls silent for the others, and records each change
(`coordinator.node_joined`, `node_assigned`, `node_left`, `node_lost` events).

Invariants: only a change of the table moves ids, at most once a tick (`tick_s`); a node that
leaves or is lost frees its ids at once; an agent that comes back is a new node. The table is
not in the replicated state: after a takeover the agents' claims (`holds`) rebuild it.
Must not: start or stop a replica (the agents do), or change the rules' state (a lost node's
replicas, if any still run, are judged by their own leases).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from recover.coordinator.connections import Connections, _Conn
from recover.coordinator.options import CoordinatorOptions
from recover.coordinator.pacing import LeaseQueue
from recover.coordinator.placement import NodeClaim, place
from recover.coordinator.protocol import ProtocolError

__all__ = ["NodeAgents"]

log = logging.getLogger("recover.coordinator")


@dataclass
class _Node:
    """A node agent (recover.agent) as the server keeps it: what it may host, what it hosts."""

    slots: int
    joined: int
    holds: tuple[int, ...] = ()
    peer: str = ""


class NodeAgents(Connections):
    """The node table of `CoordinatorServer` (see the module docstring)."""

    def __init__(
        self, options: CoordinatorOptions, *, tick_s: float, node_lease_s: float, **rest: Any
    ) -> None:
        super().__init__(options, **rest)
        self._tick_s = tick_s  # at most one placement a tick (the server ticks every tick_s)
        # Node agents (recover.agent): name -> what it hosts, and one lease each, kept by its
        # beats. Not in the replicated state: after a takeover the agents' claims rebuild it.
        self._nodes: dict[str, _Node] = {}
        self._node_leases: LeaseQueue[str] = LeaseQueue(node_lease_s)
        self._nodes_joined = itertools.count()
        self._placed = True  # False: the table changed since the ids were last placed
        self._placed_at = 0.0

    def _handle_node_beat(self, req: dict[str, Any], conn: _Conn) -> dict[str, Any]:
        """A node agent's beat: its name, its free slots now, the ids it runs. The reply is the
        ids it hosts from now on (placement.place over every live node), the run's status and
        R. A beat keeps the node's lease; `leaving: true` (drained, its replicas gone) removes
        it at once, its ids free for another node (`why`: the agent's words, for the record)."""
        self._check_authority()
        name = req.get("node")
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise ProtocolError(f"field 'node' must be a non-empty string, got {name!r}"[:200])
        slots, holds = req.get("slots"), req.get("holds", [])
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ProtocolError(f"field 'slots' must be an int >= 0, got {slots!r}"[:200])
        if not isinstance(holds, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in holds
        ):
            raise ProtocolError(f"field 'holds' must be a list of replica ids, got {holds!r}"[:200])
        st = self.state()
        if req.get("leaving") is True:
            node = self._nodes.pop(name, None)
            self._placed = False
            if node is not None:
                self._node_leases.settle([name], {name: None})
                why = req.get("why")
                why = why[:200] if isinstance(why, str) and why else "it left"
                self._node_event("node_left", name, ids=list(node.holds), reason=why)
            return {"ok": True, "assign": [], "status": st.status}
        node = self._nodes.get(name)
        if node is None:  # new, or known to a leader before us: its claim is what it runs
            node = self._nodes[name] = _Node(
                slots=slots, joined=next(self._nodes_joined), holds=tuple(holds), peer=conn.peer
            )
            self._node_event("node_joined", name, slots=slots, ids=sorted(holds), peer=conn.peer)
            self._placed = False
        if node.slots != slots:
            node.slots, self._placed = slots, False
        self._node_leases.touch(name, time.monotonic())
        # Only a change of the table moves ids, at most once a tick (3 ms at 12,500 ids on 1,563
        # nodes): a storm of joins costs the loop ticks, not joins x placements. A node given
        # nothing yet hears its ids at its next beat (the tick loop places them meanwhile).
        now = time.monotonic()
        if not self._placed and now - self._placed_at >= self._tick_s:
            self._place_nodes()
        return {
            "ok": True,
            "assign": list(node.holds),
            "status": st.status,
            "replicas": st.options.expected_replicas,
            "node_lease_s": self._node_leases.lease_s,
        }

    def _place_nodes(self) -> None:
        placed = place(
            self.state().options.expected_replicas,
            [NodeClaim(n, x.slots, x.joined, x.holds) for n, x in self._nodes.items()],
        )
        for n, ids in placed.items():
            x = self._nodes[n]
            if ids != x.holds:
                self._node_event("node_assigned", n, ids=list(ids), was=list(x.holds))
                x.holds = ids
        self._placed, self._placed_at = True, time.monotonic()

    def _node_lost(self, name: str) -> None:
        """A node agent silent past its lease: its ids are free for the other nodes (a standby
        node's next beat is given them); its replicas, if any still run, are judged by their
        own leases. An agent that comes back is a new node (it joins again, holding nothing
        the others took)."""
        node = self._nodes.pop(name, None)
        self._node_leases.settle([name], {name: None})
        self._placed = False
        if node is not None:
            self._node_event(
                "node_lost", name, ids=list(node.holds),
                reason=f"no beat for {self._node_leases.lease_s:g} s (its lease)",
            )  # fmt: skip

    def _node_event(self, what: str, node: str, **fields: Any) -> None:
        """A node's change, logged and in the run's record (`coordinator.node_*` events)."""
        level = logging.WARNING if what == "node_lost" else logging.INFO
        log.log(level, "%s: %s %s", what, node, fields)
        if self._events_fd is not None:
            line = {
                "kind": "event", "name": f"coordinator.{what}", "t_wall": time.time(),
                "node": node, "step": self.state().step, **fields,
            }  # fmt: skip
            self._write_event((json.dumps(line) + "\n").encode())

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The node table (for `status` and tests): name -> slots, holds."""
        return {n: {"slots": x.slots, "holds": list(x.holds)} for n, x in self._nodes.items()}
