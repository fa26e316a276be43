"""`recover bench balance`: a straggler under equal and under throughput-aware shares."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from recover.record import committed_steps
from recover.tooling.bench.common import (
    WARMUP_STEPS,
    bench_setup,
    machine_info,
    median_step_s,
    run_recover,
)

# ---- balance ---------------------------------------------------------------------------------


def bench_balance(args: argparse.Namespace) -> dict:
    """A straggler (`slow` fault, factor 3) under equal shares and under throughput-aware shares."""
    _, cfg, flags = bench_setup(args)
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
