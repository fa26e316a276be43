"""One replica of a multi-replica run: the step of DESIGN.md, through the coordinator.

Job: register with the coordinator, then for every step: compute the microbatch ids the published
view holds for this replica and that are not yet in the local sum, take the snapshot, all-reduce a
fresh copy of it over the epoch's group (fault-tolerant collective), report the outcome, and apply
the optimizer step only when the coordinator commits. On a Redo the local sum (never touched by
the reduce) is kept, the newly held ids are computed on top, and the reduce is redone in the new
epoch. This is the in-step recovery state machine; its record of which ids are in the snapshot is
`StepAttempt.computed`. When the view marks joiners (admitted at this step boundary), every member
first takes part in the live state transfer to them (`recover.transfer`).

Invariants kept here:
- constant batch: the committed update is apply_commit(sum over the M ids) whatever failed; a
  survivor never recomputes its own finished microbatches (it only computes `held - computed`);
- no corruption: the reduce works on a buffer made for that attempt only; after an abort the
  buffer is dropped and the local sum is the snapshot;
- agreement: every `check_every` steps the parameter hash travels with the done report and the
  coordinator stops the run on a mismatch;
- bounded waits: every call to the coordinator and every collective has a deadline.

What it must not do: decide membership or plans (the coordinator does), or reach into the model.
"""

from __future__ import annotations

import datetime
import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from recover.collective import CollectiveAborted, CollectiveConfig, GroupCache
from recover.config import (
    RunPaths,
    TrainConfig,
    check_replica_inside,
    layout_name,
    layout_ranks,
    replica_layout,
)
from recover.coordinator.client import (
    Committed,
    CoordinatorClient,
    Evicted,
    Redo,
    RequestRefused,
    Stopped,
)
from recover.coordinator.client import QuorumLost as ClientQuorumLost
from recover.data.addressing import TokenDataset
from recover.faults import FaultInjector, FaultSpec
from recover.intra import IntraReplica, ReplicaLink, SoloLink, replica_hash
from recover.metrics import MetricsWriter, read_metrics
from recover.run import RunRecorder, unigram_loss
from recover.stall import StallGuard, check_stall
from recover.train import build_trainer_for_run
from recover.trainer import pick_device
from recover.transfer import transfer_state

EXIT_OK = 0
EXIT_QUORUM_LOST = 3
EXIT_EVICTED = 4
EXIT_DIVERGED = 5
EXIT_REFUSED = 6


class QuorumLostError(RuntimeError):
    """Fewer than min_replicas survive: the run stopped; resume it from its last checkpoint."""


class DivergedError(RuntimeError):
    """Replicas hold different parameters: the run stopped; investigate, then resume."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    replica_id: int
    coordinator_host: str
    coordinator_port: int
    token: str | None = None
    data: Path
    out: Path
    resume: bool = False
    faults: tuple[FaultSpec, ...] = ()
    check_every: int = 50  # compare parameter hashes across replicas every N steps (0: never)
    register_timeout_s: float = 60.0  # start-up: all replicas must show up by then
    outcome_timeout_s: float = 120.0  # longest wait for the coordinator's decision on a step
    heartbeat_s: float = 0.1
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)
    # recover (the system), or a baseline for comparison: checkpoint-restart (the launcher
    # restarts the job; a replica never recovers nor checkpoints on a failure) or shrink
    # (a redo discards the local sum; the committed step averages what was computed).
    mode: str = "recover"
    # Ranks per replica that shard the model with FSDP2 (HSDP), split its blocks by tensor
    # parallelism, or hold its consecutive pipeline stages (one of the three above 1; all 1:
    # a replica is one rank).
    shard: int = 1
    tp: int = 1
    pp: int = 1
    # A rank whose replica-mate is silent this long stops the replica (see recover.intra).
    watchdog_s: float = 5.0
    device: str = "auto"  # auto (a GPU if one is visible), cpu or cuda
    cross_reduce: str = "gloo"  # the cross-replica reduce: gloo over host copies, or nccl
    # A training thread busy this long without progress ends its process (recover.stall); 0: off.
    stall_s: float = 300.0

    def __post_init__(self) -> None:
        check_replica_inside(
            self.shard, self.tp, self.pp, self.watchdog_s, self.device, self.cross_reduce
        )
        if self.replica_id < 0:
            raise ValueError(f"--replica-id must be >= 0, got {self.replica_id}")
        if not 0 < self.coordinator_port < 65536:
            raise ValueError(f"--coordinator port must be in 1..65535, got {self.coordinator_port}")
        if self.mode not in ("recover", "checkpoint-restart", "shrink"):
            raise ValueError(
                f"--mode must be recover, checkpoint-restart or shrink, not {self.mode!r}"
            )
        if self.check_every < 0:
            raise ValueError(f"--check-every must be >= 0, got {self.check_every}")
        check_stall(self.stall_s)
        for name in ("register_timeout_s", "outcome_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def parameter_hash(trainer) -> str:
    """A cheap, exact fingerprint of this rank's parameters (sha256 of their bytes, 16 hex)."""
    flat = trainer.flat_parameters()
    # hashlib reads the array through the buffer protocol (no copy) and releases the GIL.
    return hashlib.sha256(flat.numpy()).hexdigest()[:16]


def fingerprint(
    cfg: TrainConfig,
    dataset: TokenDataset,
    dims: dict[str, int] | None = None,
    cross_reduce: str = "gloo",
) -> dict:
    """What every replica of a run must agree on; a joiner with another one is refused."""
    return {
        "preset": cfg.preset,
        "microbatches": cfg.microbatches,
        "microbatch_size": cfg.microbatch_size,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "steps": cfg.steps,
        "data_hash": dataset.content_hash,
        "precision": cfg.precision,
        "layout": " ".join(f"{k} {v}" for k, v in (dims or {}).items()) or "single rank",
        "cross_reduce": cross_reduce,  # one group of every epoch: one backend
    }


@dataclass
class StepAttempt:
    """The record of one step in progress: which ids are in the local sum, and its timings."""

    step: int
    computed: set[int] = field(default_factory=set)
    redos: int = 0
    t_first_fault: float | None = None
    failure: str | None = None  # why this rank's part of the current attempt failed
    compute_s: float = 0.0  # seconds spent computing this replica's microbatches of the step

    def throughput(self) -> float | None:
        """Microbatches per second over the step so far; None before any was computed."""
        return len(self.computed) / self.compute_s if self.computed and self.compute_s > 0 else None


def run_worker(cfg: TrainConfig, wcfg: WorkerConfig, *, console: TextIO | None = sys.stdout) -> int:
    """Run one replica (or, with --shard S, one rank of it) to the end; return its exit status."""
    me = wcfg.replica_id
    dataset = TokenDataset.open(wcfg.data)
    paths = RunPaths(out=wcfg.out)
    writer = MetricsWriter(paths.metrics)
    device = pick_device(wcfg.device)
    if wcfg.cross_reduce == "nccl" and not device.startswith("cuda"):
        raise RuntimeError("--cross-reduce nccl needs a GPU, and no CUDA device is visible")
    # Where the cross-replica buffers live: this rank's GPU for NCCL, else host memory.
    cross_device = device if wcfg.cross_reduce == "nccl" else "cpu"
    intra = None
    dims = replica_layout(wcfg.shard, wcfg.tp, wcfg.pp)
    ranks = layout_ranks(dims)
    if ranks > 1:
        intra = IntraReplica(
            replica_id=me,
            dims=dims,
            timeout_s=wcfg.outcome_timeout_s + wcfg.register_timeout_s,
            watchdog_s=wcfg.watchdog_s,
            device=device,
            emit=writer.event,
        )
    rank = intra.rank if intra is not None else 0
    injector = FaultInjector([f for f in wcfg.faults if f.rank == rank], emit=writer.event)
    trainer, start = build_trainer_for_run(
        cfg, paths=paths, dataset=dataset, resume=wcfg.resume, intra=intra, device=device
    )
    guard = StallGuard(wcfg.stall_s, replica=me, rank=rank, emit=writer.event)

    def phase_hook(phase: str, step: int, index: int | None) -> None:
        guard.tick()  # every microbatch's forward and backward is progress
        injector(phase, step, index)

    trainer.phase_hook = phase_hook
    writer.event(
        "rank_started", replica=me, rank=rank, ranks=ranks, layout=layout_name(dims),
        device=device,
        local_values=trainer.numel,  # what this rank holds of ...
        model_values=trainer.model_values,  # ... the whole model's values
    )  # fmt: skip
    client = None
    if intra is None or intra.leader:
        client = CoordinatorClient(
            wcfg.coordinator_host,
            wcfg.coordinator_port,
            replica_id=me,
            token=wcfg.token,
            heartbeat_s=wcfg.heartbeat_s,
        )
    if intra is None:
        link = SoloLink(client)
    else:
        link = ReplicaLink(
            intra,
            client=client,
            host=wcfg.coordinator_host,
            port=wcfg.coordinator_port,
            token=wcfg.token,
        )
    recorder = RunRecorder(
        cfg=cfg,
        paths=paths,
        trainer=trainer,
        data_hash=dataset.content_hash,
        writer=writer,
        console=console,
        start_step=start,
        holds_pen=False,
        writes=rank == 0,
    )
    try:
        view = link.register(
            fingerprint=fingerprint(cfg, dataset, dims, wcfg.cross_reduce),
            next_step=start,
            deadline_s=wcfg.register_timeout_s,
        )
        joining = me in view.joined
        if joining:
            writer.event("replica_joining", replica=me, step=view.step, epoch=view.epoch)
            recorder.start_step = view.step
            recorder.last_committed = view.step - 1
        elif view.step != start:
            raise RuntimeError(f"replica {me} holds step {start}, the run is at step {view.step}")
        store_host, store_port = link.store_address
        store = torch.distributed.TCPStore(
            store_host,
            store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=wcfg.register_timeout_s),
        )
        # With several ranks per replica, the ranks at position k of every replica form the
        # cross-replica group of position k (HSDP's replicate dimension), one per epoch.
        scope = f"position{rank}/" if intra is not None else ""
        loop = ReplicaLoop(
            trainer=trainer,
            link=link,
            groups=GroupCache(store, config=wcfg.collective, scope=scope, device=cross_device),
            injector=injector,
            recorder=recorder,
            wcfg=wcfg,
            has_state=not joining,
            guard=guard,
        )
        step = view.step
        while step < cfg.steps:
            step = loop.run_step(step) + 1
        if not loop.has_state:  # admitted at the very end: it never held the run's state
            link.leave(step=step)
            return EXIT_OK
        # The pen stays where the last commit put it (replicas that already left are not in
        # the view any more, so recomputing it here could hand out a second pen).
        pen = recorder.pen_writes
        recorder.finish(
            unigram_loss=unigram_loss(
                dataset.shards("train"), dataset.shards("val"), dataset.vocab_size
            )
            if pen
            else None,
            extra=run_recovery_summary(paths.metrics) if pen else {},
        )
        phash = loop.replica_hash()
        if rank == 0:
            writer.event("replica_finished", replica=me, step=step, param_hash=phash)
        link.leave(step=step)
        return EXIT_OK
    except Evicted as e:
        print(
            f"replica {me}: evicted by the coordinator ({e}); exiting without touching the run",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_EVICTED
    except (QuorumLostError, ClientQuorumLost) as e:
        # Every survivor holds the last committed state (the optimizer steps only on commits);
        # the lowest survivor saves it, so that --resume continues from the last committed step.
        view = link.step_view()
        live = view.live if view is not None else ()
        recorder.holds_pen = not live or me == min(live)
        # (The checkpoint-restart baseline restarts from its last periodic checkpoint instead.)
        if recorder.holds_pen and wcfg.mode != "checkpoint-restart":
            recorder.checkpoint(recorder.last_committed + 1, block=True)
        print(f"replica {me}: {e}", file=sys.stderr, flush=True)
        return EXIT_QUORUM_LOST
    except RequestRefused as e:
        if e.code == "finished":
            print(f"replica {me}: nothing to join: {e}", file=sys.stderr, flush=True)
            return EXIT_OK
        print(f"replica {me}: refused by the coordinator: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    except DivergedError as e:
        print(f"replica {me}: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except Exception:
        # In a replica of several ranks, a collective inside it fails when a replica-mate dies;
        # the watchdog then names the mate and exits with EXIT_MATE_LOST. Give it the time.
        if intra is not None:
            intra.on_error(sys.exc_info()[1])
        raise
    finally:
        link.close()
        writer.close()


def run_recovery_summary(metrics_path: Path) -> dict:
    """Failures survived, microbatches recomputed and seconds recovering, from the run's record
    (the coordinator's decisions and every replica's events), for the end-of-run summary."""
    dead = redo_ids = 0
    recovering: dict[int, float] = {}
    for record in read_metrics(metrics_path):
        name = record.get("name")
        if name == "coordinator.member_dead":
            dead += 1
        elif name == "coordinator.redo":
            redo_ids += len(record.get("lost", ()))
        elif name == "recovered":  # the slowest replica's view of each recovered step
            step = int(record["step"])
            recovering[step] = max(recovering.get(step, 0.0), float(record["seconds"]))
    return {
        "failures_survived": dead,
        "microbatches_recomputed": redo_ids,
        "recovery_s": round(sum(recovering.values()), 3),
    }


@dataclass
class ReplicaLoop:
    """The step state machine of one replica (see the module docstring)."""

    trainer: object
    link: SoloLink | ReplicaLink  # the coordinator, as this rank of the replica sees it
    groups: GroupCache
    injector: FaultInjector
    recorder: RunRecorder
    wcfg: WorkerConfig
    has_state: bool  # False for a joiner until the state transfer has reached it
    guard: StallGuard  # watches the training thread in compute, reduce, optimizer
    _transferred_epoch: int = -1

    @property
    def me(self) -> int:
        return self.wcfg.replica_id

    def replica_hash(self) -> str:
        """The parameter fingerprint of the whole replica (a collective with several ranks)."""
        return replica_hash(self.link.gather(parameter_hash(self.trainer)))

    def run_step(self, step: int) -> int:
        """Run step `step` until it commits; return it. The recovery loop lives here."""
        attempt = StepAttempt(step=step)
        view = self.link.step_view()
        while True:
            if view.status in ("quorum_lost", "diverged", "finished"):
                _stop(view.status, view.reason)
            epoch = view.attempt_epoch
            reduced = None
            attempt.failure = None
            transferred = self._transfer_if_needed(view, step, attempt)
            if view.joined:  # every rank of the replica goes on only if all of them got it
                transferred = self.link.agree(transferred)
            if transferred:
                self._compute(step, view, attempt)
                snapshot = self.trainer.gradient_snapshot()  # the local sum; never reduced in place
                reduced = self._reduce(snapshot, view, step, attempt)
            check = (
                reduced is not None and self.wcfg.check_every and step % self.wcfg.check_every == 0
            )
            phash = parameter_hash(self.trainer) if check else None
            failure = None if reduced is not None else attempt.failure or "a replica-mate failed"
            if not self.link.report(
                step=step, epoch=epoch, failure=failure, param_hash=phash,
                throughput=attempt.throughput(),
            ):  # fmt: skip
                reduced = None  # some rank of this replica failed: nobody's result counts
            if reduced is not None:
                self.injector("commit", step, None)
            outcome = self.link.wait_outcome(
                step=step, epoch=epoch, deadline_s=self.wcfg.outcome_timeout_s
            )
            if isinstance(outcome, Committed):
                if reduced is None:
                    raise RuntimeError(
                        f"step {step} committed although this replica's reduce failed"
                    )
                self._commit(step, view, epoch, reduced, attempt)
                return step
            if isinstance(outcome, Redo):
                # The local sum (p.grad) was never touched by the reduce: it is the snapshot.
                if self.wcfg.mode == "shrink":  # baseline: the in-flight step is discarded
                    self.trainer.zero_local()
                    attempt.computed.clear()
                    attempt.compute_s = 0.0
                if attempt.t_first_fault is None:
                    attempt.t_first_fault = time.perf_counter()
                attempt.redos += 1
                view = outcome.view
                continue
            if isinstance(outcome, Stopped):
                _stop(outcome.status, outcome.reason)
            raise RuntimeError(f"unexpected outcome {outcome!r}")

    def _compute(self, step: int, view, attempt: StepAttempt) -> None:
        """Compute the ids this replica holds in the attempt and has not summed yet."""
        todo = [j for j in view.holdings.get(self.me, ()) if j not in attempt.computed]
        t0 = time.perf_counter()
        with self.guard.busy("computing microbatches"):
            self.trainer.compute_microbatches(step, todo, first_index=len(attempt.computed))
        attempt.computed.update(todo)
        if todo:  # reported with `done`: feeds the coordinator's throughput-aware plans
            attempt.compute_s += time.perf_counter() - t0

    def _commit(self, step: int, view, epoch: int, reduced, attempt: StepAttempt) -> None:
        recorder, me = self.recorder, self.me
        recorder.holds_pen = me == min(self.link.step_view().live)
        count = sum(len(ids) for ids in view.holdings.values())  # M, but in the shrink baseline
        with self.guard.busy("in the optimizer step"):
            stats = self.trainer.apply_commit(step, reduced, count=count)
        shares = {str(r): len(ids) for r, ids in sorted(view.holdings.items())}
        extra = {
            "epoch": epoch,
            "replicas": len(view.holdings),
            "attempts": attempt.redos + 1,
            "shares": shares,
        }
        recorder.on_commit(stats, microbatches=count, **extra)
        if attempt.t_first_fault is not None:
            seconds = time.perf_counter() - attempt.t_first_fault
            recorder.event(
                "recovered", replica=me, step=step, seconds=round(seconds, 4),
                attempts=attempt.redos + 1,
            )  # fmt: skip
            recorder.say(
                f"recovered: step {step + 1} committed with all {self.trainer.cfg.microbatches} "
                f"microbatches, {seconds:.3f} s after this replica saw the failure"
            )

    def _with_fault(self, phase: str, step: int, should_abort):
        """`should_abort`, plus the `phase` fault fired at its first call: while the collective
        of that phase is in flight (the callback is polled during it)."""
        fired = False

        def wrapped() -> str | None:
            nonlocal fired
            if not fired:
                fired = True
                self.injector(phase, step, None)
            return should_abort()

        return wrapped

    def _should_abort(self, epoch: int):
        link, guard = self.link, self.guard

        def should_abort() -> str | None:
            guard.tick()  # polled all along an in-flight collective: progress
            if link.evicted:
                return "this replica was evicted"
            newer = link.live_view()
            if newer.epoch > epoch or newer.status != "running":
                return f"epoch {newer.epoch} announced ({newer.reason})"
            return None

        return should_abort

    def _group(self, view, should_abort):
        # The attempt's members are the replicas holding ids of it (the view's live set can
        # already lack one that died during the attempt).
        members = sorted(view.holdings)
        group = self.groups.get(
            epoch=view.attempt_epoch,
            rank=members.index(self.me),
            world_size=len(members),
            should_abort=should_abort,
        )
        return group, members

    def _failed(
        self, step: int, epoch: int, error: CollectiveAborted, t0: float, what: str, attempt
    ) -> None:
        self.recorder.event(
            "failure_detected", replica=self.me, step=step, epoch=epoch, how=error.kind,
            during=what, detail=str(error.detail)[:200],
            after_s=round(time.perf_counter() - t0, 4),
        )  # fmt: skip
        # gloo's text ends in advice for its own users; the first sentence is the fact.
        detail = str(error.detail).split(". This is typically")[0]
        attempt.failure = f"{what}: {error.kind}: {detail}"[:200]  # reported by run_step

    def _transfer_if_needed(self, view, step: int, attempt: StepAttempt) -> bool:
        """Take part in the state transfer to this epoch's joiners; False if it failed."""
        epoch = view.attempt_epoch
        joined = [r for r in view.joined if r in view.holdings]
        if not self.has_state and self.me not in joined:
            raise RuntimeError(f"replica {self.me} joined but the view no longer offers it state")
        if not joined or self._transferred_epoch == epoch:
            return True
        t0 = time.perf_counter()
        should_abort = self._should_abort(epoch)
        try:
            group, members = self._group(view, should_abort)
            stats = transfer_state(
                group, self.trainer, members=members, joined=joined, me=self.me,
                should_abort=self._with_fault("transfer", step, should_abort),
            )  # fmt: skip
        except CollectiveAborted as e:
            if attempt.t_first_fault is None:
                attempt.t_first_fault = t0
            self._failed(step, epoch, e, t0, "state transfer", attempt)
            return False
        self._transferred_epoch = epoch
        self.has_state = True
        if self.me in joined:
            self.recorder.event(
                "state_transfer", replica=self.me, rank=self.link.rank, step=step, epoch=epoch,
                source=stats.source,
                bytes=stats.bytes, seconds=round(stats.seconds, 4),
            )  # fmt: skip
        return True

    def _reduce(self, snapshot, view, step: int, attempt: StepAttempt):
        """All-reduce a fresh copy of the snapshot in the attempt's epoch; None if it aborted."""
        epoch = view.attempt_epoch
        should_abort = self._should_abort(epoch)
        should_abort_reduce = self._with_fault("reduce", step, should_abort)
        # For this attempt only; dropped on abort. Where the cross-replica group reduces: in
        # host memory for gloo (whatever device the replica computes on), on the GPU for NCCL.
        buffer = snapshot.to(self.groups.device, copy=True)
        t0 = time.perf_counter()
        try:
            with self.guard.busy("in the cross-replica reduce"):  # its polls are the ticks
                group, members = self._group(view, should_abort)
                if len(members) > 1:
                    group.allreduce_sum(buffer, should_abort=should_abort_reduce)
                else:
                    should_abort_reduce()
            return buffer
        except CollectiveAborted as e:
            if attempt.t_first_fault is None:
                attempt.t_first_fault = t0
            self._failed(step, epoch, e, t0, "reduce", attempt)
            return None


def _stop(status: str, reason: str) -> None:
    if status == "quorum_lost":
        raise QuorumLostError(
            f"quorum lost: {reason}. Resume with --resume from the last checkpoint"
        )
    if status == "diverged":
        raise DivergedError(f"REPLICAS DIVERGED, training stopped: {reason}")
    raise RuntimeError(f"the run stopped ({status}): {reason}")


__all__ = ["run_worker", "WorkerConfig"]
