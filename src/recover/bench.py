"""`recover bench`: measurements that are code, with results that are data.

- `overhead`: the cost of the fault-tolerance path when nothing fails. Alternates, on the same
  machine, (a) a plain data-parallel loop (one static gloo group from init_process_group, the same
  ReplicaTrainer, a flat all-reduce of the gradients, no coordinator, no snapshot, no commit) and
  (b) `recover train --replicas R` with the same model, data, M and seed; prints the median
  step-time ratio b/a and its spread over the pairs.
- `recovery`: kills one replica at each phase of a step and prints, per phase, the median seconds
  from the kill (`failure_injected`) to the next commit (`coordinator.committed`) beside the median
  failure-free step time of the same runs.

Both write a JSON file with the machine, the versions, the method and every raw figure. Timed runs
include no start-up: step times come from the runs' own metrics (steps after the first few).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recover.metrics import committed_steps, read_metrics

WARMUP_STEPS = 3  # steps excluded from step-time medians (allocation, first rendezvous)


def machine_info() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_recover(flags: list[str], out: Path, *, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "recover.cli", "train", *flags, "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_child_env())
    if r.returncode != 0:
        raise RuntimeError(
            f"benchmark run failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}"
        )
    return out


def median_step_s(out: Path, *, skip: int = WARMUP_STEPS) -> float:
    steps = committed_steps(out / "metrics.jsonl")
    times = [s["step_s"] for k, s in sorted(steps.items()) if k >= skip]
    return statistics.median(times)


def _bench_setup(args: argparse.Namespace):
    """The dataset, the TrainConfig of a benchmark run, and the `recover train` flags for it."""
    from recover.config import TrainConfig
    from recover.data.prepare import ensure_dataset
    from recover.launch import train_flags

    data = (
        Path(args.data) if args.data else ensure_dataset(Path(args.data_root), show_progress=False)
    )
    cfg = TrainConfig(
        preset=args.preset, steps=args.steps, microbatches=args.microbatches,
        microbatch_size=args.microbatch_size, seq_len=args.seq_len, eval_every=0, ckpt_every=0,
    )  # fmt: skip
    flags = [*train_flags(cfg), "--replicas", str(args.replicas), "--data", str(data)]
    return data, cfg, flags


# ---- (a) the plain data-parallel loop --------------------------------------------------------


def _plain_replica(rank: int, world: int, port: int, cfg_dict: dict, data: str, result_path: str):
    import torch
    import torch.distributed as dist

    from recover.config import TrainConfig
    from recover.data.addressing import TokenDataset
    from recover.policy import assign
    from recover.trainer import ReplicaTrainer

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
    data, cfg, flags = _bench_setup(args)
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


# ---- recovery -------------------------------------------------------------------------------

PHASES = ("forward", "backward", "reduce", "commit", "optimizer")


def kill_to_commit_s(out: Path) -> tuple[float, float]:
    """Seconds from the injected kill to the first commit after it, and to the first commit
    after the coordinator declared the replica dead (the run going on without it). They differ
    when the kill comes after the replica's part of the step was reduced (phase commit): that
    step commits at once, and the next step pays the recovery."""
    records = list(read_metrics(out / "metrics.jsonl"))
    kill = next(r for r in records if r.get("name") == "failure_injected")
    dead = next(
        r for r in records
        if r.get("name") == "coordinator.member_dead" and r["t_wall"] >= kill["t_wall"]
    )  # fmt: skip
    commits = [r["t_wall"] for r in records if r.get("name") == "coordinator.committed"]
    after_kill = min(t for t in commits if t > kill["t_wall"])
    after_dead = min(t for t in commits if t > dead["t_wall"])
    return after_kill - kill["t_wall"], after_dead - kill["t_wall"]


def bench_recovery(args: argparse.Namespace) -> dict:
    _, _, base = _bench_setup(args)
    kill_step = args.steps // 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for phase in PHASES:
            recov, without, steps = [], [], []
            for i in range(args.repeats):
                spec = f"kill:replica={args.replicas - 1},step={kill_step},phase={phase}"
                if phase in ("forward", "backward"):
                    spec += ",microbatch=0"
                out = run_recover([*base, "--fault", spec], Path(tmp) / f"{phase}-{i}",
                                  timeout_s=args.timeout)  # fmt: skip
                next_commit, commit_without = kill_to_commit_s(out)
                recov.append(next_commit)
                without.append(commit_without)
                step_times = committed_steps(out / "metrics.jsonl")
                steps.append(statistics.median(
                    s["step_s"] for k, s in step_times.items() if k >= WARMUP_STEPS and k != kill_step
                ))  # fmt: skip
            row = {
                "phase": phase,
                "kill_to_commit_s": statistics.median(recov),
                "kill_to_commit_without_s": statistics.median(without),
                "step_s": statistics.median(steps),
                "raw_kill_to_commit_s": recov,
                "raw_kill_to_commit_without_s": without,
            }
            rows.append(row)
            print(f"  {phase:<10} kill -> next commit {row['kill_to_commit_s']:.3f} s, "
                  f"-> first commit without it {row['kill_to_commit_without_s']:.3f} s "
                  f"(median step {row['step_s']:.3f} s)", flush=True)  # fmt: skip
    result = {
        "benchmark": "recovery",
        "method": f"{args.replicas} replicas, replica {args.replicas - 1} SIGKILLed at step "
        f"{kill_step}; seconds from its failure_injected event to the next coordinator commit, "
        "and to the first commit after the coordinator declared it dead; "
        f"median of {args.repeats} runs per phase",
        "config": vars(args) | {"func": None},
        "machine": machine_info(),
        "rows": rows,
    }
    print(format_recovery_table(rows))
    return result


def format_recovery_table(rows: list[dict]) -> str:
    lines = [
        "| phase | kill -> next commit (s) | kill -> first commit without it (s) "
        "| failure-free step (s) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        without = r.get("kill_to_commit_without_s", r["kill_to_commit_s"])
        lines.append(
            f"| {r['phase']} | {r['kill_to_commit_s']:.3f} | {without:.3f} | {r['step_s']:.3f} |"
        )
    return "\n".join(lines)


# ---- rejoin ---------------------------------------------------------------------------------

# Per preset: (M, B, T, steps) sized so that the run outlives a respawned joiner's start-up on
# 2 CPU cores (a joiner imports torch and builds its model before it can join).
REJOIN_SHAPES = {
    "tiny": (6, 2, 32, 300),
    "small": (6, 4, 64, 120),
    "medium": (3, 2, 64, 40),
    "gpt2-124m": (3, 1, 64, 16),
}
REJOIN_KILL_STEP = 2


def rejoin_figures(out: Path) -> dict:
    """Transfer size and time, and seconds from the respawn to the joiner's first commit."""
    records = list(read_metrics(out / "metrics.jsonl"))
    respawned = next(r for r in records if r.get("name") == "launcher.respawned")
    transfer = next(r for r in records if r.get("name") == "state_transfer")
    first_commit = min(
        r["t_wall"]
        for r in records
        if r.get("name") == "coordinator.committed" and r["t_wall"] > transfer["t_wall"]
    )
    return {
        "transfer_bytes": transfer["bytes"],
        "transfer_s": transfer["seconds"],
        "start_to_first_commit_s": first_commit - respawned["t_wall"],
    }


def bench_rejoin(args: argparse.Namespace) -> dict:
    from recover.config import TrainConfig
    from recover.data.prepare import ensure_dataset
    from recover.launch import train_flags

    data = (
        Path(args.data) if args.data else ensure_dataset(Path(args.data_root), show_progress=False)
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.preset.split(","):
            if preset not in REJOIN_SHAPES:
                raise ValueError(f"--preset {preset!r}: rejoin knows {', '.join(REJOIN_SHAPES)}")
            M, B, T, steps = REJOIN_SHAPES[preset]
            cfg = TrainConfig(preset=preset, steps=args.steps or steps, microbatches=M,
                              microbatch_size=B, seq_len=T, eval_every=0, ckpt_every=0,
                              warmup_steps=1)  # fmt: skip
            flags = [*train_flags(cfg), "--replicas", str(args.replicas), "--data", str(data),
                     "--respawn", "0", "--fault",
                     f"kill:replica={args.replicas - 1},step={REJOIN_KILL_STEP},phase=backward"]  # fmt: skip
            figures = []
            for i in range(args.repeats):
                out = run_recover(flags, Path(tmp) / f"{preset}-{i}", timeout_s=args.timeout)
                figures.append(rejoin_figures(out))
            row = {"preset": preset, "microbatches": M, "microbatch_size": B, "seq_len": T}
            for key in figures[0]:
                row[key] = statistics.median(f[key] for f in figures)
            rows.append(row)
            print(f"  {preset:<10} state {row['transfer_bytes'] / 2**20:.1f} MiB in "
                  f"{row['transfer_s']:.3f} s; joiner start -> first commit "
                  f"{row['start_to_first_commit_s']:.2f} s", flush=True)  # fmt: skip
    print(format_rejoin_table(rows))
    return {
        "benchmark": "rejoin",
        "method": f"{args.replicas} replicas; the last is SIGKILLed at step {REJOIN_KILL_STEP} and "
        "respawned at once (--respawn 0); transfer = the joiner's state_transfer event; start -> "
        "first commit = from the launcher's respawn to the first commit after the transfer "
        f"(includes process start and torch import); median of {args.repeats}",
        "machine": machine_info(),
        "rows": rows,
    }


def format_rejoin_table(rows: list[dict]) -> str:
    lines = [
        "| preset | state transferred | transfer time (s) | joiner start -> first commit (s) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['transfer_bytes'] / 2**20:.1f} MiB | {r['transfer_s']:.3f} | "
            f"{r['start_to_first_commit_s']:.2f} |"
        )
    return "\n".join(lines)


# ---- balance ---------------------------------------------------------------------------------


def bench_balance(args: argparse.Namespace) -> dict:
    """A straggler (`slow` fault, factor 3) under equal shares and under throughput-aware shares."""
    _, cfg, flags = _bench_setup(args)
    slow = ["--fault", f"slow:replica={args.replicas - 1},step=1,factor=3"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for balance in ("equal", "throughput"):
            times, shares = [], []
            for i in range(args.repeats):
                out = run_recover([*flags, *slow, "--balance", balance],
                                  Path(tmp) / f"{balance}-{i}", timeout_s=args.timeout)  # fmt: skip
                times.append(median_step_s(out))
                last = committed_steps(out / "metrics.jsonl")[cfg.steps - 1]
                shares.append(last["shares"][str(args.replicas - 1)])
            row = {
                "balance": balance,
                "median_step_s": statistics.median(times),
                "straggler_share": statistics.median(shares),
                "fair_share": cfg.microbatches / args.replicas,
            }
            rows.append(row)
            print(f"  {balance:<10} median step {row['median_step_s']:.3f} s, straggler holds "
                  f"{row['straggler_share']:g} of {cfg.microbatches} microbatches", flush=True)  # fmt: skip
    speedup = rows[0]["median_step_s"] / rows[1]["median_step_s"]
    print(f"throughput-aware shares: step time x{1 / speedup:.2f} of equal shares "
          f"({speedup:.2f}x faster)")  # fmt: skip
    return {
        "benchmark": "balance",
        "method": f"{args.replicas} replicas, replica {args.replicas - 1} slowed 3x from step 1; "
        f"median step time after {WARMUP_STEPS} steps; share = microbatches it held at the last "
        f"step; median of {args.repeats} runs per setting",
        "config": {**cfg.to_dict(), "replicas": args.replicas},
        "machine": machine_info(),
        "rows": rows,
        "speedup": speedup,
    }


# ---- compare: every mode on the same work ---------------------------------------------------


def parse_schedule(text: str, *, replicas: int) -> list[str]:
    """`every=N,count=K[,offset=O][,phase=P]` -> K kill faults at steps N+O, 2N+O, ...,
    replicas 1, 2, ... in turn. The offset (default N // 2) puts a failure in the middle of a
    checkpoint interval when --ckpt-every equals N: the expected case for a failure that strikes at
    a random time (half an interval of work lost), not the lucky case of a failure right after a
    checkpoint."""
    fields = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    try:
        every, count = int(fields["every"]), int(fields["count"])
        offset = int(fields.get("offset", every // 2))
    except (KeyError, ValueError):
        raise ValueError(
            f"--faults {text!r}: expected every=N,count=K[,offset=O][,phase=P], e.g. "
            "every=5,count=3"
        ) from None
    phase = fields.get("phase", "backward")
    if every < 1 or count < 1 or offset < 0:
        raise ValueError("--faults: every and count must be >= 1, offset >= 0")
    specs = []
    for i in range(count):
        victim = 1 + i % (replicas - 1) if replicas > 1 else 0
        spec = f"kill:replica={victim},step={every * (i + 1) + offset},phase={phase}"
        if phase in ("forward", "backward"):
            spec += ",microbatch=0"
        specs.append(spec)
    return specs


def bench_compare(args: argparse.Namespace) -> dict:
    from recover.report import build_table, format_markdown, write_report

    _, cfg, flags = _bench_setup(args)
    faults = parse_schedule(args.faults, replicas=args.replicas)
    last_fault = max(int(f.split("step=")[1].split(",")[0]) for f in faults)
    if last_fault >= cfg.steps:
        raise ValueError(
            f"--steps {cfg.steps} ends before the last scheduled failure ({last_fault})"
        )
    fault_flags = [a for f in faults for a in ("--fault", f)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # recover runs twice: the survivors carrying on alone, and with the dead replaced at once
    # (--respawn 0). Here a respawned process starts on the same 2 cores as the survivors and its
    # start-up (torch import, model build) slows them; on a cluster it starts on another node.
    modes = {
        "failure-free": [],
        "recover": list(fault_flags),
        "recover+respawn": [*fault_flags, "--respawn", "0"],
        "checkpoint-restart": [*fault_flags, "--mode", "checkpoint-restart",
                               "--ckpt-every", str(args.ckpt_every)],
        "shrink": [*fault_flags, "--mode", "shrink"],
    }  # fmt: skip
    runs: dict[str, Path] = {}
    for name, extra in modes.items():
        run = out_dir / "runs" / name
        if run.exists():
            raise ValueError(f"{run} exists: choose a new --out for a new comparison")
        print(f"  running {name} ...", flush=True)
        t0 = time.perf_counter()
        # (flags given twice, like --ckpt-every, take their last value)
        runs[name] = run_recover([*flags, *extra], run, timeout_s=args.timeout)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    torchft_note = _maybe_run_torchft(args, cfg, faults, out_dir, runs)
    rows = build_table(runs, reference="failure-free")
    write_report(rows, out_dir, runs)
    print(format_markdown(rows))
    if torchft_note:
        print(torchft_note)
    return {
        "torchft": torchft_note or "run",
        "benchmark": "compare",
        "method": "every mode runs the same model, data, seed, M and fault schedule in one "
        "session on this machine; figures are computed from each run's metrics.jsonl",
        "faults": faults,
        "config": {**cfg.to_dict(), "replicas": args.replicas},
        "machine": machine_info(),
        "rows": rows,
    }


def _maybe_run_torchft(args, cfg, faults, out_dir: Path, runs: dict) -> str | None:
    """Run the real torchft on the same work when it is installed (the `torchft` extra)."""
    from recover.data.prepare import ensure_dataset
    from recover.torchft_harness import (
        TorchftHarnessConfig,
        TorchftUnavailable,
        require_torchft,
        run_torchft,
    )

    try:
        require_torchft()
    except TorchftUnavailable as e:
        return f"torchft skipped: {e}"
    data = (
        Path(args.data) if args.data else ensure_dataset(Path(args.data_root), show_progress=False)
    )
    run = out_dir / "runs" / "torchft"
    print("  running torchft ...", flush=True)
    hcfg = TorchftHarnessConfig(replicas=args.replicas, faults=tuple(faults))
    if run_torchft(cfg, hcfg, data=data, out=run, log=lambda *a: None) != 0:
        return "torchft run failed (see its run folder)"
    runs["torchft"] = run
    return None


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (overhead, recovery, rejoin, compare)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, helptext, defaults in (
        ("overhead", "failure-free overhead against a plain data-parallel loop",
         dict(preset="small", replicas=4, steps=30, repeats=5)),
        ("recovery", "seconds from a kill to the next commit, per phase",
         dict(preset="tiny", replicas=4, steps=12, repeats=3)),
        ("rejoin", "state transfer and time to a joiner's first commit, per preset",
         dict(preset="tiny,small,gpt2-124m", replicas=3, steps=0, repeats=1)),
        ("balance", "a straggler under equal and under throughput-aware shares",
         dict(preset="tiny", replicas=3, steps=40, repeats=3)),
        ("compare", "every mode (recover, checkpoint-restart, shrink) on the same work and faults",
         dict(preset="small", replicas=4, steps=30, repeats=1)),
    ):  # fmt: skip
        p = sub.add_parser(name, help=helptext)
        p.add_argument(
            "--preset",
            default=defaults["preset"],
            help=f"model preset (default: {defaults['preset']})",
        )
        p.add_argument("--replicas", type=int, default=defaults["replicas"])
        p.add_argument(
            "--steps",
            type=int,
            default=defaults["steps"],
            help="steps per run (rejoin: 0 = chosen per preset)",
        )
        p.add_argument("--repeats", type=int, default=defaults["repeats"])
        p.add_argument("--microbatches", type=int, default=8)
        p.add_argument("--microbatch-size", type=int, default=8)
        p.add_argument("--seq-len", type=int, default=128)
        p.add_argument("--data", default=None, help="dataset folder (default: the built-in corpus)")
        p.add_argument("--data-root", default="data")
        p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
        p.add_argument(
            "--json",
            default=f"bench-{name}.json",
            metavar="PATH",
            help=f"where to write the result (default: bench-{name}.json)",
        )
        if name == "compare":
            p.add_argument(
                "--faults",
                default="every=5,count=3",
                metavar="SCHEDULE",
                help="every=N,count=K[,phase=P]: K kills, one every N steps "
                "(default: every=5,count=3, the paper's density)",
            )
            p.add_argument(
                "--ckpt-every",
                type=int,
                default=5,
                help="checkpoint interval of the checkpoint-restart mode (default: 5)",
            )
            p.add_argument(
                "--out",
                default="bench-compare",
                metavar="DIR",
                help="run folders, compare.json/.md and plots (default: bench-compare)",
            )
    # fmt: on
    from recover.bench_script import add_script_parser

    add_script_parser(sub)
    from recover.bench_coordinator import add_coordinator_bench_parser

    add_coordinator_bench_parser(sub)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "script":
        from recover.bench_script import bench_script

        return _write_result(bench_script, args)
    if args.bench_command == "coordinator":
        from recover.bench_coordinator import run_coordinator_bench

        return run_coordinator_bench(args)
    for name in ("replicas", "repeats", "microbatches", "microbatch_size", "seq_len"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.steps < (0 if args.bench_command == "rejoin" else 1):
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.bench_command != "overhead" and args.replicas < 2:
        print("error: --replicas must be >= 2 to survive a kill", file=sys.stderr)
        return 2
    fn = {
        "overhead": bench_overhead,
        "recovery": bench_recovery,
        "rejoin": bench_rejoin,
        "balance": bench_balance,
        "compare": bench_compare,
    }[args.bench_command]
    return _write_result(fn, args)


def _write_result(fn, args: argparse.Namespace) -> int:
    try:
        result = fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0
