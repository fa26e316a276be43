"""`recover bench overhead`: the cost of the fault-tolerance path when nothing fails.

Alternates, on the same machine, (a) a plain data-parallel loop (one static gloo group from
init_process_group, the same ReplicaTrainer, a flat all-reduce of the gradients, no coordinator,
no snapshot, no commit) and (b) `recover train --replicas R` with the same model, data, M and
seed; prints the median step-time ratio b/a and its spread over the pairs.

With --deterministic: pairs of `recover train` in the normal mode and with --deterministic
(same flags otherwise; which runs first alternates), and the ratio deterministic / normal the
same way, also for each run's fastest step.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

from recover.record import committed_steps
from recover.tooling.bench.common import (
    WARMUP_STEPS,
    bench_setup,
    machine_info,
    median_step_s,
    run_recover,
)

# ---- (a) the plain data-parallel loop --------------------------------------------------------


def _plain_replica(rank: int, world: int, port: int, cfg_dict: dict, data: str, result_path: str):
    import torch
    import torch.distributed as dist

    from recover.data.addressing import TokenDataset
    from recover.policy import assign
    from recover.training.config import TrainConfig
    from recover.training.trainer import ReplicaTrainer

    torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(cfg_dict)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    trainer = ReplicaTrainer(cfg, TokenDataset.open(data))
    mine = assign(cfg.microbatches, list(range(world)))[rank]
    times = []
    last = time.perf_counter()
    for step in range(cfg.steps):
        trainer.compute_microbatches(step, mine)
        flat = trainer.snapshot()
        dist.all_reduce(flat)
        trainer.apply_commit(step, flat)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if rank == 0:
        Path(result_path).write_text(json.dumps({"step_s": times}))
    dist.destroy_process_group()


def run_plain(cfg_dict: dict, data: Path, replicas: int, *, timeout_s: float) -> list[float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "plain.json"
        procs = [
            ctx.Process(
                target=_plain_replica, args=(r, replicas, port, cfg_dict, str(data), str(result))
            )
            for r in range(replicas)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            if any(p.exitcode != 0 for p in procs):
                raise RuntimeError(f"plain loop failed: exit codes {[p.exitcode for p in procs]}")
            return json.loads(result.read_text())["step_s"]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()


def bench_overhead(args: argparse.Namespace) -> dict:
    if getattr(args, "deterministic", False):
        return bench_deterministic(args)
    data, cfg, flags = bench_setup(args)
    flags = [*flags, "--balance", "equal"]  # the plain loop's plan: equal contiguous shares
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            plain = run_plain(cfg.to_dict(), data, args.replicas, timeout_s=args.timeout)
            a = statistics.median(plain[WARMUP_STEPS:])
            out = run_recover(flags, Path(tmp) / f"recover-{i}", timeout_s=args.timeout)
            b = median_step_s(out)
            pairs.append({"plain_step_s": a, "recover_step_s": b, "ratio": b / a})
            print(f"  pair {i + 1}/{args.repeats}: plain {a * 1000:.1f} ms, recover {b * 1000:.1f} ms, "
                  f"ratio {b / a:.3f}", flush=True)  # fmt: skip
    ratios = [p["ratio"] for p in pairs]
    result = {
        "benchmark": "overhead",
        "method": "alternating pairs on one machine; per run the median step time after "
        f"{WARMUP_STEPS} warm-up steps; ratio = recover / plain data-parallel loop",
        "config": {**cfg.to_dict(), "replicas": args.replicas},
        "machine": machine_info(),
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }
    print(
        f"overhead ({args.preset}, {args.replicas} replicas, M={args.microbatches}): "
        f"median ratio {result['median_ratio']:.3f} (min {result['min_ratio']:.3f}, "
        f"max {result['max_ratio']:.3f}) over {len(pairs)} pairs"
    )
    return result


def bench_deterministic(args: argparse.Namespace) -> dict:
    """The step cost of --deterministic against the normal mode, side by side (module docstring)."""
    data, cfg, flags = bench_setup(args)
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            # Which mode runs first alternates, so that a load that drifts during the pairs
            # favours neither.
            runs = {}
            for mode in ("normal", "det") if i % 2 == 0 else ("det", "normal"):
                extra = ["--deterministic"] if mode == "det" else []
                runs[mode] = run_recover(
                    [*flags, *extra], Path(tmp) / f"{mode}-{i}", timeout_s=args.timeout
                )
            normal, det = runs["normal"], runs["det"]
            a, b = median_step_s(normal), median_step_s(det)
            fast_a, fast_b = _fastest_step_s(normal), _fastest_step_s(det)
            pairs.append({
                "normal_step_s": a, "deterministic_step_s": b, "ratio": b / a,
                "normal_fastest_step_s": fast_a, "deterministic_fastest_step_s": fast_b,
                "fastest_ratio": fast_b / fast_a,
            })  # fmt: skip
            print(f"  pair {i + 1}/{args.repeats}: normal {a * 1000:.1f} ms, deterministic "
                  f"{b * 1000:.1f} ms, ratio {b / a:.3f} (fastest steps: {fast_b / fast_a:.3f})",
                  flush=True)  # fmt: skip
    ratios = [p["ratio"] for p in pairs]
    fastest = [p["fastest_ratio"] for p in pairs]
    result = {
        "benchmark": "overhead-deterministic",
        "method": "pairs of recover train runs on one machine, the normal mode and "
        "--deterministic, which one first alternating from pair to pair; per run the median step time after {WARMUP_STEPS} warm-up steps; "
        "ratio = deterministic / normal; fastest_ratio: the same for each run's fastest step "
        "after the warm-up (less sensitive to other load on a shared machine)",
        "config": {**cfg.to_dict(), "replicas": args.replicas},
        "machine": machine_info(),
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "median_fastest_ratio": statistics.median(fastest),
    }
    print(
        f"deterministic vs normal ({args.preset}, {args.replicas} replicas, "
        f"M={args.microbatches}): median ratio {result['median_ratio']:.3f} "
        f"(min {result['min_ratio']:.3f}, max {result['max_ratio']:.3f}) over {len(pairs)} pairs; "
        f"fastest steps: median ratio {result['median_fastest_ratio']:.3f}"
    )
    return result


def _fastest_step_s(out: Path) -> float:
    steps = committed_steps(out / "metrics.jsonl")
    return min(s["step_s"] for k, s in steps.items() if k >= WARMUP_STEPS)
