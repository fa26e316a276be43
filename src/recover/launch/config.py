"""What a local launcher is asked to do (`LaunchConfig`), checked once, and the files it keeps.

Job: the launch settings of `recover train --replicas R` and `recover run` (replicas, layout,
supervision, faults, standbys, coordinators and their state), each validated in `__post_init__`
with a message that names the flag; whether the GPUs here fit the layout (`check_gpu_placement`);
and the names of the files a launcher keeps in the run folder.

What it must not do: start anything.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field, replace

from recover.coordinator.etcd import parse_state_url
from recover.coordinator.etcd_local import find_etcd
from recover.coordinator.options import CoordinatorOptions
from recover.runtime.faults import FaultSpec, fault_flag
from recover.runtime.layout import ReplicaLayout
from recover.runtime.spec import ReplicaSpec

# In the run folder while a multi-replica run goes on: the coordinator's address (host, port, pid;
# written by the coordinator once it listens), and the run's token, readable by its owner only.
# `recover status RUN` reads both; the launcher removes them at the end.
COORDINATOR_FILE = "coordinator.json"
TOKEN_FILE = "coordinator.token"
JOB_FILE = "job.json"  # `recover run`'s resolved job (`recover run --config RUN/job.json` reads it)
# The faults that fired, one --fault text a line: the launcher's control state (kept for --resume;
# a new job starts it empty), appended to by the replica processes (recover.runtime.faults).
FIRED_FILE = "faults.fired"


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    replicas: int
    # What every replica is and how it behaves (the same object the replicas get, as JSON).
    replica: ReplicaSpec = field(default_factory=ReplicaSpec)
    min_replicas: int = CoordinatorOptions.min_replicas
    lease_s: float = CoordinatorOptions.lease_s
    faults: tuple[FaultSpec, ...] = ()
    start_timeout_s: float = 60.0  # coordinator up and every replica registered by then
    respawn_s: float | None = None  # restart a dead replica after this many seconds (None: never)
    max_restarts: int = 3  # per replica
    balance: str = CoordinatorOptions.balance  # microbatch shares: "equal" or by "throughput"
    stop_grace_s: float = 30.0  # on a stop: how long replicas get to save and leave
    # Fork `recover train`'s replica processes from one that has imported torch already
    # (recover.zygote), instead of paying the import in each one; False: start each afresh.
    warm_start: bool = True
    # Modules the warm start imports besides torch and recover's own before it forks (--preload:
    # a script's heavy imports, paid once per host).
    preload: tuple[str, ...] = ()
    # Warm standbys: processes that built the replica (model, optimizer, dataset) and wait,
    # unregistered, to take a dead replica's slot at once (`recover train` only). 0 by default:
    # each holds a whole replica's memory (on GPUs, a device's worth) for a fault that may not
    # come; with one, a respawn skips its start-up.
    standby: int = 0
    # High availability of the control plane (docs/coordinator.md, "A standby that takes over"):
    # this many coordinators, one leading by etcd election, the others standing by. `state`:
    # the etcd that holds their state (etcd://HOST:PORT[,...][/PREFIX]); None with
    # coordinators > 1: a private etcd the launcher starts on 127.0.0.1 and stops.
    coordinators: int = 1
    state: str | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if not isinstance(self.replica, ReplicaSpec):
            raise ValueError(f"replica must be a ReplicaSpec, got {self.replica!r}")
        self.coordinator_options()  # --min-replicas, --lease and --balance, checked as declared
        if not self.replica.heartbeat_s < self.lease_s:
            raise ValueError(
                f"--lease ({self.lease_s:g} s) must be longer than the heartbeat interval "
                f"(--heartbeat {self.replica.heartbeat_s:g} s)"
            )
        if self.respawn_s is not None and self.respawn_s < 0:
            raise ValueError(f"--respawn must be >= 0 seconds, got {self.respawn_s}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.standby < 0:
            raise ValueError(f"--standby must be >= 0, got {self.standby}")
        if self.standby and (self.mode != "recover" or self.ranks > 1):
            raise ValueError(
                "--standby needs --mode recover and replicas of one rank (a standby builds its "
                f"model before it knows its slot); got --mode {self.mode} with {self.ranks} "
                "ranks per replica"
            )
        if isinstance(self.coordinators, bool) or not (
            isinstance(self.coordinators, int) and self.coordinators >= 1
        ):
            raise ValueError(f"--coordinators must be an int >= 1, got {self.coordinators!r}")
        if self.state is not None:
            parse_state_url(self.state)  # a ValueError names the flag
        elif self.coordinators > 1 and find_etcd() is None:
            raise ValueError(
                f"--coordinators {self.coordinators} keeps the coordinators' state in etcd, and "
                "no etcd binary is installed: apt-get install etcd-server, or give --state "
                "etcd://HOST:PORT"
            )
        for f in self.faults:
            if f.replica >= self.replicas:
                raise ValueError(
                    f"--fault names replica {f.replica}, but replicas are 0..{self.replicas - 1}"
                )
            if f.rank >= self.ranks:
                raise ValueError(
                    f"--fault names rank {f.rank}, but a replica has ranks 0..{self.ranks - 1}"
                )
            if f.phase == "transfer" and f.kind != "slow" and self.respawn_delay_s is None:
                raise ValueError(
                    f"--fault {fault_flag(f)} fires in a state transfer to a joiner, and this job "
                    "never has one: add --respawn S or --standby N (it would never fire)"
                )

    def coordinator_options(self) -> CoordinatorOptions:
        """The settings of this job's coordinator: R, the supervision flags it offers, the start
        timeout as the forming deadline, and its mode (M it learns from the replicas)."""
        options = CoordinatorOptions(
            expected_replicas=self.replicas,
            min_replicas=self.min_replicas,
            lease_s=self.lease_s,
            start_deadline_s=self.start_timeout_s,
            balance=self.balance,
            mode="shrink" if self.mode == "shrink" else "recover",
        )
        if self.mode == "checkpoint-restart":  # any death stops the job, which then restarts
            return replace(options, min_replicas=self.replicas)
        return options

    @property
    def mode(self) -> str:
        return self.replica.mode

    @property
    def layout(self) -> ReplicaLayout:
        """What a replica is inside."""
        return self.replica.layout

    @property
    def respawn_delay_s(self) -> float | None:
        """Seconds before a dead replica is replaced (None: never); standbys imply 0."""
        if self.respawn_s is None and self.standby:
            return 0.0
        return self.respawn_s

    @property
    def ranks(self) -> int:
        """Processes per replica."""
        return self.layout.ranks


def visible_gpus() -> int:
    """How many GPUs torch sees; 0 without importing torch (2.5 s of CPU in the launcher) when
    the machine has no GPU device node at all (NVIDIA's /dev/nvidia*, ROCm's /dev/kfd)."""
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpu_placement(lc: LaunchConfig, gpus: int | None = None) -> None:
    """ValueError when the local processes cannot get the GPUs NCCL needs. This launcher numbers
    the GPUs process by process, replica after replica, modulo `gpus` (how many are visible; None
    asks torch); NCCL refuses two ranks of one communicator on one GPU. So a replica of several
    ranks on GPUs needs that many GPUs (its own group is NCCL's), and --cross-reduce nccl one GPU
    per process. Replicas of one rank may share GPUs under the default gloo cross-reduce."""
    if lc.replica.cross_reduce == "gloo" and (lc.replica.device == "cpu" or lc.ranks == 1):
        return  # nothing to place (and no torch import in the launcher for it)
    if gpus is None:
        gpus = visible_gpus()
    processes = lc.replicas * lc.ranks
    if lc.replica.cross_reduce == "nccl" and processes > gpus:
        raise ValueError(
            f"--cross-reduce nccl needs a GPU per process: {processes} processes, {gpus} GPUs "
            "visible; use --cross-reduce gloo (the default) to share GPUs"
        )
    on_gpus = lc.replica.device == "cuda" or (lc.replica.device == "auto" and gpus > 0)
    if on_gpus and lc.ranks > gpus:
        raise ValueError(
            f"a replica of {lc.ranks} ranks on GPUs needs {lc.ranks} GPUs (NCCL inside the "
            f"replica), {gpus} visible; use fewer ranks per replica, or --device cpu"
        )
