"""The environment a launcher gives each replica process, read once at the entry point.

Job: name the variables (one place), and turn them into a frozen `ReplicaEnv` with clear errors.
`recover run` (and `recover train`'s launcher) set them for every process it starts; under a
multi-node job, `torchrun` plus these variables do the same. Nothing below the entry point
(`recover.runtime.api.Replica`, the CLI) reads the environment: it gets a `ReplicaEnv`.

| variable | meaning |
|---|---|
| RECOVER_COORDINATOR | HOST:PORT of the coordinator (required); with standby coordinators, HOST:PORT,HOST:PORT,... (whichever leads answers) |
| RECOVER_REPLICA_ID | this process's replica id, an int >= 0 (required) |
| RECOVER_TOKEN | the job's shared secret (optional; the coordinator refuses a wrong one) |
| RECOVER_FAULTS | `--fault` specs separated by ';' (fault injection for tests and demos) |
| RECOVER_FAULTS_FIRED | the local launcher's control file: a fault appends its `--fault` text there before it acts, so that the launcher gives it to no later process (recover.runtime.faults) |
| RECOVER_EVENTS | a metrics.jsonl path for the library's events (failures, recoveries) |
| RECOVER_REPLICA_SPEC | the replica spec as JSON (recover.runtime.spec.ReplicaSpec); a partial object keeps the other fields' defaults, e.g. `{"stall_s": 600, "watchdog_s": 10}` |
| RECOVER_DEVICE_INDEX | the GPU of this process (the local launcher numbers them), else LOCAL_RANK |
| RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT | the replica's own ranks, as torchrun sets them |
| RECOVER_IFNAME | the network interface(s), comma-separated, of every group this process builds (its address is what peers dial); else torch's GLOO_SOCKET_IFNAME; neither: the address this host reaches a remote coordinator from (recover.addresses) |
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from recover.addresses import IFNAME_ENV, InterfaceChoice
from recover.coordinator.protocol import COORDINATOR_ENV, TOKEN_ENV
from recover.runtime.faults import FaultSpec, fault_flag, parse_fault
from recover.runtime.spec import ReplicaSpec

REPLICA_ENV = "RECOVER_REPLICA_ID"
FAULTS_ENV = "RECOVER_FAULTS"
FIRED_ENV = "RECOVER_FAULTS_FIRED"
EVENTS_ENV = "RECOVER_EVENTS"
SPEC_ENV = "RECOVER_REPLICA_SPEC"
DEVICE_INDEX_ENV = "RECOVER_DEVICE_INDEX"
RANK_ENVS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_address(text: str, name: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); ValueError naming `name` (a flag or a variable) otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be HOST:PORT (port 1..65535), got {text!r}")
    return host, int(port)


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """This process's place among its replica's ranks (torchrun's variables)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RankEnv | None:
        """None when none of the variables is set (a replica of one rank); ValueError when
        only some are, or one is not a number."""
        present = [n for n in RANK_ENVS if environ.get(n)]
        if not present:
            return None
        missing = [n for n in RANK_ENVS if n not in present]
        if missing:
            raise ValueError(f"{', '.join(missing)} not set beside {', '.join(present)}")
        for n in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
            if not environ[n].isdigit():
                raise ValueError(f"{n} must be an int >= 0, got {environ[n]!r}")
        return cls(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
        )


def device_index(environ: Mapping[str, str]) -> int:
    """The GPU index of this process: RECOVER_DEVICE_INDEX, else LOCAL_RANK, else 0."""
    raw = environ.get(DEVICE_INDEX_ENV) or environ.get("LOCAL_RANK") or "0"
    if not raw.isdigit():
        raise ValueError(f"{DEVICE_INDEX_ENV} (or LOCAL_RANK) must be an int >= 0, got {raw!r}")
    return int(raw)


@dataclass(frozen=True, kw_only=True)
class ReplicaEnv:
    """What a replica process learns from its launcher (see the module docstring)."""

    coordinator: tuple[str, int]
    replica_id: int
    standbys: tuple[tuple[str, int], ...] = ()  # the other coordinators' addresses (HA)
    token: str | None = None
    faults: tuple[FaultSpec, ...] = ()
    fired: Path | None = None  # where a fault is recorded before it acts (the launcher reads it)
    events: Path | None = None
    spec: ReplicaSpec = field(default_factory=ReplicaSpec)
    ranks: RankEnv | None = None  # None: a replica of one rank
    device_index: int = 0
    # The interfaces asked for (RECOVER_IFNAME, else GLOO_SOCKET_IFNAME): this host's, not the
    # job's; the entry point resolves them, with the coordinator's address, to a PeerAddress.
    interfaces: InterfaceChoice = field(default_factory=InterfaceChoice)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ReplicaEnv:
        missing = [n for n in (COORDINATOR_ENV, REPLICA_ENV) if not environ.get(n)]
        if missing:
            raise ValueError(
                f"{' and '.join(missing)} not set: start this script with `recover run "
                f"--replicas R -- python SCRIPT` (or set them for each replica yourself, e.g. "
                f"under torchrun; see docs/api.md)"
            )
        rid = environ[REPLICA_ENV]
        if not rid.isdigit():
            raise ValueError(f"{REPLICA_ENV} must be an int >= 0, got {rid!r}")
        specs = [s for s in environ.get(FAULTS_ENV, "").split(";") if s.strip()]
        first, *others = [
            parse_address(a.strip(), COORDINATOR_ENV) for a in environ[COORDINATOR_ENV].split(",")
        ]
        return cls(
            coordinator=first,
            standbys=tuple(others),
            replica_id=int(rid),
            token=environ.get(TOKEN_ENV) or None,
            faults=tuple(parse_fault(s.strip()) for s in specs),
            fired=Path(environ[FIRED_ENV]) if environ.get(FIRED_ENV) else None,
            events=Path(environ[EVENTS_ENV]) if environ.get(EVENTS_ENV) else None,
            spec=spec_from_environ(environ),
            ranks=RankEnv.from_environ(environ),
            device_index=device_index(environ),
            interfaces=InterfaceChoice.from_environ(environ),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that give a child process this spec (the launcher's side)."""
        env = {
            COORDINATOR_ENV: ",".join(f"{h}:{p}" for h, p in (self.coordinator, *self.standbys)),
            REPLICA_ENV: str(self.replica_id),
            FAULTS_ENV: ";".join(fault_flag(f) for f in self.faults),
            SPEC_ENV: self.spec.to_json(),
        }
        if self.token:
            env[TOKEN_ENV] = self.token
        if self.fired is not None:
            env[FIRED_ENV] = str(self.fired)
        if self.events is not None:
            env[EVENTS_ENV] = str(self.events)
        if self.interfaces.ours:
            env[IFNAME_ENV] = ",".join(self.interfaces.names)
        return env


def spec_from_environ(environ: Mapping[str, str]) -> ReplicaSpec:
    """The replica spec a launcher gave this process (RECOVER_REPLICA_SPEC), else the defaults."""
    raw = environ.get(SPEC_ENV)
    return ReplicaSpec.from_json(raw, name=SPEC_ENV) if raw else ReplicaSpec()


__all__ = ["RankEnv", "ReplicaEnv", "device_index", "parse_address", "spec_from_environ"]


def die_with_launcher() -> None:
    """In a process started by the local launcher: die when the launcher dies, even by SIGKILL
    (Linux parent-death signal), so that no replica or coordinator is ever left orphaned."""
    import os

    launcher = os.environ.get("RECOVER_LAUNCHER_PID")
    if launcher:
        die_with_parent(int(launcher))


def die_with_parent(parent: int) -> None:
    """Get SIGTERM when the process `parent` (this process's parent) dies; end at once if it is
    gone already. Linux only (elsewhere a no-op)."""
    import os
    import signal

    PR_SET_PDEATHSIG = 1
    if _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) and os.getppid() != parent:
        os._exit(1)  # it died before the signal was armed


def name_process(name: str) -> None:
    """Give this process the name `ps`, `top` and /proc/PID/comm show (its first 15 bytes; the
    threads it starts afterwards inherit it): a forked replica is "replica 2", not "python3".
    Linux only (elsewhere a no-op)."""
    PR_SET_NAME = 15
    _prctl(PR_SET_NAME, name.encode()[:15])


def _prctl(option: int, arg: int | bytes) -> bool:
    """Linux's prctl(option, arg) for this process; False (nothing done) on another system."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    return True
