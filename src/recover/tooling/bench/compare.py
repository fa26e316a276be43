"""`recover bench compare`: every mode (recover, recover with respawn, checkpoint-restart, shrink,
and torchft when installed) on the same model, data, seed, M and fault schedule."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from recover.tooling.bench.common import bench_setup, machine_info, run_recover

# ---- compare: every mode on the same work ---------------------------------------------------


def parse_schedule(text: str, *, replicas: int) -> list[str]:
    """`every=N,count=K[,offset=O][,phase=P]` -> K kill faults at steps N+O, 2N+O, ...,
    replicas 1, 2, ... in turn. The offset (default N // 2) puts a failure in the middle of a
    checkpoint interval when --ckpt-every equals N: the expected case for a failure that strikes at
    a random time (half an interval of work lost), not the lucky case of a failure right after a
    checkpoint."""
    fields = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    try:
        every, count = int(fields["every"]), int(fields["count"])
        offset = int(fields.get("offset", every // 2))
    except (KeyError, ValueError):
        raise ValueError(
            f"--faults {text!r}: expected every=N,count=K[,offset=O][,phase=P], e.g. "
            "every=5,count=3"
        ) from None
    phase = fields.get("phase", "backward")
    if every < 1 or count < 1 or offset < 0:
        raise ValueError("--faults: every and count must be >= 1, offset >= 0")
    specs = []
    for i in range(count):
        victim = 1 + i % (replicas - 1) if replicas > 1 else 0
        spec = f"kill:replica={victim},step={every * (i + 1) + offset},phase={phase}"
        if phase in ("forward", "backward"):
            spec += ",microbatch=0"
        specs.append(spec)
    return specs


def bench_compare(args: argparse.Namespace) -> dict:
    from recover.tooling.report import build_table, format_markdown, write_report

    _, cfg, flags = bench_setup(args)
    faults = parse_schedule(args.faults, replicas=args.replicas)
    last_fault = max(int(f.split("step=")[1].split(",")[0]) for f in faults)
    if last_fault >= cfg.steps:
        raise ValueError(
            f"--steps {cfg.steps} ends before the last scheduled failure ({last_fault})"
        )
    fault_flags = [a for f in faults for a in ("--fault", f)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # recover runs twice: the survivors carrying on alone, and with the dead replaced at once
    # (--respawn 0). Here a respawned process starts on the same 2 cores as the survivors and its
    # start-up (torch import, model build) slows them; on a cluster it starts on another node.
    modes = {
        "failure-free": [],
        "recover": list(fault_flags),
        "recover+respawn": [*fault_flags, "--respawn", "0"],
        "checkpoint-restart": [*fault_flags, "--mode", "checkpoint-restart",
                               "--ckpt-every", str(args.ckpt_every)],
        "shrink": [*fault_flags, "--mode", "shrink"],
    }  # fmt: skip
    runs: dict[str, Path] = {}
    for name, extra in modes.items():
        run = out_dir / "runs" / name
        if run.exists():
            raise ValueError(f"{run} exists: choose a new --out for a new comparison")
        print(f"  running {name} ...", flush=True)
        t0 = time.perf_counter()
        # (flags given twice, like --ckpt-every, take their last value)
        runs[name] = run_recover([*flags, *extra], run, timeout_s=args.timeout)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    torchft_note = _maybe_run_torchft(args, cfg, faults, out_dir, runs)
    rows = build_table(runs, reference="failure-free")
    write_report(rows, out_dir, runs)
    print(format_markdown(rows))
    if torchft_note:
        print(torchft_note)
    return {
        "torchft": torchft_note or "run",
        "benchmark": "compare",
        "method": "every mode runs the same model, data, seed, M and fault schedule in one "
        "session on this machine; figures are computed from each run's metrics.jsonl",
        "faults": faults,
        "config": {**cfg.to_dict(), "replicas": args.replicas},
        "machine": machine_info(),
        "rows": rows,
    }


def _maybe_run_torchft(args, cfg, faults, out_dir: Path, runs: dict) -> str | None:
    """Run the real torchft on the same work when it is installed (the `torchft` extra)."""
    from recover.data.prepare import ensure_dataset
    from recover.tooling.torchft_harness import (
        TorchftHarnessConfig,
        TorchftUnavailable,
        require_torchft,
        run_torchft,
    )

    try:
        require_torchft()
    except TorchftUnavailable as e:
        return f"torchft skipped: {e}"
    data = (
        Path(args.data) if args.data else ensure_dataset(Path(args.data_root), show_progress=False)
    )
    run = out_dir / "runs" / "torchft"
    print("  running torchft ...", flush=True)
    hcfg = TorchftHarnessConfig(replicas=args.replicas, faults=tuple(faults))
    if run_torchft(cfg, hcfg, data=data, out=run, log=lambda *a: None) != 0:
        return "torchft run failed (see its run folder)"
    runs["torchft"] = run
    return None
