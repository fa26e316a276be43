"""`recover bench coordinator`'s flags and its runner: one row per R, straight, through relays,
or the coordinator tier alone (`--upstream-only`); a table on stdout and one JSON file.

Job: turn flags into `BenchCoordinatorConfig`s and call `coordinator.run_once` (the whole
system) or `coordinator_tier.run_tier` (the coordinator behind simulated relays) for each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from recover.coordinator.options import CoordinatorOptions
from recover.tooling.bench.common import machine_info
from recover.tooling.bench.coordinator import (
    BenchCoordinatorConfig,
    format_table,
    message_costs,
    run_once,
)
from recover.tooling.bench.coordinator import __doc__ as METHOD
from recover.tooling.bench.coordinator_tier import run_tier

__all__ = ["add_coordinator_bench_parser", "run_coordinator_bench"]


def add_coordinator_bench_parser(sub) -> None:
    p = sub.add_parser(
        "coordinator",
        help="the coordinator under R simulated replicas",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--replicas", default="64", help="R, or a comma list")
    p.add_argument("--microbatches", type=int, default=0, help="M (0: 2 x R)")
    p.add_argument("--ranks-per-replica", type=int, default=1, help="K: K-1 view watchers each")
    p.add_argument("--steps", type=int, default=8, help="failure-free steps measured")
    p.add_argument("--compute", type=float, default=1.0, help="seconds of 'compute' per step")
    p.add_argument(
        "--lease",
        type=float,
        default=CoordinatorOptions.lease_s,
        help=f"lease in seconds (default: {CoordinatorOptions.lease_s:g})",
    )
    p.add_argument("--heartbeat", type=float, default=0.1, help="heartbeat period = hold (s)")
    p.add_argument(
        "--relays",
        default="0",
        help="relay processes in front of the coordinator (replica r speaks to relay "
        "r * N // R), or a comma list matching --replicas; 0: none",
    )
    p.add_argument(
        "--drivers",
        default="1",
        help="processes that simulate the replicas, or a comma list matching --replicas",
    )
    p.add_argument(
        "--upstream-only",
        action="store_true",
        help="simulate only what the N relays send the coordinator (no replica sockets, no relay "
        "processes): the coordinator tier at an R too large to simulate whole on this machine",
    )
    p.add_argument(
        "--costs", action="store_true", help="also time the rules per message in-process (no I/O)"
    )
    p.add_argument("--no-faults", action="store_true", help="skip the kill and the hang")
    p.add_argument(
        "--etcd",
        action="store_true",
        help="keep the coordinator's state in a private etcd (serve --state; needs etcd-server) "
        "and report its writes per step and per second over the measured steps",
    )
    p.add_argument("--out", default="bench-coordinator.json", metavar="FILE", help="JSON result")


def _per_size(value: str, n: int, name: str) -> list[int]:
    xs = [int(x) for x in str(value).split(",")]
    if len(xs) == 1:
        return xs * n
    if len(xs) != n:
        raise ValueError(f"--{name} must be one number or one per --replicas value, got {value}")
    return xs


def run_coordinator_bench(args: argparse.Namespace) -> int:
    rows = []
    try:
        sizes = [int(x) for x in str(args.replicas).split(",")]
        relays = _per_size(args.relays, len(sizes), "relays")
        drivers = _per_size(args.drivers, len(sizes), "drivers")
        cfgs = [
            BenchCoordinatorConfig(
                replicas=r,
                microbatches=args.microbatches,
                ranks_per_replica=args.ranks_per_replica,
                steps=args.steps,
                compute_s=args.compute,
                lease_s=args.lease,
                heartbeat_s=args.heartbeat,
                faults=not args.no_faults,
                relays=n,
                drivers=d,
                upstream_only=args.upstream_only,
                etcd=args.etcd,
            )
            for r, n, d in zip(sizes, relays, drivers, strict=True)
        ]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for cfg in cfgs:
        row = run_tier(cfg) if cfg.upstream_only else run_once(cfg)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(format_table(rows))
    costs = [message_costs(cfg.replicas, cfg.microbatches) for cfg in cfgs] if args.costs else []
    for c in costs:
        print(json.dumps(c))
    result = {
        "benchmark": "coordinator",
        "machine": machine_info(),
        "loadavg_at_end": os.getloadavg(),
        "method": METHOD,
        "rows": rows,
        "message_costs": costs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0
