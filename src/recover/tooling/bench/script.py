"""`recover bench script`: a user's script under ReCoVer against the same script under plain DDP.

Job: the failure-free cost of adopting the drop-in API. Runs, alternately on one machine, (a) the
DDP version of a script under torchrun (gradient accumulation with `no_sync`, one all-reduce per
step: examples/train_ddp.py) and (b) the ReCoVer version under `recover run` (examples/
train_custom.py), with the same model, data, M, replicas and steps. Each script records a wall
time per step on its writer; the step time of a run is the median of the differences after
`WARMUP` steps; the ratio of a pair is b / a. Prints each pair, then the median ratio with the
spread of the pairs, and writes JSON with the machine and every raw figure.

Costs and limits: 2 x repeats job start-ups (a torch import per process); on a small shared
machine single pairs are noisy, so read the median over several pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

WARMUP = 3  # steps whose times are left out (first allocations, first rendezvous)


def _step_times(records: Path) -> list[float]:
    times = [json.loads(line)["time"] for line in records.read_text().splitlines()]
    return [b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1 :], strict=False)]


def bench_script(args: argparse.Namespace) -> dict:
    from recover.tooling.bench.common import machine_info, run_child

    script, ddp = Path(args.script).resolve(), Path(args.ddp_script).resolve()
    for path in (script, ddp):
        if not path.is_file():
            raise ValueError(f"{path}: no such script (run from the repository's root)")
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        run_child([sys.executable, str(script), "--make-data", str(data)], timeout_s=120)
        common = ["--data", str(data), "--steps", str(args.steps)]
        common += ["--microbatches", str(args.microbatches)]
        for i in range(args.repeats):
            out_a, out_b = Path(tmp) / f"ddp-{i}", Path(tmp) / f"recover-{i}"
            run_child(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(args.replicas), str(ddp), *common, "--out", str(out_a)],
                timeout_s=args.timeout,
            )  # fmt: skip
            run_child(
                [sys.executable, "-m", "recover.cli", "run", "--replicas", str(args.replicas),
                 "--quiet", "--out", str(out_b / "job"), "--", sys.executable, str(script),
                 *common, "--out", str(out_b)],
                timeout_s=args.timeout,
            )  # fmt: skip
            a = statistics.median(_step_times(out_a / "losses.jsonl"))
            b = statistics.median(_step_times(out_b / "losses.jsonl"))
            pairs.append({"ddp_step_s": a, "recover_step_s": b, "ratio": b / a})
            print(f"  pair {i + 1}/{args.repeats}: ddp {a * 1000:.1f} ms, recover "
                  f"{b * 1000:.1f} ms, ratio {b / a:.3f}", flush=True)  # fmt: skip
    ratios = sorted(p["ratio"] for p in pairs)
    result = {
        "benchmark": "script",
        "method": "alternating pairs on one machine: the DDP script under torchrun, then the "
        f"ReCoVer script under recover run; per run the median step time after {WARMUP} "
        "warm-up steps (writer's wall clock); ratio = recover / ddp",
        "scripts": {"recover": str(script), "ddp": str(ddp)},
        "config": {"replicas": args.replicas, "steps": args.steps, "M": args.microbatches},
        "machine": machine_info(),
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "min_ratio": ratios[0],
        "max_ratio": ratios[-1],
    }
    print(
        f"script overhead ({args.replicas} replicas, M={args.microbatches}): median ratio "
        f"{result['median_ratio']:.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f}) over "
        f"{len(pairs)} pairs"
    )
    return result


def add_script_parser(sub) -> None:
    p = sub.add_parser(
        "script", help="a user's script under ReCoVer against the same script under plain DDP"
    )
    p.add_argument(
        "--script",
        default="examples/train_custom.py",
        help="the ReCoVer script (default: examples/train_custom.py)",
    )
    p.add_argument(
        "--ddp-script",
        default="examples/train_ddp.py",
        help="the same training as plain DDP under torchrun (default: examples/train_ddp.py)",
    )
    p.add_argument("--replicas", type=int, default=3, help="replicas / DDP ranks (default: 3)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default: 60)")
    p.add_argument("--microbatches", type=int, default=6, help="M (default: 6)")
    p.add_argument("--repeats", type=int, default=5, help="alternating pairs (default: 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    p.add_argument(
        "--json",
        default="bench-script.json",
        metavar="PATH",
        help="where to write the result (default: bench-script.json)",
    )
