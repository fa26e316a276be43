"""Peak resident memory of `recover prepare` on a corpus of a few hundred MB, before and after
streaming (side by side, one machine, one corpus).

Method: writes a corpus of `--mb` MB of text (a folder of ~100 kB files of pseudo-random words; a
JSONL copy of it for the record formats) under a temporary folder, then prepares it in fresh
child processes and reads each child's peak RSS from `os.wait4`: "before" runs the `prepare` of
git revision `--before` (extracted with `git archive`, so nothing in the tree changes), "after"
the working tree's, on the same text folder; "after, jsonl" the same text as JSONL. Byte tokens
(no tokenizer cost hides the reading). Prints one line per run and JSON with the machine.

    python benchmarks/prepare_memory.py [--mb 300] [--before 14b71b7] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "replica rank step microbatch plan epoch commit snapshot gradient reduce survive recover "
    "token model layer attention loss optimizer learning rate batch sequence train validate"
).split()
CHILD = """
import sys, time
from recover.data.prepare import prepare_dataset
t = time.perf_counter()
prepare_dataset(sys.argv[1], source=sys.argv[2], show_progress=False)
print(time.perf_counter() - t)
"""


def write_corpus(root: Path, mb: int) -> tuple[Path, Path]:
    rng = random.Random(0)
    text_dir, jsonl = root / "text", root / "corpus.jsonl"
    text_dir.mkdir()
    line = " ".join(rng.choice(WORDS) for _ in range(2000)) + "\n"  # ~15 kB, varied per file
    with open(jsonl, "w", encoding="utf-8") as records:
        for i in range(mb * 10):
            body = f"document {i}\n" + line[i % 97 :] * 7
            (text_dir / f"doc_{i:06d}.txt").write_text(body, encoding="utf-8")
            records.write(json.dumps({"text": body}) + "\n")
    return text_dir, jsonl


def run(pythonpath: Path, out: Path, source: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), str(source)], env=env, stdout=subprocess.PIPE
    )
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = float(proc.stdout.read().decode().strip() or "nan")
    if status != 0:
        raise SystemExit(f"prepare failed for {source} (status {status})")
    return {"peak_rss_mb": usage.ru_maxrss / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300)
    parser.add_argument("--before", default="14b71b7", help="git revision of the in-memory prepare")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prepare-mem-") as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        text_dir, jsonl = write_corpus(tmp, args.mb)
        corpus_mb = sum(p.stat().st_size for p in text_dir.iterdir()) / 1e6
        print(f"corpus    {corpus_mb:,.0f} MB in {time.perf_counter() - t:.0f} s", flush=True)
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.before, "src/recover"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        results = {}
        for name, path, source in (
            ("before (in memory)", before / "src", text_dir),
            ("after (streaming)", REPO / "src", text_dir),
            ("after, jsonl", REPO / "src", jsonl),
        ):
            results[name] = run(path, tmp / name.split()[0] / name.replace(" ", "_"), source)
            r = results[name]
            print(
                f"{name:<20} peak RSS {r['peak_rss_mb']:8.0f} MB  {r['seconds']:6.1f} s", flush=True
            )
        ratio = (
            results["before (in memory)"]["peak_rss_mb"]
            / results["after (streaming)"]["peak_rss_mb"]
        )
        print(f"peak RSS before/after: {ratio:.1f}x")
    record = {
        "benchmark": "prepare_memory",
        "corpus_mb": round(corpus_mb, 1),
        "before_revision": args.before,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "results": results,
    }  # fmt: skip
    text = json.dumps(record, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
