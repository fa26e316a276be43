"""`recover bench recovery` and `recover bench rejoin`: what a failure costs.

- `recovery` kills one replica at each phase of a step and prints, per phase, the median seconds
  from the kill (`failure_injected`) to the next commit (`coordinator.committed`) beside the
  median failure-free step time of the same runs;
- `rejoin` kills a replica, respawns it, and measures the state transfer and the time to the
  joiner's first commit, per preset, for three ways of starting the joiner side by side: a warm
  standby (`--standby 1`: model built ahead, waiting), a warm fork (the default: forked from the
  zygote, torch imported) and a cold start (`--cold-start`: a fresh process).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from recover.record import committed_steps, read_metrics
from recover.tooling.bench.common import WARMUP_STEPS, bench_setup, machine_info, run_recover

# ---- recovery -------------------------------------------------------------------------------

PHASES = ("forward", "backward", "reduce", "commit", "optimizer")


def kill_to_commit_s(out: Path) -> tuple[float, float]:
    """Seconds from the injected kill to the first commit after it, and to the first commit
    after the coordinator declared the replica dead (the run going on without it). They differ
    when the kill comes after the replica's part of the step was reduced (phase commit): that
    step commits at once, and the next step pays the recovery."""
    records = list(read_metrics(out / "metrics.jsonl"))
    kill = next(r for r in records if r.get("name") == "failure_injected")
    dead = next(
        r for r in records
        if r.get("name") == "coordinator.member_dead" and r["t_wall"] >= kill["t_wall"]
    )  # fmt: skip
    commits = [r["t_wall"] for r in records if r.get("name") == "coordinator.committed"]
    after_kill = min(t for t in commits if t > kill["t_wall"])
    after_dead = min(t for t in commits if t > dead["t_wall"])
    return after_kill - kill["t_wall"], after_dead - kill["t_wall"]


def bench_recovery(args: argparse.Namespace) -> dict:
    _, _, base = bench_setup(args)
    kill_step = args.steps // 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for phase in PHASES:
            recov, without, steps = [], [], []
            for i in range(args.repeats):
                spec = f"kill:replica={args.replicas - 1},step={kill_step},phase={phase}"
                if phase in ("forward", "backward"):
                    # (the second: the first runs during the previous step's vote, --ahead;
                    # equal shares: the victim holds two ids)
                    spec += ",microbatch=1"
                out = run_recover([*base, "--balance", "equal", "--fault", spec], Path(tmp) / f"{phase}-{i}",
                                  timeout_s=args.timeout)  # fmt: skip
                next_commit, commit_without = kill_to_commit_s(out)
                recov.append(next_commit)
                without.append(commit_without)
                step_times = committed_steps(out / "metrics.jsonl")
                steps.append(statistics.median(
                    s["step_s"] for k, s in step_times.items() if k >= WARMUP_STEPS and k != kill_step
                ))  # fmt: skip
            row = {
                "phase": phase,
                "kill_to_commit_s": statistics.median(recov),
                "kill_to_commit_without_s": statistics.median(without),
                "step_s": statistics.median(steps),
                "raw_kill_to_commit_s": recov,
                "raw_kill_to_commit_without_s": without,
            }
            rows.append(row)
            print(f"  {phase:<10} kill -> next commit {row['kill_to_commit_s']:.3f} s, "
                  f"-> first commit without it {row['kill_to_commit_without_s']:.3f} s "
                  f"(median step {row['step_s']:.3f} s)", flush=True)  # fmt: skip
    result = {
        "benchmark": "recovery",
        "method": f"{args.replicas} replicas, replica {args.replicas - 1} SIGKILLed at step "
        f"{kill_step}; seconds from its failure_injected event to the next coordinator commit, "
        "and to the first commit after the coordinator declared it dead; "
        f"median of {args.repeats} runs per phase",
        "config": vars(args) | {"func": None},
        "machine": machine_info(),
        "rows": rows,
    }
    print(format_recovery_table(rows))
    return result


def format_recovery_table(rows: list[dict]) -> str:
    lines = [
        "| phase | kill -> next commit (s) | kill -> first commit without it (s) "
        "| failure-free step (s) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        without = r.get("kill_to_commit_without_s", r["kill_to_commit_s"])
        lines.append(
            f"| {r['phase']} | {r['kill_to_commit_s']:.3f} | {without:.3f} | {r['step_s']:.3f} |"
        )
    return "\n".join(lines)


# ---- rejoin ---------------------------------------------------------------------------------

# Per preset: (M, B, T, steps) sized so that the run outlives a respawned joiner's start-up on
# 2 CPU cores (a joiner imports torch and builds its model before it can join).
REJOIN_SHAPES = {
    "tiny": (6, 2, 32, 300),
    "small": (6, 4, 64, 120),
    "medium": (3, 2, 64, 40),
    "gpt2-124m": (3, 1, 64, 16),
}
REJOIN_KILL_STEP = 2


def rejoin_figures(out: Path) -> dict:
    """Transfer size and time; seconds from the respawn (or a standby's promotion) to the
    joiner's first commit, and from its admission (the coordinator's, at a step boundary) to
    that commit; with a standby, what the one still waiting at the end cost (CPU seconds over
    its life, its build included, and its resident memory)."""
    records = list(read_metrics(out / "metrics.jsonl"))
    respawned = next(r for r in records if r.get("name") == "launcher.respawned")
    transfer = next(r for r in records if r.get("name") == "state_transfer")
    admitted = next(
        r for r in records
        if r.get("name") == "coordinator.admitted" and respawned["replica"] in r["replica_ids"]
        and r["t_wall"] > respawned["t_wall"]
    )  # fmt: skip
    first_commit = min(
        r["t_wall"]
        for r in records
        if r.get("name") == "coordinator.committed" and r["t_wall"] > transfer["t_wall"]
    )
    figures = {
        "transfer_bytes": transfer["bytes"],
        "transfer_s": transfer["seconds"],
        "transfer_load_s": transfer.get("load_s"),  # of transfer_s: the joiner's load
        # of transfer_s: until the header was in (the sources' preparation, the wait for them)
        "transfer_header_s": transfer.get("header_s"),
        # the slowest source's preparation of its bytes (on GPUs, its copies to host memory)
        "source_prepare_s": max(
            (
                r["prepare_s"]
                for r in records
                if r.get("name") == "state_served" and r.get("epoch") == transfer["epoch"]
            ),
            default=None,
        ),
        "transfer_mb_s": transfer["bytes"] / transfer["seconds"] / 1e6,
        "start_to_first_commit_s": first_commit - respawned["t_wall"],
        "admission_to_first_commit_s": first_commit - admitted["t_wall"],
    }
    retired = [r for r in records if r.get("name") == "launcher.standby_retired" and "cpu_s" in r]
    if retired:
        figures |= {
            "standby_cpu_s": retired[0]["cpu_s"],
            "standby_age_s": retired[0]["age_s"],
            "standby_rss_mib": retired[0]["rss_mib"],
        }
    return figures


# How the joiner starts, in the order the runs alternate: flags for each.
REJOIN_STARTS = {"standby": ["--standby", "1"], "warm": [], "cold": ["--cold-start"]}


def bench_rejoin(args: argparse.Namespace) -> dict:
    from recover.data.prepare import ensure_dataset
    from recover.tooling.bench.common import train_flags
    from recover.training.config import TrainConfig

    data = (
        Path(args.data) if args.data else ensure_dataset(Path(args.data_root), show_progress=False)
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.preset.split(","):
            if preset not in REJOIN_SHAPES:
                raise ValueError(f"--preset {preset!r}: rejoin knows {', '.join(REJOIN_SHAPES)}")
            M, B, T, steps = REJOIN_SHAPES[preset]
            cfg = TrainConfig(preset=preset, steps=args.steps or steps, microbatches=M,
                              microbatch_size=B, seq_len=T, eval_every=0, ckpt_every=0,
                              warmup_steps=1)  # fmt: skip
            flags = [*train_flags(cfg), "--replicas", str(args.replicas), "--data", str(data),
                     "--respawn", "0", "--fault",
                     f"kill:replica={args.replicas - 1},step={REJOIN_KILL_STEP},phase=backward"]  # fmt: skip
            # The three starts alternate, so that all see the same machine.
            figures: dict[str, list[dict]] = {start: [] for start in REJOIN_STARTS}
            for i in range(args.repeats):
                for start, extra in REJOIN_STARTS.items():
                    run = Path(tmp) / f"{preset}-{start}-{i}"
                    out = run_recover([*flags, *extra], run, timeout_s=args.timeout)
                    figures[start].append(rejoin_figures(out))
            row = {"preset": preset, "microbatches": M, "microbatch_size": B, "seq_len": T}
            for key in figures["warm"][0]:  # (unprefixed: the warm fork's, as before)
                values = [f[key] for f in figures["warm"]]
                row[key] = None if None in values else statistics.median(values)
            for start in ("standby", "cold"):
                for key in figures[start][0]:
                    if key.startswith("transfer_bytes"):
                        continue
                    if any(f[key] is None for f in figures[start]):
                        row[f"{start}_{key}"] = None
                        continue
                    name = key if key.startswith("standby_") else f"{start}_{key}"
                    row[name] = statistics.median(f[key] for f in figures[start])
            row["raw"] = figures
            rows.append(row)
            print(f"  {preset:<10} state {row['transfer_bytes'] / 2**20:.1f} MiB; joiner start "
                  f"-> first commit {row['standby_start_to_first_commit_s']:.2f} s standby, "
                  f"{row['start_to_first_commit_s']:.2f} s warm, "
                  f"{row['cold_start_to_first_commit_s']:.2f} s cold; admission -> first commit "
                  f"{row['standby_admission_to_first_commit_s']:.2f} s standby (transfer "
                  f"{row['standby_transfer_s']:.3f} s, {row['standby_transfer_mb_s']:.0f} MB/s, "
                  f"of which the load into the model and optimizer "
                  f"{row['standby_transfer_load_s'] or 0:.3f} s)", flush=True)  # fmt: skip
    print(format_rejoin_table(rows))
    return {
        "benchmark": "rejoin",
        "method": f"{args.replicas} replicas; the last is SIGKILLed at step {REJOIN_KILL_STEP} and "
        "replaced at once (--respawn 0); transfer = the joiner's state_transfer event (its "
        "seconds, and of them load_s, the load into the model and optimizer; MB/s = bytes / "
        "seconds); start -> "
        "first commit = from the launcher's launcher.respawned event to the first commit after "
        "the transfer (includes, but with a standby, process start and the model build, and, "
        "cold, the torch import); admission -> first commit = from the coordinator's admission "
        "of the joiner at a step boundary to that commit (the group build, the transfer and one "
        "step); standby: --standby 1 (the joiner was built ahead and waited), warm: the respawn "
        "is forked from the launcher's zygote (the default), cold: --cold-start; the three "
        f"alternate; median of {args.repeats} each; standby_cpu_s/age_s/rss_mib: the standby "
        "still waiting at the end (started behind the promoted one), CPU over its whole life "
        "(its build included) and resident memory (pages shared with the zygote included)",
        "machine": machine_info(),
        "rows": rows,
    }


def format_rejoin_table(rows: list[dict]) -> str:
    lines = [
        "| preset | state transferred | joiner start -> first commit: standby (s) | warm fork "
        "(s) | cold (s) | admission -> first commit, standby (s) | of which transfer (s) "
        "| transfer MB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: dict, key: str, digits: int = 2) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.{digits}f}"

    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['transfer_bytes'] / 2**20:.1f} MiB "
            f"| {cell(r, 'standby_start_to_first_commit_s')} "
            f"| {cell(r, 'start_to_first_commit_s')} | {cell(r, 'cold_start_to_first_commit_s')} "
            f"| {cell(r, 'standby_admission_to_first_commit_s')} "
            f"| {cell(r, 'standby_transfer_s', 3)} | {cell(r, 'standby_transfer_mb_s', 0)} |"
        )
    return "\n".join(lines)
