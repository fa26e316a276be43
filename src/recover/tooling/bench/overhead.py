"""`recover bench overhead`: the cost of the fault-tolerance path when nothing fails.

Job: measure, on one machine, the step time of (a) a plain data-parallel loop (torch's
DistributedDataParallel over one static gloo group from init_process_group, the same
ReplicaTrainer; its gradients reduced in buckets during the last microbatch's backward pass,
`no_sync` for the others, as a DDP loop with accumulation runs; no coordinator, no commit)
against (b) `recover train --replicas R` with the same
model, data, M and seed, and state the ratio b/a with a confidence interval. With
--deterministic, (a) is `recover train` in the normal mode and (b) the same with --deterministic.

Method (interleaved blocks): both jobs are started once and run side by side, but never at the
same time: the bench freezes every process of one job (SIGSTOP) while the other runs a block of
`--block-steps` steps' worth of wall time, then swaps (SIGCONT), for `--blocks` pairs of blocks;
which job goes first alternates from pair to pair, so that a load that drifts favours neither.
A block's figure is the median of the steps that lie wholly inside it (the step under way when
a job was frozen or resumed is dropped, and so are the warm-up steps before the first block).
A pair's ratio is b's block median over a's; the overhead is the geometric mean of the pair
ratios, with a 95% percentile-bootstrap interval over the pairs (10,000 resamples, fixed seed).
The same for each block's fastest step (`fastest_ratio`). Adjacent blocks a few seconds apart
see the same machine, which is what makes the figure repeat on a shared, loaded box; the
earlier method (whole runs in alternating pairs, one median each) gave pair ratios 0.74-1.53.

Where the time goes: each job's step records carry their parts (`parts`: compute, snapshot,
reduce, vote, apply, ...; docs/metrics.md); their means over the measured steps are printed side
by side, each with its share of the job's mean step (`step_parts`, `format_parts`).

Invariants: the two jobs never run at once; a block with a failure is not a measurement (a
`coordinator.member_dead` event fails the benchmark). Costs: two start-ups, then about
2 x blocks x block-steps steps. Limits: SIGSTOP lands mid-step, so each block loses one or two
steps; cold caches after a swap are paid by both jobs alike. Every process of both jobs has its
own session (scheduling group under autogroup), else a loaded machine favours one side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from recover.record import committed_steps, read_metrics
from recover.tooling.bench.common import (
    WARMUP_STEPS,
    bench_setup,
    child_env,
    cpu_seconds,
    machine_info,
)

CONFIDENCE = 0.95
MIN_BLOCK_S = 0.5  # a block at least this long, so that a tiny model's block holds whole steps
RESAMPLES = 10_000
# Both jobs run "forever" and are ended by the bench once the blocks are measured.
ENDLESS_STEPS = 100_000
# Failure-path deadlines raised for a job that is frozen for whole blocks: they act only on a
# failure, which this benchmark has none of (and fails on), so the failure-free path is unchanged.
# The lease stays at its default: the coordinator restarts the leases after its own pause
# (connections.py, _notice_pause), and --lease 600 made replicas be evicted at the first resume. One
# resume in about 60 of a whole job did evict them at the default lease (a --deterministic run,
# small preset): the bench then fails, it does not measure a failure.
FROZEN_SAFE_FLAGS = [
    "--coordinator-grace",
    "600",
    "--reduce-deadline",
    "600",
    "--stall-timeout",
    "0",
]

# ---- pure parts: which steps count, and the ratio with its interval -------------------------


def steps_inside(records: list[tuple[float, float]], start: float, end: float) -> list[float]:
    """The step times of the records (t_end wall time, step_s) that began and ended in [start, end]."""
    return [s for t_end, s in records if _inside(t_end, s, start, end)]


def _inside(t_end: float, step_s: float, start: float, end: float) -> bool:
    """A step that began and ended in [start, end] (a step under way at a freeze is not one)."""
    return t_end - step_s >= start and t_end <= end


# Where a step's time goes, in the order shown: the step machine's parts
# (recover.runtime.step_machine.PARTS), the optimizer step ("apply"), and what is left of the step
# ("rest": recording, the step line, scheduling).
PART_ORDER = (
    "transfer",
    "compute",
    "snapshot",
    "reduce",
    "check",
    "vote",
    "apply",
    "ahead",
    "rest",
)


def step_parts(records: list[dict], windows: list[tuple[float, float]]) -> dict[str, float] | None:
    """Mean seconds per part over the step records (with `parts`) that lie wholly inside one of
    the windows, "rest" being step_s less the parts, and "step" the mean step_s; None when no
    such record has parts."""
    inside = [
        r for r in records
        if "parts" in r
        and any(_inside(r["t_wall"], r["step_s"], a, b) for a, b in windows)
    ]  # fmt: skip
    if not inside:
        return None
    mean: dict[str, float] = {}
    for name in PART_ORDER[:-1]:
        values = [r["parts"].get(name, 0.0) for r in inside]
        if any(values):
            mean[name] = statistics.fmean(values)
    mean["step"] = statistics.fmean(r["step_s"] for r in inside)
    mean["rest"] = mean["step"] - sum(v for k, v in mean.items() if k != "step")
    return mean


def format_parts(parts: dict[str, dict[str, float]]) -> str:
    """The parts of each job side by side: mean milliseconds and the share of its mean step."""
    names = list(parts)
    shown = [p for p in PART_ORDER if any(p in parts[n] for n in names)]
    lines = [f"  {'part':<9}" + "".join(f"{n:>20}" for n in names)]
    for part in [*shown, "step"]:
        cells = []
        for n in names:
            v = parts[n].get(part)
            if v is None:
                cells.append(f"{'-':>20}")
            elif part == "step":
                cells.append(f"{v * 1e3:>12.1f} ms     ")
            else:
                cells.append(f"{v * 1e3:>12.1f} ms {v / parts[n]['step']:>4.0%}")
        lines.append(f"  {part:<9}" + "".join(cells))
    return "\n".join(lines)


def geometric_mean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def ratio_interval(
    ratios: list[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(geometric mean of the pair ratios, low, high): a percentile bootstrap over the pairs."""
    if not ratios:
        raise ValueError("no pair of blocks with whole steps in both: raise --block-steps")
    point = geometric_mean(ratios)
    rng = random.Random(seed)
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    means = sorted(sum(rng.choice(logs) for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    lo = math.exp(means[int(tail * (resamples - 1))])
    hi = math.exp(means[int(math.ceil((1 - tail) * (resamples - 1)))])
    return point, min(lo, point), max(hi, point)


# ---- the jobs: start, freeze, resume, read their steps ---------------------------------------


def _sum_hook(state: object, bucket):
    """DDP's communication hook that sums a bucket over the ranks (DDP's own hook averages)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _plain_replica(
    rank: int, world: int, port: int, cfg_dict: dict, data: str, record: str, bucket_mb: float
):
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recover.data.addressing import TokenDataset
    from recover.policy import assign
    from recover.training.config import TrainConfig
    from recover.training.trainer import ReplicaTrainer

    # Its own session, as each process of `recover train` has (launch.py, zygote.py): with the
    # kernel's autogroup scheduling (sched_autogroup_enabled) a session is one scheduling
    # group, so ranks that shared the bench's session would get one share of a loaded machine's
    # CPUs between them where recover's replicas get one each.
    os.setsid()
    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(cfg_dict)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    trainer = ReplicaTrainer(cfg, TokenDataset.open(data))
    # torch's DDP, as a data-parallel loop runs it: gradients accumulate locally (no_sync) and
    # the last microbatch's backward pass reduces them in buckets as they become final, of the
    # size recover's reduce uses. A comm hook sums instead of averaging (the update divides the
    # sum by M, as recover's does); the loss sum takes one more op, as it rides in recover's.
    ddp = DDP(trainer.model, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(None, _sum_hook)
    trainer.model = ddp
    mine = assign(cfg.microbatches, list(range(world)))[rank]
    with open(record, "a") if rank == 0 else open(os.devnull, "w") as f:
        last, recording = time.perf_counter(), 0.0  # recording: the previous record's write
        for step in range(cfg.steps):
            t0 = last + recording
            trainer.model.train()
            for index, j in enumerate(mine):  # (trainer.compute_microbatches, DDP's way)
                last_one = index == len(mine) - 1
                with contextlib.nullcontext() if last_one else ddp.no_sync():
                    trainer._microbatch(step, j, index)
            t1 = time.perf_counter()
            flat = trainer.snapshot()
            loss = flat[-1:].clone()
            t2 = time.perf_counter()
            dist.all_reduce(loss)
            flat[-1] = loss[0]
            t3 = time.perf_counter()
            trainer.apply_commit(step, flat)
            now = time.perf_counter()
            parts = {"compute": t1 - t0, "snapshot": t2 - t1, "reduce": t3 - t2, "apply": now - t3}
            # The same fields as a `recover train` step record: its end (wall), its duration, and
            # where it went (the record's writing is the next step's "rest", as in recover's).
            rec = {"kind": "step", "step": step, "t_wall": time.time(), "step_s": now - last}
            rec["parts"] = {k: round(v, 6) for k, v in parts.items()}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            last, recording = now, time.perf_counter() - now
    dist.destroy_process_group()


def step_records(path: Path | None) -> list[dict]:
    """The step records of a metrics.jsonl so far, in step order ([] before it exists)."""
    if path is None or not path.exists():
        return []
    return [r for _, r in sorted(committed_steps(path).items())]


def _descendants(root: int) -> list[int]:
    """root and every process below it (/proc; the launcher's children have their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _role(pid: int) -> str:
    """What a process is, from its name (/proc/PID/comm) less a numbering: the launcher
    names its forked children ("replica 2" -> "replica", "coordinator")."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    return re.sub(r"\s+\d+$", "", name)


def cpu_per_step(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], steps: int
) -> dict[str, dict]:
    """CPU seconds per step by role, from two readings of a job's processes ({pid: (role,
    cpu_s)}) and the steps it completed between them: {role: {"processes", "cpu_s"}} and
    "total". A process missing from either reading is left out."""
    roles: dict[str, dict] = {}
    for pid, (role, end) in after.items():
        if pid in before:
            entry = roles.setdefault(role, {"processes": 0, "cpu_s": 0.0})
            entry["processes"] += 1
            entry["cpu_s"] += (end - before[pid][1]) / steps
    total = sum(e["cpu_s"] for e in roles.values())
    return {**dict(sorted(roles.items(), key=lambda kv: -kv[1]["cpu_s"])), "total": total}


def format_cpu(cpu: dict[str, dict]) -> str:
    """One line per job: its CPU per step, and each role's part of it."""
    lines = []
    for job, roles in cpu.items():
        parts = []
        for role, e in roles.items():
            if role != "total":
                count = f" x{e['processes']}" if e["processes"] > 1 else ""
                parts.append(f"{role}{count} {e['cpu_s'] * 1e3:.1f}")
        lines.append(f"  {job:<9}{roles['total'] * 1e3:>8.1f} ms  ({', '.join(parts)})")
    return "\n".join(lines)


@dataclass
class Job:
    """One side of the comparison, running in the background; frozen between its blocks."""

    name: str
    record: Path  # a metrics.jsonl file: {"kind": "step", step, t_wall (its end), step_s}
    procs: list = field(default_factory=list)  # Popen or multiprocessing.Process
    tree: bool = False  # freeze every descendant of procs[0] (a `recover train` launcher)
    _pids: list[int] = field(default_factory=list)

    def _signal(self, sig: int) -> None:
        if not self._pids:  # the process tree is settled once the warm-up steps are done
            roots = [p.pid for p in self.procs]
            self._pids = _descendants(roots[0]) if self.tree else roots
        for pid in self._pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def freeze(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def cpu(self) -> dict[int, tuple[str, float]]:
        """{pid: (role, CPU seconds so far)} of the job's processes (settled once warmed up):
        the root of a launcher's tree is "launcher", a plain loop's processes "replica"."""
        out = {}
        roots = {p.pid for p in self.procs}
        for pid in self._pids:
            if (used := cpu_seconds(pid)) is None:
                continue
            if not self.tree:
                out[pid] = ("replica", used)
            else:
                out[pid] = ("launcher" if pid in roots else _role(pid), used)
        return out

    def alive(self) -> bool:
        polls = [p.poll() is None if hasattr(p, "poll") else p.is_alive() for p in self.procs]
        return all(polls)

    def records(self) -> list[dict]:
        """Every step record so far, in order (a torn last line is skipped)."""
        return step_records(self.record)

    def steps(self) -> list[tuple[float, float]]:
        """(t_wall at the step's end, step_s) of every step recorded so far, in order."""
        return [(r["t_wall"], r["step_s"]) for r in self.records()]

    def failures(self) -> int:
        if not self.tree or not self.record.exists():
            return 0
        return sum(r.get("name") == "coordinator.member_dead" for r in read_metrics(self.record))

    def stop(self) -> None:
        self.resume()
        for pid in reversed(self._pids or [p.pid for p in self.procs]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait() if hasattr(p, "wait") else p.join()


def start_plain(cfg_dict: dict, data: Path, replicas: int, record: Path) -> Job:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from recover.runtime.spec import ReplicaSpec

    bucket_mb = ReplicaSpec().reduce_bucket_mb  # recover's default, which its job runs with
    args = (replicas, port, cfg_dict, str(data), str(record), bucket_mb)
    procs = [ctx.Process(target=_plain_replica, args=(r, *args)) for r in range(replicas)]
    for p in procs:
        p.start()
    return Job("plain", record, procs)


def start_recover(name: str, flags: list[str], out: Path) -> Job:
    cmd = [sys.executable, "-m", "recover.cli", "train", *flags, "--out", str(out), "--quiet"]
    log = open(out.parent / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    return Job(name, out / "metrics.jsonl", [proc], tree=True)


def _warm_up(job: Job, *, timeout_s: float) -> float:
    """Run `job` alone until its warm-up steps are done; freeze it; its last step time."""
    deadline = time.monotonic() + timeout_s
    while len(job.steps()) <= WARMUP_STEPS:
        if not job.alive():
            raise RuntimeError(f"{job.name} ended before its warm-up steps (see its log)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job.name}: no {WARMUP_STEPS + 1} steps in {timeout_s:.0f} s")
        time.sleep(0.05)
    time.sleep(0.01)  # let the launcher's tree settle before listing it
    job.freeze()
    return statistics.median(s for _, s in job.steps()[1:])


# ---- the benchmark -----------------------------------------------------------------------------


def interleave(a: Job, b: Job, *, blocks: int, block_s: float) -> dict:
    """Alternate two warmed-up, frozen jobs in blocks; return the pairs and the ratios."""
    windows: dict[str, list[tuple[float, float]]] = {a.name: [], b.name: []}
    loads = []
    cpu_before = {job.name: job.cpu() for job in (a, b)}  # each is frozen until its first block
    for i in range(blocks):
        for job in (a, b) if i % 2 == 0 else (b, a):
            loads.append(os.getloadavg()[0])
            start = time.time()
            job.resume()
            time.sleep(block_s)
            job.freeze()
            windows[job.name].append((start, time.time()))
            if not job.alive():
                raise RuntimeError(f"{job.name} ended during block {i + 1} (see its log)")
    cpu_after = {job.name: job.cpu() for job in (a, b)}
    for job in (a, b):
        if job.failures():
            raise RuntimeError(f"{job.name}: a replica was declared dead; not a failure-free run")
    steps = {job.name: job.steps() for job in (a, b)}
    # A job's CPU is used only inside its windows (it is frozen outside them), and so are the
    # steps that ended between its first window's start and its last one's end.
    cpu = {}
    for job in (a, b):
        first, last = windows[job.name][0][0], windows[job.name][-1][1]
        done = sum(first < t <= last for t, _ in steps[job.name])
        if done:
            cpu[job.name] = cpu_per_step(cpu_before[job.name], cpu_after[job.name], done)
    pairs = []
    for i in range(blocks):
        a_steps = steps_inside(steps[a.name], *windows[a.name][i])
        b_steps = steps_inside(steps[b.name], *windows[b.name][i])
        if not a_steps or not b_steps:
            continue  # a block without a whole step: no figure (counted in blocks_dropped)
        med_a, med_b = statistics.median(a_steps), statistics.median(b_steps)
        pairs.append({
            f"{a.name}_step_s": med_a, f"{b.name}_step_s": med_b, "ratio": med_b / med_a,
            f"{a.name}_fastest_step_s": min(a_steps), f"{b.name}_fastest_step_s": min(b_steps),
            "fastest_ratio": min(b_steps) / min(a_steps),
            "steps": [len(a_steps), len(b_steps)], "first": a.name if i % 2 == 0 else b.name,
        })  # fmt: skip
    ratio, lo, hi = ratio_interval([p["ratio"] for p in pairs])
    fast, fast_lo, fast_hi = ratio_interval([p["fastest_ratio"] for p in pairs])
    return {
        "block_s": block_s,
        "blocks": len(pairs),
        "blocks_dropped": blocks - len(pairs),
        "pairs": pairs,
        "ratio": ratio,
        "ci_low": lo,
        "ci_high": hi,
        "confidence": CONFIDENCE,
        "fastest_ratio": fast,
        "fastest_ci_low": fast_lo,
        "fastest_ci_high": fast_hi,
        "median_pair_ratio": statistics.median(p["ratio"] for p in pairs),
        "min_pair_ratio": min(p["ratio"] for p in pairs),
        "max_pair_ratio": max(p["ratio"] for p in pairs),
        "loadavg_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "windows": windows,  # the blocks' (start, end) wall times, per job
        # CPU seconds per step of all of each job's processes, by role (cpu_per_step): on a
        # machine with fewer cores than processes, what one job adds is what the other waits for.
        "cpu_per_step": cpu,
        "cpu_ratio": (
            cpu[b.name]["total"] / cpu[a.name]["total"] if a.name in cpu and b.name in cpu else None
        ),
        # Mean seconds per part of the measured steps, per job (step_parts; the writer's rank).
        "parts": {
            job.name: parts
            for job in (a, b)
            if (parts := step_parts(job.records(), windows[job.name])) is not None
        },
    }


METHOD = (
    "interleaved blocks: both jobs started once and run side by side, never at once (the bench "
    "SIGSTOPs every process of one while the other runs a block of block_steps steps' worth of "
    "wall time, then swaps; which goes first alternates per pair); per block the median of the "
    "steps wholly inside it (warm-up steps before the first block excluded); ratio = geometric "
    f"mean over pairs of {{b}} / {{a}} block medians, {CONFIDENCE:.0%} percentile-bootstrap "
    f"interval over the pairs ({RESAMPLES} resamples, seed 0); fastest_ratio: the same with each "
    "block's fastest step"
)


def run_interleaved(
    a: Job, start_b: Callable[[], Job], *, logs: Path, args: argparse.Namespace
) -> tuple[dict, Job]:
    """Warm `a` up alone, then start and warm up the job `start_b()` gives, and interleave them
    (`args.blocks` pairs of blocks of `args.block_steps` step times); returns interleave's
    result and the second job. Both jobs are stopped on the way out; on a failure their logs
    (`logs`/NAME.log) are printed first."""
    jobs = [a]
    try:
        step_a = _warm_up(a, timeout_s=args.timeout)  # alone: the start-ups never overlap
        jobs.append(start_b())
        step_b = _warm_up(jobs[1], timeout_s=args.timeout)
        block_s = max(MIN_BLOCK_S, args.block_steps * max(step_a, step_b))
        return interleave(a, jobs[1], blocks=args.blocks, block_s=block_s), jobs[1]
    except BaseException:
        for job in jobs:
            if (log := logs / f"{job.name}.log").exists():
                print(log.read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        for job in jobs:
            job.stop()


def bench_overhead(args: argparse.Namespace) -> dict:
    for name in ("blocks", "block_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    deterministic = getattr(args, "deterministic", False)
    data, cfg, flags = bench_setup(args)
    cfg = cfg.__class__.from_dict({**cfg.to_dict(), "steps": ENDLESS_STEPS})
    flags = [*_with_steps(flags, ENDLESS_STEPS), *FROZEN_SAFE_FLAGS]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if deterministic:
            a = start_recover("normal", flags, tmp / "normal")
            b_args = ("deterministic", [*flags, "--deterministic"], tmp / "det")
        else:
            # The plain loop's plan: equal contiguous shares, so recover gets --balance equal.
            a = start_plain(cfg.to_dict(), data, args.replicas, tmp / "plain.jsonl")
            b_args = ("recover", [*flags, "--balance", "equal"], tmp / "recover")
        res, b = run_interleaved(a, lambda: start_recover(*b_args), logs=tmp, args=args)
    a_name, b_name = a.name, b.name
    result = {
        "benchmark": "overhead-deterministic" if deterministic else "overhead",
        "method": METHOD.format(a=a_name, b=b_name),
        "config": {
            **cfg.to_dict(),
            "steps": None,
            "replicas": args.replicas,
            "blocks": args.blocks,
            "block_steps": args.block_steps,
        },
        "machine": machine_info(),
        **res,
    }
    what = "deterministic vs normal" if deterministic else "overhead (recover vs plain loop)"
    load = res["loadavg_1min"]
    print(
        f"{what} ({args.preset}, {args.replicas} replicas, M={args.microbatches}): "
        f"ratio {res['ratio']:.3f}, {CONFIDENCE:.0%} CI [{res['ci_low']:.3f}, {res['ci_high']:.3f}] "
        f"over {res['blocks']} block pairs ({res['blocks_dropped']} dropped; blocks of "
        f"{res['block_s']:.1f} s); fastest steps {res['fastest_ratio']:.3f} "
        f"[{res['fastest_ci_low']:.3f}, {res['fastest_ci_high']:.3f}]; "
        f"load average {load['min']:.1f}-{load['max']:.1f} (median {load['median']:.1f})"
    )
    if res["parts"]:
        print("where a step's time went (mean over the measured steps, share of the step):")
        print(format_parts(res["parts"]))
    print_cpu(res)
    return result


def print_cpu(res: dict) -> None:
    """The CPU per step of both jobs, by role, and its ratio (interleave's result)."""
    if res["cpu_ratio"] is not None:
        print(f"CPU per step, all of a job's processes (ratio {res['cpu_ratio']:.3f}):")
        print(format_cpu(res["cpu_per_step"]))


def _with_steps(flags: list[str], steps: int) -> list[str]:
    out = list(flags)
    out[out.index("--steps") + 1] = str(steps)
    return out
