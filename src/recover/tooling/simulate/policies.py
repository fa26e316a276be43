"""The four fault-tolerance policies, as state machines driven by the engine.

Job: say what a failure, a repair and the end of a timer do to the job's progress under each
policy. Each policy keeps at most one timer (its `token` voids older ones) and advances runs of
failure-free steps analytically (`_begin_run` / `_interrupt_run`).

- `recover` (this project): the survivors keep their work, the dead replica's microbatches of the
  in-flight step are spread over them, the step commits with all M microbatches; cost of a failure:
  max(own compute, failure + detect) + ceil(lost / survivors) microbatches + rebuild + one
  all-reduce. The dead replica is taken to hold the largest share (pessimistic). Nothing rolls
  back. Repaired replicas join at the next step boundary after `state_transfer_s` (the job stalls
  for it: pessimistic).
- `checkpoint-restart`: a fixed-size job (a replacement node comes with each restart); a checkpoint
  every K steps (K from Young-Daly unless `ckpt_interval_s` is set) blocks for `ckpt_s`; any
  failure (also during a checkpoint or a restart) rolls back to the last completed checkpoint and
  costs detect + `restart_s`.
- `shrink` (torchft's semantics): the in-flight step is discarded; after detect + rebuild the
  survivors go on, each with its own M / R microbatches, so a step holds fewer tokens.
- `spares`: `shrink` plus a pool of hot spare replicas (idle, held, exposed to failures); a
  failure is covered by a spare after `swap_s` while one is left. Repaired replicas refill the
  live set first, then the pool.

Limits: replicas are fungible counts, not identities; a failure picks its victim uniformly among
the replica slots the job holds (live, spare, repaired-but-not-yet-joined).

Size: the four policies the simulator compares (recover, checkpoint-restart, shrink, spares), side
by side so that their differences read in one place.
"""

from __future__ import annotations

import math

from recover.tooling.simulate.engine import Engine, SimResult
from recover.tooling.simulate.model import (
    Costs,
    JobShape,
    PoissonFailures,
    StepFailures,
    allreduce_s,
    microbatch_time_s,
    recover_step_s,
    shrink_step_s,
    young_daly_interval_s,
)

__all__ = ["POLICIES", "Recover", "CheckpointRestart", "Shrink", "Spares", "simulate"]


class _Policy:
    name = "?"

    def __init__(self, shape: JobShape, costs: Costs, failures) -> None:
        self.shape, self.costs, self.failures = shape, costs, failures
        self.engine: Engine | None = None
        self.token = 0
        self.state = "idle"
        self.steps = 0  # committed steps
        self.tokens = 0.0  # committed tokens
        self.counters: dict[str, float] = {}
        # the current run of failure-free steps
        self.t0 = self.step_s = self.tokens_per_step = 0.0
        self.run_n = math.inf
        self.timer_steps = 0

    # ---- helpers ----------------------------------------------------------------------------

    def _count(self, name: str, by: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def _timer(self, t: float) -> None:
        self.token += 1
        self.engine.schedule(t, "timer", self.token)

    def _cancel_timer(self) -> None:
        self.token += 1

    def _remaining(self) -> float:
        m = self.engine.max_steps
        return math.inf if m is None else m - self.steps

    def _begin_run(self, t: float, step_s: float, tokens_per_step: float, n: float) -> None:
        self.state = "run"
        self.t0, self.step_s, self.tokens_per_step, self.run_n = t, step_s, tokens_per_step, n
        self.engine.begin_run(t, self.steps, step_s, n)
        self.timer_steps = n
        if math.isfinite(n):
            self._timer(t + n * step_s)
        else:
            self._cancel_timer()

    def _steps_done(self, t: float) -> int:
        return int(min(self.run_n, math.floor((t - self.t0) / self.step_s)))

    def _commit(self, k: float, tokens_per_step: float) -> None:
        self.steps += k
        self.tokens += k * tokens_per_step

    def _interrupt_run(self, t: float) -> float:
        """Commit the run's steps done by t; return the start of the in-flight step."""
        k = self._steps_done(t)
        self._commit(k, self.tokens_per_step)
        self.state = "interrupted"
        self.engine.end_run()
        self._cancel_timer()
        return self.t0 + k * self.step_s

    def _stop(self) -> None:
        self.state = "stopped"
        self._cancel_timer()
        self.engine.end_run()
        self.engine.finish("quorum_lost")

    def _finish_if_done(self) -> bool:
        if self._remaining() <= 0:
            self.engine.finish("max_steps")
            return True
        return False

    # ---- what the engine asks ---------------------------------------------------------------

    def progress_at(self, t: float) -> tuple[float, float]:
        if self.state == "run":
            k = self._steps_done(t)
            return self.steps + k, self.tokens + k * self.tokens_per_step
        return self.steps, self.tokens

    def exposed_gpus(self) -> int:
        return self.held_gpus()


class _Elastic(_Policy):
    """Shared by the policies whose job shrinks and regrows: live, spare and returning slots."""

    def __init__(self, shape: JobShape, costs: Costs, failures) -> None:
        super().__init__(shape, costs, failures)
        self.live = shape.replicas
        self.spares = 0
        self.pending = 0  # repaired, waiting for the next step boundary
        self.joining = 0  # in the state transfer at a step boundary

    def held_gpus(self) -> int:
        return (self.live + self.spares + self.pending + self.joining) * self.shape.gpus_per_replica

    def live_gpus(self) -> int:
        return self.live * self.shape.gpus_per_replica

    def start(self, engine: Engine, t: float) -> None:
        self.engine = engine
        self._next(t)

    def _pick_victims(self, t: float, k: int) -> int:
        """Kill k held replica slots; return how many were live. Others wait for repair."""
        live_hit = 0
        for _ in range(k):
            slots = [self.live - live_hit, self.spares, self.pending, self.joining]
            total = sum(slots)
            if total == 0:
                break
            u = self.engine.rng.randrange(total)
            if u < slots[0]:
                live_hit += 1
            elif u < slots[0] + slots[1]:
                self.spares -= 1
            elif u < slots[0] + slots[1] + slots[2]:
                self.pending -= 1
            else:
                self.joining -= 1
            if self.costs.repair_s is not None:
                self.engine.schedule_repair(t + self.costs.repair_s)
        return live_hit

    def on_repair(self, t: float) -> None:
        self.pending += 1
        if self.state == "run":  # join at the next step boundary
            kb = self._steps_done(t) + 1
            if kb < self.timer_steps:
                self.timer_steps = kb
                self._timer(self.t0 + kb * self.step_s)

    def _next(self, t: float) -> None:
        """At a step boundary: admit returning replicas, else run steps."""
        if self._finish_if_done():
            return
        if self.pending:
            self.state = "join"
            self.joining, self.pending = self.pending, 0
            self._count("joins", self.joining)
            self._timer(t + self.costs.state_transfer_s)
            return
        self._run(t)

    def on_timer(self, t: float) -> None:
        if self.state == "run":
            self._commit(self.timer_steps, self.tokens_per_step)
            self.engine.end_run()
            self.state = "boundary"
        elif self.state == "join":
            self.live += self.joining
            self.joining = 0
        else:
            self._end_stall(t)
            return
        self._next(t)


class Recover(_Elastic):
    name = "recover"

    def __init__(self, shape: JobShape, costs: Costs, failures) -> None:
        super().__init__(shape, costs, failures)
        self.load = 0  # microbatches the most loaded live replica holds in the in-flight step
        self.compute_end = 0.0

    def _run(self, t: float) -> None:
        s = recover_step_s(self.shape, self.costs, self.live)
        self._begin_run(t, s, float(self.shape.tokens_per_step), self._remaining())

    def on_failure(self, t: float, k: int) -> int:
        live_hit = self._pick_victims(t, k)
        if live_hit == 0:
            return k
        if self.state == "run":
            ts = self._interrupt_run(t)
            self.load = math.ceil(self.shape.microbatches / self.live)
            self.compute_end = ts + self.load * microbatch_time_s(self.costs, self.live)
            if t >= self.compute_end + allreduce_s(self.costs, self.live):
                # the reduce is done: the step commits as planned; the next one runs without them
                self.live -= live_hit
                if self.live < self.shape.min_replicas:
                    self._stop()
                    return k
                self.state = "in_step"
                self._timer(ts + self.step_s)
                return k
        if self.state == "join" or self.state == "idle":
            self.live -= live_hit
            if self.live < self.shape.min_replicas:
                self._stop()
            return k
        self._lose_in_step(t, live_hit)
        return k

    def _lose_in_step(self, t: float, dead: int) -> None:
        lost = dead * self.load
        self.live -= dead
        if self.live < self.shape.min_replicas:
            self._stop()
            return
        extra = math.ceil(lost / self.live)
        mb = microbatch_time_s(self.costs, self.live)
        self.compute_end = max(self.compute_end, t + self.costs.detect_s) + extra * mb
        self.load += extra
        end = (
            self.compute_end
            + self.costs.rebuild_s
            + allreduce_s(self.costs, self.live)
            + self.costs.step_overhead_s
        )
        self._count("in_step_recoveries")
        self._count("microbatches_recomputed", lost)
        self.state = "in_step"
        self._timer(end)

    def _end_stall(self, t: float) -> None:  # the in-flight step commits, with all M microbatches
        self._commit(1, float(self.shape.tokens_per_step))
        self._next(t)


class Shrink(_Elastic):
    name = "shrink"

    def __init__(self, shape: JobShape, costs: Costs, failures) -> None:
        super().__init__(shape, costs, failures)
        self.stall_end = 0.0

    def _run(self, t: float) -> None:
        s = shrink_step_s(self.shape, self.costs, self.live)
        tokens = self.shape.tokens_per_step * self.live / self.shape.replicas
        self._begin_run(t, s, tokens, self._remaining())

    def _replace(self, dead: int) -> int:
        return 0  # no spares: the batch shrinks

    def on_failure(self, t: float, k: int) -> int:
        live_hit = self._pick_victims(t, k)
        if live_hit == 0:
            return k
        if self.state == "run":
            self._interrupt_run(t)
            self._count("steps_discarded")
            self.stall_end = t
        elif self.state == "join":
            self.live -= live_hit
            self.live += self._replace(live_hit)
            if self.live < self.shape.min_replicas:
                self._stop()
            return k
        self.live -= live_hit
        used = self._replace(live_hit)
        self.live += used
        if self.live < self.shape.min_replicas:
            self._stop()
            return k
        self.stall_end = max(self.stall_end, t + self.costs.detect_s + self.costs.rebuild_s)
        if used:
            self.stall_end += self.costs.swap_s
        self.state = "stall"
        self._timer(self.stall_end)
        return k

    def _end_stall(self, t: float) -> None:
        self._next(t)


class Spares(Shrink):
    name = "spares"

    def __init__(self, shape: JobShape, costs: Costs, failures) -> None:
        super().__init__(shape, costs, failures)
        self.spares = shape.spares

    def _replace(self, dead: int) -> int:
        used = min(self.spares, dead)
        self.spares -= used
        self._count("spare_swaps", used)
        return used

    def on_repair(self, t: float) -> None:
        if self.live + self.pending + self.joining >= self.shape.replicas:
            self.spares += 1  # back to the pool
        else:
            super().on_repair(t)


class CheckpointRestart(_Policy):
    name = "checkpoint-restart"

    def __init__(self, shape: JobShape, costs: Costs, failures) -> None:
        super().__init__(shape, costs, failures)
        self.plain_step_s = shrink_step_s(shape, costs, shape.replicas)
        self.last_ckpt = 0
        self.every = self._ckpt_every_steps()

    def _ckpt_every_steps(self) -> float:
        c = self.costs
        if c.ckpt_interval_s is not None:
            interval = c.ckpt_interval_s
        else:
            if isinstance(self.failures, PoissonFailures):
                mtbf = self.failures.job_mtbf_s(self.shape.gpus)
            elif isinstance(self.failures, StepFailures) and self.failures.steps():
                at = self.failures.steps()  # mean steps between declared failures
                mtbf = (at[-1] + 1) / len(at) * self.plain_step_s
            else:
                mtbf = math.inf
            interval = young_daly_interval_s(mtbf, c.ckpt_s) if math.isfinite(mtbf) else math.inf
        return max(1, round(interval / self.plain_step_s)) if math.isfinite(interval) else math.inf

    def held_gpus(self) -> int:
        return self.shape.gpus

    def live_gpus(self) -> int:
        return self.shape.gpus

    def start(self, engine: Engine, t: float) -> None:
        self.engine = engine
        self.counters["ckpt_every_steps"] = self.every
        self._run(t)

    def _run(self, t: float) -> None:
        if self._finish_if_done():
            return
        to_ckpt = self.every - (self.steps % self.every) if math.isfinite(self.every) else math.inf
        n = min(to_ckpt, self._remaining())
        self._begin_run(t, self.plain_step_s, float(self.shape.tokens_per_step), n)

    def on_timer(self, t: float) -> None:
        if self.state == "run":
            self._commit(self.timer_steps, self.tokens_per_step)
            self.engine.end_run()
            self.state = "boundary"
            if self._finish_if_done():
                return
            if math.isfinite(self.every) and self.steps % self.every == 0:
                self.state = "ckpt"
                self._timer(t + self.costs.ckpt_s)
            else:
                self._run(t)
        elif self.state == "ckpt":
            self.last_ckpt = self.steps
            self._count("checkpoints")
            self._run(t)
        else:  # restart done: the checkpoint is loaded
            self._count("restarts")
            self._run(t)

    def on_failure(self, t: float, k: int) -> int:
        if self.state == "run":
            self._interrupt_run(t)
        self._count("steps_rolled_back", self.steps - self.last_ckpt)
        self.tokens -= (self.steps - self.last_ckpt) * self.shape.tokens_per_step
        self.steps = self.last_ckpt
        self.state = "restart"
        self._timer(t + self.costs.detect_s + self.costs.restart_s)
        return k

    def on_repair(self, t: float) -> None:  # replacements come with every restart
        pass


POLICIES = {
    "recover": Recover,
    "checkpoint-restart": CheckpointRestart,
    "shrink": Shrink,
    "spares": Spares,
}


def simulate(
    policy: str,
    shape: JobShape,
    costs: Costs,
    failures: PoissonFailures | StepFailures | None,
    *,
    seed: int = 0,
    horizon_s: float | None = None,
    max_steps: int | None = None,
    gpu_hour_budget: float | None = None,
) -> SimResult:
    """Run `policy` (a name in policies.POLICIES) on the job and return what it achieved."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    engine = Engine(
        shape, costs, failures, seed=seed, horizon_s=horizon_s, max_steps=max_steps,
        gpu_hour_budget=gpu_hour_budget,
    )  # fmt: skip
    return engine.run(POLICIES[policy](shape, costs, failures))
