"""The torchft baseline: the real torchft (PyPI `torchft`) driving our GPT on our data.

Job: run R replica processes, each a torchft `Manager` around one `ReplicaTrainer`, against a
torchft lighthouse on loopback, under the same fault schedule (`--fault` grammar of
recover.runtime.faults) as `recover train`, and write our run folder (config.json with launch.mode
"torchft", metrics.jsonl in the schema of docs/metrics.md, final/model.safetensors). The report
(recover.tooling.report) then puts it beside the other modes.

How a step runs (torchft's own semantics; this module adds no recovery of its own):
- `start_quorum()` (synchronous quorum) -> the participants of this step;
- replica r computes its fixed share of the step's microbatch ids, `j % R == r` (the ids a
  DistributedSampler-style shard would give it), so a dead replica's ids are simply not computed
  and the global batch shrinks;
- the flat gradient sum, loss sum and microbatch count go through the manager's all-reduce
  (`Manager.allreduce`, SUM), not torchft's DDP wrapper (which crashes survivors when a peer dies
  inside a gloo all-reduce);
- `should_commit()`: if True, the update is sum / count (the gradient averaged over what was
  computed); if False, the step is discarded and redone with a new quorum, written as a
  `coordinator.redo` event so the report counts it like our in-step redos.

Fairness settings: the lighthouse's heartbeat timeout is our lease, quorum retries are given to the
manager, every replica starts from the same seed (init_sync off), and a dead replica is not
respawned (as in `--mode shrink`).

Limits: torchft is optional; `require_torchft()` raises `TorchftUnavailable` naming why when it is
missing. torchft's manager server binds `[::]` (all interfaces) by its own code; we advertise
127.0.0.1 and every peer connects over loopback. One rank per replica.
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
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType

from recover.record import MetricsWriter
from recover.runtime.faults import FaultInjector, faults_for, parse_fault
from recover.training.config import RunPaths, TrainConfig
from recover.training.runfolder import open_run_folder, read_dataset_info

__all__ = ["TorchftHarnessConfig", "TorchftUnavailable", "require_torchft", "run_torchft"]

MODE = "torchft"


class TorchftUnavailable(RuntimeError):
    """torchft cannot be imported here (not installed, or built for another torch)."""


class TorchftRunFailed(RuntimeError):
    """The torchft run did not finish: no replica completed every step before the deadline."""


@dataclass(frozen=True, kw_only=True)
class TorchftHarnessConfig:
    replicas: int = 4
    min_replicas: int = 1  # the lighthouse's and the manager's minimum quorum size
    lease_s: float = 1.0  # lighthouse heartbeat timeout: set equal to our coordinator's lease
    heartbeat_s: float = 0.1  # manager -> lighthouse heartbeat interval
    join_timeout_s: float = 10.0  # first quorum: wait this long for every replica to join
    quorum_retries: int = 3  # torchft retries a failed quorum this many times
    collective_timeout_s: float = 30.0  # manager timeout: all-reduce, should_commit
    quorum_timeout_s: float = 60.0
    run_deadline_s: float = 1800.0  # the whole run; the harness kills its replicas after it
    faults: tuple[str, ...] = ()  # `--fault` values, recover.runtime.faults grammar

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(f"min_replicas must be in 1..replicas, got {self.min_replicas}")
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ValueError("lease_s must be > heartbeat_s > 0")
        for name in ("join_timeout_s", "collective_timeout_s", "quorum_timeout_s",
                     "run_deadline_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0, got {self.quorum_retries}")
        for text in self.faults:
            parse_fault(text)  # ValueError with the grammar on a bad one


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
def run_torchft(
    cfg: TrainConfig, hcfg: TorchftHarnessConfig, *, data: Path, out: Path, log=print
) -> int:
    """Run the torchft baseline into run folder `out`; return 0 when a replica finished."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    paths = RunPaths(out=Path(out))
    open_run_folder(
        paths, cfg, data_info=read_dataset_info(Path(data)), resume=False,
        launch={"mode": MODE, "replicas": hcfg.replicas, "min_replicas": hcfg.min_replicas,
                "faults": list(hcfg.faults), "torchft": asdict(hcfg)},
    )  # fmt: skip
    writer = MetricsWriter(paths.metrics)
    writer.event("launcher.started", mode=MODE, replicas=hcfg.replicas)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=hcfg.min_replicas,
        join_timeout_ms=int(hcfg.join_timeout_s * 1000),
        heartbeat_timeout_ms=int(hcfg.lease_s * 1000),
    )
    # The lighthouse names itself by the host's name; its peers reach it over loopback.
    port = lighthouse.address().rsplit(":", 1)[1]
    lighthouse_addr = f"http://127.0.0.1:{port}"
    children: list[subprocess.Popen] = []
    ready_dir = Path(tempfile.mkdtemp(prefix="torchft-ready-"))
    code = 1
    try:
        spec = json.dumps({"train": cfg.to_dict(), "harness": asdict(hcfg)})
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for r in range(hcfg.replicas):
            children.append(subprocess.Popen(
                [sys.executable, "-m", "recover.tooling.torchft_harness", "--replica", str(r),
                 "--lighthouse", lighthouse_addr, "--data", str(data), "--out", str(out),
                 "--ready-dir", str(ready_dir), "--spec", spec],
                env=env,
            ))  # fmt: skip
        log(f"torchft lighthouse at {lighthouse_addr}; {hcfg.replicas} replicas started")
        deadline = time.monotonic() + hcfg.run_deadline_s
        while any(c.poll() is None for c in children):
            if time.monotonic() > deadline:
                log(f"torchft run: deadline of {hcfg.run_deadline_s:.0f} s passed; stopping")
                break
            time.sleep(0.1)
        finished = [c for c in children if c.returncode == 0]
        code = 0 if finished else 1
        return code
    finally:
        for c in children:  # only the processes this launcher started, by their PID
            if c.poll() is None:
                c.send_signal(signal.SIGKILL)
            c.wait()
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
    h = spec["harness"]
    paths = RunPaths(out=out)
    writer = MetricsWriter(paths.metrics)
    faults = faults_for([parse_fault(f) for f in h["faults"]], replica)
    injector = FaultInjector(faults, emit=lambda name, **f: writer.event(name, **f))
    trainer = ReplicaTrainer(cfg, TokenDataset.open(data), phase_hook=injector)
    # This replica group's own TCPStore (one rank per group): torchft's manager connects to it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=h["collective_timeout_s"])
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=trainer.load_state_dict,
        state_dict=trainer.state_dict,
        min_replica_size=h["min_replicas"],
        use_async_quorum=False,  # the participants must be known before the microbatches
        timeout=timeout,
        quorum_timeout=timedelta(seconds=h["quorum_timeout_s"]),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica:04d}",
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(seconds=h["heartbeat_s"]),
        init_sync=False,  # every replica initialises from the run's seed
        quorum_retries=h["quorum_retries"],
    )
    M, R = cfg.microbatches, h["replicas"]
    _start_barrier(ready_dir, replica, R, deadline_s=h["join_timeout_s"])
    own_ids = [j for j in range(M) if j % R == replica]
    tokens_per_mb = cfg.microbatch_size * cfg.seq_len
    t_start = t_last = time.time()
    attempts = 0
    try:
        while manager.current_step() < cfg.steps:
            manager.start_quorum()  # may heal this replica: read the step after it
            step = manager.current_step()
            attempts += 1
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
            count = float(flat[-1])
            # apply_commit divides by M: scale so the update is the average over `count`.
            stats = trainer.apply_commit(step, flat[:-1] * (M / count))
            now = time.time()
            if pen:
                writer.step(step=step, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                            tokens=int(count) * tokens_per_mb, microbatches=int(count),
                            step_s=now - t_last, wall_s=now - t_start,
                            replicas=manager.num_participants(), attempts=attempts)  # fmt: skip
            t_last, attempts = now, 0
        if manager.participating_rank() == 0:
            paths.final_model.parent.mkdir(parents=True, exist_ok=True)
            tmp = paths.final_model.with_name("model.safetensors.tmp")
            save_model(trainer.model, str(tmp))
            os.replace(tmp, paths.final_model)
            writer.write("summary", steps=cfg.steps, wall_s=time.time() - t_start, out=str(out))
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
    p.add_argument("--spec", required=True, help="JSON: {train: TrainConfig, harness: ...}")
    a = p.parse_args(argv)
    require_torchft()
    return _replica_main(a.replica, a.lighthouse, a.data, a.out, a.ready_dir, json.loads(a.spec))


if __name__ == "__main__":
    sys.exit(main())
