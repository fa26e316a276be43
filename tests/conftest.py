"""Shared fixtures: a small deterministic corpus and dataset, and a CLI runner that reaps."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

from recover import exits
from recover.record import committed_steps, read_metrics
from recover.tooling.compare import compare_runs

torch.set_num_threads(1)

# The tiers, like torchtitan's: `unit` (pure functions, seconds), `inprocess` (the runtime's
# pieces against an in-process coordinator: the step machine, the API, the server and client,
# the single-replica loop) and `process` (real processes under SIGKILL/SIGSTOP at declared
# points: the fault tests). `pytest` runs all three (CI); `pytest -m unit` or
# `pytest -m "unit or inprocess"` is the quick loop while editing. Each file has its tier here
# (a new test file must be added: collection fails otherwise); a test may override its file's
# tier with its own marker.
TIERS = {
    "unit": (
        "test_addressing", "test_architecture", "test_checkpoint", "test_cli_help", "test_readme", "test_coordinator_decide",
        "test_etcd_store", "test_jobconfig",
        "test_data_formats", "test_data_prepare", "test_kubernetes", "test_placement", "test_policy", "test_report", "test_simulate",
        "test_session", "test_spec", "test_tree_sum", "test_units", "test_update_guard",
    ),
    "inprocess": (
        "test_addresses", "test_api_usage", "test_coordinator_server", "test_reach",
        "test_step_machine", "test_overlap", "test_early_update", "test_script_update",
        "test_train_single",
    ),
    "process": (
        "test_api", "test_bench_compare", "test_collective", "test_coordinator_relay",
        "test_coordinator_takeover",
        "test_coordinator_lost",
        "test_deterministic",
        "test_coordinator_scale", "test_durability", "test_export", "test_fault_specs",
        "test_graceful", "test_logs", "test_multirank", "test_multireplica", "test_nonfinite",
        "test_rejoin", "test_run_views", "test_status", "test_transfer", "test_zygote",
        "test_cpu_kernels", "test_hosts", "test_storage", "test_agent", "test_slurm",
        "test_optimizer_states", "test_pipeline", "test_torchtitan", "test_grads_layout",
    ),
}  # fmt: skip
_TIER_OF = {name: tier for tier, names in TIERS.items() for name in names}
# The order files are handed to the test workers (pytest-xdist, a file per worker at a time):
# the longest first, so that the workers end together rather than one finishing a long file
# alone; then the rest of the process tier, the in-process tier, and the many short unit tests,
# which fill the gaps. The longest files, from the durations of the suite's runs.
_LONGEST_FIRST = (
    "test_rejoin", "test_multirank", "test_multihost", "test_api", "test_pipeline",
    "test_cpu_kernels", "test_multireplica", "test_coordinator_takeover",
    "test_deterministic", "test_train_single", "test_run_views", "test_bench_compare",
    "test_torchtitan",
)  # fmt: skip
_TIER_ORDER = ("process", "inprocess", "unit")


def _file_order(item) -> tuple[int, int]:
    stem = item.path.stem
    if stem in _LONGEST_FIRST:
        return (0, _LONGEST_FIRST.index(stem))
    return (1 + _TIER_ORDER.index(_TIER_OF.get(stem, "unit")), 0)


def pytest_collection_modifyitems(config, items):
    unplaced = set()
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            continue
        tier = _TIER_OF.get(item.path.stem)
        if tier is None:
            unplaced.add(item.path.name)
        else:
            item.add_marker(getattr(pytest.mark, tier))
    if unplaced:
        raise pytest.UsageError(
            f"tests/conftest.py TIERS has no tier for {', '.join(sorted(unplaced))}: add each "
            "file to unit, inprocess or process"
        )
    items.sort(key=_file_order)  # (stable: a file's tests keep their order)


# Flags for a run that takes a second or two on one core.
TINY_TRAIN_FLAGS = [
    "--preset", "tiny", "--seq-len", "32", "--microbatch-size", "2", "--microbatches", "4",
    "--eval-every", "5", "--eval-batches", "2", "--warmup-steps", "2",
]  # fmt: skip

WORDS = (
    "replica rank step microbatch plan epoch commit snapshot gradient reduce survive recover "
    "token model layer attention loss optimizer learning rate batch sequence train validate"
).split()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 small text documents of pseudo-random words (about 100 kB), the same every session."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(7)
    for i in range(40):
        lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(40)]
        (root / f"doc_{i:03d}.txt").write_text(f"document {i}\n" + "\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory, tiny_corpus: Path) -> Path:
    from recover.data import prepare_dataset

    out = tmp_path_factory.mktemp("datasets") / "tiny-byte"
    return prepare_dataset(out, source=tiny_corpus, val_fraction=0.2, show_progress=False)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="session")
def custom_token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A token file for examples/train_custom.py (made by its --make-data)."""
    path = tmp_path_factory.mktemp("custom-data") / "custom.bin"
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_custom.py"), "--make-data", str(path)],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return path


RECOVER_CLI = (sys.executable, "-m", "recover.cli")


def run_cli(args: list[str], *, timeout: float = 60, cwd: Path | None = None):
    """Run `python -m recover.cli ARGS` to completion (killed on timeout); return the result."""
    return subprocess.run(
        [*RECOVER_CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=cwd,
    )


def cli_here(args: list[str]) -> subprocess.CompletedProcess:
    """Run `recover ARGS` in this process, as `run_cli` does in a child: for the commands that
    only read a run (compare, sample), which would otherwise pay a torch import each (2.5 s of
    CPU). Its output and exit status are returned as run_cli's; torch's thread count and the
    `recover` loggers are put back after it."""
    import contextlib
    import io
    import logging

    from recover.cli import main

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    loggers = [logging.getLogger(n) for n in ("", "recover")]
    saved = [(list(g.handlers), g.level, g.propagate) for g in loggers]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's refusals
                code = e.code if isinstance(e.code, int) else 2
    finally:
        torch.set_num_threads(threads)
        for g, (handlers, level, propagate) in zip(loggers, saved, strict=True):
            g.handlers[:] = handlers
            g.setLevel(level)
            g.propagate = propagate
    return subprocess.CompletedProcess(["recover", *args], code, out.getvalue(), err.getvalue())


def start_cli(args: list[str], **popen) -> subprocess.Popen:
    """Start `python -m recover.cli ARGS` with stdout piped and stderr merged into it, as `finish`
    reads them (`popen` overrides, e.g. stdout=subprocess.DEVNULL). Reap it with `finish` (or a
    kill) in a `finally`, so that a failing test leaves no process behind."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen([*RECOVER_CLI, *args], **{**options, "env": child_env(), **popen})


def start_train(data: Path, out: Path, *args: str, **popen) -> subprocess.Popen:
    """`recover train ARGS --data DATA --out OUT`, started by `start_cli`."""
    return start_cli(["train", *args, "--data", str(data), "--out", str(out)], **popen)


def wait_until(
    condition: Callable[[], object],
    what: str,
    *,
    alive: Iterable[subprocess.Popen] = (),
    timeout: float = 90,
) -> None:
    """Poll `condition()` every 20 ms until it holds; AssertionError naming `what` when one of the
    `alive` processes ends first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p.returncode for p in alive if p.poll() is not None]
        assert not ended, f"ended (exit {ended[0]}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def last_recorded_step(out: Path) -> int:
    """The highest step with a step record in OUT/metrics.jsonl; -1 before the first."""
    path = out / "metrics.jsonl"
    return max(committed_steps(path), default=-1) if path.exists() else -1


def wait_for_step(out: Path, step: int, **how) -> None:
    """`wait_until` OUT/metrics.jsonl holds the record of step `step` (`how`: alive, timeout)."""
    wait_until(lambda: last_recorded_step(out) >= step, f"step {step} recorded", **how)


def coordinator_pid(out: Path) -> int:
    """The (leading) coordinator's process, as the run folder's coordinator.json names it."""
    return int(json.loads((out / "coordinator.json").read_text())["pid"])


def replica_pid(out: Path, replica: int) -> int | None:
    """The pid of replica `replica`'s rank 0 (its latest incarnation), from its `rank_started`
    event; None before it."""
    if not (out / "metrics.jsonl").exists():
        return None
    started = [e for e in events(out, "rank_started") if e["replica"] == replica and e["rank"] == 0]
    return int(started[-1]["pid"]) if started else None


def finish(proc: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    """Wait at most `timeout` s for `proc` (stdout piped, stderr merged into it); kill it if it is
    still running then (a launcher's own finally reaps its children); return what it printed."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


def finish_after(
    proc: subprocess.Popen, fault: Callable[[], object], timeout: float
) -> tuple[subprocess.CompletedProcess, float]:
    """Inflict `fault()` on the running job of `proc`, then `finish` it (killed if it runs past
    `timeout`, or if the fault raises): what it printed, and the seconds it took to end after
    the fault."""
    try:
        fault()
    except BaseException:
        proc.kill()  # (the launcher's children die with it)
        proc.wait()
        raise
    at = time.monotonic()
    r = finish(proc, timeout=timeout)
    return r, time.monotonic() - at


def leftover_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (the run folder)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def events(out: Path, name: str) -> list[dict]:
    return [
        r
        for r in read_metrics(out / "metrics.jsonl")
        if r.get("kind") == "event" and r.get("name") == name
    ]


# The stated tolerance of a recovered fp32 run against the failure-free one (relative loss per
# step, relative L2 of the final parameters). fp32 summation-order noise between layouts is ~1e-7
# of either here, three orders below it, on any CPU. bf16 has a noise floor of its own, measured
# by the tests that use it (test_multirank's bf16_tolerance), which widens it where larger.
TRAJECTORY_RTOL = 1e-4


def assert_invariants(
    reference: Path,
    out: Path,
    r: subprocess.CompletedProcess,
    *,
    steps: int,
    microbatches: int,
    rtol: float = TRAJECTORY_RTOL,
) -> None:
    """the invariants of docs/design.md for a multi-replica run `out` against the failure-free `reference`,
    with the trajectory within `rtol` (loss per step, final parameters)."""
    assert r.returncode == 0, r.stdout[-4000:]
    committed = committed_steps(out / "metrics.jsonl")
    assert sorted(committed) == list(range(steps)), "every step must be committed"
    # ...and recorded once (committed_steps keeps the last record of a step: a second record of
    # a step would pass through it unseen)
    records = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"]
    assert sorted(records) == list(range(steps)), "a committed step recorded twice"
    assert all(s["microbatches"] == microbatches for s in committed.values()), "batch changed"
    result = compare_runs(reference, out)
    assert result.common_steps == steps
    assert result.max_loss_rel_diff <= rtol, result
    assert result.param_rel_l2 is not None and result.param_rel_l2 <= rtol, result
    hashes = {e["replica"]: e["param_hash"] for e in events(out, "replica_finished")}
    assert hashes, "no replica finished"
    assert len(set(hashes.values())) == 1, f"survivors diverged: {hashes}"
    assert_faults_fired(out)
    assert leftover_processes(str(out)) == [], "processes of the run were left behind"


def on_gloo_ranks(target: Callable, *args, nprocs: int = 2) -> dict:
    """`target(rank, *args)` in `nprocs` spawned processes (one thread each) that form one gloo
    group on 127.0.0.1; what each returned, by rank. An exception in one is its repr there, and
    the spawn raises. `target` must be a module-level function (the children import it)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_gloo_rank, args=(nprocs, port, results, target, args), nprocs=nprocs, join=True)
        return dict(results)


def _gloo_rank(rank: int, nprocs: int, port: int, results, target: Callable, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nprocs)
    try:
        results[rank] = target(rank, *args)
    except BaseException as e:  # reported by the test
        results[rank] = repr(e)
        raise
    finally:
        dist.destroy_process_group()


def assert_faults_fired(out: Path) -> None:
    """Every fault the run `out` declared fired (the launcher's verdict lists those that did not):
    a drill whose kill never fired proves nothing."""
    unfired = [f for v in events(out, "launcher.verdict") for f in v.get("unfired", [])]
    assert not unfired, f"declared faults that never fired: {unfired}"


def coordinator_lost_lines(r: subprocess.CompletedProcess) -> list[str]:
    """The lines `the coordinator is lost` of a launcher or worker `r` that ended as a lost
    coordinator must end it: status 11, no traceback."""
    assert r.returncode == exits.COORDINATOR_LOST, r.stdout[-3000:]
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    return [line for line in r.stdout.splitlines() if "the coordinator is lost" in line]


def assert_last_commit_saved_once(out: Path) -> None:
    """After a lost coordinator: the lowest replica checkpointed the last committed step (announced
    once durable), and every committed step has exactly one record."""
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"]
    saved = [(e["step"], e["replica"]) for e in events(out, "checkpoint_saved")]
    assert sorted(steps) == list(range(len(steps))), "a committed step without its one record"
    assert saved == [(len(steps), 0)], saved
