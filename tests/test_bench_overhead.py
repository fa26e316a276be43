"""`recover bench overhead`: the interleaved-block method and its interval.

The pure parts (which steps count in a block, the ratio's bootstrap interval) are unit tests; a
tiny end-to-end run checks the JSON's structure and that each interval holds its point estimate,
not any speed (this machine is shared).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import child_env, leftover_processes
from recover.tooling.bench.overhead import (
    cpu_per_step,
    format_cpu,
    format_parts,
    ratio_interval,
    step_parts,
    steps_inside,
)
from recover.tooling.simulate.scenarios import read_bench


@pytest.mark.unit
def test_a_block_counts_only_the_steps_wholly_inside_it():
    records = [(10.0, 1.0), (11.0, 1.0), (12.5, 1.5), (13.2, 0.7), (14.1, 0.9)]
    # The step that began before the block (ends at 11.0, began at 10.0 < 10.2) and the one that
    # ends after it (14.1 > 14.0) are dropped.
    assert steps_inside(records, 10.2, 14.0) == [1.5, 0.7]
    assert steps_inside(records, 20.0, 30.0) == []


@pytest.mark.unit
def test_a_steps_parts_are_averaged_over_the_steps_inside_the_blocks():
    def rec(t_end, step_s, **parts):
        return {"t_wall": t_end, "step_s": step_s, "parts": parts}

    records = [
        rec(10.0, 1.0, compute=0.6, reduce=0.2),  # began before the block: not counted
        rec(11.0, 0.5, compute=0.3, reduce=0.1, vote=0.05),
        rec(11.5, 0.5, compute=0.2, reduce=0.1, vote=0.15),
        {"t_wall": 11.9, "step_s": 0.4},  # a record without parts (an older version)
    ]
    p = step_parts(records, [(10.2, 12.0)])
    assert p == pytest.approx({"compute": 0.25, "reduce": 0.1, "vote": 0.1, "step": 0.5,
                               "rest": 0.05})  # fmt: skip
    assert step_parts(records, [(20.0, 21.0)]) is None
    table = format_parts({"plain": {"compute": 0.4, "step": 0.5, "rest": 0.1}, "recover": p})
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert list(rows) == ["compute", "reduce", "vote", "rest", "step"]  # the order of a step
    assert "400.0 ms  80%" in rows["compute"] and "250.0 ms  50%" in rows["compute"]
    assert rows["vote"].split()[1] == "-"  # the plain loop has none


@pytest.mark.unit
def test_cpu_per_step_sums_each_role_over_the_steps_and_leaves_out_a_process_gone():
    before = {1: ("replica", 10.0), 2: ("replica", 11.0), 3: ("coordinator", 1.0), 4: ("x", 0)}
    after = {1: ("replica", 14.0), 2: ("replica", 15.5), 3: ("coordinator", 1.2), 5: ("y", 9.0)}
    cpu = cpu_per_step(before, after, steps=10)
    assert cpu["replica"] == {"processes": 2, "cpu_s": pytest.approx(0.85)}
    assert cpu["coordinator"] == {"processes": 1, "cpu_s": pytest.approx(0.02)}
    assert set(cpu) == {"replica", "coordinator", "total"}  # 4 ended, 5 started: not measured
    assert cpu["total"] == pytest.approx(0.87)
    assert list(cpu)[:2] == ["replica", "coordinator"]  # the largest first
    line = format_cpu({"recover": cpu})
    assert "870.0 ms" in line and "replica x2 850.0" in line and "coordinator 20.0" in line


@pytest.mark.unit
def test_a_scripts_steps_are_the_gaps_between_its_lines_and_its_failures_are_counted(tmp_path):
    """`recover bench script` reads each job's steps from the writer's losses.jsonl (a line per
    step with its wall time; a line being written is skipped) and a dead replica from the run's
    record, which fails the benchmark (it measures the failure-free cost)."""
    from recover.tooling.bench.script import ScriptJob

    losses, record = tmp_path / "losses.jsonl", tmp_path / "metrics.jsonl"
    job = ScriptJob("recover", losses, run_record=record)
    assert job.steps() == [] and job.failures() == 0 and job.records() == []
    losses.write_text('{"time": 10.0}\n{"time": 10.5}\n{"time": 11.25}\n{"tim')
    assert job.steps() == [(10.5, 0.5), (11.25, 0.75)]
    record.write_text(
        json.dumps({"kind": "event", "name": "coordinator.member_dead", "t_wall": 1.0}) + "\n"
    )
    assert job.failures() == 1


@pytest.mark.unit
def test_the_interval_holds_the_geometric_mean_and_narrows_with_agreement():
    point, lo, hi = ratio_interval([1.0, 1.1, 0.95, 1.2, 1.05])
    assert point == pytest.approx(math.exp(sum(map(math.log, [1.0, 1.1, 0.95, 1.2, 1.05])) / 5))
    assert 0.95 <= lo <= point <= hi <= 1.2
    assert ratio_interval([1.03]) == pytest.approx((1.03, 1.03, 1.03))
    assert ratio_interval([1.02] * 8) == pytest.approx((1.02, 1.02, 1.02))
    wide = ratio_interval([0.8, 1.3, 0.9, 1.2, 1.0, 1.1])
    narrow = ratio_interval([0.99, 1.02, 1.0, 1.01, 1.0, 1.0])
    assert wide[2] - wide[1] > 4 * (narrow[2] - narrow[1])
    assert ratio_interval([1.0, 1.2], seed=3) == ratio_interval([1.0, 1.2], seed=3)
    with pytest.raises(ValueError, match="block-steps"):
        ratio_interval([])


@pytest.mark.process
@pytest.mark.timeout(300)
# The deterministic arm is the same method with `--deterministic` on one side (overhead.py: three
# lines): the vs-plain run covers the method end to end, test_deterministic the mode itself, so
# the second end-to-end run is kept out of the default suite for its time (`pytest -m slow`).
@pytest.mark.parametrize(
    "deterministic",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["vs-plain", "deterministic"],
)
def test_a_tiny_run_reports_the_ratio_with_its_interval(tiny_dataset, tmp_path, deterministic):
    blocks = 3
    env = {**child_env(), "TMPDIR": str(tmp_path)}  # the run folders: found again below
    r = subprocess.run(
        [sys.executable, "-m", "recover.cli", "bench", "overhead", "--preset", "tiny",
         "--replicas", "2", "--microbatches", "4", "--microbatch-size", "2", "--seq-len", "32",
         "--blocks", str(blocks), "--block-steps", "3", "--data", str(tiny_dataset),
         "--json", str(tmp_path / "o.json"), *(["--deterministic"] if deterministic else [])],
        capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "o.json").read_text())
    a, b = ("normal", "deterministic") if deterministic else ("plain", "recover")
    assert res["benchmark"] == ("overhead-deterministic" if deterministic else "overhead")
    assert "interleaved blocks" in res["method"] and f"{b} / {a}" in res["method"]
    assert res["blocks"] + res["blocks_dropped"] == blocks and res["blocks"] == len(res["pairs"])
    assert res["blocks"] >= 1 and res["block_s"] >= 0.5
    assert res["ci_low"] <= res["ratio"] <= res["ci_high"] and res["ci_low"] > 0
    assert res["fastest_ci_low"] <= res["fastest_ratio"] <= res["fastest_ci_high"]
    assert res["min_pair_ratio"] <= res["median_pair_ratio"] <= res["max_pair_ratio"]
    for pair in res["pairs"]:
        assert pair["ratio"] == pytest.approx(pair[f"{b}_step_s"] / pair[f"{a}_step_s"])
        assert all(n >= 1 for n in pair["steps"])
        assert pair[f"{a}_fastest_step_s"] <= pair[f"{a}_step_s"]
    assert [p["first"] for p in res["pairs"]][:2] in ([a, b], [a], [b])  # alternating order
    load = res["loadavg_1min"]
    assert 0 <= load["min"] <= load["median"] <= load["max"]
    (line,) = [x for x in r.stdout.splitlines() if "CI [" in x]
    assert f"ratio {res['ratio']:.3f}" in line and "load average" in line
    # Where the steps went, side by side: the plain loop has no vote, recover's step has one.
    parts = res["parts"]
    assert set(parts) == {a, b}
    for name, p in parts.items():
        assert {"compute", "reduce", "apply", "step"} <= set(p), (name, p)
        assert min(p.values()) >= -1e-3 and p["compute"] > 0, (name, p)
        assert sum(v for k, v in p.items() if k != "step") == pytest.approx(p["step"])
    assert "vote" in parts[b] and ("vote" in parts[a]) == deterministic
    assert "where a step's time went" in r.stdout and "\n  vote " in r.stdout
    # The CPU of all of each job's processes per step, by role (read from /proc): the launcher
    # names its forked children, so recover's coordinator is told apart from its replicas.
    cpu = res["cpu_per_step"]
    assert set(cpu) == {a, b}
    for roles in cpu.values():
        assert roles["total"] == pytest.approx(
            sum(e["cpu_s"] for k, e in roles.items() if k != "total")
        )
        assert roles["replica"]["processes"] == 2 and roles["replica"]["cpu_s"] > 0, roles
    assert res["cpu_ratio"] == pytest.approx(cpu[b]["total"] / cpu[a]["total"])
    assert cpu[b]["coordinator"]["processes"] == 1 and cpu[b]["launcher"]["processes"] == 1
    assert ("coordinator" in cpu[a]) == deterministic
    assert f"CPU per step, all of a job's processes (ratio {res['cpu_ratio']:.3f})" in r.stdout
    if not deterministic:  # the simulator reads the pairs (`--from-bench`)
        assert read_bench([tmp_path / "o.json"], cpu_cores=2).step_overhead_s is not None
    assert leftover_processes(str(tmp_path)) == []
