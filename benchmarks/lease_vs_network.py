"""How slow and lossy a replica's link may be before the default lease (1 s, a heartbeat every
0.1 s) declares it dead falsely: a grid of one-way delays and frame-loss rates, one run each.

Method: three hosts made of network namespaces on one bridge (tests/hosts.py): the coordinator
(`recover coordinator serve --lease 1`) on host 0, replica 0 (`recover worker`, tiny preset,
M = 4, 2 replicas) on host 1 behind a clean veth, replica 1 on host 2 behind the user-space relay
that holds each frame delay_ms and drops it with probability loss, in each direction (so the
round trip gains 2 * delay_ms; the relay is the one tests/hosts.py uses, there is no netem). The
dataset is a small corpus of pseudo-random words prepared under a temporary folder. Per setting:
whether the run finished (both workers exit 0 before the per-run timeout; the coordinator is
sent SIGTERM after them, should it still serve), the `coordinator.member_dead` events of its
--events file (every one is a false death: nothing is faulted), the median and max of the step
records' step_s, the steps committed, the wall time from the coordinator's start to the last
worker's exit, the counts of the other events, and the load average before and after the run. On
a timeout the Network's close() kills every process on the hosts and deletes the namespaces.

    sudo python benchmarks/lease_vs_network.py [--steps 20] [--grid 25:0,50:0,50:0.05 ...]
        [--timeout 180] [--out benchmarks/results/lease_vs_network.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import hosts  # noqa: E402  (tests/hosts.py: the namespaces)

PORT = 29400
TOKEN = "lease-vs-network-token"
M = 4
LEASE_S = 1.0
RESULT = ROOT / "benchmarks/results/lease_vs_network.json"
WORDS = "replica rank step microbatch plan epoch commit snapshot gradient reduce".split()
TINY = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", str(M),
    "--eval-every", "0", "--warmup-steps", "2", "--ckpt-every", "0",
]  # fmt: skip
# (delay_ms each way, loss): the delays at no loss, then the loss rates at 50 ms.
DEFAULT_GRID = [(25, 0.0), (50, 0.0), (100, 0.0), (200, 0.0), (300, 0.0), (400, 0.0),
                (450, 0.0), (500, 0.0), (50, 0.05), (50, 0.10), (50, 0.20)]  # fmt: skip


def parse_grid(text: str) -> list[tuple[float, float]]:
    """`25:0,50:0.05` -> [(25.0, 0.0), (50.0, 0.05)]."""
    grid = []
    for item in text.split(","):
        delay, _, loss = item.strip().partition(":")
        grid.append((float(delay), float(loss or 0)))
    return grid


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line torn by a process killed mid-write
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make_dataset(tmp: Path) -> Path:
    from recover.data import prepare_dataset

    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = random.Random(7)
    for i in range(40):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(40))
        (corpus / f"doc_{i:03d}.txt").write_text(text + "\n")
    return prepare_dataset(tmp / "data", source=corpus, show_progress=False)


def one_run(data: Path, run: Path, delay_ms: float, loss: float, steps: int, timeout: float):
    run.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RECOVER_TOKEN": TOKEN}
    py = [sys.executable, "-m", "recover.cli"]
    load_before = os.getloadavg()
    codes: list[int | None] = [None, None]
    with hosts.Network(3, impaired={2: (delay_ms, loss)}) as net:
        logs = [open(run / name, "w") for name in ("coordinator.log", "w0.log", "w1.log")]
        try:
            t0 = time.monotonic()
            coordinator = net.host(0).popen(
                [*py, "coordinator", "serve", "--host", "0.0.0.0", "--port", str(PORT),
                 "--replicas", "2", "--lease", str(LEASE_S),
                 "--events", str(run / "metrics.jsonl")],
                env=env, stdout=logs[0], stderr=subprocess.STDOUT,
            )  # fmt: skip
            workers = []
            for r in (0, 1):
                argv = [*py, "worker", "--coordinator", f"{net.host(0).addr}:{PORT}",
                        "--replica-id", str(r), "--data", str(data), "--out", str(run),
                        *TINY, "--steps", str(steps)]  # fmt: skip
                w = net.host(r + 1).popen(
                    argv, env=env, stdout=logs[r + 1], stderr=subprocess.STDOUT
                )
                workers.append(w)
            deadline = t0 + timeout
            for i, w in enumerate(workers):
                try:
                    codes[i] = w.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass  # killed, with all the rest, by the Network's close()
            wall = time.monotonic() - t0
            coordinator.terminate()  # (an older coordinator serves on after the run)
            try:
                coordinator.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        finally:
            for f in logs:
                f.close()
    load_after = os.getloadavg()
    recs = records(run / "metrics.jsonl")
    step_s = {r["step"]: r["step_s"] for r in recs if r.get("kind") == "step"}
    dead = [r for r in recs if r.get("name") == "coordinator.member_dead"]
    names = collections.Counter(r["name"] for r in recs if r.get("kind") == "event")
    timed_out = None in codes
    out = {
        "delay_ms_each_way": delay_ms,
        "rtt_ms": 2 * delay_ms,
        "loss": loss,
        "finished": codes == [0, 0],
        "timed_out": timed_out,
        "exit_status": codes,
        "false_deaths": len(dead),
        "member_dead": [
            {k: r.get(k) for k in ("replica_id", "how", "reason", "lease_age_s") if k in r}
            for r in dead
        ],
        "steps_committed": len(step_s),
        "step_s_median": round(statistics.median(step_s.values()), 3) if step_s else None,
        "step_s_max": round(max(step_s.values()), 3) if step_s else None,
        "wall_s": round(wall, 2),
        "events": dict(sorted(names.items())),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
    }
    if not out["finished"] or dead:  # what the processes said last, to tell why
        out["log_tails"] = {
            f.stem: (run / f.name).read_text(errors="replace")[-1500:]
            for f in (run / "coordinator.log", run / "w0.log", run / "w1.log")
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--grid", type=parse_grid, default=DEFAULT_GRID,
        help="DELAY_MS[:LOSS],... one-way delay and loss of replica 1's link (default: "
        + ",".join(f"{d:g}:{x:g}" for d, x in DEFAULT_GRID) + ")",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    ok, why = hosts.available(tap=True)
    if not ok:
        sys.exit(f"needs network namespaces and /dev/net/tun: {why}")
    import torch

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    runs = []
    head = f"{'delay':>6} {'RTT':>6} {'loss':>5} {'finished':>8} {'deaths':>6} {'steps':>5} " \
           f"{'step_s med':>10} {'max':>6} {'wall_s':>7} {'load 1m':>11}"  # fmt: skip
    print(head, flush=True)
    with tempfile.TemporaryDirectory(prefix="lease_vs_network-") as tmp:
        data = make_dataset(Path(tmp))
        for i, (delay, loss) in enumerate(args.grid):
            r = one_run(data, Path(tmp) / f"run{i}", delay, loss, args.steps, args.timeout)
            runs.append(r)
            med = "-" if r["step_s_median"] is None else f"{r['step_s_median']:.3f}"
            mx = "-" if r["step_s_max"] is None else f"{r['step_s_max']:.2f}"
            fin = "yes" if r["finished"] else ("timeout" if r["timed_out"] else "no")
            print(f"{delay:>4g}ms {2 * delay:>4g}ms {loss:>5.2f} {fin:>8} {r['false_deaths']:>6} "
                  f"{r['steps_committed']:>5} {med:>10} {mx:>6} {r['wall_s']:>7.1f} "
                  f"{r['load_average_before'][0]:>5.2f}-{r['load_average_after'][0]:<5.2f}",
                  flush=True)  # fmt: skip
    clean = [r for r in runs if r["finished"] and r["false_deaths"] == 0]
    result = {
        "benchmark": "lease_vs_network",
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "machine": {
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "time": started,
        },
        "lease_s": LEASE_S,
        "steps": args.steps,
        "timeout_s": args.timeout,
        "runs": runs,
        "clean": [[r["delay_ms_each_way"], r["loss"]] for r in clean],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
