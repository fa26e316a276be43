"""The torchft baseline: the real torchft (PyPI `torchft`) driving our GPT on our data.

Job: run R replica processes, each a torchft `Manager` around one `ReplicaTrainer`, against a
torchft lighthouse on loopback, under the same fault schedule (`--fault` grammar of
recover.runtime.faults) as `recover train`; restart a dead replica as torchft's documentation
expects of a scheduler; write our run folder (config.json with launch.mode "torchft", metrics.jsonl
in the schema of docs/metrics.md, final/model.safetensors). The report (recover.tooling.report)
then puts it beside the other modes.

How a step runs (torchft's own semantics; this module adds no recovery of its own):
- `start_quorum()`: with async quorum (torchft's default) the quorum forms while the step computes;
  a replica that is behind (a restarted one) heals in the background from a live peer through
  torchft's checkpoint transport (HTTP), computes nothing that counts in that step (the manager
  zeroes its share), and loads the peer's state before `should_commit()`. With a synchronous
  quorum it heals inside `start_quorum()`;
- replica r computes its fixed share of the step's microbatch ids, `j % R == r` (the ids a
  DistributedSampler-style shard would give it), so a dead replica's ids are simply not computed
  and the global batch shrinks until it is back;
- the flat gradient sum, loss sum and microbatch count go through the manager's all-reduce
  (`Manager.allreduce`, SUM), not torchft's DDP wrapper (which crashes survivors when a peer dies
  inside a gloo all-reduce);
- `should_commit()`: if True, the update is sum / count (the gradient averaged over what was
  computed) at the manager's step; if False, the step is discarded and redone with a new quorum,
  written as a `coordinator.redo` event so the report counts it like our in-step redos.

Settings: two named sets, each written to the run's config.json and into the comparison's
table. `DOCUMENTED`: torchft's documented defaults (the lighthouse command of torchft's README:
join timeout 10 s, quorum tick 0.1 s; the lighthouse's heartbeat timeout default, 5 s; the
Manager's defaults: async quorum, 60 s timeouts, 0.1 s heartbeats, no quorum retries). `TUNED`:
join timeout 1 s, heartbeat timeout 1 s (our lease), quorum timeout 10 s, manager timeout 30 s
(our reduce deadline), 3 quorum retries (why: the comment at TUNED). In both: `init_sync` off, as the Manager's docstring asks when
every replica seeds its weights the same (ours do; with it on, step 0 would heal 3 of 4
replicas); a dead replica is restarted after `respawn_s` (the compare bench gives the delay of
its `recover+respawn` row) with the faults of its replica that have not fired yet, at most
`max_restarts` times per replica.

Fairness: every replica starts from the same seed and waits at a start barrier until every
manager is up, so the first quorum holds all R (without it the first process to start forms a
quorum alone and trains ahead). The run ends when the final model is written; a process still
running 1 s later (a replica restarted just before the end) is stopped, so a late joiner neither
trains a run of its own nor keeps the wall clock running. The transfer state is our model's and
optimizer's own state dicts, not `ReplicaTrainer.state_dict()`: torch's optimizer state-dict
helper steps an optimizer whose state is still empty, and torchft reads the state in its quorum
thread beside the training thread.

Limits: torchft is optional; `require_torchft()` raises `TorchftUnavailable` naming why when it is
missing. torchft's manager server binds `[::]` (all interfaces) by its own code; we advertise
127.0.0.1 and every peer connects over loopback. One rank per replica. Size: the launcher
(supervision with restarts) and the replica loop are one concept, torchft driven from outside;
about 460 lines.

Size: the torchft baseline end to end (its lighthouse, its managers, the same model and
data as ours, the measurements), kept apart from the product in one module.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from types import ModuleType

from recover.launch import FIRED_FILE
from recover.record import MetricsWriter
from recover.runtime.faults import FaultInjector, fault_flag, faults_for, parse_fault, read_fired
from recover.training.config import RunPaths, TrainConfig
from recover.training.runfolder import open_run_folder, read_dataset_info

__all__ = [
    "DOCUMENTED",
    "TUNED",
    "TorchftHarnessConfig",
    "TorchftUnavailable",
    "describe_settings",
    "pending_faults",
    "require_torchft",
    "run_torchft",
    "supervise",
]

MODE = "torchft"
FINISH_GRACE_S = 1.0  # after the final model is written, the others get this long to exit


class TorchftUnavailable(RuntimeError):
    """torchft cannot be imported here (not installed, or built for another torch)."""


class TorchftRunFailed(RuntimeError):
    """The torchft run did not finish: no replica completed every step before the deadline."""


@dataclass(frozen=True, kw_only=True)
class TorchftHarnessConfig:
    """One torchft run's settings. The defaults are torchft's documented ones (DOCUMENTED)."""

    replicas: int = 4
    min_replicas: int = 1  # the lighthouse's and the manager's minimum quorum size
    # lighthouse
    heartbeat_timeout_s: float = 5.0  # a replica silent this long is dead (lighthouse default)
    join_timeout_s: float = 10.0  # wait this long for heartbeating stragglers (README's command)
    quorum_tick_s: float = 0.1  # how often the lighthouse re-checks a pending quorum
    # manager (torchft.Manager)
    heartbeat_s: float = 0.1  # manager -> lighthouse heartbeat interval
    async_quorum: bool = True  # the quorum forms while the step computes
    init_sync: bool = False  # off: every replica initialises from the run's seed
    timeout_s: float = 60.0  # all-reduce, should_commit, checkpoint transfer
    quorum_timeout_s: float = 60.0  # one quorum request
    connect_timeout_s: float = 60.0
    quorum_retries: int = 0  # torchft retries a failed quorum this many times
    # the scheduler's part (the harness)
    respawn_s: float | None = None  # restart a dead replica after this long; None: never
    max_restarts: int = 3  # restarts per replica
    start_deadline_s: float = 300.0  # every replica's manager up (the start barrier)
    run_deadline_s: float = 1800.0  # the whole run; the harness kills its replicas after it
    faults: tuple[str, ...] = ()  # `--fault` values, recover.runtime.faults grammar

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"min_replicas must be in 1..replicas, got {self.min_replicas}")
        if not 0 < self.heartbeat_s < self.heartbeat_timeout_s:
            raise ValueError("heartbeat_timeout_s must be > heartbeat_s > 0")
        for name in ("join_timeout_s", "quorum_tick_s", "timeout_s", "quorum_timeout_s",
                     "connect_timeout_s", "start_deadline_s", "run_deadline_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.quorum_retries < 0 or self.max_restarts < 0:
            raise ValueError("quorum_retries and max_restarts must be >= 0")
        if self.respawn_s is not None and self.respawn_s < 0:
            raise ValueError(f"respawn_s must be >= 0 or None, got {self.respawn_s}")
        for text in self.faults:
            parse_fault(text)  # ValueError with the grammar on a bad one


# torchft's documented defaults, and tuned for a fast failure detection like ours: the heartbeat
# timeout is what finds a killed replica (the lighthouse waits for it until then) and equals our
# lease; the join timeout bounds how long a quorum waits for a heartbeating replica that has not
# asked to join (a restarted one still starting): at 10 s the first quorum after a kill waited
# 10 s for the restart (measured on the compare bench's dense schedule, small, 4 replicas: that
# step took 11.7 s, the run 35.9 s against 27.0 s at 1 s); the manager timeout is our reduce
# deadline.
DOCUMENTED = TorchftHarnessConfig()
TUNED = replace(
    DOCUMENTED, join_timeout_s=1.0, heartbeat_timeout_s=1.0, quorum_timeout_s=10.0,
    timeout_s=30.0, quorum_retries=3,
)  # fmt: skip


def describe_settings(h: TorchftHarnessConfig) -> str:
    """The settings of a run as one line for the comparison's table."""
    respawn = "no restart" if h.respawn_s is None else f"restart after {h.respawn_s:g} s"
    return (
        f"join timeout {h.join_timeout_s:g} s, heartbeat timeout {h.heartbeat_timeout_s:g} s, "
        f"{'async' if h.async_quorum else 'sync'} quorum, quorum timeout {h.quorum_timeout_s:g} s, "
        f"timeout {h.timeout_s:g} s, quorum retries {h.quorum_retries}, "
        f"init_sync {'on' if h.init_sync else 'off'}, {respawn}"
    )


def pending_faults(faults: Iterable[str], replica: int, fired: set[str]) -> list[str]:
    """The faults of `replica` not in `fired` (the run's control file, RUN/faults.fired, as
    `read_fired` gives it; recover.runtime.faults): what a restarted incarnation is given, so a
    schedule of several failures outlives a restart and none fires twice. A `slow` one never
    fires once: every incarnation from its step on is slow."""
    specs = [parse_fault(text) for text in faults]
    return [fault_flag(s) for s in specs
            if s.replica == replica and (s.kind == "slow" or fault_flag(s) not in fired)]  # fmt: skip


def require_torchft() -> ModuleType:
    """Import torchft or raise TorchftUnavailable saying why and what to do."""
    try:
        import torchft
        from torchft._torchft import LighthouseServer  # noqa: F401  (the compiled part)
    except ImportError as e:
        import torch

        raise TorchftUnavailable(
            f"torchft cannot be imported beside torch {torch.__version__}: {e}. Install it with "
            "`pip install torchft` in an environment whose torch it accepts (see docs/baselines.md)"
        ) from e
    return torchft


# ---- the launcher (parent process) --------------------------------------------------------------
def supervise(
    spawn: Callable[[int, int], subprocess.Popen],
    *,
    replicas: int,
    respawn_s: float | None,
    max_restarts: int,
    done: Callable[[], bool],
    deadline_s: float,
    on_respawn: Callable[[int, int], None] = lambda replica, restart: None,
    log: Callable[[str], None] = print,
    poll_s: float = 0.05,
) -> bool:
    """Start replicas 0..R-1 (`spawn(replica, restart)`), restart the dead ones, end the run.

    A replica that exits non-zero before the run is done is started again `respawn_s` later
    (None: never), at most `max_restarts` times. Once `done()` (the final model is written),
    nobody is restarted and a process still running FINISH_GRACE_S later is SIGKILLed. Returns
    whether the run is done; every process started here has ended when it returns.
    """
    procs = {r: spawn(r, 0) for r in range(replicas)}
    restarts = dict.fromkeys(range(replicas), 0)
    respawn_at: dict[int, float] = {}
    deadline = time.monotonic() + deadline_s
    done_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if done_at is None and done():
                done_at, respawn_at = now, {}
            for r, p in procs.items():
                code = p.poll()
                if (code not in (None, 0) and done_at is None and r not in respawn_at
                        and respawn_s is not None and restarts[r] < max_restarts):  # fmt: skip
                    restarts[r] += 1
                    respawn_at[r] = now + respawn_s
                    procs[r] = _Ended(code)  # counted once
            if not respawn_at and all(p.poll() is not None for p in procs.values()):
                break
            if done_at is not None and now - done_at > FINISH_GRACE_S:
                break
            if now > deadline:
                log(f"torchft run: deadline of {deadline_s:.0f} s passed; stopping")
                break
            for r, at in sorted(respawn_at.items()):
                if now >= at:
                    del respawn_at[r]
                    log(f"restarting replica {r} (restart {restarts[r]})")
                    procs[r] = spawn(r, restarts[r])
                    on_respawn(r, restarts[r])
            time.sleep(poll_s)
        return done()
    finally:
        for p in procs.values():  # only the processes this launcher started, by their PID
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


class _Ended:
    """Stands for a dead incarnation whose restart is scheduled (already reaped)."""

    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode

    def wait(self) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:  # pragma: no cover (never running)
        pass


def run_torchft(
    cfg: TrainConfig, hcfg: TorchftHarnessConfig, *, data: Path, out: Path, log=print
) -> int:
    """Run the torchft baseline into run folder `out`; return 0 when the run finished."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    paths = RunPaths(out=Path(out))
    open_run_folder(
        paths, cfg, data_info=read_dataset_info(Path(data)), resume=False,
        launch={"mode": MODE, "replicas": hcfg.replicas, "min_replicas": hcfg.min_replicas,
                "faults": list(hcfg.faults), "torchft": asdict(hcfg),
                "settings": describe_settings(hcfg)},
    )  # fmt: skip
    writer = MetricsWriter(paths.metrics)
    writer.event("launcher.started", mode=MODE, replicas=hcfg.replicas)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=hcfg.min_replicas,
        join_timeout_ms=int(hcfg.join_timeout_s * 1000),
        quorum_tick_ms=int(hcfg.quorum_tick_s * 1000),
        heartbeat_timeout_ms=int(hcfg.heartbeat_timeout_s * 1000),
    )
    # The lighthouse names itself by the host's name; its peers reach it over loopback.
    port = lighthouse.address().rsplit(":", 1)[1]
    lighthouse_addr = f"http://127.0.0.1:{port}"
    ready_dir = Path(tempfile.mkdtemp(prefix="torchft-ready-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    code = 1

    def spawn(replica: int, restart: int) -> subprocess.Popen:
        faults = pending_faults(hcfg.faults, replica, read_fired(out / FIRED_FILE))
        spec = json.dumps({"train": cfg.to_dict(), "harness": asdict(hcfg), "faults": faults,
                           "restart": restart})  # fmt: skip
        return subprocess.Popen(
            [sys.executable, "-m", "recover.tooling.torchft_harness", "--replica", str(replica),
             "--lighthouse", lighthouse_addr, "--data", str(data), "--out", str(out),
             "--ready-dir", str(ready_dir), "--spec", spec],
            env=env,
        )  # fmt: skip

    try:
        log(f"torchft lighthouse at {lighthouse_addr}; starting {hcfg.replicas} replicas")
        finished = supervise(
            spawn, replicas=hcfg.replicas, respawn_s=hcfg.respawn_s,
            max_restarts=hcfg.max_restarts, done=paths.final_model.exists,
            deadline_s=hcfg.run_deadline_s, log=log,
            on_respawn=lambda r, n: writer.event("launcher.respawned", replica=r, restart=n,
                                                 how="spawn"),
        )  # fmt: skip
        code = 0 if finished else 1
        return code
    finally:
        lighthouse.shutdown()
        shutil.rmtree(ready_dir, ignore_errors=True)
        writer.event("launcher.finished", exit_status=code)
        writer.close()


# ---- one replica (child process) ----------------------------------------------------------------
def _start_barrier(ready_dir: Path, replica: int, replicas: int, *, deadline_s: float) -> None:
    """Wait until every replica's manager is up (heartbeating) before the first quorum.

    Without it the first replica to start forms a quorum alone and trains ahead; the others then
    heal from it, which is torchft behaviour but not the same work as the other modes.
    """
    (ready_dir / str(replica)).touch()
    deadline = time.monotonic() + deadline_s
    while len(list(ready_dir.iterdir())) < replicas:
        if time.monotonic() > deadline:
            raise TorchftRunFailed(
                f"replica {replica}: not every replica started within {deadline_s:.0f} s"
            )
        time.sleep(0.05)


def _replica_main(
    replica: int, lighthouse: str, data: Path, out: Path, ready_dir: Path, spec: dict
) -> int:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_model
    from torchft import Manager, ProcessGroupGloo

    from recover.data.addressing import TokenDataset
    from recover.training.trainer import ReplicaTrainer

    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(spec["train"])
    h = TorchftHarnessConfig(**{**spec["harness"], "faults": tuple(spec["harness"]["faults"])})
    paths = RunPaths(out=out)
    writer = MetricsWriter(paths.metrics)
    faults = faults_for([parse_fault(f) for f in spec["faults"]], replica)
    injector = FaultInjector(
        faults, emit=lambda name, **f: writer.event(name, **f), fired=out / FIRED_FILE
    )
    trainer = ReplicaTrainer(cfg, TokenDataset.open(data), phase_hook=injector)

    def state_dict() -> dict:  # read-only: see the module docstring
        return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])

    # This replica group's own TCPStore (one rank per group): torchft's manager connects to it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=h.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=h.min_replicas,
        use_async_quorum=h.async_quorum,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=h.quorum_timeout_s),
        connect_timeout=timedelta(seconds=h.connect_timeout_s),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica:04d}",
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(seconds=h.heartbeat_s),
        init_sync=h.init_sync,
        quorum_retries=h.quorum_retries,
    )
    M, R = cfg.microbatches, h.replicas
    if spec["restart"] == 0:
        _start_barrier(ready_dir, replica, R, deadline_s=h.start_deadline_s)
    own_ids = [j for j in range(M) if j % R == replica]
    tokens_per_mb = cfg.microbatch_size * cfg.seq_len
    t_start = t_last = time.time()
    attempts, rejoined = 0, False
    try:
        while manager.current_step() < cfg.steps:
            manager.start_quorum()  # synchronous: may heal here; async: heals in the background
            step = manager.current_step()  # (a replica healing in the background computes
            attempts += 1  # for its old step: the manager zeroes its share)
            trainer.clear()
            trainer.compute_microbatches(step, own_ids)
            flat = torch.cat([trainer.snapshot(), torch.tensor([float(len(own_ids))])])
            injector("reduce", step, None)
            manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            injector("commit", step, None)
            pen = manager.participating_rank() == 0
            if not manager.should_commit():
                if pen:
                    writer.event("coordinator.redo", step=step, reason="torchft should_commit "
                                 "returned False: the step is discarded and redone")  # fmt: skip
                continue
            step = manager.current_step() - 1  # the step committed (a healed replica's is new)
            count = float(flat[-1])
            # apply_commit divides by M: scale so the update is the average over `count`.
            stats = trainer.apply_commit(step, flat[:-1] * (M / count))
            now = time.time()
            if pen:
                writer.step(step=step, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                            tokens=int(count) * tokens_per_mb, microbatches=int(count),
                            step_s=now - t_last, wall_s=now - t_start,
                            replicas=manager.num_participants(), attempts=attempts)  # fmt: skip
            if spec["restart"] and not rejoined:  # a restarted replica's first commit
                rejoined = True
                writer.event("torchft.rejoined", replica=replica, restart=spec["restart"],
                             step=step, microbatches=int(count))  # fmt: skip
            t_last, attempts = now, 0
        if manager.participating_rank() == 0:
            paths.final_model.parent.mkdir(parents=True, exist_ok=True)
            tmp = paths.final_model.with_name("model.safetensors.tmp")
            save_model(trainer.model, str(tmp))
            writer.write("summary", steps=cfg.steps, wall_s=time.time() - t_start, out=str(out))
            os.replace(tmp, paths.final_model)  # last: the launcher ends the run on it
        return 0
    finally:
        manager.shutdown(wait=False)
        writer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one torchft replica (started by run_torchft)")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ready-dir", type=Path, required=True, help="start barrier folder")
    p.add_argument("--spec", required=True,
                   help="JSON: {train: TrainConfig, harness: ..., faults: [...], restart: N}")  # fmt: skip
    a = p.parse_args(argv)
    require_torchft()
    return _replica_main(a.replica, a.lighthouse, a.data, a.out, a.ready_dir, json.loads(a.spec))


if __name__ == "__main__":
    sys.exit(main())
