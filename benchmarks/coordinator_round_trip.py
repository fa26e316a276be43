"""A step's coordinator round trips: the done report answered with the outcome (one round trip)
against the done report, then `wait_outcome` (two), side by side.

A real `recover coordinator serve` process (no torch store) and R replica processes, each a
`CoordinatorClient` that does nothing but report: every step each replica reports done and waits
for the commit, so a step's time is the control plane's alone. The two ways take turns in blocks
of `--block` steps (which goes first alternates per pair of blocks); every replica runs the same
schedule, so a step is reported one way by all. The old way is the client's previous code path:
the report on its own (no `deadline_s`), then the `wait_outcome` long poll.

Figures, per way: the median over steps of the step's time (one replica's clock: the time from
one commit it saw to the next), and the median of the report latency (report sent -> outcome in
hand, every replica); `ratio` = one round trip / two, per pair of blocks (median of the step
times in each block), as the geometric mean over the pairs, with a 95% percentile-bootstrap
interval over the pairs (2,000 resamples, seed 0). The load average before and after.

    python benchmarks/coordinator_round_trip.py [--replicas 2] [--pairs 20] [--block 25]
        [--json benchmarks/results/coordinator_round_trip.json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recover.coordinator.client import CoordinatorClient


def _replica(
    r: int, replicas: int, address: tuple[str, int], schedule: list[str], block: int, out
) -> None:
    c = CoordinatorClient(*address, replica_id=r)
    try:
        view = c.register(fingerprint={"microbatches": 2 * replicas}, next_step=0, deadline_s=60)
        rows = []
        for b, way in enumerate(schedule):
            for _ in range(block):
                step, epoch = view.step, view.attempt_epoch
                t0 = time.perf_counter()
                if way == "one":
                    outcome = c.report_done(step=step, epoch=epoch, deadline_s=30)
                else:  # the previous code path: the report alone, then the wait
                    c._raise_report_refusal(
                        c._rpc_call(c._member({"kind": "done", "step": step, "epoch": epoch})),
                        step,
                        epoch,
                    )
                    outcome = c.wait_outcome(step=step, epoch=epoch, deadline_s=30)
                t1 = time.perf_counter()
                if type(outcome).__name__ != "StepCommitted":
                    raise RuntimeError(f"step {step}: {outcome!r}")
                rows.append((b, way, t1 - t0, t1))
                view = c.view
        out.put((r, rows))
        c.leave(step=view.step)
    finally:
        c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--block", type=int, default=25, help="steps per block")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    schedule = []
    for k in range(args.pairs):  # which way goes first alternates per pair
        schedule += ["one", "two"] if k % 2 == 0 else ["two", "one"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        addr_file = Path(tmp) / "addr.json"
        cmd = [
            sys.executable, "-c", "import sys; from recover.cli import main; sys.exit(main())",
            "coordinator", "serve",
            "--replicas", str(args.replicas),
            "--no-store", "--port", "0", "--address-file", str(addr_file), "--lease", "5",
            "--log-level", "warning",
        ]  # fmt: skip
        server = subprocess.Popen(cmd, start_new_session=True)
        try:
            end = time.monotonic() + 60
            while not addr_file.exists() or not addr_file.read_text().strip():
                if time.monotonic() > end or server.poll() is not None:
                    raise RuntimeError("the coordinator did not start")
                time.sleep(0.05)
            info = json.loads(addr_file.read_text())
            address = (info["host"], int(info["port"]))
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            procs = [
                ctx.Process(
                    target=_replica, args=(r, args.replicas, address, schedule, args.block, out)
                )
                for r in range(args.replicas)
            ]
            for proc in procs:
                proc.start()
            results = dict(out.get(timeout=600) for _ in procs)
            for proc in procs:
                proc.join(30)
        finally:
            server.terminate()
            server.wait(10)
    load_after = os.getloadavg()

    latency = {w: [x for rows in results.values() for _, way, x, _ in rows if way == w]
               for w in ("one", "two")}  # fmt: skip
    step_s: dict[str, list[float]] = {"one": [], "two": []}
    block_median: dict[int, float] = {}
    rows0 = results[0]
    for b in range(len(schedule)):
        ends = [t for bb, _, _, t in rows0 if bb == b]
        gaps = [y - x for x, y in zip(ends, ends[1:], strict=False)]
        step_s[schedule[b]] += gaps
        block_median[b] = statistics.median(gaps)
    ratios = []
    for k in range(args.pairs):
        b_one, b_two = (2 * k, 2 * k + 1) if schedule[2 * k] == "one" else (2 * k + 1, 2 * k)
        ratios.append(block_median[b_one] / block_median[b_two])
    logs = [math.log(x) for x in ratios]
    ratio = math.exp(statistics.fmean(logs))
    rng = random.Random(0)
    boot = sorted(math.exp(statistics.fmean(rng.choices(logs, k=len(logs)))) for _ in range(2000))
    result = {
        "benchmark": "coordinator_round_trip",
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "replicas": args.replicas,
        "pairs": args.pairs,
        "block": args.block,
        "step_s_median": {w: statistics.median(v) for w, v in step_s.items()},
        "report_latency_s_median": {w: statistics.median(v) for w, v in latency.items()},
        "report_latency_s_p90": {w: statistics.quantiles(v, n=10)[-1] for w, v in latency.items()},
        "ratio_one_over_two": ratio,
        "ratio_95_interval": [boot[49], boot[1949]],
        "ratio_per_pair_min_max": [min(ratios), max(ratios)],
        "load_average_before_after": [load_before[0], load_after[0]],
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
