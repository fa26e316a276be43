"""Two trees of this project side by side on the script path: did a change to the library cost or
save time per step?

`recover bench script` times a script under `recover run` against plain DDP; a change to the
library moves that ratio by a percent or two, less than its spread from run to run (the machine's
speed drifts: the same tree gave ratios 1.065 and 1.110 an hour apart on one 2-core EPYC). This
runs the same script (examples/train_custom.py with --early-update, 3 replicas, M = 6) under
`recover run` twice at once, each job importing the library from its own source folder
(PYTHONPATH), and interleaves them with the bench's method (recover.tooling.bench.overhead:
both jobs started once, one SIGSTOPped while the other runs a block of 10 step times, which goes
first alternating per pair). It prints B's step-time ratio over A's with its 95% interval over
the block pairs, and each job's CPU per step by process (its processes' CPU over its blocks,
divided by the steps it completed in them; the CPU ratio is the steadier figure on a machine
with fewer cores than processes, where the step-time ratio follows it).

Run A against A first: that is the method's noise on the machine at hand. On a 2-core EPYC four
such runs gave step-time ratios 0.995-1.034 and CPU ratios 0.977-1.007.

    git worktree add /tmp/before HEAD~1
    python benchmarks/tree_ab.py /tmp/before/src src [--blocks 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_custom.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="tree A's source folder (holding recover/)")
    p.add_argument("b", type=Path, help="tree B's source folder")
    p.add_argument("--blocks", type=int, default=30, help="pairs of blocks (default: 30)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=6)
    p.add_argument("--timeout", type=float, default=120.0, help="a job's start-up, seconds")
    p.add_argument("--json", type=Path, help="where to write the result")
    args = p.parse_args(argv)
    for name in ("a", "b"):
        src = getattr(args, name).resolve()
        if not (src / "recover" / "__init__.py").is_file():
            p.error(f"{src}: not a source folder of this project (no recover/__init__.py)")
        setattr(args, name, src)
    if args.blocks < 1:
        p.error("--blocks must be >= 1")
    sys.path.insert(0, str(ROOT / "src"))
    from recover.tooling.bench.common import child_env, machine_info
    from recover.tooling.bench.overhead import (
        ENDLESS_STEPS,
        FROZEN_SAFE_FLAGS,
        print_cpu,
        run_interleaved,
    )
    from recover.tooling.bench.script import ScriptJob, start_script_job

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "tokens.bin"
        env = {**child_env(), "PYTHONPATH": str(args.a)}
        subprocess.run([sys.executable, str(SCRIPT), "--make-data", str(data)], check=True, env=env)
        common = ["--data", str(data), "--steps", str(ENDLESS_STEPS)]
        common += ["--microbatches", str(args.microbatches), "--early-update"]

        def start(name: str, src: Path) -> ScriptJob:
            out = tmp / name
            out.mkdir()
            cmd = [
                sys.executable, "-m", "recover.cli", "run", "--replicas", str(args.replicas),
                "--quiet", *FROZEN_SAFE_FLAGS, "--out", str(out / "job"), "--",
                sys.executable, str(SCRIPT), *common, "--out", str(out),
            ]  # fmt: skip
            record = out / "job" / "metrics.jsonl"
            return start_script_job(name, cmd, out, record, env={"PYTHONPATH": str(src)})

        timing = argparse.Namespace(blocks=args.blocks, block_steps=10, timeout=args.timeout)
        res, _ = run_interleaved(
            start("a", args.a), lambda: start("b", args.b), logs=tmp, args=timing
        )
    load = res["loadavg_1min"]
    print(
        f"B / A ({args.b} / {args.a}): step time {res['ratio']:.3f} [{res['ci_low']:.3f}, "
        f"{res['ci_high']:.3f}] over {res['blocks']} block pairs, fastest steps "
        f"{res['fastest_ratio']:.3f} [{res['fastest_ci_low']:.3f}, {res['fastest_ci_high']:.3f}]; "
        f"load average {load['min']:.1f}-{load['max']:.1f}"
    )
    print_cpu(res)
    if args.json:
        result = {"benchmark": "tree_ab", "a": str(args.a), "b": str(args.b), **res}
        result["machine"] = machine_info()
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
