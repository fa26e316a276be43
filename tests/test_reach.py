"""The reach probe (recover.runtime.reach): its verdicts on real sockets, and a group build that
ends early, naming the peer, when a peer that reached the rendezvous cannot be dialled."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch.distributed as dist

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import CollectiveAborted, CollectiveConfig
from recover.runtime.reach import KEY, ReachListener, parse_endpoint, probe_one, probe_peers


@pytest.fixture
def listener():
    reach = ReachListener("127.0.0.1")
    yield reach
    reach.close()


def closed_port() -> int:
    """A port on 127.0.0.1 that nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_listening_peer_is_reachable(listener):
    assert listener.endpoint is not None
    assert probe_one(listener.endpoint, timeout_s=2.0) is None


def test_a_refused_connect_is_unreachable_and_names_the_address():
    port = closed_port()
    why = probe_one(f"127.0.0.1:{port}:abc", timeout_s=2.0)
    assert why is not None and f"127.0.0.1:{port}" in why


def test_another_process_at_the_address_is_unreachable(listener):
    """The address answers, but with another listener's token: the peer's address is not its
    own from here (as a loopback address advertised to a remote host would be)."""
    host, port, _ = parse_endpoint(listener.endpoint)
    why = probe_one(f"{host}:{port}:not-its-token", timeout_s=2.0)
    assert why is not None and "another process" in why


def test_a_peer_that_accepts_but_never_answers_is_reachable():
    """A stopped or busy process: the kernel completes the connect (its backlog), no line comes.
    The network reaches it; its lease, not this probe, judges it."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # never accept()ed
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        assert probe_one(f"127.0.0.1:{port}:tok", timeout_s=0.3) is None
        assert time.monotonic() - t0 < 2.0


def test_probe_peers_names_only_the_unreachable_ranks_in_parallel(listener):
    endpoints = {1: listener.endpoint, 2: f"127.0.0.1:{closed_port()}:x", 3: "garbage"}
    verdicts = probe_peers(endpoints, timeout_s=1.0)
    assert sorted(verdicts) == [2, 3]


def test_a_closed_listener_stops_answering():
    reach = ReachListener("127.0.0.1")
    endpoint = reach.endpoint
    reach.close()
    assert probe_one(endpoint, timeout_s=1.0) is not None


def test_an_address_that_cannot_be_bound_turns_the_probe_off():
    reach = ReachListener("192.0.2.1")  # not an address of this host: bind fails
    assert reach.endpoint is None
    reach.close()


@pytest.mark.timeout(30)
def test_a_build_whose_peer_cannot_be_dialled_ends_early_naming_it(listener):
    """Rank 1 reached the rendezvous (its endpoint is published) at an address that refuses:
    rank 0's build ends soon after reach_after_s with kind "unreachable" naming rank 1, not at
    build_timeout_s."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    epoch = 3
    prefix = dist.PrefixStore(f"recover/runtime/collective/epoch{epoch}", store)
    prefix.set(f"{KEY}1", f"127.0.0.1:{closed_port()}:gone")
    config = CollectiveConfig(build_timeout_s=8.0, reach_after_s=0.3, reach_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(CollectiveAborted) as info:
        EpochGroup.build(
            store, epoch=epoch, rank=0, world_size=2, config=config, reach=listener,
            should_abort=lambda: None,
        )  # fmt: skip
    assert info.value.kind == "unreachable" and list(info.value.unreachable) == [1]
    assert time.monotonic() - t0 < 4.0  # not build_timeout_s
    assert prefix.get(f"{KEY}0").decode() == listener.endpoint  # its own endpoint, published


@pytest.mark.timeout(30)
def test_a_build_whose_peer_is_reachable_waits_for_it():
    """The probe finds the peer reachable (it is only slow): the build goes on to its deadline."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    peer = ReachListener("127.0.0.1")
    try:
        prefix = dist.PrefixStore("recover/runtime/collective/epoch4", store)
        prefix.set(f"{KEY}1", peer.endpoint)
        config = CollectiveConfig(build_timeout_s=2.0, reach_after_s=0.2, reach_timeout_s=0.5)
        with pytest.raises(CollectiveAborted) as info:
            EpochGroup.build(store, epoch=4, rank=0, world_size=2, config=config,
                             reach=ReachListener("127.0.0.1"), should_abort=lambda: None)  # fmt: skip
        assert info.value.kind == "deadline" and info.value.unreachable == {}
    finally:
        peer.close()
