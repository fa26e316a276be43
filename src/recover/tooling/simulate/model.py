"""Pure models of the simulator: job shape, step time, failure costs, failure processes.

Job: hold the numbers that describe a pre-training job (`JobShape`), what its operations cost
(`Costs`) and how it fails (`PoissonFailures`, `StepFailures`), and compute the step time of a
view with `live` replicas. No clock, no randomness, no I/O: the engine (`engine.py`) asks these
functions and advances time.

Step-time model (every rule is stated, with its source, in docs/simulator.md):

- a replica of `gpus_per_replica` GPUs computes its microbatches one after another, each taking
  `microbatch_s`; the step's compute ends when the most loaded replica is done, so a step with
  `live` replicas and constant batch M costs ceil(M / live) microbatch times;
- on an oversubscribed CPU (`cpu_cores` set: replicas are processes sharing cores) each replica
  runs at min(1, cores / live) of a core, so a microbatch takes microbatch_s * max(1, live / cores);
- the cross-replica all-reduce of the gradient shards is a ring: 2 (n-1)/n * shard / bandwidth,
  plus a latency of 2 * alpha * ceil(log2 n) (tree-like latency term), not overlapped with compute;
- fault-tolerant runs (recover) pay `step_overhead_s` per step (snapshot copy, commit round trip).

Limits: one microbatch time for every replica (no stragglers), the all-reduce is not overlapped
with compute (pessimistic for every policy alike), replicas are fungible (which one fails only
matters through how many microbatches it held).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recover.checks import is_int

__all__ = [
    "LLAMA3_GPU_FAILURES_PER_HOUR",
    "Costs",
    "JobShape",
    "PoissonFailures",
    "StepFailures",
    "allreduce_s",
    "microbatch_time_s",
    "recover_step_s",
    "shrink_step_s",
    "young_daly_interval_s",
    "gpu_microbatch_s",
    "state_bytes_per_gpu",
]

# Llama 3 report (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in a 54-day
# snapshot of pre-training on 16,384 H100 GPUs. Taken as a per-GPU Poisson rate.
LLAMA3_GPU_FAILURES_PER_HOUR = 419 / (54 * 24 * 16_384)


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not (isinstance(value, int | float) and math.isfinite(value) and ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """What the job is: R replicas of TP x PP GPUs, M microbatches per step."""

    replicas: int  # R: data-parallel replicas at the start
    gpus_per_replica: int  # TP x PP GPUs in one replica; one GPU failure kills its replica
    microbatches: int  # M: microbatches per step (constant batch for recover)
    tokens_per_microbatch: int  # sequences per microbatch x sequence length
    spares: int = 0  # hot spare replicas (the `spares` policy only)
    min_replicas: int = 1  # below this many live replicas the job stops (quorum lost)

    def __post_init__(self) -> None:
        for name in ("replicas", "gpus_per_replica", "microbatches", "tokens_per_microbatch"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not is_int(self.spares) or self.spares < 0:
            raise ValueError(f"spares must be an int >= 0, got {self.spares!r}")
        if not (1 <= self.min_replicas <= self.replicas):
            raise ValueError(
                f"min_replicas must be in 1..replicas ({self.replicas}), got {self.min_replicas!r}"
            )

    @property
    def gpus(self) -> int:
        """GPUs doing work at full size (spares excluded)."""
        return self.replicas * self.gpus_per_replica

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.tokens_per_microbatch


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds each operation takes. Defaults: see docs/simulator.md, table "defaults"."""

    microbatch_s: float  # forward+backward of one microbatch on one replica (one core on CPU)
    allreduce_shard_bytes: float = 0.0  # gradient bytes each GPU reduces across replicas
    link_bytes_per_s: float = 50e9  # per-GPU cross-replica bandwidth (400 Gb/s NIC)
    allreduce_alpha_s: float = 20e-6  # per-hop latency of the all-reduce
    cpu_cores: int | None = None  # set for CPU runs: replicas share this many cores
    step_overhead_s: float = 0.0  # recover's failure-free per-step cost (snapshot, commit)
    detect_s: float = 0.003  # failure -> coordinator declares the replica dead (session EOF)
    rebuild_s: float = 0.02  # build the survivors' process group
    ckpt_s: float = 30.0  # blocking part of one checkpoint (checkpoint-restart)
    restart_s: float = 300.0  # stop every process, restart, rendezvous, load the checkpoint
    ckpt_interval_s: float | None = None  # None: Young-Daly sqrt(2 * MTBF * ckpt_s)
    state_transfer_s: float = 0.5  # a joining replica gets params + optimizer from a live one
    swap_s: float = 0.5  # a hot spare takes a dead replica's place (state transfer included)
    repair_s: float | None = None  # a dead replica comes back after this long; None: never

    def __post_init__(self) -> None:
        _positive("microbatch_s", self.microbatch_s)
        for name in ("allreduce_shard_bytes", "allreduce_alpha_s", "step_overhead_s", "detect_s",
                     "rebuild_s", "ckpt_s", "restart_s", "state_transfer_s", "swap_s"):  # fmt: skip
            _positive(name, getattr(self, name), allow_zero=True)
        _positive("link_bytes_per_s", self.link_bytes_per_s)
        if self.cpu_cores is not None and (
            isinstance(self.cpu_cores, bool)
            or not isinstance(self.cpu_cores, int)
            or self.cpu_cores < 1
        ):
            raise ValueError(f"cpu_cores must be None or an int >= 1, got {self.cpu_cores!r}")
        if self.ckpt_interval_s is not None:
            _positive("ckpt_interval_s", self.ckpt_interval_s)
        if self.repair_s is not None:
            _positive("repair_s", self.repair_s)


@dataclass(frozen=True, kw_only=True)
class PoissonFailures:
    """Failures as a per-GPU Poisson process over every GPU the job holds (spares included).

    With probability `correlated_fraction` a failure takes its whole node of `node_gpus` GPUs,
    i.e. max(1, node_gpus // gpus_per_replica) replicas at once.
    """

    gpu_rate_per_h: float = LLAMA3_GPU_FAILURES_PER_HOUR
    correlated_fraction: float = 0.0
    node_gpus: int = 8

    def __post_init__(self) -> None:
        _positive("gpu_rate_per_h", self.gpu_rate_per_h, allow_zero=True)
        if not (0.0 <= self.correlated_fraction <= 1.0):
            raise ValueError(
                f"correlated_fraction must be in [0, 1], got {self.correlated_fraction!r}"
            )
        if self.node_gpus < 1:
            raise ValueError(f"node_gpus must be >= 1, got {self.node_gpus!r}")

    def job_mtbf_s(self, gpus: int) -> float:
        rate = self.gpu_rate_per_h * gpus / 3600.0
        return math.inf if rate == 0 else 1.0 / rate


@dataclass(frozen=True, kw_only=True)
class StepFailures:
    """A declared schedule: one replica dies in step `every - 1`, `2 every - 1`, ... (`count` in
    all; or in the steps listed in `at`), at fraction `phase` of that step's failure-free duration; like `--fault`, each fires once,
    the first time the job runs that step (a rolled-back step is not hit again)."""

    every: int
    count: int
    phase: float = 0.5
    first: int | None = None  # step of the first failure; default every - 1
    at: tuple[int, ...] | None = None  # explicit steps instead (every, count, first ignored)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every!r}")
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count!r}")
        if not (0.0 <= self.phase < 1.0):
            raise ValueError(f"phase must be in [0, 1), got {self.phase!r}")
        if self.first is not None and self.first < 0:
            raise ValueError(f"first must be >= 0, got {self.first!r}")
        if self.at is not None and any(s < 0 for s in self.at):
            raise ValueError(f"at must hold steps >= 0, got {self.at!r}")

    def steps(self) -> list[int]:
        if self.at is not None:
            return sorted(self.at)
        start = self.every - 1 if self.first is None else self.first
        return [start + i * self.every for i in range(self.count)]


# ---- step time ------------------------------------------------------------------------------


def microbatch_time_s(costs: Costs, live: int) -> float:
    """One microbatch on one replica when `live` replicas run at once."""
    if costs.cpu_cores is None:
        return costs.microbatch_s
    return costs.microbatch_s * max(1.0, live / costs.cpu_cores)


def allreduce_s(costs: Costs, live: int) -> float:
    """Ring all-reduce of each GPU's gradient shard over `live` replicas (0 for one replica)."""
    if live <= 1:
        return 0.0
    bandwidth = 2.0 * (live - 1) / live * costs.allreduce_shard_bytes / costs.link_bytes_per_s
    latency = 2.0 * costs.allreduce_alpha_s * math.ceil(math.log2(live))
    return bandwidth + latency


def recover_step_s(shape: JobShape, costs: Costs, live: int) -> float:
    """Failure-free step with `live` replicas sharing all M microbatches (constant batch)."""
    per_replica = math.ceil(shape.microbatches / live)
    return (
        per_replica * microbatch_time_s(costs, live)
        + allreduce_s(costs, live)
        + costs.step_overhead_s
    )


def shrink_step_s(shape: JobShape, costs: Costs, live: int) -> float:
    """Step with `live` replicas each keeping its own M / R microbatches (the batch shrinks)."""
    per_replica = math.ceil(shape.microbatches / shape.replicas)
    return per_replica * microbatch_time_s(costs, live) + allreduce_s(costs, live)


def young_daly_interval_s(mtbf_s: float, ckpt_s: float) -> float:
    """Young (1974) / Daly (2006) first-order optimum checkpoint interval."""
    return math.sqrt(2.0 * mtbf_s * ckpt_s)


# ---- scaling rules (GPU figures from FLOPs) -------------------------------------------------


def gpu_microbatch_s(
    *, params: float, tokens_per_microbatch: int, gpus_per_replica: int, peak_flops: float,
    mfu: float,
) -> float:  # fmt: skip
    """6 * params * tokens FLOPs (forward + backward, Kaplan et al. 2020) at `mfu` of peak."""
    if not (0 < mfu <= 1):
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    return 6.0 * params * tokens_per_microbatch / (gpus_per_replica * peak_flops * mfu)


def state_bytes_per_gpu(params: float, gpus_per_replica: int, *, bytes_per_param: float) -> float:
    return params * bytes_per_param / gpus_per_replica
