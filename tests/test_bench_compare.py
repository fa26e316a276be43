"""`recover bench compare` end to end on a short run: every mode on the same work and one kill.

The table's columns must come from the runs: the shrink baseline shows fewer microbatches after
the failure and drifts from the failure-free loss; recover keeps M and the trajectory;
checkpoint-restart keeps the trajectory but recommits the steps after its checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import child_env, leftover_processes

M = 6


@pytest.mark.timeout(300)
def test_short_compare_computes_every_column_from_the_runs(tiny_dataset, tmp_path):
    out = tmp_path / "cmp"
    r = subprocess.run(
        [sys.executable, "-m", "recover.cli", "bench", "compare", "--preset", "tiny",
         "--replicas", "3", "--steps", "12", "--microbatches", str(M), "--microbatch-size", "2",
         "--seq-len", "32", "--faults", "every=4,count=1,offset=2", "--ckpt-every", "4",
         "--data", str(tiny_dataset), "--out", str(out), "--json", str(tmp_path / "cmp.json")],
        capture_output=True, text=True, timeout=280, env=child_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads((out / "compare.json").read_text())["rows"]}
    assert set(rows) == {
        "failure-free",
        "recover",
        "recover+respawn",
        "checkpoint-restart",
        "shrink",
    }
    free, rec, ckr, shr = (
        rows[k] for k in ("failure-free", "recover", "checkpoint-restart", "shrink")
    )

    assert free["failures"] == 0 and free["tokens_per_s_ratio"] == pytest.approx(1.0)
    for row in (rec, rows["recover+respawn"], ckr, shr):
        assert row["failures"] == 1 and row["steps_committed"] == 12
        assert row["tokens_per_s"] > 0 and row["median_failure_to_commit_s"] > 0

    assert rec["microbatches_min_after_failure"] == M and rec["microbatches_last"] == M
    assert rec["loss_max_rel_dev"] <= 1e-4 and rec["param_rel_l2"] <= 1e-4
    assert rec["redo_events"] >= 1

    assert shr["microbatches_min_after_failure"] < M  # the global batch shrank
    assert shr["loss_max_rel_dev"] > 1e-4  # and the trajectory moved

    assert ckr["steps_recommitted"] >= 2  # the steps after checkpoint 4 were committed again
    assert ckr["loss_max_rel_dev"] <= 1e-4 and ckr["microbatches_min_after_failure"] == M

    assert (out / "compare.md").read_text().count("\n") >= 5
    for run in rows:
        assert leftover_processes(str(out / "runs" / run)) == []
