"""Fault injection at declared points of a step, in the real code path.

Job: parse `--fault KIND:replica=R,step=T,phase=P[,microbatch=K][,rank=N][,wake_after=S]
[,factor=F]` and, inside replica R (in its rank N, default 0, when a replica has several ranks),
do the fault to the real process when the step reaches that point:

- `kill`: the replica SIGKILLs itself (no cleanup, sockets drop: a crashed GPU host);
- `hang`: the replica SIGSTOPs itself (a hung process that still holds its sockets); the local
  launcher sends SIGCONT after `wake_after` seconds if given, else leaves it stopped;
- `exit`: the replica exits with status 17 without leaving the coordinator cleanly;
- `freeze`: the replica's training thread blocks for good while the process, its heartbeats and
  its sockets stay alive (a deadlock, or a kernel that never returns); phases forward, backward,
  overlap, reduce and optimizer, where the stall guard watches (recover.runtime.stall);
- `slow`: from step T on, every microbatch takes `factor` times as long (a straggler);
- `nan`: at the K-th microbatch's backward, the replica's local gradient sum gets a NaN while
  its losses stay finite: a silent data corruption (a faulty GPU). Phase backward only.

Phases: `forward`, `backward` (at the K-th microbatch the rank computes in the step, default 0;
ids reassigned during recovery come after its own; microbatch 0 may be computed during the
previous step's vote, `--ahead`, and its fault fires there), `overlap` (inside the last backward pass of
the rank's share, once the step's reduce has started its first bucket: only where the reduce
overlaps the backward, recover.runtime.overlap, so never in the first attempt of an epoch),
`reduce` (while the cross-replica all-reduce is in flight), `commit` (after reporting done, before the commit
arrives), `optimizer` (inside the optimizer step; in replicas of one rank that step runs from the
moment the replica's done report is sent, while the vote completes, and this fault fires once the
report is on record (the injector's `on_record` waits for that); elsewhere after the commit), `ahead` (during step T's vote, as the replica starts computing step
T+1's first microbatch ahead: `recover train --ahead`, its default, in replicas of one rank),
`transfer` (during the live
state transfer to a joiner, sender or receiver; it fires at the first transfer at or after step T,
since a joiner cannot know in advance at which step it will be admitted).

Each fault fires at most once per process, and it is written as a `failure_injected` event before
it happens. The parsing is pure; the injector only acts on its own process.

Under a local launcher a fault also fires at most once per run: before it acts, the process
appends its `--fault` text to the launcher's control file (`record_fired`, RUN/faults.fired, named
by RECOVER_FAULTS_FIRED), and the launcher hands a respawn, a promoted standby or a restarted job
only the faults not there (`read_fired`). One `write` with O_APPEND, done before the SIGKILL or
the stop, so a process killed by its own fault has told; the reader ignores a last line without
its newline. The file is control state, not the run's record (metrics.jsonl): it is written
whatever the process's fence says, since the fault acts all the same, and it does not depend on
where, or whether, the process writes its events.

A fault that could never fire, or never end, is refused at start-up with a ValueError naming the
field: `wake_after` and `factor` must be finite and not negative (`factor` > 1 for `slow`,
`wake_after` at most an hour); and,
where the run's M and steps are known (`check_faults_fit`, called by the CLI), `microbatch` must
be < M and `step` < steps.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from recover import exits

if TYPE_CHECKING:
    import torch  # (annotations only: this module stays torch-free at import)

log = logging.getLogger(__name__)

KINDS = ("kill", "hang", "exit", "freeze", "slow", "nan")
MAX_WAKE_AFTER_S = 3600.0  # a hang woken later than this is a hang for good: leave it out
FREEZE_PHASES = ("forward", "backward", "overlap", "reduce", "optimizer", "ahead")
PHASES = ("forward", "backward", "overlap", "reduce", "commit", "optimizer", "ahead", "transfer")
# Phases that run during the vote in replicas of one rank, from the moment the done report is
# sent: their faults act once the report is on record, the point they name (the injector waits
# for it, `FaultInjector.on_record`, before one of them acts: StepMachine.wait_on_record).
ON_RECORD_PHASES = ("optimizer", "ahead")
GRAMMAR = (
    "KIND:replica=R,step=T,phase=P[,microbatch=K][,rank=N][,wake_after=S]  or  "
    "slow:replica=R,step=T,factor=F[,rank=N]   with KIND in {kill, hang, exit, freeze, nan} and "
    "P in {forward, backward, overlap, reduce, commit, optimizer, ahead, transfer}"
)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    kind: str
    replica: int
    step: int
    phase: str | None = None
    microbatch: int = 0
    wake_after: float | None = None
    factor: float = 1.0
    rank: int = 0  # which rank of the replica (replicas of several ranks)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} unknown; allowed: {', '.join(KINDS)}")
        if self.replica < 0 or self.step < 0 or self.microbatch < 0 or self.rank < 0:
            raise ValueError("fault replica, step, microbatch and rank must be >= 0")
        for name in ("wake_after", "factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"fault {name} must be a finite number >= 0, got {value}")
        if self.kind == "slow":
            if not self.factor > 1.0:
                raise ValueError(f"slow fault needs factor > 1, got {self.factor}")
        elif self.phase not in PHASES:
            raise ValueError(f"fault phase {self.phase!r} unknown; allowed: {', '.join(PHASES)}")
        elif self.kind == "nan" and self.phase != "backward":
            raise ValueError(f"nan corrupts a gradient: phase backward only, not {self.phase}")
        elif self.kind == "freeze" and self.phase not in FREEZE_PHASES:
            raise ValueError(
                f"freeze is for the phases the stall guard watches ({', '.join(FREEZE_PHASES)}), "
                f"not {self.phase}"
            )
        if self.wake_after is not None and (self.kind != "hang" or self.wake_after < 0):
            raise ValueError("wake_after is for hang faults only, and must be >= 0")
        if self.wake_after is not None and self.wake_after > MAX_WAKE_AFTER_S:
            raise ValueError(
                f"fault wake_after must be <= {MAX_WAKE_AFTER_S:g} s, got {self.wake_after:g} "
                "(leave wake_after out for a replica that stays stopped)"
            )

    def describe(self) -> str:
        if self.kind == "slow":
            return f"slow x{self.factor:g} on replica {self.replica} from step {self.step}"
        where = f"{self.phase}"
        if self.phase in ("forward", "backward"):
            where += f" of microbatch #{self.microbatch}"
        who = f"replica {self.replica}" + (f" rank {self.rank}" if self.rank else "")
        return f"{self.kind} of {who} at step {self.step}, {where}"


def parse_fault(text: str) -> FaultSpec:
    """Parse one --fault value; ValueError showing the grammar on anything malformed."""
    try:
        kind, _, rest = text.partition(":")
        if not rest:
            raise ValueError("missing ':' and its fields")
        values: dict[str, str] = {}
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not value or key in values:
                raise ValueError(f"bad field {item!r}")
            values[key] = value.strip()
        known = {"replica", "step", "phase", "microbatch", "wake_after", "factor", "rank"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        for required in ("replica", "step"):
            if required not in values:
                raise ValueError(f"missing {required}=")
        return FaultSpec(
            kind=kind.strip(),
            replica=int(values["replica"]),
            step=int(values["step"]),
            phase=values.get("phase"),
            microbatch=int(values.get("microbatch", 0)),
            wake_after=float(values["wake_after"]) if "wake_after" in values else None,
            factor=float(values.get("factor", 1.0)),
            rank=int(values.get("rank", 0)),
        )
    except ValueError as e:
        raise ValueError(f"--fault {text!r}: {e}. Grammar: {GRAMMAR}") from None


def check_faults_fit(
    specs: Iterable[FaultSpec], *, steps: int, microbatches: int, ahead: str | None = None
) -> None:
    """ValueError naming the field when a fault could never fire in a run of `steps` steps of
    `microbatches` (M) microbatches: its step is not below `steps`, or its microbatch index (the
    K-th microbatch a rank computes in the step, at most M of them) is not below M. M = 0 (the
    coordinator learns it from the replicas) skips the microbatch check. `ahead`: why this run
    computes no microbatch ahead (None: it does), for phase `ahead`, which needs a next step."""
    for spec in specs:
        if spec.phase == "ahead" and spec.kind != "slow":
            if ahead is not None:
                raise ValueError(f"--fault {spec.describe()}: never fires, {ahead}")
            if spec.step >= steps - 1:
                raise ValueError(
                    f"--fault {spec.describe()}: step={spec.step} has no next step to compute "
                    f"ahead, the run has --steps {steps} (phase ahead: steps 0..{steps - 2})"
                )
        if spec.step >= steps:
            raise ValueError(
                f"--fault {spec.describe()}: step={spec.step} never comes, the run has "
                f"--steps {steps} (steps 0..{steps - 1})"
            )
        at_microbatch = spec.kind != "slow" and spec.phase in ("forward", "backward")
        if at_microbatch and microbatches > 0 and spec.microbatch >= microbatches:
            raise ValueError(
                f"--fault {spec.describe()}: microbatch={spec.microbatch} never comes, a step "
                f"has --microbatches {microbatches} (indices 0..{microbatches - 1})"
            )


def faults_for(specs: list[FaultSpec], replica: int) -> list[FaultSpec]:
    return [s for s in specs if s.replica == replica]


Emit = Callable[..., None]


class FaultInjector:
    """The phase hook of one replica process: fires its faults at their declared points."""

    def __init__(
        self,
        specs: list[FaultSpec],
        *,
        emit: Emit | None = None,
        corrupt: Callable[[], None] | None = None,
        fired: Path | None = None,
    ) -> None:
        """`corrupt()` does a `nan` fault to the replica's local gradient sum; `fired`: the
        launcher's control file, where each fault is recorded before it acts (None: nowhere)."""
        self.specs = list(specs)
        self.fired = fired
        if corrupt is None and any(s.kind == "nan" for s in self.specs):
            raise ValueError("a nan fault needs the replica's gradients: not supported here")
        self.corrupt = corrupt
        self.emit = emit or (lambda name, **fields: None)
        self._fired: set[int] = set()
        self._slow = [s for s in self.specs if s.kind == "slow"]
        self._t_microbatch: float | None = None
        # Waits until this replica's done report is on record (set once the step machine exists:
        # StepMachine.wait_on_record); a fault of ON_RECORD_PHASES acts only after it.
        self.on_record: Callable[[], None] = lambda: None

    def __call__(self, phase: str, step: int, index: int | None) -> None:
        if phase == "forward":
            self._t_microbatch = time.perf_counter()
        elif phase == "done":
            self._straggle(step)
            return
        for n, spec in enumerate(self.specs):
            if n in self._fired or spec.kind == "slow" or spec.phase != phase:
                continue
            if step != spec.step and not (phase == "transfer" and step > spec.step):
                continue
            if phase in ("forward", "backward") and index != spec.microbatch:
                continue
            if phase in ON_RECORD_PHASES:
                self.on_record()
            self._fired.add(n)
            self._fire(spec)

    def _straggle(self, step: int) -> None:
        factors = [s.factor for s in self._slow if step >= s.step]
        if factors and self._t_microbatch is not None:
            spent = time.perf_counter() - self._t_microbatch
            time.sleep(spent * (max(factors) - 1.0))

    def _fire(self, spec: FaultSpec) -> None:
        if self.fired is not None:
            record_fired(self.fired, spec)
        self.emit(
            "failure_injected",
            fault=spec.kind,
            replica=spec.replica,
            rank=spec.rank,
            step=spec.step,
            phase=spec.phase,
            microbatch=spec.microbatch if spec.phase in ("forward", "backward") else None,
            description=spec.describe(),
        )
        log.warning(f"injecting fault: {spec.describe()}")
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
            # Continued (SIGCONT): the process goes on; the coordinator has fenced it meanwhile.
        elif spec.kind == "exit":
            sys.stdout.flush()
            os._exit(exits.FAULT_EXIT)
        elif spec.kind == "freeze":
            threading.Event().wait()  # never set: this thread is stuck, the others run on
        elif spec.kind == "nan" and self.corrupt is not None:  # (required for nan: __init__)
            self.corrupt()


def record_fired(path: Path, spec: FaultSpec) -> None:
    """Append `spec`'s --fault text to the control file `path` as one line, in one write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (fault_flag(spec) + "\n").encode())
    finally:
        os.close(fd)


def read_fired(path: Path) -> set[str]:
    """The --fault texts (`fault_flag`) of the faults recorded in `path` as fired; a last line
    still without its newline (being written) is not one yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return set()
    return set(text.split("\n")[:-1]) - {""}


def poison_gradient(params: Iterable[torch.Tensor]) -> None:
    """A NaN in the local gradient sum (the `nan` fault): in the first parameter's gradient,
    which the next backward adds to (made if the sum is still empty)."""
    p = next(iter(params))
    if p.grad is None:
        p.grad = p.detach().new_zeros(p.shape)
    p.grad.view(-1)[0] = float("nan")


def fault_flag(spec: FaultSpec) -> str:
    """The `--fault` text of a spec: the inverse of `parse_fault`."""
    parts = [f"replica={spec.replica}", f"step={spec.step}"]
    if spec.rank:
        parts.append(f"rank={spec.rank}")
    if spec.kind == "slow":
        parts.append(f"factor={spec.factor}")
    else:
        parts.append(f"phase={spec.phase}")
        if spec.phase in ("forward", "backward"):
            parts.append(f"microbatch={spec.microbatch}")
        if spec.wake_after is not None:
            parts.append(f"wake_after={spec.wake_after}")
    return f"{spec.kind}:" + ",".join(parts)
