"""Addresses across machines: what each process advertises to its peers, chosen once at start.

Job: one place for the rules of docs/design.md, "Across machines": every address that is
advertised can be dialled from the other hosts (never a wildcard, never loopback when a peer is
remote), and interfaces are chosen as torch users expect.

- A replica's gloo devices (every group it builds: each epoch's, the transfer's, which runs over
  the epoch's group) come from one `PeerAddress`, resolved at the entry point by
  `resolve_peer_address` from what the operator asked (`InterfaceChoice`: `--ifname`, else
  `RECOVER_IFNAME`, else torch's `GLOO_SOCKET_IFNAME`) and from where the coordinator is:
  1. interfaces asked for: a gloo device on each (torch's `create_device(interface=...)`);
  2. none, the coordinator on another host: the address this host reaches the coordinator from
     (the kernel's route to it: a UDP `connect`, which sends nothing, then `getsockname`). On a
     host whose name resolves to 127.0.x.x (a stock /etc/hosts) this is what works; gloo's own
     default (the host name's address) would advertise loopback;
  3. none, the coordinator on loopback (a local run): gloo's default device, exactly as before.
  The choice is refused (`AddressError`, one line) when the address it would advertise is
  loopback while the coordinator is remote, or when an interface asked for does not exist.
- The coordinator gives each replica its store's address (`advertised_store_host`): `--advertise
  HOST` when given; bound to a wildcard, the local address of the connection the replica came in
  on (the address that replica reached it at, so it can dial it); else the bound address.

The decision (`choose_peer_address`) is pure, over `HostFacts`; `gather_host_facts` does the
socket calls (name resolution, the route look-up, interface addresses: Linux ioctls, IPv4).
Nothing here reads the environment: the entry points pass it in. Stdlib only (the coordinator
imports it and stays torch-free).

Limits: an interface's address is read for IPv4 only (an IPv6-only interface is still used by
gloo, only not named in messages or bound by the coordinator's `--ifname`). "Remote" is judged
from the coordinator's address: a replica that reaches a coordinator on its own host through
127.0.0.1 while its peers are on other hosts cannot tell, and keeps gloo's default; give it the
coordinator's network address, or --ifname.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

IFNAME_ENV = "RECOVER_IFNAME"  # ours: the interfaces of every group this process builds
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # torch's: honoured the same way when ours is not set
IFNAME_FLAG = "--ifname"
_OURS = (IFNAME_FLAG, IFNAME_ENV)
_WILDCARDS = ("", "0.0.0.0", "::")
_SET_IT = (
    f"set {IFNAME_FLAG} or {IFNAME_ENV} (or torch's {GLOO_IFNAME_ENV}) to the interface that "
    "reaches the other hosts"
)

__all__ = [
    "GLOO_IFNAME_ENV",
    "IFNAME_ENV",
    "AddressError",
    "HostFacts",
    "InterfaceChoice",
    "PeerAddress",
    "advertised_store_host",
    "choose_peer_address",
    "export_for_torch",
    "gather_host_facts",
    "interface_ipv4",
    "is_loopback",
    "is_wildcard",
    "resolve_peer_address",
]


class AddressError(ValueError):
    """The address this process would advertise cannot be dialled by its peers, or an interface
    asked for does not exist. Raised at start, before the process registers; the message is one
    line naming the host, what its name resolves to, and the flag or variable to set."""


def is_loopback(address: str) -> bool:
    """Whether an IP address (text) is a loopback one (127.0.0.0/8, ::1, ::ffff:127.x.x.x)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def is_wildcard(host: str) -> bool:
    """Whether a bind address means every interface (0.0.0.0, ::, or empty)."""
    return host.strip("[]") in _WILDCARDS


def unmapped(address: str) -> str:
    """An IPv4-mapped IPv6 address as plain IPv4 (a dual-stack socket's view of an IPv4 peer)."""
    try:
        mapped = getattr(ipaddress.ip_address(address), "ipv4_mapped", None)
    except ValueError:
        return address
    return str(mapped) if mapped is not None else address


def advertised_store_host(bind_host: str, advertise: str | None, local: str | None) -> str:
    """The store host the coordinator gives one replica: `advertise` when set; bound to a
    wildcard, `local` (the local address of the connection the replica came in on, which that
    replica reached, so can dial); else the bound address. Never a wildcard."""
    if advertise:
        return advertise
    if is_wildcard(bind_host) and local:
        return unmapped(local)
    return bind_host


@dataclass(frozen=True, kw_only=True)
class InterfaceChoice:
    """The interfaces the operator asked every group of this process to use, and who asked
    (`--ifname`, `RECOVER_IFNAME` or `GLOO_SOCKET_IFNAME`; empty when none did)."""

    names: tuple[str, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.names, tuple) or not all(
            isinstance(n, str) and n for n in self.names
        ):
            raise ValueError(f"interface names must be non-empty strings, got {self.names!r}")
        if self.names and not self.source:
            raise ValueError("an InterfaceChoice with names must say where they came from")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], flag: str | None = None) -> InterfaceChoice:
        """`flag` (--ifname's value) first, then RECOVER_IFNAME, then GLOO_SOCKET_IFNAME; a
        comma-separated list gives one gloo device per interface, as torch does."""
        for source, raw in (
            (IFNAME_FLAG, flag),
            (IFNAME_ENV, environ.get(IFNAME_ENV)),
            (GLOO_IFNAME_ENV, environ.get(GLOO_IFNAME_ENV)),
        ):
            if raw is None or (source != IFNAME_FLAG and not raw.strip()):
                continue
            names = tuple(n.strip() for n in raw.split(",") if n.strip())
            if not names:
                raise ValueError(f"{source} must name an interface (e.g. eth0), got {raw!r}")
            return cls(names=names, source=source)
        return cls()

    @property
    def ours(self) -> bool:
        """Asked for with our flag or variable (torch's own groups then get it too)."""
        return self.source in _OURS


@dataclass(frozen=True)
class Interface:
    name: str
    loopback: bool
    ipv4: str | None  # None: no IPv4 address (or not readable here)


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    """What `choose_peer_address` decides from (gathered by `gather_host_facts`)."""

    hostname: str
    hostname_ips: tuple[str, ...]  # what the host's name resolves to (empty: nothing)
    coordinator: tuple[str, int]  # as given (host may be a name)
    coordinator_ips: tuple[str, ...]  # what it resolves to, the dialled one first
    route_source: str | None  # this host's address on the route to the coordinator
    interfaces: tuple[Interface, ...] = ()  # every interface of this host

    def interface(self, name: str) -> Interface | None:
        return next((i for i in self.interfaces if i.name == name), None)

    def interface_of(self, address: str | None) -> str | None:
        return next((i.name for i in self.interfaces if address and i.ipv4 == address), None)


@dataclass(frozen=True, kw_only=True)
class PeerAddress:
    """How this process's gloo devices are made (one choice for every group it builds):
    on `interfaces`, else bound to `hostname`, else gloo's default (this host's name).
    `advertised`: the address(es) peers will dial, when known; `reason`: why, for the log."""

    interfaces: tuple[str, ...] = ()
    hostname: str | None = None
    advertised: tuple[str, ...] = ()
    reason: str = "gloo's default (this host's name)"

    def __post_init__(self) -> None:
        if self.interfaces and self.hostname is not None:
            raise ValueError("a PeerAddress takes interfaces or a hostname, not both")

    @property
    def default(self) -> bool:
        return not self.interfaces and self.hostname is None


def choose_peer_address(asked: InterfaceChoice, facts: HostFacts) -> PeerAddress:
    """Pure: the gloo device choice (see the module docstring), or AddressError naming the host,
    what its name resolves to, and what to set."""
    chost, cport = facts.coordinator
    dialled = facts.coordinator_ips[0] if facts.coordinator_ips else None
    remote = dialled is not None and not is_loopback(dialled)
    where = f"the coordinator {chost}:{cport}" + (f" ({dialled})" if dialled != chost else "")
    resolved = ", ".join(facts.hostname_ips) or "nothing"
    name = f"host {facts.hostname} (its name resolves to {resolved})"

    def refuse(advertises: str) -> AddressError:
        via = facts.interface_of(facts.route_source)
        hint = f" ({via}, {facts.route_source} here)" if via and remote else ""
        return AddressError(
            f"{name} would advertise {advertises} to its peers, a loopback address that "
            f"{where} and the other hosts cannot dial: {_SET_IT}{hint}"
        )

    if asked.names:
        known = [i.name for i in facts.interfaces]
        addresses = []
        for n in asked.names:
            found = facts.interface(n)
            if found is None:
                raise AddressError(
                    f"{name}: {asked.source} names interface {n!r}, which this host does not "
                    f"have (it has {', '.join(known) or 'none'}); set {asked.source} to one of them"
                )
            if remote and (found.loopback or (found.ipv4 and is_loopback(found.ipv4))):
                raise refuse(f"{found.ipv4 or n} (interface {n}, from {asked.source})")
            if found.ipv4:
                addresses.append(found.ipv4)
        shown = ", ".join(asked.names)
        return PeerAddress(
            interfaces=asked.names,
            advertised=tuple(addresses),
            reason=f"interface {shown} ({', '.join(addresses) or 'no IPv4'}) from {asked.source}",
        )
    if not remote:
        why = "is on this host" if dialled is not None else "does not resolve here (yet)"
        return PeerAddress(
            advertised=facts.hostname_ips[:1],
            reason=f"gloo's default, this host's name ({where} {why})",
        )
    source = facts.route_source
    if source is None:  # no route to it from here: only the host's name is left
        if not facts.hostname_ips or all(is_loopback(ip) for ip in facts.hostname_ips):
            raise refuse(facts.hostname_ips[0] if facts.hostname_ips else "no address")
        return PeerAddress(
            advertised=facts.hostname_ips[:1],
            reason=f"gloo's default, this host's name (no route to {where} found)",
        )
    if is_loopback(source):
        raise refuse(source)
    return PeerAddress(
        hostname=source,
        advertised=(source,),
        reason=f"the address this host reaches {where} from"
        + (f" (interface {facts.interface_of(source)})" if facts.interface_of(source) else ""),
    )


def gather_host_facts(coordinator: tuple[str, int]) -> HostFacts:
    """The socket calls behind a choice: this host's name and what it resolves to, the
    coordinator's addresses and the route to it (no packet is sent), the interfaces."""
    host, port = coordinator
    hostname = socket.gethostname()
    coordinator_ips = _resolve(host, port)
    route = _route_source(coordinator_ips[0], port) if coordinator_ips else None
    interfaces = tuple(
        Interface(name=n, loopback=_is_loopback_interface(n), ipv4=interface_ipv4(n))
        for _, n in _interface_names()
    )
    return HostFacts(
        hostname=hostname,
        hostname_ips=_resolve(hostname, None),
        coordinator=(host, port),
        coordinator_ips=coordinator_ips,
        route_source=route,
        interfaces=interfaces,
    )


def resolve_peer_address(coordinator: tuple[str, int], asked: InterfaceChoice) -> PeerAddress:
    """`choose_peer_address` over this host's facts; AddressError when it cannot be dialled."""
    return choose_peer_address(asked, gather_host_facts(coordinator))


def export_for_torch(asked: InterfaceChoice, environ: MutableMapping[str, str]) -> bool:
    """At an entry point only: give torch's own gloo groups (a replica's own group, FSDP's, the
    checkpoint group: `init_process_group`/`new_group` take no gloo devices, only torch's
    variable) the interfaces asked with our flag or variable. True when it set the variable."""
    if not asked.ours:
        return False
    value = ",".join(asked.names)
    if environ.get(GLOO_IFNAME_ENV) == value:
        return False
    environ[GLOO_IFNAME_ENV] = value
    return True


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of interface `name` (Linux SIOCGIFADDR), or None."""
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError, ValueError):
        return None


# ---- socket helpers ---------------------------------------------------------------------------


def _resolve(host: str, port: int | None) -> tuple[str, ...]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ()
    return tuple(dict.fromkeys(unmapped(str(info[4][0])) for info in infos))


def _route_source(address: str, port: int) -> str | None:
    """This host's address on the route to `address` (a UDP connect picks it; nothing is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, port or 9))
            return unmapped(str(s.getsockname()[0]))
    except OSError:
        return None


def _interface_names() -> list[tuple[int, str]]:
    try:
        return socket.if_nameindex()
    except OSError:
        return []


def _is_loopback_interface(name: str) -> bool:
    try:
        with open(f"/sys/class/net/{name}/flags") as f:
            return bool(int(f.read().strip(), 16) & 0x8)  # IFF_LOOPBACK
    except (OSError, ValueError):
        address = interface_ipv4(name)
        return name == "lo" or (address is not None and is_loopback(address))
