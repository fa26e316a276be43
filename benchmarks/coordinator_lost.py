"""What a lost coordinator costs without a standby: from its SIGKILL to the checkpoint of the last
committed step, and to the end of every process.

Method: `recover train` (tiny preset, 2 replicas, M = 4, `--coordinator-grace G`) on a small
corpus of pseudo-random words prepared under a temporary folder; the coordinator (its pid from
RUN/coordinator.json) is SIGKILLed once `--kill-at` steps are recorded. Measured per run: seconds
from the kill to the `checkpoint_saved` event's write (the save is durable then), the save's own
seconds, and seconds to the launcher's exit; checked per run: the exit status is 11, the
checkpoint is of the step after the last step record, every step recorded once. Prints one line
per run and JSON with the machine, the load average and the medians.

    python benchmarks/coordinator_lost.py [--runs 3] [--grace 2] [--kill-at 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = "replica rank step microbatch plan epoch commit snapshot gradient reduce".split()
TRAIN = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", "4",
    "--eval-every", "0", "--warmup-steps", "2", "--steps", "2000", "--ckpt-every", "0",
    "--replicas", "2",
]  # fmt: skip


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_run(data: Path, out: Path, grace: float, kill_at: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "recover.cli", "train", *TRAIN, "--data", str(data)]
    cmd += ["--out", str(out), "--coordinator-grace", str(grace)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        end = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < end:
            if sum(r.get("kind") == "step" for r in records(out / "metrics.jsonl")) >= kill_at:
                break
            time.sleep(0.02)
        pid = json.loads((out / "coordinator.json").read_text())["pid"]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=300)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    recs = records(out / "metrics.jsonl")
    steps = [r["step"] for r in recs if r.get("kind") == "step"]
    (saved,) = [r for r in recs if r.get("name") == "checkpoint_saved"]
    ok = proc.returncode == 11 and saved["step"] == len(steps)
    ok = ok and sorted(steps) == list(range(len(steps)))
    return {
        "ok": ok,
        "exit_status": proc.returncode,
        "steps_committed": len(steps),
        "checkpoint_step": saved["step"],
        "kill_to_saved_s": round(saved["t_wall"] - killed, 3),
        "save_s": saved["seconds"],
        "kill_to_exit_s": round(ended - killed, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from recover.data import prepare_dataset

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        rng = random.Random(7)
        for i in range(40):
            text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(40))
            (corpus / f"doc_{i:03d}.txt").write_text(text + "\n")
        data = prepare_dataset(Path(tmp) / "data", source=corpus, show_progress=False)
        runs = []
        for i in range(args.runs):
            runs.append(one_run(data, Path(tmp) / f"run{i}", args.grace, args.kill_at))
            print(json.dumps(runs[-1]), flush=True)
    result = {
        "benchmark": "coordinator_lost",
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "python": platform.python_version(),
        "grace_s": args.grace,
        "runs": runs,
        "median": {
            k: statistics.median(r[k] for r in runs)
            for k in ("kill_to_saved_s", "save_s", "kill_to_exit_s")
        },
    }
    print(json.dumps(result["median"]))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
