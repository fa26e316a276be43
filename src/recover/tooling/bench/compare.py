"""`recover bench compare`: every mode (recover, recover with respawn, checkpoint-restart, shrink,
and torchft twice when installed: its documented defaults and tuned) on the same model, data,
seed, M and fault schedule. Every row carries its settings and the load average around its run."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from recover.tooling.bench.common import bench_setup, machine_info, run_recover

# The delay before a dead replica is restarted: the recover+respawn row's `--respawn`, and the
# scheduler's delay in both torchft rows (torchft expects its dead replicas to be restarted).
RESPAWN_S = 0.0

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
            # The replica's second microbatch: its first runs during the previous step's vote
            # (--ahead), where a kill lands between two steps, not in the middle of one.
            spec += ",microbatch=1"
        specs.append(spec)
    return specs


def bench_compare(args: argparse.Namespace) -> dict:
    from recover.tooling.report import build_table, format_markdown, write_report

    data, cfg, flags = bench_setup(args)
    faults = parse_schedule(args.faults, replicas=args.replicas)
    last_fault = max(int(f.split("step=")[1].split(",")[0]) for f in faults)
    if last_fault >= cfg.steps:
        raise ValueError(
            f"--steps {cfg.steps} ends before the last scheduled failure ({last_fault})"
        )
    fault_flags = [a for f in faults for a in ("--fault", f)]
    # Equal shares in every mode: the victim then holds the microbatch its kill names (under
    # throughput weights a replica measured slow may hold one id).
    flags = [*flags, "--balance", "equal"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # recover runs twice: the survivors carrying on alone, and with the dead replaced at once
    # (--respawn RESPAWN_S, as in the torchft rows). Here a restarted process starts on the same
    # 2 cores as the survivors and its start-up (torch import, model build) slows them; on a
    # cluster it starts on another node.
    # Each mode's own flags (its settings in the table); every mode but the first gets the faults.
    modes = {
        "failure-free": [],
        "recover": [],
        "recover+respawn": ["--respawn", f"{RESPAWN_S:g}"],
        "checkpoint-restart": ["--mode", "checkpoint-restart",
                               "--ckpt-every", str(args.ckpt_every)],
        "shrink": ["--mode", "shrink"],
    }  # fmt: skip
    runs: dict[str, Path] = {}
    settings: dict[str, str] = {}
    loads: dict[str, tuple[float, float]] = {}  # 1-minute load average at a run's start and end
    for name, own in modes.items():
        run = out_dir / "runs" / name
        if run.exists():
            raise ValueError(f"{run} exists: choose a new --out for a new comparison")
        print(f"  running {name} ...", flush=True)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        faulted = fault_flags if name != "failure-free" else []
        # (flags given twice, like --ckpt-every, take their last value)
        runs[name] = run_recover([*flags, *faulted, *own], run, timeout_s=args.timeout)
        loads[name] = (load0, os.getloadavg()[0])
        settings[name] = " ".join(own) or ("no faults" if not faulted else "defaults")
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    if getattr(args, "without_torchft", False):
        torchft_note, torchft_settings = "torchft left out (--without-torchft)", {}
    else:
        torchft_note, torchft_settings = _maybe_run_torchft(
            cfg, args.replicas, faults, data, out_dir, runs, settings, loads
        )
    rows = build_table(runs, reference="failure-free")
    for row in rows:
        row["settings"] = settings[row["name"]]
        row["load_1m_start"], row["load_1m_end"] = loads[row["name"]]
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
        "respawn_s": RESPAWN_S,
        "torchft_settings": torchft_settings,
        "machine": machine_info(),
        "rows": rows,
    }


def _maybe_run_torchft(
    cfg, replicas: int, faults, data: Path, out_dir: Path, runs: dict, settings: dict, loads: dict
) -> tuple[str | None, dict]:
    """Run the real torchft on the same work when it is installed (the `torchft` extra): with its
    documented defaults and tuned, each restarting a dead replica after RESPAWN_S. Returns a note
    when it did not run, and each run's full settings."""
    from recover.tooling.torchft_harness import (
        DOCUMENTED,
        TUNED,
        TorchftUnavailable,
        describe_settings,
        require_torchft,
        run_torchft,
    )

    try:
        require_torchft()
    except TorchftUnavailable as e:
        return f"torchft skipped: {e}", {}
    full: dict[str, dict] = {}
    for name, base in (("torchft-defaults", DOCUMENTED), ("torchft-tuned", TUNED)):
        hcfg = replace(base, replicas=replicas, faults=tuple(faults), respawn_s=RESPAWN_S)
        run = out_dir / "runs" / name
        print(f"  running {name} ...", flush=True)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        if run_torchft(cfg, hcfg, data=data, out=run, log=lambda *a: None) != 0:
            return f"{name} run failed (see its run folder {run})", full
        loads[name] = (load0, os.getloadavg()[0])
        runs[name], settings[name], full[name] = run, describe_settings(hcfg), asdict(hcfg)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return None, full
