"""A Slurm cluster on one machine for tests: slurmctld and N slurmd nodes, each on a host of
tests/hosts.py (its own network namespace, address, hostname and /etc/hosts).

Job: write a slurm.conf for the hosts (node i+1 is host i+1, the controller host 0), start the
daemons, submit a batch job and follow it (`sbatch`, `job_state`), and kill a node whole
(`kill_node`: its slurmd, slurmstepd and every task, as a machine's death does). Everything lives
in the Network's temp dir and dies with it (`Network.close()` kills every process in the
namespaces), so a failing test leaves nothing behind.

Configuration choices, all for one machine without a munge key or a cgroup hierarchy of its own:
- `AuthType=auth/none`, `CredType=cred/none`: no munged (the daemons and clients trust each other;
  fine inside private namespaces, never on a real cluster);
- `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`: no cgroup containment. slurmd
  still loads its cgroup plugin at start, so each node's mount namespace gets a cgroup v1
  hierarchy mounted on /sys/fs/cgroup (or, where v1 controllers cannot be mounted, cgroup2);
- `SlurmdTimeout=5`: a dead node is declared DOWN within seconds, not minutes.

Needs root, Debian's slurmctld, slurmd and slurm-client (`available()` says what is missing).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

from hosts import Network

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol")
V1_CONTROLLERS = ("freezer", "cpuset", "memory", "devices", "cpuacct")


def available() -> tuple[bool, str]:
    """(True, "") where a cluster can run here; else (False, why), for `pytest.skip`."""
    import hosts

    ok, why = hosts.available()
    if not ok:
        return ok, why
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (
            False,
            f"{', '.join(missing)} not installed (apt-get install slurmctld slurmd slurm-client)",
        )
    return True, ""


def _cgroup_mounts() -> tuple[str, str]:
    """(shell commands that mount a cgroup hierarchy slurmd accepts, its cgroup.conf)."""
    v1 = "mount -t tmpfs cgroup /sys/fs/cgroup && " + " && ".join(
        f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
        for c in V1_CONTROLLERS
    )
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", v1], capture_output=True, text=True, timeout=10
    )
    if probe.returncode == 0:
        return v1, "CgroupPlugin=cgroup/v1\n"
    return "mount -t cgroup2 none /sys/fs/cgroup", "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n"


class SlurmCluster:
    """slurmctld on host 0 of `network`, slurmd on hosts 1.. (named as the hosts are)."""

    def __init__(self, network: Network, *, cpus: int = 2) -> None:
        self.network = network
        self.dir = network.tmp_dir / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.nodes = [h.name for h in network.hosts[1:]]
        if not self.nodes:
            raise ValueError("a cluster needs a controller host and at least one node host")
        mounts, cgroup_conf = _cgroup_mounts()
        (self.dir / "state").mkdir(parents=True)
        for n in self.nodes:
            (self.dir / "spool" / n).mkdir(parents=True)
        (self.dir / "cgroup.conf").write_text(cgroup_conf)
        ctl = network.host(0)
        node_lines = "".join(
            f"NodeName={h.name} NodeAddr={h.addr} CPUs={cpus} State=UNKNOWN\n"
            for h in network.hosts[1:]
        )
        d = self.dir
        self.conf.write_text(
            textwrap.dedent(f"""\
                ClusterName=recover-test
                SlurmctldHost={ctl.name}({ctl.addr})
                AuthType=auth/none
                CredType=cred/none
                SlurmUser=root
                SlurmdUser=root
                StateSaveLocation={d}/state
                SlurmdSpoolDir={d}/spool/%n
                SlurmctldPidFile={d}/slurmctld.pid
                SlurmdPidFile={d}/slurmd-%n.pid
                SlurmctldLogFile={d}/slurmctld.log
                SlurmdLogFile={d}/slurmd-%n.log
                ProctrackType=proctrack/linuxproc
                TaskPlugin=task/none
                JobAcctGatherType=jobacct_gather/none
                AccountingStorageType=accounting_storage/none
                MpiDefault=none
                SchedulerType=sched/builtin
                SelectType=select/linear
                ReturnToService=2
                SlurmdTimeout=5
                MinJobAge=600
                KillWait=2
                InactiveLimit=0
                """)
            + node_lines
            + f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP\n"
        )
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        log = open(d / "daemons.out", "ab")
        with log:
            ctl.popen(["slurmctld", "-D", "-f", str(self.conf)], env=self.env, stdout=log,
                      stderr=subprocess.STDOUT)  # fmt: skip
            for h in network.hosts[1:]:
                h.popen(["sh", "-c", f'{mounts} && exec slurmd -D -f "$0"', str(self.conf)],
                        env=self.env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        self._wait_idle(timeout_s=30)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.network.host(1).run(["sinfo", "-h", "-o", "%T %D"], timeout=10, env=self.env)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if states.get("idle") == str(len(self.nodes)):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"slurm nodes not idle after {timeout_s} s: {r.stdout}{self.logs()}"
                )
            time.sleep(0.2)

    def logs(self) -> str:
        """The daemons' log tails, for a failure message."""
        parts = []
        for f in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def sbatch(self, argv: list[str], *, env: Mapping[str, str], timeout: float = 30) -> int:
        """Submit from node 1 (as a login node would); the job id."""
        r = self.network.host(1).run(["sbatch", "--parsable", *argv], timeout=timeout,
                                     env={**self.env, **env})  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed: {r.stderr}{r.stdout}")
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList...)."""
        r = self.network.host(1).run(["scontrol", "-o", "show", "job", str(job_id)], timeout=10,
                                     env=self.env)  # fmt: skip
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def wait_job(self, job_id: int, timeout_s: float) -> dict[str, str]:
        """The job once it has ended (not PENDING, RUNNING, COMPLETING...)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout_s} s")
            time.sleep(0.3)

    def kill_node(self, name: str) -> list[int]:
        """Node `name`'s death: slurmd, its step daemons and every task on it, SIGKILLed."""
        host = next(h for h in self.network.hosts if h.name == name)
        return host.kill_all()


def path_with(python_dir: Path) -> str:
    """PATH with `python_dir` (a venv's bin: `recover` and `python`) first."""
    return os.pathsep.join([str(python_dir), os.environ.get("PATH", os.defpath)])
