"""The multi-host harness itself (tests/hosts.py): reach, names, partition, impairment, cleanup.

Each test builds its own Network (0.1 s) and talks only to addresses inside it; the whole file
takes a few seconds. Skipped, with the reason, where namespaces cannot be made (not root, no ip).
"""

from __future__ import annotations

import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hosts import Host, Network, available, list_namespaces, pid_alive, remove_stale

pytestmark = pytest.mark.process

PORT = 7100

# On a host: a TCP server that sends its hostname, then echoes; and a UDP echo on the same port.
SERVER = """
import socket, sys, threading
addr, port = sys.argv[1], int(sys.argv[2])
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind((addr, port))
def udp_echo():
    while True:
        data, peer = udp.recvfrom(2048)
        udp.sendto(data, peer)
def serve(conn):
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(socket.gethostname().encode() + b"\\n")
        while data := conn.recv(4096):
            conn.sendall(data)
threading.Thread(target=udp_echo, daemon=True).start()
tcp = socket.create_server((addr, port))
print("listening", flush=True)
while True:
    conn, _ = tcp.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

# On a host: connect, read the server's hostname, time `rounds` one-byte round trips; one JSON line.
CLIENT = """
import json, socket, sys, time
addr, port, rounds, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    conn = socket.create_connection((addr, port), timeout=timeout)
except OSError as e:
    print(json.dumps({"error": type(e).__name__}))
    sys.exit(0)
conn.settimeout(30)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
stream = conn.makefile("rb")
peer = stream.readline().decode().strip()
rtts = []
for _ in range(rounds):
    start = time.monotonic()
    conn.sendall(b"x")
    assert stream.read(1) == b"x"
    rtts.append((time.monotonic() - start) * 1000)
print(json.dumps({"hostname": socket.gethostname(), "peer": peer, "rtts_ms": rtts}))
"""

# On a host: send `count` numbered datagrams 1 ms apart, count the distinct echoes.
UDP_CLIENT = """
import json, socket, sys, time
addr, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setblocking(False)
seen = set()
def drain():
    while True:
        try:
            seen.add(sock.recv(64))
        except BlockingIOError:
            return
for i in range(count):
    sock.sendto(str(i).encode(), (addr, port))
    time.sleep(0.001)
    drain()
end = time.monotonic() + 0.3
while time.monotonic() < end and len(seen) < count:
    time.sleep(0.01)
    drain()
print(json.dumps({"sent": count, "echoed": len(seen)}))
"""

RESOLVE = """
import socket, sys
print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), socket.gethostbyname(sys.argv[1]))
"""


@pytest.fixture(scope="module", autouse=True)
def _harness_available() -> None:
    ok, reason = available(tap=True)
    if not ok:
        pytest.skip(f"no multi-host harness here: {reason}")


def _start_server(host: Host) -> subprocess.Popen:
    proc = host.popen([sys.executable, "-c", SERVER, host.addr, str(PORT)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 10.0)
    assert ready and proc.stdout.readline() == b"listening\n", f"server on {host} did not start"
    return proc


def _client(host: Host, target: Host, *, rounds: int = 1, connect_timeout: float = 5.0) -> dict:
    argv = [sys.executable, "-c", CLIENT, target.addr, str(PORT), str(rounds), str(connect_timeout)]
    done = host.run(argv, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in out.stdout.splitlines())


@pytest.mark.timeout(30)
def test_two_hosts_reach_each_other_by_address_and_see_their_own_hostnames():
    our_hostname = socket.gethostname()
    with Network(2) as net:
        a, b = net.host(0), net.host(1)
        for server, client in ((a, b), (b, a)):
            _start_server(server)
            reply = _client(client, server, rounds=3)
            assert reply["peer"] == server.name
            assert reply["hostname"] == client.name
            assert len(reply["rtts_ms"]) == 3
    assert socket.gethostname() == our_hostname  # the hostnames were set in UTS namespaces only


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["loopback", "routable"])
def test_hosts_file_modes(mode):
    etc_hosts = Path("/etc/hosts").read_text()
    with Network(2, mode=mode) as net:
        a, b = net.host(0), net.host(1)
        done = a.run([sys.executable, "-c", RESOLVE, b.name], timeout=10)
        assert done.returncode == 0, done.stderr
        name, own, other = done.stdout.split()
        assert name == a.name
        if mode == "loopback":
            assert own.startswith("127."), own  # as in a stock Debian /etc/hosts
        else:
            assert own == a.addr
        assert other == b.addr
    assert Path("/etc/hosts").read_text() == etc_hosts  # bind-mounted in a mount namespace only


@pytest.mark.timeout(30)
def test_partition_makes_connects_fail_and_heal_restores_them():
    with Network(2) as net:
        server, client = net.host(0), net.host(1)
        _start_server(server)
        assert _client(client, server)["peer"] == server.name
        server.partition()
        assert _client(client, server, connect_timeout=0.5) == {"error": "TimeoutError"}
        server.heal()
        deadline = time.monotonic() + 10
        while "error" in (reply := _client(client, server, connect_timeout=0.5)):
            assert time.monotonic() < deadline, f"no connect 10 s after heal: {reply}"
        assert reply["peer"] == server.name


@pytest.mark.timeout(60)
def test_impaired_link_adds_the_delay_and_loses_frames():
    delay_ms = 25.0
    with Network(3, impaired={1: (delay_ms, 0.0)}) as net:
        client, slow, fast = net.hosts
        _start_server(slow)
        _start_server(fast)
        fast_rtts = _client(client, fast, rounds=10)["rtts_ms"]
        slow_rtts = _client(client, slow, rounds=10)["rtts_ms"]
        # Each frame crosses the relay once each way: a round trip is held 2 * delay_ms.
        assert min(slow_rtts) >= 2 * delay_ms, slow_rtts
        assert statistics.median(slow_rtts) < 2 * delay_ms + 20, slow_rtts
        assert statistics.median(fast_rtts) < delay_ms, fast_rtts  # the veth link is not delayed

        slow.impair(5.0, 0.05)
        reply = _client(client, slow, rounds=10)  # TCP retransmits through 5% loss
        assert reply["peer"] == slow.name and min(reply["rtts_ms"]) >= 10.0
        udp = client.run(
            [sys.executable, "-c", UDP_CLIENT, slow.addr, str(PORT), "300"], timeout=20
        )
        echoed = json.loads(udp.stdout)["echoed"]
        # A round trip survives with probability 0.95**2 (about 271 of 300 expected).
        assert 200 <= echoed <= 297, echoed

        slow.partition()  # an impaired host is cut off at its switch-side tap
        assert _client(client, slow, connect_timeout=0.5) == {"error": "TimeoutError"}


@pytest.mark.timeout(30)
def test_relay_stops_at_the_end_of_its_lifetime():
    with Network(1, impaired={0: (0.0, 0.0)}, relay_lifetime_s=0.5) as net:
        assert net.relays[0].wait(timeout=5) == 0


@pytest.mark.timeout(30)
def test_close_removes_namespaces_processes_and_files_even_when_the_test_fails():
    links_before = _root_links()
    with pytest.raises(RuntimeError, match="the test failed"):
        with Network(2, impaired={1: (1.0, 0.0)}) as net:
            namespaces, tmp_dir = net.namespaces, net.tmp_dir
            sleeper = net.host(0).popen(["sleep", "60"])
            # A process that left its process group: only the namespace sweep can find it.
            detach = "setsid sleep 60 >/dev/null 2>&1 & echo $!"
            daemon = net.host(1).run(["sh", "-c", detach], timeout=10)
            pids = [sleeper.pid, int(daemon.stdout), net.relays[1].pid]
            assert all(pid_alive(pid) for pid in pids)
            assert set(namespaces) <= set(list_namespaces())
            raise RuntimeError("the test failed")
    assert not set(namespaces) & set(list_namespaces())
    deadline = time.monotonic() + 5  # the orphan is reaped by init, not by us
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if pid_alive(pid)]
    assert not tmp_dir.exists()
    assert _root_links() == links_before
    net.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        net.host(0).popen(["true"])


@pytest.mark.timeout(30)
def test_remove_stale_deletes_only_what_a_dead_pid_left():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_ns, live_ns = f"rcvh-{dead.pid}-0-sw", f"rcvh-{os.getpid()}-live-test"
    stale_dir = Path(tempfile.mkdtemp(prefix=f"rcvh-{dead.pid}-0-"))
    try:
        for ns in (stale_ns, live_ns):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        assert stale_ns in remove_stale()
        names = list_namespaces()
        assert stale_ns not in names and live_ns in names
        assert not stale_dir.exists()
    finally:
        for ns in (stale_ns, live_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
