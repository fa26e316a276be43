"""Addresses across machines (recover.addresses; docs/design.md, "Across machines").

What one host can show: the pure choice of the address a replica's gloo devices advertise (from
fabricated host facts: a stock /etc/hosts that maps the host's name to loopback, a remote or a
local coordinator, interfaces asked for or not), its refusal as one line, and, for real, on this
host: a coordinator bound to 0.0.0.0 gives each replica the address it came in on (never
0.0.0.0), a loopback --advertise is refused to a replica from another address, the interfaces
reach gloo's devices, and the worker and the script API stop at start with the named error.
Real multi-host runs are the network-namespace harness's (tests/hosts.py).
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from recover import exits
from recover.addresses import (
    GLOO_IFNAME_ENV,
    IFNAME_ENV,
    AddressError,
    HostFacts,
    Interface,
    InterfaceChoice,
    PeerAddress,
    advertised_store_host,
    choose_peer_address,
    export_for_torch,
    interface_ipv4,
    is_loopback,
    is_wildcard,
    resolve_peer_address,
)
from recover.coordinator import CoordinatorOptions, CoordinatorServer
from recover.coordinator.channel import request_once
from recover.coordinator.cli import bind_host
from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import CollectiveConfig
from recover.runtime.env import ReplicaEnv
from recover.runtime.spec import ReplicaSpec

LO = Interface(name="lo", loopback=True, ipv4="127.0.0.1")
ETH0 = Interface(name="eth0", loopback=False, ipv4="10.0.0.2")


def _facts(coordinator_ip: str, **over) -> HostFacts:
    """Host B of a two-host job with a stock /etc/hosts (its name maps to 127.0.1.1)."""
    fields = dict(
        hostname="hostb",
        hostname_ips=("127.0.1.1",),
        coordinator=(coordinator_ip, 29400),
        coordinator_ips=(coordinator_ip,),
        route_source="10.0.0.2" if not is_loopback(coordinator_ip) else "127.0.0.1",
        interfaces=(LO, ETH0),
    )
    return HostFacts(**{**fields, **over})


def _local_ipv4() -> str | None:
    """A non-loopback IPv4 address of this host (eth0's in a container), or None."""
    for _, name in socket.if_nameindex():
        address = interface_ipv4(name)
        if address is not None and not is_loopback(address):
            return address
    return None


LOCAL_IP = _local_ipv4()
needs_lan = pytest.mark.skipif(LOCAL_IP is None, reason="no non-loopback IPv4 address here")


# ---- the choice (pure) ------------------------------------------------------------------------


@pytest.mark.unit
def test_ours_then_torchs_variable_then_nothing():
    env = {IFNAME_ENV: "eth1", GLOO_IFNAME_ENV: "eth0"}
    assert InterfaceChoice.from_environ(env, "ib0,ib1") == InterfaceChoice(
        names=("ib0", "ib1"), source="--ifname"
    )
    assert InterfaceChoice.from_environ(env).names == ("eth1",)
    assert InterfaceChoice.from_environ(env).source == IFNAME_ENV
    torchs = InterfaceChoice.from_environ({GLOO_IFNAME_ENV: "eth0, eth2"})
    assert (torchs.names, torchs.source, torchs.ours) == (("eth0", "eth2"), GLOO_IFNAME_ENV, False)
    assert InterfaceChoice.from_environ({}) == InterfaceChoice()
    with pytest.raises(ValueError, match="--ifname must name an interface"):
        InterfaceChoice.from_environ({}, " , ")


@pytest.mark.unit
def test_a_remote_coordinator_gives_the_address_this_host_reaches_it_from():
    """The issue's host: its name resolves to loopback, which gloo's default would advertise."""
    peer = choose_peer_address(InterfaceChoice(), _facts("10.0.0.1"))
    assert peer.hostname == "10.0.0.2" and peer.advertised == ("10.0.0.2",)
    assert not peer.default and "interface eth0" in peer.reason


@pytest.mark.unit
def test_a_local_coordinator_keeps_glooss_default():
    for coordinator in ("127.0.0.1", "::1"):
        peer = choose_peer_address(InterfaceChoice(), _facts(coordinator))
        assert peer.default and peer.interfaces == () and peer.hostname is None


@pytest.mark.unit
def test_interfaces_asked_for_are_the_devices_even_for_a_local_coordinator():
    asked = InterfaceChoice.from_environ({GLOO_IFNAME_ENV: "eth0"})
    remote = choose_peer_address(asked, _facts("10.0.0.1"))
    assert remote.interfaces == ("eth0",) and remote.advertised == ("10.0.0.2",)
    assert GLOO_IFNAME_ENV in remote.reason
    local = choose_peer_address(
        InterfaceChoice.from_environ({IFNAME_ENV: "lo"}), _facts("127.0.0.1")
    )
    assert local.interfaces == ("lo",)


@pytest.mark.unit
def test_loopback_for_remote_peers_is_refused_in_one_line_naming_host_resolution_and_knobs():
    asked = InterfaceChoice.from_environ({IFNAME_ENV: "lo"})
    with pytest.raises(AddressError) as refused:
        choose_peer_address(asked, _facts("10.0.0.1"))
    line = str(refused.value)
    assert "\n" not in line
    assert "host hostb (its name resolves to 127.0.1.1)" in line
    assert "would advertise 127.0.0.1 (interface lo, from RECOVER_IFNAME)" in line
    assert "10.0.0.1:29400" in line
    for knob in ("--ifname", "RECOVER_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert knob in line
    assert "(eth0, 10.0.0.2 here)" in line  # the interface that does reach it


@pytest.mark.unit
def test_without_a_route_the_hosts_loopback_name_is_refused():
    facts = _facts("10.0.0.1", route_source=None)
    with pytest.raises(AddressError, match=r"resolves to 127\.0\.1\.1\) would advertise 127"):
        choose_peer_address(InterfaceChoice(), facts)
    named = _facts("10.0.0.1", route_source=None, hostname_ips=("10.0.0.2",))
    assert choose_peer_address(InterfaceChoice(), named).default  # gloo's default works there


@pytest.mark.unit
def test_an_interface_this_host_lacks_is_refused_naming_those_it_has():
    with pytest.raises(
        AddressError, match=r"'eth9', which this host does not have \(it has lo, eth0\)"
    ):
        choose_peer_address(InterfaceChoice.from_environ({}, "eth9"), _facts("127.0.0.1"))


@pytest.mark.unit
def test_the_store_host_a_replica_is_told_is_never_a_wildcard():
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and not is_wildcard("10.0.0.1")
    assert advertised_store_host("0.0.0.0", None, "10.0.0.1") == "10.0.0.1"
    assert advertised_store_host("::", None, "::ffff:10.0.0.1") == "10.0.0.1"  # dual stack
    assert advertised_store_host("0.0.0.0", "coord.example", "10.0.0.1") == "coord.example"
    assert advertised_store_host("10.0.0.1", None, "10.0.0.1") == "10.0.0.1"
    assert advertised_store_host("127.0.0.1", None, "127.0.0.1") == "127.0.0.1"


@pytest.mark.unit
def test_one_choice_reaches_the_collective_config_and_the_environment():
    env = ReplicaEnv.from_environ(
        {"RECOVER_COORDINATOR": "10.0.0.1:29400", "RECOVER_REPLICA_ID": "0", IFNAME_ENV: "eth0"}
    )
    assert env.interfaces.names == ("eth0",) and env.interfaces.ours
    assert env.to_environ()[IFNAME_ENV] == "eth0"
    torchs = ReplicaEnv.from_environ(
        {"RECOVER_COORDINATOR": "h:1", "RECOVER_REPLICA_ID": "0", GLOO_IFNAME_ENV: "eth0"}
    )
    assert torchs.interfaces.source == GLOO_IFNAME_ENV and IFNAME_ENV not in torchs.to_environ()
    spec = ReplicaSpec()
    assert spec.collective().gloo_interfaces == () and spec.collective().gloo_hostname is None
    on_eth0 = spec.collective(PeerAddress(interfaces=("eth0",)))
    assert on_eth0.gloo_interfaces == ("eth0",) and on_eth0.gloo_hostname is None
    assert spec.collective(PeerAddress(hostname="10.0.0.2")).gloo_hostname == "10.0.0.2"
    with pytest.raises(ValueError, match="not both"):
        CollectiveConfig(gloo_interfaces=("eth0",), gloo_hostname="10.0.0.2")
    with pytest.raises(ValueError, match="gloo_interfaces"):
        CollectiveConfig(gloo_interfaces=["eth0"])


@pytest.mark.unit
def test_torchs_own_groups_get_our_interfaces_only_through_its_variable():
    environ = {GLOO_IFNAME_ENV: "eth1"}
    assert not export_for_torch(InterfaceChoice.from_environ(environ), environ)
    assert export_for_torch(InterfaceChoice.from_environ({IFNAME_ENV: "eth0"}), environ)
    assert environ[GLOO_IFNAME_ENV] == "eth0"


@pytest.mark.unit
def test_the_coordinators_bind_address():
    assert bind_host(None, None, {}) == "127.0.0.1"  # as before
    assert bind_host("0.0.0.0", None, {IFNAME_ENV: "lo"}) == "0.0.0.0"  # the flag wins
    assert bind_host(None, "lo", {}) == "127.0.0.1"  # lo's address
    assert bind_host(None, None, {GLOO_IFNAME_ENV: "lo"}) == "127.0.0.1"
    with pytest.raises(ValueError, match="--host or --ifname, not both"):
        bind_host("0.0.0.0", "lo", {})
    with pytest.raises(ValueError, match="'nosuch0', which has no IPv4 address"):
        bind_host(None, "nosuch0", {})


# ---- on this host -----------------------------------------------------------------------------


def _register(host: str, port: int, replica_id: int = 0) -> dict:
    req = {"kind": "register", "replica_id": replica_id, "incarnation": f"i{replica_id}",
           "fingerprint": {},
           "next_step": 0, "view_version": -1}  # fmt: skip
    return request_once(host, port, req)


@pytest.mark.timeout(30)
def test_a_wildcard_coordinator_tells_each_replica_the_address_it_came_in_on():
    opts = CoordinatorOptions(expected_replicas=2, microbatches=2)
    with CoordinatorServer(opts, host="0.0.0.0", port=0, store_port=0) as server:
        port, store_port = server.address[1], server.store_address[1]
        assert server.store_address[0] == "0.0.0.0"  # bound there; never told to a replica
        reply = _register("127.0.0.1", port)
        assert reply["ok"] and reply["store"] == ["127.0.0.1", store_port]
        status = request_once("127.0.0.1", port, {"kind": "status"})
        assert status["store"] == ["127.0.0.1", store_port]
        if LOCAL_IP is not None:  # the same coordinator reached at the LAN address
            assert _register(LOCAL_IP, port, 1)["store"] == [LOCAL_IP, store_port]
        # the store answers at the address given
        store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False)
        store.set("k", "v")
        assert store.get("k") == b"v"


@pytest.mark.timeout(30)
def test_an_advertised_address_wins_and_loopback_is_refused_to_another_host():
    opts = CoordinatorOptions(expected_replicas=2, microbatches=2)
    with CoordinatorServer(
        opts, host="0.0.0.0", port=0, store_port=0, advertise="127.0.0.1"
    ) as server:
        port, store_port = server.address[1], server.store_address[1]
        assert server.store_address == ("127.0.0.1", store_port)
        assert _register("127.0.0.1", port)["store"] == ["127.0.0.1", store_port]
        if LOCAL_IP is None:
            return
        refused = _register(LOCAL_IP, port, 1)  # a peer at a non-loopback address
        assert not refused["ok"] and refused["code"] == "address"
        assert "--advertise" in refused["reason"] and LOCAL_IP in refused["reason"]
        assert "\n" not in refused["reason"]
        assert 1 not in server.state().members  # refused before it joined anything


@needs_lan
@pytest.mark.timeout(30)
def test_a_replica_of_a_lan_coordinator_binds_gloo_where_it_reaches_it():
    peer = resolve_peer_address((LOCAL_IP, 29400), InterfaceChoice())
    assert peer.hostname == LOCAL_IP and peer.advertised == (LOCAL_IP,)
    assert resolve_peer_address(("127.0.0.1", 29400), InterfaceChoice()).default


def _pair_sum(config: CollectiveConfig) -> list[float]:
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    box: dict = {}

    def rank0() -> None:
        try:
            box["g"] = EpochGroup.build(store, epoch=1, rank=0, world_size=2, config=config)
        except Exception as exc:  # re-raised below
            box["e"] = exc

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    g1 = EpochGroup.build(store, epoch=1, rank=1, world_size=2, config=config)
    thread.join(config.build_timeout_s + 2)
    if "e" in box:
        raise box["e"]
    g0, out = box["g"], []
    try:
        bufs = [torch.full((4,), 1.0), torch.full((4,), 2.0)]
        t = threading.Thread(
            target=lambda: g0.allreduce_sum(bufs[0], should_abort=lambda: None), daemon=True
        )
        t.start()
        g1.allreduce_sum(bufs[1], should_abort=lambda: None)
        t.join(10)
        out = [bufs[0][0].item(), bufs[1][0].item()]
    finally:
        g0.abandon()
        g1.abandon()
    return out


@pytest.mark.timeout(60)
def test_the_interfaces_and_the_address_reach_glooss_devices():
    config = CollectiveConfig(build_timeout_s=10, op_deadline_s=10, pg_timeout_s=20)
    assert _pair_sum(CollectiveConfig(**{**_fields(config), "gloo_interfaces": ("lo",)})) == [3, 3]
    if LOCAL_IP is not None:
        on_lan = CollectiveConfig(**{**_fields(config), "gloo_hostname": LOCAL_IP})
        assert _pair_sum(on_lan) == [3, 3]
    with pytest.raises(RuntimeError):  # what the start-up check keeps from every epoch's build
        _pair_sum(CollectiveConfig(**{**_fields(config), "gloo_interfaces": ("nosuch0",)}))


def _fields(config: CollectiveConfig) -> dict:
    return {k: getattr(config, k) for k in ("build_timeout_s", "op_deadline_s", "pg_timeout_s")}


@pytest.mark.timeout(60)
def test_a_worker_and_a_script_with_loopback_for_a_remote_coordinator_stop_at_start(
    tmp_path, capsys
):
    from recover.cli import parse_args, run_worker_cli
    from recover.runtime.api import Replica

    args = parse_args(
        ["worker", "--coordinator", "10.255.255.1:29400", "--replica-id", "0", "--ifname", "lo",
         "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    )  # fmt: skip
    assert run_worker_cli(args) == exits.ADDRESS
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: host ") and "--ifname" in err[0]
    assert "Traceback" not in "".join(err) and not (tmp_path / "run").exists()
    env = {"RECOVER_COORDINATOR": "10.255.255.1:29400", "RECOVER_REPLICA_ID": "0", IFNAME_ENV: "lo"}
    with pytest.raises(AddressError, match="RECOVER_IFNAME"):
        Replica(microbatches=2, env=env)
