"""The coordinators of a local job: one, or N that share the run's state in etcd.

Job: start the job's coordinator processes on ports drawn for it (`start`), each one `recover
coordinator serve` on 127.0.0.1 with the job's settings (one JSON object); with --coordinators N, put their state in
etcd (under --state, or in a private etcd started for the run and ended with it, `stop`), so that
the first elected leads and the others stand by; start a dead one again as a standby while another
still leads (`restart_dead`, at most --max-restarts times each).

What it must not do: judge the run (the launcher's verdict does) or talk to the coordinators (the
replicas do): it only starts processes.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from recover.coordinator.etcd import parse_state_url
from recover.coordinator.etcd_local import LocalEtcd, start_local_etcd
from recover.launch.config import COORDINATOR_FILE, LaunchConfig
from recover.supervisor import RECOVER as _RECOVER
from recover.supervisor import ProcessHost
from recover.training.config import RunPaths

# The nice value a local job's coordinator runs at (`coordinator serve --nice`). It shares the
# cores with the replicas, and at the default value a reply it sends wakes a replica that can take
# the core from it before its next reply (a fifth of its samples were in socket writes with 3
# replicas on 2 cores), so the last replica of a step waits a scheduling round for its answer.
# Measured by switching a running job's coordinator between 0 and -10 twice: the vote part's
# median 2.13 -> 1.68 ms and 1.95 -> 1.53 ms; `recover bench script` did not resolve it (1.050
# and 1.094 at -10, 1.113 and 1.057 at 0, 60 block pairs each). Refused without CAP_SYS_NICE:
# the coordinator then runs as started.
COORDINATOR_NICE = -10


class CoordinatorFleet:
    """The coordinators of the jobs of one launcher (a checkpoint-restart starts them again for
    each job; the private etcd lives as long as the launcher)."""

    def __init__(self, host: ProcessHost, lcfg: LaunchConfig, paths: RunPaths) -> None:
        self.host, self.lcfg, self.paths = host, lcfg, paths
        self.standbys: tuple[tuple[str, int], ...] = ()  # the standbys' addresses (-coordinators N)
        self._etcd: LocalEtcd | None = None  # the private etcd of --coordinators N
        self._specs: dict[str, tuple] = {}  # name -> its _spawn arguments
        self._restarts: dict[str, int] = {}

    def start(self, ports: list[int]) -> tuple[str, int]:
        """Start the coordinator on a free loopback port; return its address at once.

        The replicas are started right after, without waiting for it: they retry registering
        until it listens, so torch's import in every process overlaps (start-up is CPU-bound).
        With --coordinators N, N of them share the state in etcd (`_ha_state`): the first
        elected leads, the others stand by (`self.standbys`: their addresses). `ports`: drawn
        for the job's processes (one is taken per coordinator). Each is handed the job's
        settings as one JSON object (`LaunchConfig.coordinator_options`); M it learns from the
        replicas' fingerprints.
        """
        address_file = self.paths.out / COORDINATOR_FILE
        address_file.unlink(missing_ok=True)
        lc = self.lcfg
        ha = self._ha_state() if lc.coordinators > 1 or lc.state is not None else None
        addresses = []
        for i in range(lc.coordinators):
            port = ports.pop()  # free a moment ago; the coordinator binds it a moment later
            name = "coordinator" if i == 0 else f"coordinator.{i}"
            self._spawn(name, port, address_file, ha)
            self._specs[name] = (port, address_file, ha)
            addresses.append(("127.0.0.1", port))
        self.standbys = tuple(addresses[1:])
        return addresses[0]

    def _ha_state(self) -> list[str]:
        """The coordinators' --state flags for this job: under --state's prefix, or in a private
        etcd started now (127.0.0.1, a temporary data directory; `stop` ends it), each job
        (a checkpoint-restart starts another) under a prefix of its own, so none loads the state
        of an earlier job."""
        lc = self.lcfg
        if lc.state is not None:
            url = parse_state_url(lc.state)
        else:
            if self._etcd is None:
                self._etcd = start_local_etcd(tempfile.mkdtemp(prefix="recover-etcd-"))
                self.host.say(
                    f"etcd for the coordinators' state at 127.0.0.1:{self._etcd.client_port}"
                )
            url = parse_state_url(self._etcd.url)
        prefix = f"{url.prefix}/{self.paths.out.name}-{secrets.token_hex(4)}"
        return ["--state", str(replace(url, prefix=prefix)), "--leader-ttl", "1"]

    def stop(self) -> None:
        """End the private etcd, if one was started (at the end of the run)."""
        if self._etcd is not None:
            self._etcd.stop()
            shutil.rmtree(self._etcd.data_dir, ignore_errors=True)
            self._etcd = None

    def restart_dead(self, finishing: bool) -> None:
        """With --coordinators N, a coordinator that died while others live is started again on
        its port, as a standby (the one leading now keeps leading): the next leader death is
        survived too. At most --max-restarts times each."""
        if len(self._specs) < 2 or finishing:
            return
        for name, spec in self._specs.items():
            proc = self.host.children[name]
            if proc.poll() is None or self._restarts.get(name, 0) >= self.lcfg.max_restarts:
                continue
            self._restarts[name] = self._restarts.get(name, 0) + 1
            self.host.say(
                f"{name} exited (status {proc.returncode}); starting it again as a standby"
            )
            self.host.writer.event(
                "launcher.coordinator_restarted", coordinator=name, exit_status=proc.returncode
            )
            self._spawn(name, *spec)

    def _spawn(self, name: str, port: int, address_file: Path, ha: list[str] | None) -> None:
        lc = self.lcfg
        self.host.spawn(
            name,
            [
                *_RECOVER, "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--store-port", "0", "--options", lc.coordinator_options().settings_json(),
                "--events", str(self.paths.metrics), "--address-file", str(address_file),
                "--keep-serving", "--nice", str(COORDINATOR_NICE),
                "--log-level", lc.replica.log_level, *(ha or ()),
            ],
            f"[{name}] ",
        )  # fmt: skip
