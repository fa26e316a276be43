"""One replica of a `recover train` run: the built-in GPT trainer as a client of the step machine.

Job: open the dataset and the run folder's writer, build the replica's trainer (and, for a replica
of several ranks, its group inside), register with the coordinator, then run every step through
`recover.runtime.step_machine.StepMachine` (compute the ids it hands out, apply the update it commits) and
record each commit (`recover.training.recorder.RunRecorder`). On the way out: the final model and summary, a
checkpoint of the last committed state when the quorum is lost, and an exit status that says why.

What it must not do: the step's recovery logic (the step machine's), decide membership or plans
(the coordinator's), or reach into the model (the trainer's).

Size: one replica process from start to exit: set-up, the step loop as a client of the step
machine, and every way out with its exit status; the step's own logic is in
recover.runtime.step_machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from recover import exits
from recover.addresses import PeerAddress
from recover.checkpoint.folders import checkpoint_path
from recover.data.addressing import TokenDataset
from recover.policy import WORKLOADS
from recover.record import MetricsWriter, read_metrics
from recover.runtime.env import ReplicaEnv
from recover.runtime.faults import FaultInjector, poison_gradient
from recover.runtime.links import IntraReplica
from recover.runtime.session import STOPS, ReplicaSession
from recover.runtime.spec import ReplicaSpec
from recover.runtime.stall import StallGuard
from recover.runtime.step_machine import CommittedStep, StepHooks, StepOptions
from recover.runtime.update_guard import UpdateGuard
from recover.training.config import (
    RunPaths,
    TrainConfig,
)
from recover.training.recorder import RunRecorder, unigram_loss
from recover.training.solo import build_trainer_for_run
from recover.training.trainer import CommitStats, NonFiniteError, pick_device

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """One replica process of `recover train`: who it is (its `ReplicaEnv`, with the job's
    replica spec), where its data and run folder are, and its start-up and decision deadlines."""

    env: ReplicaEnv
    data: Path
    out: Path
    resume: bool = False
    # The exact command that continues this run from its checkpoint (said when the run stops
    # early: the coordinator lost); empty: "the same command with --resume".
    resume_command: str = ""
    # The gloo devices of every group this process builds (recover.addresses; resolved and
    # checked by the entry point from --ifname/RECOVER_IFNAME/GLOO_SOCKET_IFNAME and the
    # coordinator's address). The default: gloo's own (this host's name), for a local run.
    peer: PeerAddress = PeerAddress()


# Settings that only decide what is recorded, never the committed update: a replica may differ.
_RECORD_ONLY = ("eval_every", "eval_batches", "ckpt_every", "keep_ckpts")


def fingerprint(cfg: TrainConfig, dataset: TokenDataset, spec: ReplicaSpec | None = None) -> dict:
    """What every replica of a run must agree on; a joiner with another one is refused (naming
    the field). Every training setting that changes the committed update is in it: the model,
    the batch, the seed, the optimizer and schedule, clipping, dropout, precision, the layout, the
    cross-replica backend and its buckets, the mode, and the dataset's content."""
    spec = spec or ReplicaSpec()
    train = {k: v for k, v in cfg.to_dict().items() if k not in _RECORD_ONLY}
    return {
        **train,
        "data_hash": dataset.content_hash,
        "layout": spec.layout.describe(),
        "cross_reduce": spec.cross_reduce,  # one group of every epoch: one backend
        "reduce_bucket": spec.reduce_bucket_bytes,  # one order of ops in a step's reduce
        "mode": spec.mode,
        **({"deterministic": True} if spec.deterministic else {}),  # another reduce: all or none
    }


@dataclass(frozen=True, kw_only=True)
class PreparedReplica:
    """What a replica of one rank builds before it knows who it is: its dataset, device and
    trainer (model and optimizer at their initial state). A standby holds one while it waits;
    building it touches neither the run folder nor the coordinator."""

    dataset: TokenDataset
    device: str
    trainer: object


def prepare_replica(
    cfg: TrainConfig, *, data: Path, spec, device_index: int = 0
) -> PreparedReplica:
    """Open the dataset and build the trainer of a fresh replica of one rank (a joiner: its state
    comes by transfer, so nothing is loaded). `spec`: the job's ReplicaSpec."""
    if spec.layout.ranks > 1:
        raise ValueError("a replica is prepared ahead only when it has one rank")
    dataset = TokenDataset.open(data)
    device = pick_device(spec.device, device_index)
    trainer, _ = build_trainer_for_run(
        cfg, paths=RunPaths(out=Path()), dataset=dataset, resume=False, device=device
    )
    return PreparedReplica(dataset=dataset, device=device, trainer=trainer)


def run_worker(
    cfg: TrainConfig,
    wcfg: WorkerConfig,
    *,
    console: TextIO | None = sys.stdout,
    prepared: PreparedReplica | None = None,
) -> int:
    """Run one replica (or, with --shard S, one rank of it) to the end; return its exit status.
    `prepared`: its dataset and trainer built ahead (a promoted standby), a fresh joiner's."""
    me, spec = wcfg.env.replica_id, wcfg.env.spec
    if prepared is not None and (wcfg.resume or spec.layout.ranks > 1):
        raise ValueError("a prepared replica joins afresh, with one rank, without --resume")
    dataset = prepared.dataset if prepared is not None else TokenDataset.open(wcfg.data)
    paths = RunPaths(out=wcfg.out)
    writer = MetricsWriter(paths.metrics)
    device = (
        prepared.device if prepared is not None else pick_device(spec.device, wcfg.env.device_index)
    )
    if spec.cross_reduce == "nccl" and not device.startswith("cuda"):
        raise RuntimeError("--cross-reduce nccl needs a GPU, and no CUDA device is visible")
    # Where the cross-replica buffers live: this rank's GPU for NCCL, else host memory.
    cross_device = device if spec.cross_reduce == "nccl" else "cpu"
    intra = None
    layout = spec.layout
    ranks = layout.ranks
    if ranks > 1:
        intra = IntraReplica(
            replica_id=me,
            layout=layout,
            ranks=wcfg.env.ranks,
            timeout_s=StepOptions.outcome_timeout_s + spec.register_timeout_s,
            watchdog_s=spec.watchdog_s,
            device=device,
            emit=writer.event,
        )
    rank = intra.rank if intra is not None else 0
    if prepared is not None:
        trainer, start = prepared.trainer, 0
    else:
        trainer, start = build_trainer_for_run(
            cfg, paths=paths, dataset=dataset, resume=wcfg.resume, intra=intra, device=device
        )
    injector = FaultInjector(
        [f for f in wcfg.env.faults if f.rank == rank],
        emit=writer.event,
        corrupt=lambda: poison_gradient(trainer.model.parameters()),
        fired=wcfg.env.fired,
    )
    guard = StallGuard(spec.stall_s, replica=me, rank=rank, emit=writer.event)

    def phase_hook(phase: str, step: int, index: int | None) -> None:
        guard.tick()  # every microbatch's forward and backward is progress
        injector(phase, step, index)

    trainer.phase_hook = phase_hook
    # The client, the link of the replica's ranks, and the fence: from its eviction on, this
    # incarnation writes nothing to the run folder (every record, checkpoint and the final model
    # passes the fence, whatever thread writes it).
    session = ReplicaSession(wcfg.env, intra=intra, writer=writer)
    recorder = RunRecorder(
        cfg=cfg,
        paths=paths,
        trainer=trainer,
        data_hash=dataset.content_hash,
        writer=writer,
        console=console,
        start_step=start,
        is_writer=False,
        leads=rank == 0,
        replica=me,
        peak_tflops=spec.peak_tflops,
        devices_per_replica=layout.ranks,
        tensorboard=spec.tensorboard,
        wandb=spec.wandb,
    )

    def save_last_committed() -> bool:
        """When the run cannot go on: the lowest replica of the last view saves the committed
        state it holds (every replica holds the same: the optimizer steps only on commits), so
        that --resume loses nothing. A replica that never held the run's state (not admitted
        yet, or a joiner before its transfer) saves nothing; nor does the checkpoint-restart
        baseline, which restarts from its last periodic checkpoint. True if this rank wrote."""
        if not session.has_state or spec.mode == "checkpoint-restart":
            return False
        recorder.is_writer = session.lowest_live()
        if not recorder.is_writer:
            return False
        # None: fenced before it began; a path not in place: fenced before the publish. Only a
        # checkpoint that is on disk may be announced as saved.
        path = recorder.checkpoint(recorder.last_committed + 1, block=True)
        return path is not None and path.exists() and recorder.writes_records

    try:
        view = session.join(
            fingerprint(cfg, dataset, spec),
            next_step=start,
        )
        # Only a member writes to the run's record: a worker refused at registration (another
        # token, other settings, an id in use) leaves no trace in it.
        writer.event(
            "rank_started", replica=me, rank=rank, ranks=ranks, layout=layout.name,
            device=device, pid=os.getpid(),
            local_values=trainer.numel,  # what this rank holds of ...
            model_values=trainer.model_values,  # ... the whole model's values
        )  # fmt: skip
        joining = me in view.joined
        if joining:
            writer.event("replica_joining", replica=me, step=view.step, epoch=view.epoch)
            recorder.start_step = view.step
            recorder.last_committed = view.step - 1
        elif view.step != start:
            raise RuntimeError(f"replica {me} holds step {start}, the run is at step {view.step}")
        elif console is not None and rank == 0 and me == min(view.live):  # one header per run
            log.info(
                f"training {cfg.preset} ({trainer.model_values / 1e6:.2f}M parameters) for "
                f"{cfg.steps} steps of {cfg.microbatches} x {cfg.microbatch_size} x "
                f"{cfg.seq_len} tokens on {len(view.live)} replicas"
                + (f" of {ranks} ranks ({layout.name})" if ranks > 1 else "")
                + f"; run folder {paths.out}",
            )  # fmt: skip
        # A replica of one rank applies each update while its vote completes (EarlyUpdates).
        early = EarlyUpdates(trainer, guard, steps=cfg.steps) if ranks == 1 else None
        machine = session.start(
            trainer,
            peer=wcfg.peer,
            cross_device=cross_device,
            options=StepOptions(
                replica_id=me,
                check_every=spec.check_every,
                discard_on_redo=WORKLOADS.get(spec.mode, WORKLOADS["recover"]).discards,
                deterministic=spec.deterministic,
            ),
            # A writer reports the next step only once its checkpoint is durable: the coordinator
            # then counts its step as recorded (a gap is filled only after a lost writer).
            hooks=StepHooks(
                phase=injector,
                event=writer.event,
                guard=guard,
                before_done=recorder.wait_saves,
                apply_early=early,
                ahead=early.ahead if early is not None and spec.why_not_ahead() is None else None,
            ),
            has_state=not joining,
        )
        # The update and the work ahead run from the moment the done report is sent: a fault
        # declared in them acts once the report is on record, the point its phase names.
        injector.on_record = machine.wait_on_record

        def compute(todo) -> None:
            trainer.compute_microbatches(todo.step, todo.ids, first_index=todo.first_index)

        session.stop_on_signals()  # a stop request, served at a step boundary (below)
        step = view.step
        while step < cfg.steps:
            session.confirm_member()
            commit = machine.run(step, compute)
            apply_commit(
                commit, replica=me, trainer=trainer, recorder=recorder, guard=guard, early=early
            )
            step += 1
            # A planned leave (session.boundary): it leaves with the committed state saved.
            if step < cfg.steps and session.boundary():
                if recorder.is_writer and not commit.released:
                    recorder.checkpoint(step, block=True)
                recorder.event("replica_stopped", replica=me, rank=rank, step=step)
                log.info(
                    f"replica {me}: stopped as asked at the boundary of step {step}"
                    + (f"; the committed state is checkpointed in {paths.checkpoints}"
                       if recorder.writes_records else ""),
                )  # fmt: skip
                session.leave(step=step)
                return exits.STOPPED
        if not machine.has_state:  # admitted at the very end: it never held the run's state
            session.leave(step=step)
            return exits.OK
        # The writer stays the one the last commit named (replicas that already left are not in
        # the view any more, so recomputing it here could name a second writer).
        writes = recorder.writes_records
        recorder.finish(
            unigram_loss=unigram_loss(
                dataset.shards("train"), dataset.shards("val"), dataset.vocab_size
            )
            if writes
            else None,
            extra=run_recovery_summary(paths.metrics) if writes else {},
        )
        phash = machine.replica_hash()
        if rank == 0:
            writer.event("replica_finished", replica=me, step=step, param_hash=phash)
        session.leave(step=step)
        return exits.OK
    except STOPS as e:
        return _stopped(session.stop_of(e), session, recorder, save_last_committed, wcfg, paths)
    except NonFiniteError as e:
        # Every replica holds the same last finite state (no skipped step was applied); the
        # writer of the last step saves it, so that a resume starts from it.
        if recorder.is_writer:
            recorder.checkpoint(recorder.last_committed + 1, block=True)
        log.error(f"replica {me}: {e}")
        return exits.NONFINITE
    except Exception:
        # In a replica of several ranks, a collective inside it fails when a replica-mate dies;
        # the watchdog then names the mate and exits with exits.MATE_LOST. Give it the time.
        if intra is not None:
            intra.on_error(sys.exc_info()[1])
        raise
    finally:
        session.close()
        writer.close()


def _stopped(stop, session, recorder, save_last_committed, wcfg: WorkerConfig, paths) -> int:
    """The trainer's part of a way out (`session.stop_of`): what it saves, and its line."""
    me = session.replica_id
    if stop.kind == "evicted":
        recorder.settle()  # a save in flight publishes nothing now; its temporary file goes
        log.warning(f"replica {me}: {stop.line}; exiting without touching the run")
    elif stop.kind == "quorum_lost":
        # Every survivor holds the last committed state (the optimizer steps only on commits);
        # the lowest survivor saves it, so that --resume continues from the last committed step.
        save_last_committed()
        log.error(f"replica {me}: {stop.line} (run it again with --resume)")
    elif stop.kind == "finished":
        log.info(f"replica {me}: {stop.line}")
    elif stop.kind == "coordinator_lost":
        # No coordinator answered for the grace (gone or frozen, and no standby took over):
        # nobody can commit any more. Every replica holds its last committed state; the lowest
        # replica of the last view saves it through the normal checkpoint path (announced once
        # durable), so that --resume loses nothing that committed. One line, no traceback.
        if session.machine is None:  # never admitted: nothing of the run is held here
            log.error(
                f"replica {me}: the coordinator cannot be reached ({stop.cause}); nothing was "
                "trained here; start it again once a coordinator is up"
            )
            return stop.status
        saved = save_last_committed()
        log.error(
            f"replica {me}: {stop.line}; stopping; "
            f"{_what_was_saved(saved, session, recorder, paths)}; to continue: "
            f"{wcfg.resume_command or 'the same command with --resume'}"
        )
    elif stop.kind == "storage":
        # The run folder cannot be written (a full disk, a read-only folder): the run cannot keep
        # its record, so it stops. The lowest replica tries to save the last committed state
        # (where space allows: a checkpoint folder may fit where a line did not); its line
        # says whether it could.
        try:
            saved = save_last_committed()
        except Exception as why:  # noqa: BLE001 - the save's own failure is the answer here
            saved, cause = False, f" ({_why_not_saved(why)})"
        else:
            cause = ""
        step = recorder.last_committed
        outcome = (
            f"step {step}, the last committed, is checkpointed in "
            f"{checkpoint_path(paths.checkpoints, step + 1)}"
            if saved
            else f"the last committed step ({step}) was not saved here{cause}"
        )
        log.error(f"replica {me}: {stop.line}: the run stops; {outcome}")
    else:  # refused, diverged
        log.error(f"replica {me}: {stop.line}")
    return stop.status


def _why_not_saved(error: BaseException) -> str:
    """A save's failure in a few words (DCP wraps each rank's error with its traceback)."""
    text = str(error)
    for reason in ("No space left on device", "Read-only file system", "Disk quota exceeded"):
        if reason in text:
            return f"the checkpoint could not be written either: {reason}"
    return text.splitlines()[0][:160] if text else type(error).__name__


def _what_was_saved(saved: bool, session: ReplicaSession, recorder, paths: RunPaths) -> str:
    """The coordinator-lost line's account of the last committed state."""
    me = session.replica_id
    step = recorder.last_committed
    if saved:
        return (
            f"step {step}, the last committed, is checkpointed in "
            f"{checkpoint_path(paths.checkpoints, step + 1)}"
        )
    if not session.has_state:
        return "this replica held no committed state of the run yet (a joiner)"
    view = session.link.step_view()
    lowest = min(view.live) if view is not None and view.live else me
    if lowest != me:  # (it may be fenced and unable to: its own line says whether it saved)
        return (
            f"replica {lowest}, the lowest live, is the one to checkpoint the last committed "
            "step (its line says whether it could)"
        )
    if recorder.leads:  # the lowest replica could not save: it may have been evicted meanwhile
        return (
            f"step {step}, the last committed, was not saved (no coordinator confirmed this "
            "replica is still a member); the newest checkpoint is the one to resume from"
        )
    return "rank 0 of this replica is the one to checkpoint the last committed step"


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


class EarlyUpdates:
    """The update of a step applied while its vote completes (StepHooks.apply_early), in a
    replica of one rank: the optimizer step runs from the moment this replica's done report is
    sent, instead of after the commit arrives. Its undo puts back the state before it (the update
    guard's backup, recover.runtime.update_guard) and the local sum (held by reference), so that
    a redo computes on top of the sum as it was."""

    def __init__(self, trainer, guard, *, steps: int) -> None:
        self.trainer, self.guard, self.steps = trainer, guard, steps
        self._applied: dict[int, tuple[CommitStats, float]] = {}

    def ahead(self, step: int, ids: tuple[int, ...]) -> bool:
        """StepHooks.ahead: microbatches `ids` of the next step `step`, computed during the
        vote on the parameters the update just made, into the local sum the update emptied.
        They are the first the replica computes in that step (a fault's microbatch 0 fires
        here). False past the run's last step."""
        if step >= self.steps:
            return False
        self.trainer.phase_hook("ahead", step - 1, None)  # (the fault phase: step's - 1 vote)
        self.trainer.compute_microbatches(step, ids, first_index=0)
        return True

    def __call__(
        self, step: int, reduced: torch.Tensor, count: int, finite: bool
    ) -> Callable[[], None]:
        trainer = self.trainer
        held, skips = trainer.grads.hold(), trainer.consecutive_skips
        t0 = time.perf_counter()
        with self.guard.busy("in the optimizer step"):
            stats = trainer.apply_commit(step, reduced, count=count, finite=finite)
        self._applied[step] = (stats, round(time.perf_counter() - t0, 6))

        def undo() -> None:
            del self._applied[step]
            if not stats.skipped:  # (a skipped step changed no state, or undid its own)
                trainer.update_guard.restore()
            trainer.grads.put_back(held)
            trainer.consecutive_skips = skips

        return undo

    def take(self, step: int) -> tuple[CommitStats, float]:
        """The stats and seconds of step `step`'s update, applied during its vote."""
        return self._applied.pop(step)

    @contextlib.contextmanager
    def before(self, step: int) -> Iterator[None]:
        """The model and optimizer as they were before step `step`'s update, for the length of
        the block (what the writer of `step` records of earlier steps: fill_gaps), then the
        updated state again."""
        stats, _ = self._applied[step]
        if stats.skipped:  # nothing was changed
            yield
            return
        after = UpdateGuard(self.trainer.optimizer)
        after.save()
        self.trainer.update_guard.restore()
        try:
            yield
        finally:
            after.restore()


def apply_commit(
    commit: CommittedStep, *, replica: int, trainer, recorder: RunRecorder, guard,
    early: EarlyUpdates | None = None,
) -> None:  # fmt: skip
    """The update of a committed step (unless it was applied during the vote: `early`), then
    its records (the writer was named with the commit)."""
    recorder.is_writer = commit.writer
    # A previous writer died or left before its records were known written: what the run folder
    # lacks is written now, from the state committed before this step (an update applied during
    # the vote is set aside meanwhile).
    applied = commit.applied and early is not None
    gaps = recorder.is_writer and commit.records_from < commit.step
    with early.before(commit.step) if applied and gaps else contextlib.nullcontext():
        recorder.fill_gaps(commit.records_from, commit.step)
    if applied:
        stats, apply_s = early.take(commit.step)
    else:
        t0 = time.perf_counter()
        with guard.busy("in the optimizer step"):
            stats = trainer.apply_commit(
                commit.step, commit.reduced, count=commit.count, finite=commit.finite
            )
        apply_s = round(time.perf_counter() - t0, 6)
    recorder.on_commit(
        stats,
        microbatches=commit.count,  # M, but in the shrink baseline
        epoch=commit.epoch,
        replicas=len(commit.shares),
        attempts=commit.attempts,
        shares={str(r): n for r, n in commit.shares.items()},
        parts={**commit.parts, "apply": apply_s},  # where the writer's step went (PARTS)
        overlapped=commit.overlapped,  # the share of its reduce started during the backward
        # ids of the step the writer computed during the previous step's vote (and kept)
        **({"ahead": list(commit.ahead)} if commit.ahead else {}),
    )
    trainer.stop_if_diverging()  # NonFiniteError after max_nonfinite skipped steps in a row
    if commit.recovered_s is not None:
        seconds = commit.recovered_s
        recorder.event(
            "recovered", replica=replica, step=commit.step, seconds=round(seconds, 4),
            attempts=commit.attempts,
        )  # fmt: skip
        recorder.say(
            f"recovered: step {commit.step} committed with all {commit.count} "
            f"microbatches, {seconds:.3f} s after this replica saw the failure"
        )


__all__ = ["PreparedReplica", "WorkerConfig", "prepare_replica", "run_worker"]
