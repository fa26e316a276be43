"""The comparison table is computed from the run folders: synthetic runs with hand-made records.

Four runs with M = 4 microbatches of 16 tokens (64 tokens a step), two replicas, six steps:
a failure-free reference, `recover` (one kill in step 2, the step redone in-step with M kept),
`shrink` (one kill in step 2, later steps sum 2 microbatches) and `checkpoint-restart` (a kill in
step 3, the job restarts from the checkpoint at step 2 and commits steps 2 and 3 again).
Every expected number below is worked out by hand from the records written here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recover.tooling.report import build_table, format_markdown, summarize_run, write_report

pytestmark = pytest.mark.timeout(30)

M = 4
TOKENS_PER_MB = 16
T0 = 1000.0


class RunWriter:
    """A synthetic run folder: config.json, metrics.jsonl, final/model.safetensors."""

    def __init__(self, root: Path, *, mode: str | None, weight: float) -> None:
        self.root = root
        root.mkdir(parents=True)
        config = {"format": 1, "train": {"microbatches": M, "microbatch_size": 2, "seq_len": 8}}
        if mode is not None:
            config["launch"] = {"mode": mode, "replicas": 2}
        (root / "config.json").write_text(json.dumps(config))
        (root / "final").mkdir()
        save_file({"w": torch.full((4,), weight), "b": torch.zeros(2)},
                  str(root / "final" / "model.safetensors"))  # fmt: skip
        self.lines: list[dict] = []

    def event(self, t: float, name: str, **fields) -> None:
        self.lines.append({"kind": "event", "t_wall": T0 + t, "name": name, **fields})

    def step(self, t: float, step: int, *, mb: int = M, replicas: int = 2, step_s: float = 1.0,
             loss: float | None = None) -> None:  # fmt: skip
        self.lines.append({
            "kind": "step", "t_wall": T0 + t, "step": step,
            "loss": 3.0 - 0.1 * step if loss is None else loss,
            "tokens": mb * TOKENS_PER_MB, "microbatches": mb, "step_s": step_s,
            "wall_s": t, "replicas": replicas,
        })  # fmt: skip

    def close(self) -> Path:
        text = "".join(json.dumps(r) + "\n" for r in self.lines)
        (self.root / "metrics.jsonl").write_text(text + '{"kind": "step", "t_wa')  # torn line
        return self.root


def make_reference(root: Path) -> Path:
    w = RunWriter(root, mode=None, weight=1.0)
    w.event(0.0, "launcher.started")
    for s in range(6):
        w.step(1.0 + s, s)
    w.event(7.0, "launcher.finished", exit_status=0)
    return w.close()


def make_recover(root: Path) -> Path:
    w = RunWriter(root, mode="recover", weight=1.0)
    w.event(0.0, "launcher.started")
    w.step(1.0, 0)
    w.step(2.0, 1)
    w.event(2.5, "failure_injected", fault="kill", replica=1, step=2, phase="backward")
    w.event(2.6, "coordinator.redo", lost=[2, 3])
    w.step(3.2, 2, replicas=1, step_s=1.2)
    for s in (3, 4, 5):
        w.step(1.2 + s, s, replicas=1)
    w.event(8.0, "launcher.finished", exit_status=0)
    return w.close()


def make_shrink(root: Path) -> Path:
    w = RunWriter(root, mode="shrink", weight=1.1)
    w.event(0.0, "launcher.started")
    w.step(1.0, 0)
    w.step(2.0, 1)
    w.event(2.5, "failure_injected", fault="kill", replica=1, step=2, phase="backward")
    w.event(2.6, "coordinator.redo", lost=[2, 3])
    # after the failure: half the batch, and a loss off the reference by 0.03 at step 2 (2.8)
    w.step(3.0, 2, mb=2, replicas=1, loss=2.8 + 0.03)
    for s in (3, 4, 5):
        w.step(1.0 + s, s, mb=2, replicas=1, loss=3.0 - 0.1 * s + 0.01)
    w.event(6.5, "launcher.finished", exit_status=0)
    return w.close()


def make_checkpoint_restart(root: Path) -> Path:
    w = RunWriter(root, mode="checkpoint-restart", weight=1.0)
    w.event(0.0, "launcher.started")
    for s in range(4):
        w.step(1.0 + s, s)
    w.event(4.5, "failure_injected", fault="kill", replica=0, step=4, phase="forward")
    w.event(5.0, "launcher.restarted", restart=1)
    # resumed from the checkpoint taken before step 2: steps 2 and 3 are committed again
    w.step(8.0, 2, step_s=3.0)
    for s in (3, 4, 5):
        w.step(5.0 + s, s)
    w.event(11.0, "launcher.finished", exit_status=0)
    return w.close()


@pytest.fixture()
def runs(tmp_path: Path) -> dict[str, Path]:
    return {
        "failure-free": make_reference(tmp_path / "ref"),
        "recover": make_recover(tmp_path / "rec"),
        "shrink": make_shrink(tmp_path / "shr"),
        "checkpoint-restart": make_checkpoint_restart(tmp_path / "ckr"),
    }


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def test_modes_come_from_config(runs):
    rows = by_name(build_table(runs, reference="failure-free"))
    assert rows["failure-free"]["mode"] == "recover"  # no launch.mode: recover
    assert rows["shrink"]["mode"] == "shrink"
    assert rows["checkpoint-restart"]["mode"] == "checkpoint-restart"


def test_effective_throughput_and_ratio(runs):
    rows = by_name(build_table(runs, reference="failure-free"))
    ref = 6 * 64 / 7.0
    assert rows["failure-free"]["tokens_per_s"] == pytest.approx(ref)
    assert rows["failure-free"]["tokens_per_s_ratio"] == pytest.approx(1.0)
    assert rows["recover"]["tokens_per_s"] == pytest.approx(6 * 64 / 8.0)
    assert rows["recover"]["tokens_per_s_ratio"] == pytest.approx((6 * 64 / 8.0) / ref)
    # shrink commits fewer tokens after the failure: 2 steps of 64 and 4 of 32 in 6.5 s
    assert rows["shrink"]["tokens_committed"] == 2 * 64 + 4 * 32
    assert rows["shrink"]["tokens_per_s"] == pytest.approx((2 * 64 + 4 * 32) / 6.5)
    # checkpoint-restart: recommitted steps count once, the restart is inside the wall time
    assert rows["checkpoint-restart"]["tokens_committed"] == 6 * 64
    assert rows["checkpoint-restart"]["tokens_per_s"] == pytest.approx(6 * 64 / 11.0)


def test_tokens_per_live_replica_is_time_weighted(runs):
    rows = by_name(build_table(runs, reference="failure-free"))
    assert rows["failure-free"]["mean_live_replicas"] == pytest.approx(2.0)
    mean = (2 * 1.0 + 2 * 1.0 + 1 * 1.2 + 3 * 1 * 1.0) / (1.0 + 1.0 + 1.2 + 3.0)
    assert rows["recover"]["mean_live_replicas"] == pytest.approx(mean)
    assert rows["recover"]["tokens_per_s_per_replica"] == pytest.approx(6 * 64 / 8.0 / mean)
    assert rows["failure-free"]["tokens_per_s_per_replica"] == pytest.approx(6 * 64 / 7.0 / 2)


def test_failure_to_next_commit(runs):
    rows = by_name(build_table(runs, reference="failure-free"))
    assert rows["failure-free"]["failures"] == 0
    assert rows["failure-free"]["median_failure_to_commit_s"] is None
    assert rows["recover"]["median_failure_to_commit_s"] == pytest.approx(0.7)
    assert rows["shrink"]["median_failure_to_commit_s"] == pytest.approx(0.5)
    assert rows["checkpoint-restart"]["median_failure_to_commit_s"] == pytest.approx(3.5)


def test_failure_median_over_several_and_without_commit(tmp_path):
    w = RunWriter(tmp_path / "two", mode="recover", weight=1.0)
    w.step(1.0, 0)
    w.event(1.5, "failure_injected", fault="kill", replica=1, step=1, phase="forward")
    w.step(2.0, 1)  # 0.5 s after the first failure
    w.event(2.1, "failure_injected", fault="kill", replica=2, step=2, phase="reduce")
    w.step(3.6, 2)  # 1.5 s after the second
    w.event(3.7, "failure_injected", fault="kill", replica=3, step=3, phase="forward")
    run = w.close()  # no launcher events, and the last failure is never followed by a commit
    row = summarize_run(run, reference=None)
    assert row["failure_to_commit_s"] == pytest.approx([0.5, 1.5])
    assert row["median_failure_to_commit_s"] == pytest.approx(1.0)
    assert row["failures"] == 3 and row["failures_without_commit"] == 1
    # wall time falls back to the first and last records' t_wall
    assert row["wall_s"] == pytest.approx(2.7)
    assert row["tokens_per_s"] == pytest.approx(3 * 64 / 2.7)
    assert row["loss_max_rel_dev"] is None and row["tokens_per_s_ratio"] is None


def test_steps_lost_or_redone(runs):
    rows = by_name(build_table(runs, reference="failure-free"))
    assert rows["failure-free"]["steps_lost_or_redone"] == 0
    assert rows["recover"]["redo_events"] == 1
    assert rows["recover"]["steps_recommitted"] == 0
    assert rows["recover"]["steps_lost_or_redone"] == 1
    assert rows["checkpoint-restart"]["step_records"] == 8
    assert rows["checkpoint-restart"]["steps_committed"] == 6
    assert rows["checkpoint-restart"]["steps_lost_or_redone"] == 2


def test_global_batch_after_failures(runs):
    rows = by_name(build_table(runs, reference="failure-free"))
    assert rows["recover"]["microbatches_last"] == M
    assert rows["recover"]["microbatches_min_after_failure"] == M
    assert rows["shrink"]["microbatches_last"] == 2
    assert rows["shrink"]["microbatches_min_after_failure"] == 2
    assert rows["shrink"]["first_failure_step"] == 2
    assert rows["checkpoint-restart"]["microbatches_min_after_failure"] == M
    assert rows["failure-free"]["microbatches_min_after_failure"] is None


def test_loss_deviation_and_parameter_distance(runs):
    rows = by_name(build_table(runs, reference="failure-free"))
    assert rows["recover"]["loss_max_rel_dev"] == 0.0
    assert rows["recover"]["param_rel_l2"] == 0.0
    assert rows["shrink"]["loss_max_rel_dev"] == pytest.approx(0.03 / 2.83)
    assert rows["shrink"]["loss_worst_step"] == 2
    # w: 1.1 against 1.0 in four entries, b zero: ||0.1 * 1|| / ||1|| = 0.1
    assert rows["shrink"]["param_rel_l2"] == pytest.approx(0.1)
    assert rows["checkpoint-restart"]["common_steps"] == 6


def test_reference_must_be_a_run(runs):
    with pytest.raises(ValueError, match="reference"):
        build_table(runs, reference="nope")


def test_write_report_files(runs, tmp_path):
    rows = build_table(runs, reference="failure-free")
    out = write_report(rows, tmp_path / "report", runs)
    document = json.loads(out["json"].read_text())
    assert [r["name"] for r in document["rows"]] == list(runs)
    shrink = next(r for r in document["rows"] if r["name"] == "shrink")
    assert shrink["microbatches_min_after_failure"] == 2
    assert math.isclose(shrink["tokens_per_s"], (2 * 64 + 4 * 32) / 6.5)
    table = out["markdown"].read_text()
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(runs)
    assert "tok/s per live replica" in lines[0]
    assert f"{(2 * 64 + 4 * 32) / 6.5:.1f}" in next(x for x in lines if "| shrink |" in x)
    assert table.startswith(format_markdown(rows))
    pytest.importorskip("matplotlib")
    for key in ("loss_png", "tokens_png"):
        assert out[key] is not None
        assert out[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["plots_skipped"] is None


def test_torchft_harness_config_and_absence():
    from recover.tooling.torchft_harness import (
        TorchftHarnessConfig,
        TorchftUnavailable,
        require_torchft,
    )

    with pytest.raises(ValueError, match="min_replicas"):
        TorchftHarnessConfig(replicas=2, min_replicas=3)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        TorchftHarnessConfig(heartbeat_timeout_s=0.05, heartbeat_s=0.1)
    with pytest.raises(ValueError, match="Grammar"):
        TorchftHarnessConfig(faults=("kill:replica=1",))
    try:
        import torchft  # noqa: F401
    except ImportError:
        with pytest.raises(TorchftUnavailable, match="torchft cannot be imported"):
            require_torchft()
    else:
        assert require_torchft() is not None
