"""A diverging run never commits a non-finite update (real processes, the built-in trainer).

`--lr 1e4 --grad-clip 0` overflows the gradient within a few steps. Each such step commits as
skipped (recorded with `skipped: non-finite`, no update applied), the replicas name the ids they
computed, and after `--max-nonfinite` in a row the run stops with status 9 and a checkpoint of the
last finite state; no final model is written. Without the guard the run commits NaN steps, writes
NaN checkpoints and exits 0.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TRAIN_FLAGS, events, leftover_processes, run_cli
from recover.record import read_metrics
from recover.training.checkpoint import load_latest

DIVERGING = [
    "--lr",
    "1e4",
    "--grad-clip",
    "0",
    "--min-lr",
    "0",
    "--steps",
    "12",
    "--eval-every",
    "0",
]


def assert_stopped_on_the_last_finite_state(out, r) -> None:
    assert r.returncode != 0, r.stdout[-3000:]
    assert "consecutive steps had a non-finite gradient or loss" in r.stdout + r.stderr
    steps = [rec for rec in read_metrics(out / "metrics.jsonl") if rec.get("kind") == "step"]
    skipped = [rec["step"] for rec in steps if rec.get("skipped") == "non-finite"]
    assert len(skipped) >= 3 and skipped[-3:] == list(range(skipped[-1] - 2, skipped[-1] + 1))
    assert [rec["step"] for rec in steps] == list(range(len(steps))), "a step record is missing"
    state = load_latest(out / "checkpoints")
    assert state is not None and state["meta"]["step"] == steps[-1]["step"] + 1
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (out / "final" / "model.safetensors").exists()


@pytest.mark.timeout(120)
def test_two_replicas_skip_non_finite_steps_and_stop(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    flags = [*TINY_TRAIN_FLAGS, *DIVERGING, "--replicas", "2"]
    r = run_cli(["train", *flags, "--data", str(tiny_dataset), "--out", str(out)], timeout=100)
    assert_stopped_on_the_last_finite_state(out, r)
    assert "steps not finite" in r.stdout + r.stderr  # the verdict (errors go to stderr)
    named = events(out, "nonfinite_microbatches")
    assert {e["replica"] for e in named} == {0, 1} and all(e["ids"] for e in named)
    assert leftover_processes(str(out)) == []


@pytest.mark.timeout(60)
def test_one_replica_skips_non_finite_steps_and_stops(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    r = run_cli(["train", *TINY_TRAIN_FLAGS, *DIVERGING, "--data", str(tiny_dataset),
                 "--out", str(out)], timeout=50)  # fmt: skip
    assert r.returncode == 9, r.stdout[-2000:] + r.stderr[-2000:]
    assert_stopped_on_the_last_finite_state(out, r)
