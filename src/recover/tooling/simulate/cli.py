"""`recover simulate`: flags -> assumptions -> studies -> tables, JSON and plots under --out.

Job: the only place of the simulator that reads flags; it builds the validated configs
(`GpuAssumptions`, `PoissonFailures`), runs the paper scenario, the scale and MTBF sweeps (or,
with --validate, the comparison with measured run folders) and writes `simulate.json` and PNGs.
Exit status: 0; 1 when a validated run misses the tolerance; 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["add_simulate_parser", "run_simulate"]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x.replace("k", "000")) for x in text.split(",") if x]


def add_simulate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="project effective throughput at 512..100k GPUs (recover vs checkpoint-restart, "
        "shrink, spares)",
        description="Discrete-event simulation of a pre-training job under four fault-tolerance "
        "policies, with costs from `recover bench` JSON and documented defaults "
        "(docs/simulator.md).",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("sim"),
        metavar="DIR",
        help="where simulate.json and the PNG plots go (default: sim)",
    )
    p.add_argument(
        "--from-bench",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="a `recover bench recovery|overhead|coordinator` JSON (repeatable)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the first run (default: 0)")
    p.add_argument("--seeds", type=int, default=8, help="runs averaged per sweep point")
    p.add_argument("--horizon-days", type=float, default=7.0, help="simulated wall time per run")
    p.add_argument(
        "--scales",
        type=_ints,
        default=[512, 4096, 16384, 100_000],
        metavar="LIST",
        help="GPU counts (default: 512,4096,16384,100000)",
    )
    p.add_argument("--mtbf-gpus", type=int, default=16384, help="GPUs of the MTBF sweep")
    p.add_argument(
        "--mtbf-hours",
        type=_floats,
        default=[0.25, 0.5, 1, 2, 4, 8, 16, 32],
        metavar="LIST",
        help="job MTBFs of the MTBF sweep",
    )
    p.add_argument(
        "--gpu-failures-per-hour",
        type=float,
        default=None,
        metavar="RATE",
        help="per-GPU failure rate (default: Llama 3, 419 in 54 days on 16,384 GPUs)",
    )
    p.add_argument(
        "--correlated",
        type=float,
        default=0.0,
        metavar="F",
        help="fraction of failures that take a whole node (default: 0)",
    )
    p.add_argument(
        "--node-gpus",
        type=int,
        default=8,
        help="GPUs per node: a correlated failure takes them all (default: 8)",
    )
    g = p.add_argument_group("job and costs (defaults: docs/simulator.md)")
    g.add_argument("--params", type=float, default=8.0e9, help="model parameters (default: 8e9)")
    g.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    g.add_argument(
        "--gpus-per-replica",
        type=int,
        default=8,
        help="GPUs in one replica (TP x PP); one GPU failure ends its replica (default: 8)",
    )
    g.add_argument(
        "--microbatches-per-replica",
        type=int,
        default=128,
        help="microbatches each replica sums per step; M = this x replicas (default: 128)",
    )
    g.add_argument(
        "--mfu", type=float, default=0.40, help="model FLOPs utilisation, 0..1 (default: 0.4)"
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="peak TFLOP/s of one GPU (default: 989, H100 dense bf16)",
    )
    g.add_argument(
        "--rebuild-s",
        type=float,
        default=2.0,
        help="seconds to build the survivors' cross-replica group (default: 2)",
    )
    g.add_argument(
        "--restart-s",
        type=float,
        default=300.0,
        help="checkpoint-restart: seconds to stop, relaunch, rendezvous and load (default: 300)",
    )
    g.add_argument("--repair-h", type=float, default=1.0, help="<= 0: never repaired")
    v = p.add_argument_group("validation")
    v.add_argument(
        "--validate",
        nargs="+",
        default=None,
        metavar="RUN",
        help="run folders (PATH or MODE=PATH): predicted vs measured throughput",
    )
    v.add_argument(
        "--tolerance",
        type=float,
        default=0.15,
        help="largest relative error of a validated prediction (default: 0.15)",
    )
    v.add_argument(
        "--cpu-cores",
        type=int,
        default=os.cpu_count() or 1,
        help="cores of the machine the runs ran on (default: this one's)",
    )
    p.add_argument("--no-plots", action="store_true", help="write simulate.json only, no PNGs")


def _validate(args: argparse.Namespace, bench) -> int:
    from recover.tooling.simulate.model import Costs
    from recover.tooling.simulate.report import format_validation, write_json
    from recover.tooling.simulate.scenarios import DEFAULT_DETECT_S
    from recover.tooling.simulate.validate import parse_validate_arg, validate_run

    fixed = bench.recovery_fixed_s if bench.recovery_fixed_s is not None else DEFAULT_DETECT_S
    # CPU costs: the measured fixed cost of a failure covers detection, the gloo rebuild and the
    # redo reduce; the microbatch time is calibrated per run.
    costs = Costs(microbatch_s=1.0, detect_s=fixed, rebuild_s=0.0 if bench.recovery_fixed_s
                  is not None else 0.02, ckpt_s=0.05, restart_s=5.0)  # fmt: skip
    rows = []
    for text in args.validate:
        mode, path = parse_validate_arg(text)
        rows.append(validate_run(path, costs, mode=mode, cpu_cores=args.cpu_cores).as_dict())
    print(format_validation(rows, args.tolerance))
    write_json(args.out / "validation.json", {"tolerance": args.tolerance, "runs": rows,
                                              "bench": list(bench.sources)})  # fmt: skip
    print(f"wrote {args.out / 'validation.json'}")
    return 0 if all(abs(r["rel_error"]) <= args.tolerance for r in rows) else 1


def run_simulate(args: argparse.Namespace) -> int:
    from recover.tooling.simulate.model import PoissonFailures
    from recover.tooling.simulate.report import (
        format_mtbf_table,
        format_paper,
        format_scale_table,
        write_json,
        write_plots,
    )
    from recover.tooling.simulate.scenarios import (
        GpuAssumptions,
        mtbf_sweep,
        paper_scenario,
        read_bench,
        scale_sweep,
    )

    try:
        if args.seeds < 1 or args.horizon_days <= 0:
            raise ValueError("--seeds must be >= 1 and --horizon-days > 0")
        bench = read_bench(args.from_bench, cpu_cores=args.cpu_cores)
        if args.validate:
            return _validate(args, bench)
        a = GpuAssumptions(
            params=args.params, seq_len=args.seq_len, gpus_per_replica=args.gpus_per_replica,
            microbatches_per_replica=args.microbatches_per_replica, mfu=args.mfu,
            peak_flops=args.peak_tflops * 1e12, rebuild_s=args.rebuild_s,
            restart_s=args.restart_s, repair_s=args.repair_h * 3600 if args.repair_h > 0 else None,
        )  # fmt: skip
        kw = {"correlated_fraction": args.correlated, "node_gpus": args.node_gpus}
        if args.gpu_failures_per_hour is not None:
            kw["gpu_rate_per_h"] = args.gpu_failures_per_hour
        failures = PoissonFailures(**kw)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    horizon = args.horizon_days * 86400.0
    paper = paper_scenario(a, bench)
    sens = [paper_scenario(a, bench, restart_s=r) for r in (30.0, 120.0, 300.0, 900.0)]
    scale = scale_sweep(a, bench, gpus=args.scales, failures=failures, horizon_s=horizon,
                        seeds=args.seeds, seed=args.seed)  # fmt: skip
    mtbf = mtbf_sweep(a, bench, gpus=args.mtbf_gpus, mtbf_h=args.mtbf_hours, base=failures,
                      horizon_s=horizon, seeds=args.seeds, seed=args.seed)  # fmt: skip
    print(format_paper(paper, sens))
    print(f"\nScale (per-GPU failure rate {failures.gpu_rate_per_h:.3g}/h, "
          f"{args.horizon_days:g} days, mean of {args.seeds} seeds):\n")  # fmt: skip
    print(format_scale_table(scale))
    print(f"\nMTBF sweep at {args.mtbf_gpus:,} GPUs:\n")
    print(format_mtbf_table(mtbf))
    figures = {
        "assumptions": vars(a), "failures": vars(failures), "bench": list(bench.sources),
        "horizon_s": horizon, "seeds": args.seeds, "seed": args.seed,
        "paper_scenario": paper, "restart_sensitivity": sens, "scale": scale, "mtbf": mtbf,
    }  # fmt: skip
    write_json(args.out / "simulate.json", figures)
    print(f"\nwrote {args.out / 'simulate.json'}")
    if not args.no_plots:
        paths, why = write_plots(args.out, scale, mtbf)
        for path in paths:
            print(f"wrote {path}")
        if why:
            print(why)
    return 0
