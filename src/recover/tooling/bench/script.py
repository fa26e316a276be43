"""`recover bench script`: a user's script under ReCoVer against the same script under plain DDP.

Job: the failure-free cost of adopting the drop-in API. Runs on one machine (a) the DDP version
of a script under torchrun (gradient accumulation with `no_sync`: the last microbatch's backward
pass reduces in buckets; examples/train_ddp.py) and (b) the ReCoVer version under `recover run`
(examples/train_custom.py, by default with --early-update: its update runs during each step's
vote), with the same model, data, M and replicas, and states the step-time ratio b / a with a 95%
interval, for the median steps and for the fastest ones, and where recover's step went (the
parts its step records carry).

Method: `recover bench overhead`'s interleaved blocks (recover.tooling.bench.overhead): both
jobs started once and run side by side but never at once (every process of one is frozen while
the other runs a block of `--block-steps` step times, which goes first alternating per pair);
per block the median (and the fastest) of the steps wholly inside it; the ratio is the geometric
mean over the pairs with a percentile-bootstrap interval. A step's time is the gap between two
lines of the writer's losses.jsonl (each script writes one per step with its wall time).

Costs and limits: two start-ups, then about 2 x blocks x block-steps steps. The DDP ranks share
torchrun's session (one scheduling group under autogroup) where recover's processes have one
each: this matters only against other load on the machine, since the two jobs never run at once.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from recover.record import read_metrics
from recover.tooling.bench.overhead import (
    ENDLESS_STEPS,
    FROZEN_SAFE_FLAGS,
    METHOD,
    Job,
    format_parts,
    print_cpu,
    run_interleaved,
    step_records,
)


@dataclass
class ScriptJob(Job):
    """A script's job: its steps from the writer's losses.jsonl (a line per step with its wall
    time; a step's time is the gap to the line before), its failures from `run_record` (a
    `recover run` folder's metrics.jsonl)."""

    run_record: Path | None = None

    def records(self) -> list[dict]:
        """The step records of a `recover run` folder, whose parts the step machine times (the
        DDP script's log has none)."""
        return step_records(self.run_record)

    def steps(self) -> list[tuple[float, float]]:
        if not self.record.exists():
            return []
        times = []
        for line in self.record.read_text().splitlines():
            try:
                times.append(float(json.loads(line)["time"]))
            except (ValueError, KeyError):
                continue  # a torn last line: the script is writing it
        return [(b, b - a) for a, b in zip(times, times[1:], strict=False)]

    def failures(self) -> int:
        if self.run_record is None or not self.run_record.exists():
            return 0
        return sum(
            r.get("name") == "coordinator.member_dead" for r in read_metrics(self.run_record)
        )


def start_script_job(
    name: str,
    cmd: list[str],
    out: Path,
    run_record: Path | None = None,
    env: dict[str, str] | None = None,
) -> ScriptJob:
    """Start `cmd` as job `name` (its output in `out`'s parent folder, NAME.log), writing its
    steps to `out`/losses.jsonl; `env`: variables added to the bench's child environment."""
    from recover.tooling.bench.common import child_env

    log = open(out.parent / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**child_env(), **(env or {})},
        start_new_session=True,
    )  # fmt: skip
    return ScriptJob(name, out / "losses.jsonl", [proc], tree=True, run_record=run_record)


def bench_script(args: argparse.Namespace) -> dict:
    from recover.tooling.bench.common import machine_info, run_child

    for name in ("blocks", "block_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    script, ddp = Path(args.script).resolve(), Path(args.ddp_script).resolve()
    for path in (script, ddp):
        if not path.is_file():
            raise ValueError(f"{path}: no such script (run from the repository's root)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "tokens.bin"
        run_child([sys.executable, str(script), "--make-data", str(data)], timeout_s=120)
        common = ["--data", str(data), "--steps", str(ENDLESS_STEPS)]
        common += ["--microbatches", str(args.microbatches)]
        out_a, out_b = tmp / "ddp", tmp / "recover"
        for out in (out_a, out_b):
            out.mkdir()
        a = start_script_job(
            "ddp",
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", str(args.replicas), str(ddp), *common, "--out", str(out_a)],
            out_a,
        )  # fmt: skip
        recover = [
            sys.executable, "-m", "recover.cli", "run", "--replicas", str(args.replicas),
            "--quiet", *FROZEN_SAFE_FLAGS, "--out", str(out_b / "job"), "--",
            sys.executable, str(script), *common, "--out", str(out_b),
            *shlex.split(args.script_args),
        ]  # fmt: skip
        res, _ = run_interleaved(
            a,
            lambda: start_script_job(
                "recover", recover, out_b, run_record=out_b / "job" / "metrics.jsonl"
            ),
            logs=tmp,
            args=args,
        )
    result = {
        "benchmark": "script",
        "method": METHOD.format(a="ddp", b="recover"),
        "scripts": {"recover": str(script), "ddp": str(ddp)},
        "script_args": args.script_args,
        "config": {
            "replicas": args.replicas,
            "M": args.microbatches,
            "blocks": args.blocks,
            "block_steps": args.block_steps,
        },  # fmt: skip
        "machine": machine_info(),
        **res,
    }
    load = res["loadavg_1min"]
    print(
        f"script overhead ({args.replicas} replicas, M={args.microbatches}): ratio "
        f"{res['ratio']:.3f}, 95% CI [{res['ci_low']:.3f}, {res['ci_high']:.3f}] over "
        f"{res['blocks']} block pairs ({res['blocks_dropped']} dropped; blocks of "
        f"{res['block_s']:.1f} s); fastest steps {res['fastest_ratio']:.3f} "
        f"[{res['fastest_ci_low']:.3f}, {res['fastest_ci_high']:.3f}]; load average "
        f"{load['min']:.1f}-{load['max']:.1f} (median {load['median']:.1f})"
    )
    if res["parts"]:
        print("where recover's step went (mean over the measured steps, share of the step):")
        print(format_parts(res["parts"]))
    print_cpu(res)
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
    p.add_argument(
        "--script-args", default="--early-update", metavar="ARGS",
        help="more arguments for the ReCoVer script only (default: --early-update: the update "
        "runs during each step's vote; give '' for the optimizer step in the loop)",
    )  # fmt: skip
    p.add_argument("--replicas", type=int, default=3, help="replicas / DDP ranks (default: 3)")
    p.add_argument("--microbatches", type=int, default=6, help="M (default: 6)")
    p.add_argument(
        "--blocks", type=int, default=30,
        help="pairs of interleaved blocks, one of each job (default: 30)",
    )  # fmt: skip
    p.add_argument(
        "--block-steps", type=int, default=10,
        help="a block's length in step times of the slower job (default: 10)",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=float, default=600.0, help="a job's start-up and warm-up, seconds"
    )
    p.add_argument(
        "--json",
        default="bench-script.json",
        metavar="PATH",
        help="where to write the result (default: bench-script.json)",
    )
