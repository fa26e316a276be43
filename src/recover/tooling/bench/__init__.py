"""`recover bench`: measurements that are code, with results that are data.

One module per benchmark: `overhead`, `recovery` (and `rejoin`), `balance`, `compare`, `script`,
`coordinator`; `common` holds what they share. Each writes a JSON file with the machine, the
versions, the method and every raw figure; speed claims are ratios measured side by side in one
run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (named below once all are added)")
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
        p.add_argument(
            "--replicas",
            type=int,
            default=defaults["replicas"],
            help=f"replicas per run (default: {defaults['replicas']})",
        )
        p.add_argument(
            "--steps",
            type=int,
            default=defaults["steps"],
            help="steps per run (rejoin: 0 = chosen per preset)",
        )
        p.add_argument(
            "--repeats",
            type=int,
            default=defaults["repeats"],
            help=f"runs per configuration; medians are quoted (default: {defaults['repeats']})",
        )
        p.add_argument(
            "--microbatches", type=int, default=8, help="M: microbatches per step (default: 8)"
        )
        p.add_argument(
            "--microbatch-size",
            type=int,
            default=8,
            help="sequences per microbatch (default: 8)",
        )
        p.add_argument(
            "--seq-len", type=int, default=128, help="tokens per sequence (default: 128)"
        )
        p.add_argument("--data", default=None, help="dataset folder (default: the built-in corpus)")
        p.add_argument(
            "--data-root",
            default="data",
            help="where the built-in corpus is prepared (default: data)",
        )
        p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
        p.add_argument(
            "--json",
            default=f"bench-{name}.json",
            metavar="PATH",
            help=f"where to write the result (default: bench-{name}.json)",
        )
        if name == "overhead":
            p.add_argument(
                "--deterministic",
                action="store_true",
                help="measure --deterministic against the normal mode instead (the same "
                "interleaved blocks), ratio = deterministic / normal step time",
            )
            p.add_argument(
                "--blocks",
                type=int,
                default=30,
                help="pairs of interleaved blocks, one of each job (--repeats is not used "
                "here; default: 30)",
            )
            p.add_argument(
                "--block-steps",
                type=int,
                default=6,
                help="a block's length in step times of the slower job (default: 6: a block "
                "then holds 4-6 whole steps, as the freeze and the resume cut one or two; at 3 "
                "it held 1-2, and single steps made pair ratios spread 0.73-1.33)",
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
                "--without-torchft",
                action="store_true",
                help="leave out the two torchft rows even when torchft is installed",
            )
            p.add_argument(
                "--out",
                default="bench-compare",
                metavar="DIR",
                help="run folders, compare.json/.md and plots (default: bench-compare)",
            )
    # fmt: on
    from recover.tooling.bench.script import add_script_parser

    add_script_parser(sub)
    from recover.tooling.bench.coordinator_cli import add_coordinator_bench_parser

    add_coordinator_bench_parser(sub)
    # `recover --help` names every benchmark: its line is written from the parsers added above.
    for action in subparsers._choices_actions:  # (argparse keeps each subcommand's help here)
        if action.dest == "bench":
            action.help = f"benchmarks ({', '.join(sub.choices)})"


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "script":
        from recover.tooling.bench.script import bench_script

        return _write_result(bench_script, args)
    if args.bench_command == "coordinator":
        from recover.tooling.bench.coordinator_cli import run_coordinator_bench

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
    from importlib import import_module

    module = "recovery" if args.bench_command == "rejoin" else args.bench_command
    fn = getattr(import_module(f"recover.tooling.bench.{module}"), f"bench_{args.bench_command}")
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
