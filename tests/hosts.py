"""Several "hosts" on one machine for tests: Linux network namespaces joined by a bridge.

Job: build N hosts, each a network namespace with its own address, hostname and /etc/hosts,
joined by one Linux bridge; run processes on them; cut a host off (`partition`/`heal`); give one
host's link a delay and a loss rate without sch_netem (`impaired=`, `Host.impair`).

Layout (a Network numbered n of the test process with pid P; X is the subnet's third octet):

    switch ns  rcvh-P-n-sw   bridge br0 (no address), one port s<i> per host
    host ns    rcvh-P-n-h<i> lo up, eth0 = 10.231.X.<i+1>/24, joined to s<i> by either
                             - a veth pair (eth0 here, s<i> in the switch ns), or
                             - for an impaired host, two tap devices (eth0 here, s<i> in the
                               switch ns) and a relay process that copies each frame between
                               them, holding it delay_ms and dropping it with probability loss
                               (both directions, so a round trip gains 2 * delay_ms).

    Running argv on host i is
        ip netns exec NS unshare --uts --mount sh -c \\
            'hostname NAME && mount --bind HOSTS /etc/hosts && exec "$@"' sh argv...
    so the process sees its own hostname and /etc/hosts; it starts a new session, so that its
    process group can be killed. /etc/hosts has two modes: "routable" (every host name, this
    host's too, maps to its bridge address) and "loopback" (this host's name maps to 127.0.1.1,
    as a stock Debian /etc/hosts does; the other hosts map to their addresses).

Invariants:
- The root network namespace is never touched: every bridge, veth and tap is created directly
  inside its namespace (`ip link add ... netns NS`), the bridge has no address, and only the
  namespace handles (/run/netns/rcvh-*) appear outside. Interfaces have short names (eth0, s<i>,
  br0) since they live only in the Network's own namespaces; the namespace names carry the pid
  and the counter, so two test files run at once (pytest-xdist) never share a name.
- The subnet 10.231.X.0/24 is derived from the pid and the counter (distinct for the nearby pids
  of xdist workers); a clash would be harmless anyway, each Network's bridge being private.
- `close()` (also from `__exit__` when a test fails, and from atexit) kills the process group of
  every process started here, then every process still inside the namespaces (`ip netns pids`),
  deletes the links, the namespaces and the temp dir, and raises if a namespace is left.
- A relay exits by itself when its parent (the test process) dies or after `relay_lifetime_s`.
- `remove_stale()` deletes namespaces and temp dirs named with this prefix and a dead pid (a
  crashed run); every Network calls it when built.

Costs (measured on a 2-core development machine): building a 4-host network takes about 0.06 s
(0.11 s with one impaired host: the relay is a Python process that must start), closing it about
0.15 s (`ip netns pids` and link deletions per namespace). Running a command on a host adds a few
ms (ip, unshare, sh) to its start. A veth round trip takes 0.05 ms; through a relay at delay_ms
20 it takes 40.4 ms (0.4 ms over 2 * delay_ms). The relay is a Python select loop: fine for test
traffic, not for bulk throughput.
Limits: needs root, iproute2, util-linux unshare, and /dev/net/tun for impairment.
Not thread-safe: one Network is used by one test thread.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import ctypes
import errno
import fcntl
import itertools
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

PREFIX = "rcvh"
NETNS_DIR = Path("/var/run/netns")
HostsMode = Literal["routable", "loopback"]
_HOSTNAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
# The one piece of module state: Network numbers, so that two Networks of one process (or one
# built after another was closed) never share a name. A count, not a config: nothing reads it.
_counter = itertools.count()


class Impairment(NamedTuple):
    """What the relay does to each frame of a host's link, in each direction."""

    delay_ms: float  # held this long before it is passed on
    loss: float  # dropped with this probability, in [0, 1)

    def validated(self) -> Impairment:
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        return self


def available(*, tap: bool = False) -> tuple[bool, str]:
    """(True, "") where Networks can be built here; else (False, why), for `pytest.skip`.

    Builds and deletes a probe namespace with a bridge, a veth and an unshared process (30 ms).
    `tap=True` also checks /dev/net/tun, which impairment needs."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    for tool in ("ip", "unshare", "hostname", "mount"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not on PATH"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    steps = [
        ["ip", "netns", "add", probe],
        ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"],
        ["ip", "netns", "exec", probe, "unshare", "--uts", "--mount", "true"],
    ]
    try:
        for argv in steps:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            if proc.returncode != 0:
                return False, f"`{' '.join(argv)}` failed: {proc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    if tap:
        try:
            os.close(os.open("/dev/net/tun", os.O_RDWR))
        except OSError as e:
            return False, f"/dev/net/tun cannot be opened: {e}"
    return True, ""


def list_namespaces() -> list[str]:
    """The names `ip netns list` shows."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces and temp dirs of crashed runs: named `prefix-PID-...` with PID dead.

    Returns the namespaces deleted. Namespaces of live processes (another xdist worker) stay."""
    removed = []
    for ns in list_namespaces():
        match = re.match(rf"^{re.escape(prefix)}-(\d+)-", ns)
        if match and not pid_alive(int(match.group(1))):
            _kill_inside(ns, deadline=time.monotonic() + 5)
            _ip_quiet("netns", "del", ns)
            removed.append(ns)
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}-*"):
        match = re.match(rf"^{re.escape(prefix)}-(\d+)-", path.name)
        if match and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    return removed


class Host:
    """One namespace of a Network: run processes on it, cut it off, slow its link down."""

    def __init__(self, network: Network, index: int, name: str, addr: str, ns: str) -> None:
        self.network = network
        self.index = index
        self.name = name  # its hostname
        self.addr = addr  # its address on the bridge
        self.ns = ns  # its network namespace
        self.hosts_file = network.tmp_dir / f"hosts-{index}"  # bind-mounted on its /etc/hosts

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.name!r}, {self.addr}, ns={self.ns!r})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` on this host (its namespace, hostname and /etc/hosts)."""
        script = '"$1" "$2" && "$3" --bind "$4" /etc/hosts && shift 4 && exec "$@"'
        tools = self.network.tools
        return [
            tools["ip"], "netns", "exec", self.ns, tools["unshare"], "--uts", "--mount",
            "/bin/sh", "-c", script, "sh", tools["hostname"], self.name, tools["mount"],
            str(self.hosts_file), *argv,
        ]  # fmt: skip

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start `argv` on this host in a new session; `close()` kills its process group."""
        if kwargs.pop("start_new_session", True) is not True:
            raise ValueError("start_new_session must stay True: close() kills process groups")
        self.network.check_open()
        proc = subprocess.Popen(self.command(argv), env=env, start_new_session=True, **kwargs)
        self.network.started.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to its end, output captured as text; kill it at `timeout`."""
        proc = self.popen(
            argv,
            env=env,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def partition(self) -> None:
        """Cut this host off: its switch port leaves the bridge. Its link stays up, so, as in a
        real partition, its frames vanish silently (connects time out, nothing is refused)."""
        self.network.check_open()
        _ip("-n", self.network.switch_ns, "link", "set", f"s{self.index}", "nomaster")

    def heal(self) -> None:
        """Undo `partition`: the switch port joins the bridge again."""
        self.network.check_open()
        _ip("-n", self.network.switch_ns, "link", "set", f"s{self.index}", "master", "br0")

    def kill_all(self, timeout_s: float = 10.0) -> list[int]:
        """A host's death: SIGKILL every process inside its namespace (daemons and what they
        started too) until none is left; returns the pids seen."""
        self.network.check_open()
        seen = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        _kill_inside(self.ns, time.monotonic() + timeout_s)
        return [int(p) for p in seen.stdout.split()]

    def impair(self, delay_ms: float, loss: float) -> None:
        """Change this host's delay and loss (restarts its relay: frames in flight are lost).

        Only for a host built with `impaired=`: the others are joined by a veth, no relay."""
        self.network.start_relay(self.index, Impairment(delay_ms, loss).validated())


class Network:
    """N hosts on one bridge, each in its own namespace; a context manager that cleans up.

    `impaired` maps a host index to (delay_ms, loss): that host is joined through a relay."""

    def __init__(
        self,
        hosts: int,
        *,
        mode: HostsMode = "routable",
        impaired: Mapping[int, tuple[float, float]] | None = None,
        names: Sequence[str] | None = None,
        relay_lifetime_s: float = 900.0,
    ) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {hosts}")
        if mode not in ("routable", "loopback"):
            raise ValueError(f"mode must be 'routable' or 'loopback', got {mode!r}")
        names = list(names) if names is not None else [f"host{i}" for i in range(hosts)]
        if len(names) != hosts or len(set(names)) != hosts:
            raise ValueError(f"names must be {hosts} distinct hostnames, got {names}")
        for name in names:
            if not _HOSTNAME_RE.match(name):
                raise ValueError(f"names: {name!r} is not a lowercase hostname")
        impairments = {i: Impairment(*v).validated() for i, v in (impaired or {}).items()}
        for i in impairments:
            if not 0 <= i < hosts:
                raise ValueError(f"impaired: host index {i} is not in 0..{hosts - 1}")
        if relay_lifetime_s <= 0:
            raise ValueError(f"relay_lifetime_s must be > 0, got {relay_lifetime_s}")

        self.mode = mode
        self.relay_lifetime_s = relay_lifetime_s
        self.tools = {tool: _which(tool) for tool in ("ip", "unshare", "hostname", "mount")}
        pid, number = os.getpid(), next(_counter)
        tag = f"{PREFIX}-{pid}-{number}"
        self.switch_ns = f"{tag}-sw"
        self.subnet = f"10.231.{1 + (pid * 4 + number) % 252}"  # .0/24
        self.started: list[subprocess.Popen] = []  # every process run on a host
        self.relays: dict[int, subprocess.Popen] = {}  # host index -> its relay
        self._tapped = sorted(impairments)  # hosts joined by taps and a relay
        self._closed = False
        remove_stale()
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
        self.hosts = tuple(
            Host(self, i, name, f"{self.subnet}.{i + 1}", f"{tag}-h{i}")
            for i, name in enumerate(names)
        )
        self._made: list[str] = []  # namespaces created so far, for close() after a failed build
        atexit.register(self.close)
        try:
            self._build(impairments)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, i: int) -> Host:
        return self.hosts[i]

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns, *(h.ns for h in self.hosts)]

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Network {self.switch_ns} is closed")

    def _build(self, impairments: Mapping[int, Impairment]) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _ip(
            "-n", sw, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0"
        )
        _ip("-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            self._add_ns(h.ns)
            port = f"s{h.index}"
            if h.index in impairments:
                _ip("-n", h.ns, "tuntap", "add", "dev", "eth0", "mode", "tap")
                _ip("-n", sw, "tuntap", "add", "dev", port, "mode", "tap")
            else:
                # Both ends are created inside their namespaces: none exists in the root one.
                _ip("link", "add", "eth0", "netns", h.ns, "type", "veth", "peer", "name", port, "netns", sw)  # fmt: skip
            _ip("-n", sw, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            h.hosts_file.write_text(self._hosts_text(h))
        for i, impairment in impairments.items():
            self.start_relay(i, impairment)

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def _hosts_text(self, me: Host) -> str:
        lines = ["127.0.0.1\tlocalhost"]
        if self.mode == "loopback":
            lines.append(f"127.0.1.1\t{me.name}")
        for h in self.hosts:
            if h is not me or self.mode == "routable":
                lines.append(f"{h.addr}\t{h.name}")
        lines.append("::1\tlocalhost ip6-localhost ip6-loopback")
        return "\n".join(lines) + "\n"

    def start_relay(self, i: int, impairment: Impairment) -> None:
        """(Re)start host i's relay with `impairment`; waits until both taps are attached."""
        self.check_open()
        if i not in self._tapped:
            raise ValueError(f"host {i} has no relay: pass impaired={{{i}: (delay_ms, loss)}}")
        if i in self.relays:
            _stop(self.relays.pop(i))
        log = open(self.tmp_dir / f"relay-{i}.log", "ab")  # the relay's stderr
        with log:
            proc = subprocess.Popen(
                [
                    self.tools["ip"], "netns", "exec", self.switch_ns, sys.executable,
                    str(Path(__file__).resolve()), "relay", "--host-ns", self.hosts[i].ns,
                    "--host-tap", "eth0", "--switch-tap", f"s{i}",
                    "--delay-ms", str(impairment.delay_ms), "--loss", str(impairment.loss),
                    "--seed", str(i), "--lifetime-s", str(self.relay_lifetime_s),
                    "--parent-pid", str(os.getpid()),
                ],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True,
            )  # fmt: skip
        self.relays[i] = proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10.0)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            error = (self.tmp_dir / f"relay-{i}.log").read_text(errors="replace")
            raise RuntimeError(f"relay of host {i} did not start: {line!r} {error[-2000:]}")

    def close(self) -> None:
        """Kill every process on the hosts and the relays, delete links, namespaces, temp dir.

        Safe to call twice; raises RuntimeError if a namespace could not be deleted."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        deadline = time.monotonic() + 10
        for proc in [*self.started, *self.relays.values()]:
            _kill_group(proc)
        for ns in self._made:
            _kill_inside(ns, deadline)  # also what left the process groups (setsid, daemons)
        for proc in [*self.started, *self.relays.values()]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # a process in uninterruptible sleep: reported below by its namespace
            if proc.stdout is not None:
                proc.stdout.close()
        # Links first, so that none outlives a namespace kept alive by a stuck process.
        if self.switch_ns in self._made:
            _ip_quiet("-n", self.switch_ns, "link", "del", "br0")
            for i in self._tapped:
                _ip_quiet("-n", self.switch_ns, "link", "del", f"s{i}")
        for h in self.hosts:
            if h.ns in self._made:
                _ip_quiet("-n", h.ns, "link", "del", "eth0")  # a veth takes its peer s<i> along
        for ns in self._made:
            _ip_quiet("netns", "del", ns)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        left = sorted(set(self._made) & set(list_namespaces()))
        if left:
            raise RuntimeError(f"namespaces left after close: {left}")


def _which(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(f"`{tool}` is not on PATH (see hosts.available())")
    return path


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _ip_quiet(*args: str) -> None:
    """`ip` in cleanup: the thing may already be gone (a veth deleted with its peer)."""
    subprocess.run(["ip", *args], capture_output=True, timeout=10)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return  # reaped: its pid may be reused; what its group left is killed by namespace
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop(proc: subprocess.Popen) -> None:
    _kill_group(proc)
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


def _kill_inside(ns: str, deadline: float) -> None:
    """SIGKILL every process inside namespace `ns` (all of them ours) until none is left."""
    while True:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


# --- The relay: `ip netns exec SWITCH python hosts.py relay ...` ----------------------------------

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_MAX_QUEUED = 10_000  # frames held per direction; more are dropped, as by a full queue


def _open_tap(name: str) -> int:
    """Attach to tap `name` of the current network namespace; a non-blocking fd of frames."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def _setns(fd: int) -> None:
    """setns(2) into a network namespace (os.setns needs Python 3.12)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _forward(
    a: int, b: int, impairment: Impairment, rng: random.Random, deadline: float, parent: int
) -> None:
    """Copy frames between fds a and b, each held delay_ms, each dropped with probability loss."""
    delay_s = impairment.delay_ms / 1000
    peer = {a: b, b: a}
    # fd -> the frames (due time, bytes) to write to it, oldest first (one delay for all).
    held: dict[int, collections.deque[tuple[float, bytes]]] = {
        a: collections.deque(),
        b: collections.deque(),
    }
    while time.monotonic() < deadline and os.getppid() == parent:
        now = time.monotonic()
        due = min((q[0][0] for q in held.values() if q), default=now + 0.2)
        readable, _, _ = select.select([a, b], [], [], min(0.2, max(0.0, due - now)))
        now = time.monotonic()
        for fd in readable:
            for _ in range(256):
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                queue = held[peer[fd]]
                if rng.random() >= impairment.loss and len(queue) < _MAX_QUEUED:
                    queue.append((now + delay_s, frame))
        now = time.monotonic()
        for fd, queue in held.items():
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                try:
                    os.write(fd, frame)
                except OSError as e:
                    # EIO: the tap's interface is down; EAGAIN/ENOBUFS: its queue is full. The
                    # frame is lost, as on a wire; any other error is a bug and ends the relay.
                    if e.errno not in (errno.EIO, errno.EAGAIN, errno.ENOBUFS):
                        raise


def _relay_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hosts.py relay")
    parser.add_argument("--host-ns", required=True)
    parser.add_argument("--host-tap", required=True)
    parser.add_argument("--switch-tap", required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--loss", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lifetime-s", type=float, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.lifetime_s
    # A tap is attached in the namespace current at open(): the switch's (ip netns exec put us
    # there), then the host's; then back home, so that `ip netns pids SWITCH` finds us.
    switch_fd = _open_tap(args.switch_tap)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / args.host_ns, os.O_RDONLY)
    _setns(target)
    host_fd = _open_tap(args.host_tap)
    _setns(home)
    os.close(target)
    os.close(home)
    print("ready", flush=True)
    impairment = Impairment(args.delay_ms, args.loss).validated()
    _forward(host_fd, switch_fd, impairment, random.Random(args.seed), deadline, args.parent_pid)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        sys.exit(_relay_main(sys.argv[2:]))
    sys.exit("usage: hosts.py relay --host-ns NS ... (started by Network, not by hand)")
