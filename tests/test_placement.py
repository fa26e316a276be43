"""Which node hosts which replica ids: the pure rule (coordinator/placement.py), and the server's
node table that applies it to node agents' beats (leases, a drain, a node that comes back)."""

from __future__ import annotations

import json
import time

import pytest

from recover.coordinator import CoordinatorOptions, CoordinatorServer
from recover.coordinator.channel import NodeLink
from recover.coordinator.outcomes import RequestRefused
from recover.coordinator.placement import NodeClaim, place


def test_ids_fill_the_nodes_in_join_order_and_a_late_node_is_a_standby():
    nodes = [NodeClaim("b", 2, 1), NodeClaim("a", 1, 0), NodeClaim("spare", 4, 2)]
    assert place(3, nodes) == {"a": (0,), "b": (1, 2), "spare": ()}


def test_a_live_node_keeps_its_ids_and_a_lost_nodes_ids_go_to_the_first_with_room():
    # Node "a" (ids 0, 1) is gone: its ids go to the standby, never moved off "b", whose ids
    # are not the lowest (a replica is never moved off a node that lives).
    nodes = [NodeClaim("b", 1, 1, (2,)), NodeClaim("spare", 2, 2), NodeClaim("c", 1, 3)]
    assert place(3, nodes) == {"b": (2,), "spare": (0, 1), "c": ()}


def test_fewer_slots_give_back_the_highest_ids_and_two_claims_go_to_the_first_node():
    assert place(3, [NodeClaim("a", 1, 0, (0, 2))]) == {"a": (0,)}
    assert place(3, [NodeClaim("a", 0, 0, (0, 2))]) == {"a": ()}  # draining to 0
    # After a takeover both claim id 1: the node that joined first keeps it; ids beyond R and
    # duplicates are dropped.
    claims = [NodeClaim("late", 2, 5, (1, 7)), NodeClaim("early", 2, 4, (1, 1))]
    assert place(2, claims) == {"early": (0, 1), "late": ()}
    with pytest.raises(ValueError, match="slots must be an int >= 0"):
        NodeClaim("x", -1, 0)


def test_every_id_is_held_once_whatever_the_claims():
    import random

    rng = random.Random(3)
    for _ in range(500):
        replicas = rng.randint(0, 9)
        nodes = [
            NodeClaim(f"n{i}", rng.randint(0, 3), rng.randint(0, 5),
                      tuple(rng.randint(0, 11) for _ in range(rng.randint(0, 3))))
            for i in range(rng.randint(0, 5))
        ]  # fmt: skip
        got = place(replicas, nodes)
        held = [r for ids in got.values() for r in ids]
        assert len(held) == len(set(held)) and all(0 <= r < replicas for r in held)
        slots = sum(n.slots for n in nodes)
        assert len(held) == min(replicas, slots)  # no id left unhosted while a slot is free
        for n in nodes:
            assert len(got[n.name]) <= n.slots
            mine = {r for r in n.holds if 0 <= r < replicas}
            others = {r for m in nodes if m is not n for r in m.holds}
            if len(mine) <= n.slots and not mine & others:  # a node alone with its replicas
                assert mine <= set(got[n.name])  # keeps every one of them


def beat(link: NodeLink, expect: list[int] | None = None, **claim) -> dict:
    """A node's beats until its answer is `expect` (ids are placed at most once a tick: a node
    may hear them at its next beat, as an agent does), at most 2 s; the last answer."""
    deadline = time.monotonic() + 2
    while True:
        reply = link.beat(**claim)
        if expect is None or reply["assign"] == expect or time.monotonic() > deadline:
            return reply
        time.sleep(0.01)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_the_server_hands_a_lost_nodes_ids_to_a_standby_and_a_drained_node_leaves(tmp_path):
    events = tmp_path / "events.jsonl"
    server = CoordinatorServer(
        CoordinatorOptions(expected_replicas=2, microbatches=4, node_lease_s=0.5),
        store_port=None, token="t", events_path=events,
    )  # fmt: skip
    server.start()
    try:
        link = NodeLink([server.address], token="t")
        assert beat(link, [0], node="a", slots=1, holds=[])["assign"] == [0]
        assert beat(link, [1], node="b", slots=1, holds=[])["assign"] == [1]
        reply = beat(link, node="spare", slots=1, holds=[])
        time.sleep(0.1)  # (several ticks: had it been given an id, the next beat would say so)
        reply = beat(link, node="spare", slots=1, holds=[])
        assert reply["assign"] == [] and reply["replicas"] == 2 and reply["status"] == "forming"
        # "b" is silent past its lease while the others beat: its id goes to the standby.
        deadline = time.monotonic() + 5
        while "b" in server.nodes() and time.monotonic() < deadline:
            link.beat(node="a", slots=1, holds=[0])
            time.sleep(0.1)
        assert "b" not in server.nodes()
        assert beat(link, [1], node="spare", slots=1, holds=[])["assign"] == [1]
        # "b" comes back claiming id 1: it is a new node now, and the id stays where it is.
        beat(link, node="b", slots=1, holds=[1])
        time.sleep(0.1)
        assert beat(link, node="b", slots=1, holds=[1])["assign"] == []
        # A drained node gives its ids back at once: the next node with room gets them.
        assert link.beat(node="a", slots=0, holds=[0], leaving=True)["assign"] == []
        assert beat(link, [0], node="b", slots=1, holds=[])["assign"] == [0]
        assert server.nodes() == {
            "spare": {"slots": 1, "holds": [1]},
            "b": {"slots": 1, "holds": [0]},
        }
        with pytest.raises(RequestRefused):
            NodeLink([server.address], token="wrong").beat(node="x", slots=1, holds=[])
        with pytest.raises(RequestRefused, match="slots"):
            link.beat(node="x", slots=-1, holds=[])
        link.close()
    finally:
        server.stop()
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    named = [(e["name"], e["node"]) for e in lines]
    assert ("coordinator.node_lost", "b") in named and ("coordinator.node_left", "a") in named
    lost = next(e for e in lines if e["name"] == "coordinator.node_lost")
    assert lost["ids"] == [1]
