"""ReCoVer as a library: your own model, optimizer, data and loop, kept training through failures.

Job: the replica side of a job, for any training script. A script makes a `Replica`, attaches its
model and optimizer, and writes its loop as usual, with the microbatches of each step taken from
`replica.microbatches()`:

    replica = recover.Replica(microbatches=M)            # the job named by `recover run`'s env
    replica.attach(model, optimizer, extra_state={"scheduler": scheduler})
    for step in replica.steps(total_steps):
        for j in replica.microbatches():                 # own ids, then reassigned ones
            x, y = data.batch(step, j)                   # a pure function of (step, j)
            replica.backward(loss_fn(model(x), y))
        # p.grad holds the committed mean over the step's M microbatches, as under DDP
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

The boundary (docs/design.md, "the library boundary"): the library owns the plan, the snapshot, the
fault-tolerant reduce, the vote and the redo loop (`recover.runtime.step_machine`); the script owns one
microbatch's forward and backward, the optimizer, clipping and schedule. A joiner receives the
committed model, optimizer and extra state (torch.distributed.checkpoint's state_dict helpers, so
FSDP2/DTensor state is sent as this rank's shards) before it computes anything.

Contract the script keeps: the tokens (and any randomness) of microbatch `(step, j)` are a pure
function of `(step, j)`; `recover.TokenWindows` gives that over a token file. `check_data=` makes
the replicas compare a hash of a replayed microbatch every `check_every` steps.

Misuse fails with `UsageError` naming what to change: gradients left in `.grad` when a step
begins, an optimizer step inside `microbatches()`, a microbatch without `backward()`, a step left
before it committed, calls out of order.

Replicas of several ranks (`recover run --ranks-per-replica N`): `Replica(shard=S, tp=T)` builds
the replica's own group and a device mesh (`replica.mesh`, dims "shard" and "tp"); the script
applies FSDP2 (`fully_shard(..., mesh=replica.mesh["shard"])`) and/or tensor parallelism over it.
The ids of the replica are dealt over the shard dimension (a rank with one fewer runs a padding
pass whose gradient `backward()` scales by 0); the ranks along tp compute the same ids.

Size: the public API (`Replica`) and its checks of misuse, each with the message a user needs; the
machinery is in the step machine.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from recover import exits
from recover.addresses import AddressError, export_for_torch, resolve_peer_address
from recover.checks import is_int
from recover.coordinator.client import QuorumLost as _QuorumLost
from recover.logs import process_prefix, replica_name, setup_logging
from recover.policy import deal_round_robin
from recover.runtime.env import ReplicaEnv
from recover.runtime.faults import FaultInjector, check_faults_fit
from recover.runtime.grads import set_aside
from recover.runtime.layout import ReplicaLayout
from recover.runtime.pipeline import PipelinePart, StageFollower
from recover.runtime.script_record import StepRecords, dashboards_for
from recover.runtime.script_update import Compute, ScriptUpdate, Update
from recover.runtime.script_work import (
    ScriptWork,
    explain_divergence,
    save_safetensors,
    sum_inside_fsdp,
    whole_state,
)
from recover.runtime.session import (
    STOPS,
    ReplicaSession,
    end_quietly_on,
    stop_of,
    stop_on_lost_mate,
)
from recover.runtime.stall import StallGuard
from recover.runtime.step_machine import (
    StepHooks,
    StepMachine,
    StepOptions,
)
from recover.runtime.update_guard import UpdateGuard
from recover.runtime.usage import UsageError

if TYPE_CHECKING:
    from recover.dashboards import RecordMirror

log = logging.getLogger(__name__)


class NonFinite(RuntimeError):
    """Too many consecutive steps were not finite; the model holds the last finite state."""


class CoordinatorLost(RuntimeError):
    """No coordinator answered for the grace (--coordinator-grace; nothing committed meanwhile):
    the model holds the last committed state. Catch it to save on `is_writer` (the first rank
    of the lowest replica of the last view); uncaught, the process ends with its one line and
    exits.COORDINATOR_LOST, no traceback."""


class QuorumLost(_QuorumLost):
    """Too few replicas survive; the model holds the last committed state (save it, resume).
    (The coordinator client's QuorumLost, with what a script does about it in its message.)"""


class Replica:
    """This process's part of a replica of a ReCoVer job (see the module docstring).

    Arguments:
    - microbatches: M, the microbatches every step sums (the same on every replica);
    - shard, tp, pp: the replica's layout when it is several ranks (their product = ranks per
      replica): FSDP2 shards, tensor-parallel ranks, pipeline stages (with pp > 1 a step's
      share is handed to a schedule by `pipeline()`);
    - config: settings that must be the same on every replica (lr, schedule, clip, seed...): a
      replica whose config differs is refused when it joins, with the field named;
    - check_every: compare parameter hashes across replicas every N steps (0: never);
    - check_data: optional `(step, j) -> tensors`; with it the check also compares a replayed
      microbatch, which catches data that is not a pure function of (step, j);
    - max_nonfinite: a step whose summed gradient or loss is not finite is never applied (every
      .grad is None, `skipped` is True); a step whose optimizer update made a parameter or
      optimizer state value non-finite is undone when the loop comes back for the next step
      (`skipped` is True then); after this many in a row `NonFinite` is raised (0: never);
    - save_final: at the end of a finished job the writer saves the model's whole state as
      RUN/final/model.safetensors next to the run's metrics.jsonl (what `recover compare` and
      `recover export` read; a sharded replica gathers it, a collective inside the replica);
    - env: the launcher's variables (default: this process's environment; see recover.runtime.env).
    """

    def __init__(
        self,
        *,
        microbatches: int,
        shard: int = 1,
        tp: int = 1,
        pp: int = 1,
        config: Mapping[str, Any] | None = None,
        check_every: int = 50,
        check_data: Callable[[int, int], Any] | None = None,
        max_nonfinite: int = 3,
        save_final: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not is_int(microbatches) or microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
        if (
            isinstance(max_nonfinite, bool)
            or not isinstance(max_nonfinite, int)
            or max_nonfinite < 0
        ):
            raise ValueError(f"max_nonfinite must be an int >= 0, got {max_nonfinite!r}")
        self.env = ReplicaEnv.from_environ(os.environ if env is None else env)
        if env is None:  # this process's own environment: it is the script's entry point
            from recover.runtime.env import die_with_launcher

            die_with_launcher()  # started by the local launcher: die with it, never orphaned
            end_quietly_on(CoordinatorLost, exits.COORDINATOR_LOST)
            end_quietly_on(AddressError, exits.ADDRESS)
            # torch's own gloo groups (the replica's own, a Checkpointer's) take only its variable
            export_for_torch(self.env.interfaces, os.environ)
            ranks = self.env.ranks
            name = replica_name(
                self.env.replica_id, *((ranks.rank, ranks.world_size) if ranks else ())
            )
            setup_logging(self.env.spec.log_level, prefix=process_prefix(name, os.environ))
        self._own_signals = env is None  # SIGTERM/SIGINT become stop requests once it trains
        self.microbatches_per_step = microbatches
        self.layout = ReplicaLayout(pp=pp, shard=shard, tp=tp)
        if self.env.spec.deterministic and self.layout.ranks > 1:
            raise ValueError(
                f"--deterministic supports replicas of one rank; not yet {self.layout.describe()}"
            )
        # Before the run forms: the address every group of this process advertises (one choice,
        # from RECOVER_IFNAME/GLOO_SOCKET_IFNAME and the coordinator's address), refused with
        # AddressError when the peers could not dial it (recover.addresses).
        self.peer = resolve_peer_address(self.env.coordinator, self.env.interfaces)
        self.config = dict(config or {})
        self.check_every, self.check_data = check_every, check_data
        self.replica_id = self.env.replica_id
        self._writer = None
        if self.env.events is not None:
            from recover.record import MetricsWriter

            self._writer = MetricsWriter(self.env.events)
        self.intra = None
        if self.layout.ranks > 1:
            from recover.runtime.links import IntraReplica

            self.intra = IntraReplica(
                replica_id=self.replica_id,
                layout=self.layout,
                ranks=self.env.ranks,
                timeout_s=StepOptions.outcome_timeout_s + self.env.spec.register_timeout_s,
                watchdog_s=self.env.spec.watchdog_s,
                emit=self.event,
            )
            # A mate's death surfaces as an error of a collective inside the replica, often in the
            # script's own code (an FSDP2 all-gather in its forward): end with the watchdog's
            # status and one line, not a traceback, wherever it is raised.
            stop_on_lost_mate(self.intra)
        self.rank = self.intra.rank if self.intra is not None else 0
        self.mesh = self.intra.mesh if self.intra is not None else None
        self.step: int | None = None  # the step in progress (or the last one handed out)
        self.loss: float | None = None  # the committed mean loss of the last committed step
        self.save_final = save_final
        # The dashboards' mirrors of the record (--tensorboard, --wandb).
        self._mirrors: list[RecordMirror] = []
        if self._writer is not None and self.rank == 0:
            self._mirrors = dashboards_for(
                self.env.spec, self._writer.path, self.replica_id, config
            )
        self._records = StepRecords(
            self._writer, replica=self.replica_id, leads=self.rank == 0,
            on_written=self._follow_mirrors,
        )  # fmt: skip
        # Set when the coordinator is lost: whether this rank saves (CoordinatorLost's message).
        self._writer_when_lost: bool | None = None
        self.committed_microbatches = 0  # microbatches summed in the last committed step (M)
        # The last step was not applied: its sum was not finite (.grad is None), or the update
        # the optimizer made of it was not (undone at the next step's start).
        self.skipped = False
        self.stopped = False  # steps() ended early: a stop was asked for (SIGTERM, SIGINT)
        self.max_nonfinite = max_nonfinite
        self._skips = 0
        self._machine: StepMachine | None = None
        self._work: ScriptWork | None = None
        self._committed = -1
        # (step, j, index, weight) awaiting backward()
        self._pending: tuple[int, int, int | None, float] | None = None
        self._follower = StageFollower()  # the pipeline stages' chunks, for pipeline()
        self._in_step = False
        self._update: ScriptUpdate | None = None  # attach(update=...)
        self._ahead: Compute | None = None  # attach(ahead=...)
        self._total_steps = 0  # steps(N)'s N
        self._first_index = 0  # the index of the first id microbatches() hands out in a step
        self._closed = False

    @property
    def is_writer(self) -> bool:
        """This rank writes the records of the last committed step: the coordinator named its
        replica with the commit, it is the replica's first rank, and it is not fenced (an evicted
        incarnation is never the writer). After `CoordinatorLost`: whether this rank saves."""
        if self._writer_when_lost is not None:
            return self._writer_when_lost
        return self._records.writes()

    @property
    def _attached(self) -> ScriptWork:
        """The model and optimizer of `attach()` (a step runs only after it)."""
        if self._work is None:
            raise UsageError("call replica.attach(model, optimizer) first")
        return self._work

    # ---- set-up --------------------------------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        """Record a library event in RECOVER_EVENTS (when the launcher named a file)."""
        if self._writer is not None:
            with self._stops():
                self._writer.event(name, **fields)

    def attach(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        extra_state: Mapping[str, Any] | None = None,
        update: Update | None = None,
        ahead: Compute | None = None,
    ) -> None:
        """The model (wrapped as the script likes) and optimizer whose gradients and state the
        library manages; `extra_state` objects (LR schedulers...) with state_dict() and
        load_state_dict() travel to joiners too.

        `update`, optional: the script's update as a callable of no arguments (its clipping,
        `optimizer.step()`, `scheduler.step()`, `optimizer.zero_grad()`), returning None or a
        dict of scalars for the step's record. The library runs it once per committed step, on
        the mean gradient, before the loop body goes on after `microbatches()`; the body then
        steps no optimizer. In a replica of one rank it runs while the step's vote completes
        (the coordinator's round trip off the critical path); a redo undoes it (parameters,
        optimizer state and hyper-parameters, `extra_state`), so it must change nothing else.

        `ahead`, optional, with `update`: the script's microbatch as a callable `ahead(step, j)`
        that computes microbatch `(step, j)` (its forward pass and `replica.backward(loss)`,
        as the loop body does). In a replica of one rank the library then computes the next
        step's first microbatch with it once the update has run during the vote, while the
        vote completes; `microbatches()` of that step does not hand that id out again. A redo
        drops that work (docs/api.md, "The next step's first microbatch during the vote")."""
        if self._work is not None:
            raise UsageError("attach() was called already: one model and optimizer per Replica")
        if ahead is not None and update is None:
            raise UsageError(
                "attach(ahead=...) needs update=... too: the next step's microbatch is computed "
                "during the vote on the parameters the update made, which the library makes "
                "then only when it runs the update"
            )
        self._ahead = ahead
        extra = dict(extra_state or {})
        for name, obj in extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UsageError(f"extra_state[{name!r}] has no state_dict()/load_state_dict()")
        sum_inside_fsdp(model)
        self._work = ScriptWork(
            model, optimizer, extra, self.check_data, self, one_rank=self.intra is None
        )
        self._faults = FaultInjector(
            [f for f in self.env.faults if f.replica == self.replica_id and f.rank == self.rank],
            emit=self.event,
            fired=self.env.fired,
        )
        self._guard = StallGuard(
            self.env.spec.stall_s, replica=self.replica_id, rank=self.rank, emit=self.event
        )
        self._update_guard = UpdateGuard(optimizer)
        if update is not None:
            self._update = ScriptUpdate(
                update, grads=self._work.grads, guard=self._update_guard, stall=self._guard,
                extra=extra,
            )  # fmt: skip
        optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        step = self._committed
        if self._update is not None:
            if not self._update.running:
                raise UsageError(
                    "optimizer.step() was called outside the update given to replica.attach("
                    "update=...): the library runs that update after each step commits"
                )
            step = self.step if self.step is not None else -1  # (maybe during its vote)
        elif self._in_step:
            raise UsageError(
                "optimizer.step() was called inside replica.microbatches(): step the optimizer "
                "after the loop over microbatches has ended (the step has committed then)"
            )
        if step >= 0:
            self._guard.tick()
            self._faults("optimizer", step, None)

    def _fingerprint(self, total_steps: int) -> dict[str, Any]:
        model = self._attached.model
        shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
        return {
            "microbatches": self.microbatches_per_step,
            "steps": total_steps,
            "model": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "optimizer": type(self._attached.optimizer).__name__,
            "layout": self.layout.describe(),
            "cross_reduce": self.env.spec.cross_reduce,  # one backend in every epoch's group
            "reduce_bucket": self.env.spec.reduce_bucket_bytes,  # one order of ops in a reduce
            **({"deterministic": True} if self.env.spec.deterministic else {}),
            **{f"config.{k}": v for k, v in sorted(self.config.items())},
        }

    def _join(self, total_steps: int, start_step: int) -> int:
        cross_device = self._cross_device()  # (a refusal comes before joining)
        # The client (fencing the record: nothing from an evicted incarnation) and the link.
        self._session = session = ReplicaSession(self.env, intra=self.intra, writer=self._writer)
        self._link = session.link
        view = session.join(self._fingerprint(total_steps), next_step=start_step)
        joining = self.replica_id in view.joined
        if joining:
            self.event("replica_joining", replica=self.replica_id, step=view.step, epoch=view.epoch)
        elif view.step != start_step:
            raise UsageError(
                f"this replica starts at step {start_step}, the job is at step {view.step}: "
                "give every replica the same start_step (the step its checkpoint holds)"
            )
        # An update given to attach() runs during the vote in a replica of one rank, and the
        # next step's first microbatch after it (attach(ahead=...)).
        update = self._update
        early = update.early if update is not None and self.intra is None else None
        ahead = self._compute_ahead if self._why_not_ahead() is None else None
        self._machine = session.start(
            self._work,
            peer=self.peer,
            cross_device=cross_device,
            options=StepOptions(
                replica_id=self.replica_id,
                check_every=self.check_every,
                deterministic=self.env.spec.deterministic,
            ),
            hooks=StepHooks(
                phase=self._faults,
                event=self.event,
                guard=self._guard,
                apply_early=early,
                ahead=ahead,
            ),  # fmt: skip
            has_state=not joining,
        )
        # (an update run during the vote starts as the done report is sent: a fault declared in
        # it, or in the work ahead, acts once the report is on record, the point it names)
        self._faults.on_record = self._machine.wait_on_record
        self._groups = session.groups
        # The process must not end while an abandoned group is being torn down (GroupCache.
        # wait_closed says why); the script's own end is the interpreter's, so it waits there.
        atexit.register(self._groups_closed)
        if self._own_signals:  # leave at the next step boundary (before now: nothing to save)
            session.stop_on_signals()
        return view.step

    # ---- the loop ------------------------------------------------------------------------------
    def steps(self, total_steps: int, *, start_step: int = 0) -> Iterator[int]:
        """The steps this replica takes part in, from the job's current step (`start_step` on a
        fresh or resumed job: the step your checkpoint holds; a joiner starts where the job is)
        to `total_steps - 1`. Leaves the job cleanly at the end."""
        if self._work is None:
            raise UsageError("call replica.attach(model, optimizer) before replica.steps()")
        if self._machine is not None:
            raise UsageError("steps() can be iterated once per Replica")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step must be in 0..{total_steps}, got {start_step}")
        # A fault the launcher passed that could never fire (its step or microbatch beyond this
        # run) is refused now, naming the field (the launcher does not know M or the steps).
        self._total_steps = total_steps
        check_faults_fit(
            self.env.faults, steps=total_steps, microbatches=self.microbatches_per_step,
            ahead=self._why_not_ahead(),
        )  # fmt: skip
        try:
            with self._stops():
                step = self._join(total_steps, start_step)
            while step < total_steps:
                # A process woken after a freeze acts on no stale view (nor lets its script write
                # a log of its own) before the coordinator confirmed it is still a member; the
                # replica's first rank holds the membership.
                with self._stops():
                    self._session.confirm_member()
                self.step = step
                yield step
                if self._committed != step:
                    raise UsageError(
                        f"step {step} ended before it committed: iterate replica.microbatches() "
                        "to its end in every step"
                    )
                self._check_update(step)
                # The step's record (and a lost writer's), before the next step is reported.
                with self._stops():
                    self._records.write_due(self.event)
                step += 1
                # A stop request (SIGTERM/SIGINT to any rank of the replica) is served at a step
                # boundary: the next step's done report asks to leave, and the coordinator plans
                # the step after without this replica; then the loop ends early with `stopped`
                # set (save after it). When the coordinator keeps it (the last replicas, or
                # min_replicas), it leaves all the same.
                if step < total_steps and self._session.boundary():
                    self.stopped = True
                    self.event(
                        "replica_stopped", replica=self.replica_id, rank=self.rank, step=step
                    )
                    self._say(f"stopped as asked at the boundary of step {step}", 0)
                    break
            if step == total_steps:
                with self._stops():
                    self._finish(total_steps, start_step)
            with self._stops():
                self._session.leave(step=step)
        finally:
            self.close()

    def log(self, **scalars: float | None) -> None:
        """Add scalars (numbers: an lr, a gradient norm, an accuracy) to the record of the step
        that just committed, which the library writes to the run's metrics.jsonl (with its loss
        and M) when the loop body of the step returns. Call it on every replica, after
        `replica.microbatches()`: the replica that writes a lost writer's records writes them
        from what it kept."""
        if self.step is None or self._committed != self.step:
            raise UsageError(
                "replica.log(...) belongs in a step's body after replica.microbatches() has "
                "ended (the step has committed then)"
            )
        try:
            self._records.log(self.step, scalars)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def committed_steps(self) -> list[dict[str, Any]]:
        """For a script that keeps a log of its own: the records this rank must write in it now
        ([] unless it is the writer): a lost writer's steps first (committed, not in the run's
        record), then the step that just committed, each a dict of `step`, `loss`,
        `microbatches` and the scalars given to `log()` so far. Call it after `log()`, in the
        step's body; the library writes the same records to metrics.jsonl when the body returns."""
        if self.step is None or self._committed != self.step:
            raise UsageError(
                "replica.committed_steps() belongs in a step's body after replica.microbatches() "
                "has ended"
            )
        return self._records.due()

    def _finish(self, total_steps: int, start_step: int) -> None:
        """The end of a finished job, on the replica that wrote the last step's records: the
        final model (when `save_final`) and the summary record."""
        records = self._records
        if not records.named or self._writer is None:
            return
        state = whole_state(self._attached.model, self.intra) if self.save_final else None
        if not records.writes():  # the replica's other ranks took part in gathering it
            return
        out = self._writer.path.parent
        if state is not None:
            final = out / "final" / "model.safetensors"
            if not save_safetensors(state, final):
                self._say(
                    f"the final model holds a value that is not finite: {final} not written", 0
                )
        summary = {
            "steps": total_steps,
            "steps_this_run": total_steps - start_step,
            "wall_s": round(records.wall_s(), 3),  # (of this process)
            "out": str(out.resolve()),
        }
        self._writer.write("summary", **summary)
        for mirror in self._mirrors:
            mirror.follow(final=True)

    def _follow_mirrors(self) -> None:
        for mirror in self._mirrors:
            mirror.follow()

    def microbatches(self) -> Iterator[int]:
        """The microbatch ids of the current step this rank computes: its share of the plan,
        then (after a failure) the ids of dead replicas reassigned to it. Call `backward(loss)`
        once per id. When the loop ends the step has committed and every `p.grad` holds the
        mean gradient over the step's M microbatches (with `attach(update=...)`: the update has
        run on it, and `.grad` is what the update and any work ahead left); `replica.loss` its
        mean loss."""
        index = None
        for step, plan in self._attempts("microbatches"):
            if index is None:  # (after the ids computed during the last vote, if any)
                index = self._first_index
            for j, real in plan:
                if real:
                    self._faults("forward", step, index)
                self._pending = (step, j, index if real else None, 1.0 if real else 0.0)
                yield j
                if self._pending is not None:
                    raise UsageError(
                        f"microbatch ({step}, {j}) had no replica.backward(loss): call it "
                        "once per microbatch instead of loss.backward()"
                    )
                index += real

    def pipeline(self) -> Iterator[PipelinePart]:
        """The current step's share of this rank's pipeline, one `PipelinePart` per attempt
        (its share of the plan, then ids reassigned after a failure), for a replica cut into
        pipeline stages (`Replica(pp=P)`). Run each part through a `torch.distributed.pipelining`
        schedule built by `part.schedule(ScheduleGPipe, stage, loss_fn=...)` (or with
        `part.loss(fn)` as its loss_fn, `n_microbatches=len(part)` and `scale_grads=False`),
        feeding it `part.batch(...)`. When the loop ends the step has committed, as after
        `microbatches()`."""
        if self.layout.pp == 1:
            raise UsageError(
                "replica.pipeline() is for a replica cut into pipeline stages (Replica(pp=P), "
                "P > 1); iterate replica.microbatches() otherwise"
            )
        work = self._attached
        params = work.grads.params
        index = 0
        for step, plan in self._attempts("pipeline"):
            part = PipelinePart(
                step, plan, first_index=index, add_loss=work.grads.add_loss,
                phase=self._faults, follower=self._follower,
            )  # fmt: skip
            with set_aside(params):  # the step's earlier parts, kept from the new schedule
                self._follower.part = part
                try:
                    yield part
                finally:
                    self._follower.part = None
                part.check()
            self._guard.tick()
            index = part.next_index

    @property
    def microbatch_id(self) -> int | None:
        """The id this rank computes now: in `microbatches()`, the id just handed out; in
        `pipeline()`, the id whose stage forward runs (a stage seeds its randomness by
        `(step, microbatch_id)`); None elsewhere."""
        if self._pending is not None:
            return self._pending[1]
        part = self._follower.part
        return part.current if part is not None else None

    def _attempts(self, loop: str) -> Iterator[tuple[int, list[tuple[int, bool]]]]:
        """The step's attempts as (step, this rank's plan [(id, real)]): the replica's ids dealt
        over the shard dimension, padded; then the commit applied to the model."""
        step = self.step
        if self._machine is None or step is None:
            raise UsageError(f"call replica.{loop}() inside `for step in replica.steps(N)`")
        if self._committed == step:
            raise UsageError(f"step {step} has committed already: go on to the next step")
        if self._in_step:
            raise UsageError(f"replica.{loop}() is already being iterated")
        work = self._attached
        # The step's first microbatch, computed during the last vote, is in the sum already.
        ahead = self._machine.holds_ahead(step)
        leftover = [] if ahead else work.grads.leftover()
        if leftover:
            names = [n for n, p in work.model.named_parameters() if p.requires_grad]
            raise UsageError(
                f"step {step} begins with gradients in .grad (e.g. {names[leftover[0]]}): call "
                f"optimizer.zero_grad() after optimizer.step(), and compute nothing outside "
                f"replica.{loop}(); the step would add them to its sum"
            )
        if not ahead:
            work.grads.clear()
        ways = self.layout.shard  # the ranks along tp (and pp) compute the same ids
        mine = self.intra.coordinate("shard") if self.intra is not None else 0
        self._in_step = True
        attempts = self._machine.run_step(step)
        try:
            with self._stops():
                todo = next(attempts)
            self._first_index = todo.first_index
            while True:
                plan = deal_round_robin(todo.ids, ways, mine)
                if plan:
                    yield step, plan
                try:
                    with self._stops():
                        todo = attempts.send(None)
                except StopIteration as done:
                    commit = done.value
                    break
        finally:
            attempts.close()  # left mid-attempt: the step machine drops what it started
            self._in_step = False
            self._pending = None
        self._apply_commit(step, commit)

    def _apply_commit(self, step: int, commit: Any) -> None:
        """The committed step as the script sees it: its loss and M, the mean gradient in .grad
        (or none, skipped), its record."""
        work = self._attached
        self.loss = self._replica_loss(commit.reduced) / commit.count
        self.skipped = not commit.finite
        self.committed_microbatches = commit.count
        self._committed = step
        self._records.committed(
            step, loss=self.loss, microbatches=commit.count, replicas=len(commit.shares),
            attempts=commit.attempts, epoch=commit.epoch, writer=commit.writer,
            records_from=commit.records_from, overlapped=commit.overlapped, parts=commit.parts,
            ahead=commit.ahead,
        )  # fmt: skip
        if self.skipped:
            # Never applied: every .grad is None, so the optimizer step changes no parameter
            # (torch's optimizers pass over parameters without a gradient).
            if commit.applied and self._update is not None:
                self._update.take(step)  # (nothing was applied: the sum was not finite)
            work.grads.clear()
            self._skip(step, "non-finite")
        elif self._update is not None:
            self._run_update(step, commit)
        else:
            work.grads.load(commit.reduced, divide_by=commit.count)
            # The script's optimizer step comes next: what it produces is checked after it
            # (`_check_update`), and undone from this copy if it is not finite.
            self._update_guard.save()
        if commit.recovered_s is not None:
            self.event(
                "recovered", replica=self.replica_id, step=step,
                seconds=round(commit.recovered_s, 4), attempts=commit.attempts,
            )  # fmt: skip
            if self.is_writer:
                log.info(
                    f"[recover] step {step} committed with all {commit.count} microbatches, "
                    f"{commit.recovered_s:.3f} s after this replica saw the failure"
                )

    def _run_update(self, step: int, commit: Any) -> None:
        """The update given to attach() of a committed step: taken from its vote, where it ran
        meanwhile (a replica of one rank), or run now; then checked on every rank of the
        replica, undone where it made a value that is not finite, its scalars logged where not."""
        update = self._update
        assert update is not None
        done = update.take(step) if commit.applied else None
        if done is None:  # (not run during the vote)
            self._attached.grads.load(commit.reduced, divide_by=commit.count)
            done = update.apply()
        self._records.update_ran(step, done.seconds, during_vote=done.during_vote)
        if not self._keep_update(step, done.finite):
            return
        try:
            self._records.log(step, done.scalars)
        except ValueError as e:
            raise UsageError(f"the update given to attach() returned {e}") from None

    def _why_not_ahead(self) -> str | None:
        """Why this replica computes no microbatch of the next step during a vote, or None."""
        if self._ahead is None:
            return "the script gave replica.attach() no ahead=... (with update=...)"
        if self.intra is not None:
            return (
                f"replicas of {self.layout.describe()} compute no microbatch ahead (replicas of "
                "one rank do)"
            )
        return self.env.spec.why_not_ahead()

    def _compute_ahead(self, step: int, ids: tuple[int, ...]) -> bool:
        """StepHooks.ahead: microbatches `ids` of the next step `step`, computed by the
        script's `ahead(step, j)` during the vote of step `step - 1` (its update has run), into
        the local sum the step machine emptied; numbered first in that step. False past the
        last step."""
        fn = self._ahead
        assert fn is not None
        if step >= self._total_steps:
            return False
        self._faults("ahead", step - 1, None)
        for index, j in enumerate(ids):
            self._faults("forward", step, index)
            self._pending = (step, j, index, 1.0)
            fn(step, j)
            if self._pending is not None:
                self._pending = None
                raise UsageError(
                    f"the ahead function given to attach() computed microbatch ({step}, {j}) "
                    "without replica.backward(loss): call it once, as in the loop body"
                )
        return True

    def _skip(self, step: int, reason: str) -> None:
        """Count step `step` as skipped (its update never applied, or undone); `NonFinite`
        after `max_nonfinite` in a row."""
        self._skips += 1
        self._records.skipped(step, reason)
        self.event("step_skipped", replica=self.replica_id, step=step, reason=reason)
        if self.max_nonfinite and self._skips >= self.max_nonfinite:
            self._records.write_due(self.event)  # the run ends here: its last step is recorded
            raise NonFinite(
                f"{self._skips} consecutive steps had a non-finite gradient, loss or update "
                f"(skipped, never applied): the model holds the state after step {step} of the "
                "last finite one; lower the learning rate or check the data, then resume"
            )

    def _check_update(self, step: int) -> None:
        """After the script's optimizer step of a committed step: where it made any parameter
        or optimizer state non-finite on any rank of the replica, every rank puts the state
        saved before it back, and the step counts as skipped (`replica.skipped`)."""
        if self.skipped or self._update is not None:
            return  # nothing was applied, or the update given to attach() was checked already
        self._keep_update(step, self._update_guard.finite())

    def _keep_update(self, step: int, finite: bool) -> bool:
        """Whether step `step`'s update stands: `finite` (this rank's parameters and optimizer
        state) on every rank of the replica; where not, every rank puts the state saved before
        it back and the step counts as skipped."""
        if self._link.agree(finite):
            self._skips = 0
            return True
        self._update_guard.restore()
        self.skipped = True
        self._say(f"step {step}'s update made a value that is not finite: undone", 0)
        self._skip(step, "non-finite update")
        return False

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` for the microbatch just handed out, counted in the step's loss (a
        padding pass of a sharded replica is scaled by 0 here and not counted)."""
        if self._pending is None:
            raise UsageError("replica.backward(loss) belongs inside replica.microbatches()")
        step, j, index, weight = self._pending
        if index is not None:
            self._faults("backward", step, index)
        # (torch's Tensor.backward has no annotations: an untyped call to mypy --strict only)
        (loss * weight if weight != 1.0 else loss).backward()  # type: ignore[no-untyped-call, unused-ignore]
        if weight:
            self._attached.grads.add_loss(j, float(loss.detach()))
            self._faults("done", step, index)
        self._guard.tick()
        self._pending = None

    def _replica_loss(self, reduced: torch.Tensor) -> float:
        if self.intra is None:
            return float(reduced[-1])
        import torch.distributed as dist

        # The ranks along shard hold different ids' losses; those along tp the same ones.
        mine = reduced[-1:].to(torch.float64, copy=True)
        if self.intra.coordinate("tp") != 0:
            mine.zero_()
        dist.all_reduce(mine, group=self.intra.group)
        return float(mine)

    # ---- the end -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _stops(self) -> Iterator[None]:
        """The ways a job stops this replica, as the script sees them: QuorumLost (the model holds
        the last committed state: save it, then resume), or a one-line message and the exit
        status the launcher understands (evicted 4, diverged 5, refused 6)."""
        try:
            yield
        except STOPS as e:
            session = getattr(self, "_session", None)
            stop = session.stop_of(e) if session is not None else stop_of(e)
            if stop.kind == "storage":
                # A full disk or a read-only run folder: the run cannot keep its record, so it
                # stops (the others stop as they hit it, or as for a lost coordinator).
                line = (
                    f"{stop.line}: the run stops; the model holds the state after step "
                    f"{self._committed}, the last committed (save it elsewhere to keep it)"
                )
            elif stop.kind == "diverged":
                line = explain_divergence(stop.line)
            elif stop.kind == "coordinator_lost":
                self._writer_when_lost = (
                    session is not None and session.has_state and self.rank == 0
                    and session.lowest_live()
                )  # fmt: skip
                # No step can run any more: stop the heartbeats and the replica's watchdog now,
                # so that the ranks of a replica that end on it are not taken for lost mates.
                self.close()
                raise CoordinatorLost(
                    f"replica {self.replica_id}: {stop.line[:240]}; the model holds the state "
                    f"after step {self._committed}, the last committed (is_writer: save it), "
                    f"then resume with start_step={self._committed + 1}"
                ) from None
            elif stop.kind == "quorum_lost":
                if stop.nothing_held:
                    raise QuorumLost(f"replica {self.replica_id}: {stop.line}") from None
                raise QuorumLost(
                    f"replica {self.replica_id}: {stop.line}; the model holds the state after "
                    f"step {self._committed} (save it on the writer, then resume with "
                    f"start_step={self._committed + 1})"
                ) from None
            else:  # evicted, finished, refused
                line = stop.line
            raise SystemExit(self._say(line, stop.status)) from None

    def _groups_closed(self) -> None:
        """At the process's exit: wait for the cross-replica groups torn down in the background
        (at once when their peers are gone; a stopped peer holds one until gloo's timeout)."""
        groups = self._groups
        if groups is None or not groups.wait_closed(0.5):
            return
        bound = groups.config.pg_timeout_s
        log.info(
            f"replica {self.replica_id}: waiting for the cross-replica groups to close before "
            f"exiting (a peer of an abandoned group is silent; at most {bound:g} s)"
        )
        groups.wait_closed()

    def _cross_device(self) -> str:
        """Where the cross-replica reduce sums this process's gradients: a host copy (gloo), or
        the GPU that holds the model (--cross-reduce nccl; refused in one line, status 6, before
        joining, where this process has no GPU or its model is not on one)."""
        if self.env.spec.cross_reduce != "nccl":
            return "cpu"
        devices = sorted({str(p.device) for p in self._attached.model.parameters()})
        why = None
        if not torch.cuda.is_available():
            why = "this process sees no GPU"
        elif len(devices) != 1 or not devices[0].startswith("cuda"):
            why = f"its model is on {', '.join(devices)}, not on one GPU"
        if why is not None:
            line = (
                f"--cross-reduce nccl sums gradients between GPUs, and {why}: use --cross-reduce "
                "gloo (the default), or put the model on this process's GPU"
            )
            raise SystemExit(self._say(line, exits.REFUSED))
        return devices[0]

    def _say(self, line: str, status: int) -> int:
        log.error(f"replica {self.replica_id}: {line}")
        return status

    def close(self) -> None:
        """Stop the heartbeats and watchers (called at the end of steps(); idempotent)."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_session", None) is not None:
            self._session.close()
        elif self.intra is not None:
            self.intra.close()
        if self._work is not None:
            self._guard.close()
        if self._machine is not None:
            self._machine.close()
        for mirror in self._mirrors:
            mirror.close()
        self._mirrors = []
        # The events file stays open to the end of the process: what ends it after this (a lost
        # replica-mate, seen by the watchdog or an error) is still recorded.


__all__ = ["CoordinatorLost", "NonFinite", "QuorumLost", "Replica", "UsageError"]
