"""The environment a launcher gives each replica process, read once at the entry point.

Job: name the variables (one place), and turn them into a frozen `ReplicaEnv` with clear errors.
`recover run` (and `recover train`'s launcher) set them for every process it starts; under a
multi-node job, `torchrun` plus these variables do the same. Nothing below the entry point
(`recover.runtime.api.Replica`, the CLI) reads the environment: it gets a `ReplicaEnv`.

| variable | meaning |
|---|---|
| RECOVER_COORDINATOR | HOST:PORT of the coordinator (required) |
| RECOVER_REPLICA_ID | this process's replica id, an int >= 0 (required) |
| RECOVER_TOKEN | the job's shared secret (optional; the coordinator refuses a wrong one) |
| RECOVER_FAULTS | `--fault` specs separated by ';' (fault injection for tests and demos) |
| RECOVER_EVENTS | a metrics.jsonl path for the library's events (failures, recoveries) |
| RECOVER_STALL_TIMEOUT | seconds without progress before a stuck process ends itself (0: off) |
| RECOVER_WATCHDOG | seconds a replica-mate may be silent (replicas of several ranks) |
| RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT | the replica's own ranks, as torchrun sets them |
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from recover.runtime.faults import FaultSpec, fault_flag, parse_fault

COORDINATOR_ENV = "RECOVER_COORDINATOR"
REPLICA_ENV = "RECOVER_REPLICA_ID"
TOKEN_ENV = "RECOVER_TOKEN"
FAULTS_ENV = "RECOVER_FAULTS"
EVENTS_ENV = "RECOVER_EVENTS"
STALL_ENV = "RECOVER_STALL_TIMEOUT"
WATCHDOG_ENV = "RECOVER_WATCHDOG"


def parse_address(text: str, name: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); ValueError naming `name` (a flag or a variable) otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be HOST:PORT (port 1..65535), got {text!r}")
    return host, int(port)


def _seconds(environ: Mapping[str, str], name: str, default: float, *, zero: bool) -> float:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {raw!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ReplicaEnv:
    """What a replica process learns from its launcher (see the module docstring)."""

    coordinator: tuple[str, int]
    replica_id: int
    token: str | None = None
    faults: tuple[FaultSpec, ...] = ()
    events: Path | None = None
    stall_s: float = 300.0
    watchdog_s: float = 5.0

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
        return cls(
            coordinator=parse_address(environ[COORDINATOR_ENV], COORDINATOR_ENV),
            replica_id=int(rid),
            token=environ.get(TOKEN_ENV) or None,
            faults=tuple(parse_fault(s.strip()) for s in specs),
            events=Path(environ[EVENTS_ENV]) if environ.get(EVENTS_ENV) else None,
            stall_s=_seconds(environ, STALL_ENV, 300.0, zero=True),
            watchdog_s=_seconds(environ, WATCHDOG_ENV, 5.0, zero=False),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that give a child process this spec (the launcher's side)."""
        env = {
            COORDINATOR_ENV: f"{self.coordinator[0]}:{self.coordinator[1]}",
            REPLICA_ENV: str(self.replica_id),
            FAULTS_ENV: ";".join(fault_flag(f) for f in self.faults),
            STALL_ENV: repr(self.stall_s),
            WATCHDOG_ENV: repr(self.watchdog_s),
        }
        if self.token:
            env[TOKEN_ENV] = self.token
        if self.events is not None:
            env[EVENTS_ENV] = str(self.events)
        return env


__all__ = ["ReplicaEnv", "parse_address"]


def die_with_launcher() -> None:
    """In a process started by the local launcher: die when the launcher dies, even by SIGKILL
    (Linux parent-death signal), so that no replica or coordinator is ever left orphaned."""
    import os
    import signal

    launcher = os.environ.get("RECOVER_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(launcher):  # it died before the signal was armed
        os._exit(1)
