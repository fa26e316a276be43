"""The node agents' load on the coordinator at scale: N nodes join, are placed and beat.

A `recover coordinator serve` process (no torch store, R replica ids) and N simulated node agents
in a few driver processes: each node beats as `recover agent` does (`node_beat` with its name,
slots and the ids it holds, every --beat seconds on one connection per driver). Measured:
- the join storm: from the first beat to every id placed (each node heard its ids);
- a steady beat's round trip (median and p99 over every beat after the storm);
- the coordinator's CPU share over the whole run (storm and steady beats).
A node lost and its ids handed on is tests/test_placement.py's and test_agent.py's.
This is the agents' part only; the replicas' sessions behind agents that relay them are
`recover bench coordinator --relays N --upstream-only` (docs/benchmarks.md).

    python benchmarks/node_beats.py [--replicas 12500] [--nodes 1564] [--slots 8] [--drivers 2]
        [--beat 0.83] [--seconds 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _drive(port: int, names: list[str], slots: int, beat_s: float, until: float, out) -> None:
    from recover.coordinator.channel import NodeLink

    link = NodeLink([("127.0.0.1", port)], token="bench", timeout_s=10.0)
    holds: dict[str, list[int]] = {n: [] for n in names}
    placed_at: dict[str, float] = {}
    rtts: list[tuple[float, float]] = []  # (when, round trip)
    while time.time() < until:
        start = time.time()
        for n in names:
            t0 = time.perf_counter()
            reply = link.beat(node=n, slots=slots, holds=holds[n])
            rtts.append((time.time(), time.perf_counter() - t0))
            if reply["assign"] != holds[n]:
                holds[n] = reply["assign"]
                placed_at[n] = time.time()
        time.sleep(max(0.0, beat_s - (time.time() - start)))
    out.put({"placed_at": placed_at, "rtts": rtts, "holds": holds})


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=12500)
    p.add_argument("--nodes", type=int, default=1564, help="nodes (the last ones are standbys)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--drivers", type=int, default=2)
    p.add_argument("--beat", type=float, default=5.0 / 6, help="seconds between a node's beats")
    p.add_argument("--seconds", type=float, default=10.0, help="how long the nodes beat")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        address = Path(tmp) / "address.json"
        env = {**os.environ, "RECOVER_TOKEN": "bench"}
        server = subprocess.Popen(
            [sys.executable, "-m", "recover.cli", "coordinator", "serve", "--port", "0",
             "--no-store", "--replicas", str(args.replicas),
             "--address-file", str(address), "--log-level", "warning", "--keep-serving"],
            env=env,
        )  # fmt: skip
        try:
            while not address.exists():
                time.sleep(0.05)
            port = json.loads(address.read_text())["port"]
            names = [f"node{i:05d}" for i in range(args.nodes)]
            out = mp.Queue()
            start = time.time()
            until = start + args.seconds
            procs = [
                mp.Process(target=_drive, args=(port, names[d :: args.drivers], args.slots,
                                                args.beat, until, out))
                for d in range(args.drivers)
            ]  # fmt: skip
            cpu0 = _cpu_s(server.pid)
            for proc in procs:
                proc.start()
            results = [out.get(timeout=args.seconds + 120) for _ in procs]
            cpu1 = _cpu_s(server.pid)
            for proc in procs:
                proc.join()
        finally:
            server.terminate()
            server.wait()
    placed = [t for r in results for t in r["placed_at"].values()]
    held = sorted(i for r in results for ids in r["holds"].values() for i in ids)
    storm_end = max(placed) if placed else start
    steady = [rtt for r in results for when, rtt in r["rtts"] if when > storm_end]
    steady.sort()
    row = {
        "replicas": args.replicas, "nodes": args.nodes, "slots": args.slots,
        "beat_s": args.beat, "drivers": args.drivers,
        "every_id_placed": held == list(range(args.replicas)),
        "storm_s": round(storm_end - start, 3),
        "beats_per_s": round(len(steady) / max(1e-9, until - storm_end), 1),
        "beat_rtt_ms_median": round(1e3 * statistics.median(steady), 3) if steady else None,
        "beat_rtt_ms_p99": round(1e3 * steady[int(0.99 * (len(steady) - 1))], 3) if steady else None,
        "coordinator_cpu": round((cpu1 - cpu0) / (time.time() - start), 3),
        "loadavg": os.getloadavg()[0],
    }  # fmt: skip
    print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(row, indent=2) + "\n")
    return 0 if row["every_id_placed"] else 1


if __name__ == "__main__":
    sys.exit(main())
