"""Warm standbys of a local job (`--standby N`): replicas built ahead, waiting for a dead one's id.

Job: keep N standby processes (`recover worker --standby`, forked warm: torch imported, dataset
open, model built), unregistered and writing nothing, each waiting on its stdin for the variables
that make it a replica (`promote`: the dead replica's id, its faults not fired yet, its device);
replace quietly one that died while waiting, up to `LOSSES_PER_SLOT` per slot, then go on without
(`check`); at the end of a job, record what each still waiting cost and end it (`retire`).

What it must not do: decide when a replica is replaced (the launcher's restart rule does) or
anything about the run's state (a promoted standby joins by transfer, as a respawn does).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

from recover.runtime.env import DEVICE_INDEX_ENV, FAULTS_ENV, REPLICA_ENV
from recover.runtime.faults import FaultSpec, fault_flag
from recover.supervisor import ProcessHost, end_politely, proc_name


class StandbyPool:
    """`slots` standbys started with `command`, and the job's environment `env(host, port)`
    (the coordinator's address), building on device `device_index`; `pending_faults(r)`: replica
    r's faults not fired yet, handed over with a promotion."""

    # A standby that died while waiting is replaced quietly, up to this many times per standby
    # slot; past that (a standby that cannot start at all), the run goes on without standbys.
    LOSSES_PER_SLOT = 3

    def __init__(
        self,
        host: ProcessHost,
        *,
        slots: int,
        command: list[str],
        env: Callable[[str, int], dict[str, str]],
        device_index: int,
        pending_faults: Callable[[int], list[FaultSpec]],
    ) -> None:
        self.host, self.slots, self.command, self.env = host, slots, command, env
        self.device_index, self.pending_faults = device_index, pending_faults
        self.waiting: list[str] = []  # names (in host.children) of waiting standbys, oldest first
        self._started = 0
        self._lost = 0  # standbys that died while waiting
        self._since: dict[str, float] = {}  # name -> when it was started (monotonic)

    def start(self, host: str, port: int) -> None:
        """Start one standby: a `recover worker --standby` that builds the replica (forked from
        the zygote: torch imported), then waits on its stdin, unregistered and writing nothing,
        for the variables that make it a replica (`promote`). It has the job's TrainConfig and
        replica spec; its id, faults and device come with the promotion."""
        self._started += 1
        name = f"standby {self._started}"
        env = {
            k: v
            for k, v in self.env(host, port).items()
            if k not in (REPLICA_ENV, FAULTS_ENV)  # (given with the promotion)
        }
        # (on GPUs it builds on the device after the replicas', modulo those there are)
        env[DEVICE_INDEX_ENV] = str(self.device_index)
        proc = self.host.spawn(name, self.command, f"[{name}] ", env, stdin=True)
        self.waiting.append(name)
        self._since[name] = time.monotonic()
        self.host.writer.event("launcher.standby_started", standby=name, pid=proc.pid)
        self.host.say(f"started {name} (pid {proc.pid})", logging.DEBUG)

    def retire(self) -> None:
        """At the end of a job: record what each standby still waiting cost (CPU seconds and
        resident memory over its life, its build included), then end it (SIGTERM: it has
        nothing to save)."""
        tick = os.sysconf("SC_CLK_TCK")
        for name in self.waiting:
            proc = self.host.children[name]
            cost = {}
            try:
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cost["cpu_s"] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
                cost["rss_mib"] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            except (OSError, IndexError, ValueError):
                pass  # (ended meanwhile)
            age = time.monotonic() - self._since[name]
            self.host.writer.event(
                "launcher.standby_retired", standby=name, pid=proc.pid, age_s=round(age, 3),
                **{k: round(v, 3) for k, v in cost.items()},
            )  # fmt: skip
            end_politely(proc)
        self.waiting.clear()

    def check(self, finishing: bool, coordinator: tuple[str, int]) -> None:
        """Replace, quietly, a standby that died while waiting (up to STANDBY_LOSSES_PER_SLOT
        per slot; then warn once and go on without)."""
        for name in list(self.waiting):
            code = self.host.children[name].poll()
            if code is None:
                continue
            self.waiting.remove(name)
            self.host.children.pop(name)
            self._lost += 1
            limit = self.LOSSES_PER_SLOT * self.slots
            self.host.say(f"{name} ended while waiting (status {code})", logging.DEBUG)
            if finishing:
                continue
            if self._lost > limit:
                if self._lost == limit + 1:
                    self.host.say(
                        f"{self._lost} standbys ended while waiting: going on without "
                        "standbys (a dead replica is respawned afresh)",
                        logging.WARNING,
                    )
                continue
            self.start(*coordinator)

    def promote(self, r: int) -> bool:
        """Give replica r's slot to the oldest waiting standby: it gets its id, the faults of
        r not fired yet and r's device, registers as r's new incarnation, and joins at a step
        boundary with the state by transfer (the caller starts a new standby behind it). False
        when no standby could take it (none waiting, or it died just now)."""
        while self.waiting:
            name = self.waiting.pop(0)
            proc = self.host.children.pop(name)
            promotion = {
                REPLICA_ENV: str(r),
                FAULTS_ENV: ";".join(fault_flag(f) for f in self.pending_faults(r)),
                DEVICE_INDEX_ENV: str(r),
            }
            try:
                proc.stdin.write(json.dumps(promotion) + "\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):  # it died meanwhile: the next one
                self.host.children[name] = proc  # (reaped with the others at the end)
                continue
            self.host.children.pop(proc_name(r, 0), None)
            self.host.children[proc_name(r, 0)] = proc
            self.host._prefixes[id(proc)][0] = f"[replica {r}] "
            self.host.say(f"{name} (pid {proc.pid}) takes the slot of replica {r}", logging.DEBUG)
            return True
        return False
