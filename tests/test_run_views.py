"""What a person watching a run sees besides metrics.jsonl: `recover plot`'s PNGs, the TensorBoard
event files of `--tensorboard`, the W&B run of `--wandb`, and the achieved TFLOP/s and MFU in the step records.

One faulty run (3 replicas, replica 2 SIGKILLed in step 2) and its failure-free one-replica
reference; every series drawn or written is checked against the run's own record.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from conftest import TINY_TRAIN_FLAGS, events, leftover_processes, run_cli
from recover.record import committed_steps, read_metrics

STEPS, M, PEAK = 6, 6, 0.001  # PEAK: --peak-tflops, so that a CPU run reports an MFU
FLAGS = [*TINY_TRAIN_FLAGS, "--microbatches", str(M), "--steps", str(STEPS), "--eval-every", "3"]


@pytest.fixture(scope="module")
def runs(tiny_dataset, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("views")
    faulty, reference, tb = root / "faulty", root / "reference", root / "tb"
    r = run_cli(
        # (microbatch 1 of equal shares: microbatch 0 runs during the previous step's vote)
        ["train", "--data", str(tiny_dataset), "--out", str(faulty), *FLAGS, "--replicas", "3",
         "--balance", "equal", "--fault", "kill:replica=2,step=2,phase=backward,microbatch=1",
         "--tensorboard", str(tb),
         "--peak-tflops", str(PEAK)],
        timeout=90,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = run_cli(["train", "--data", str(tiny_dataset), "--out", str(reference), *FLAGS])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {"faulty": faulty, "reference": reference, "tb": tb}


def test_plot_draws_the_runs_series(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from recover.tooling.plot import plot_runs

    done = plot_runs([runs["faulty"], runs["reference"]], tmp_path / "plots")
    assert sorted(p.name for p in done["files"]) == [
        "loss_vs_step.png", "replicas_vs_time.png", "step_time.png", "tokens_vs_time.png",
    ]  # fmt: skip
    for png in done["files"]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    faulty, reference = done["series"]["faulty"], done["series"]["reference"]
    record = committed_steps(runs["faulty"] / "metrics.jsonl")
    # Loss: every committed step's loss, on the failure-free trajectory.
    assert faulty.loss == [(s, record[s]["loss"]) for s in range(STEPS)]
    assert [s for s, _ in reference.loss] == list(range(STEPS))
    for (_, a), (_, b) in zip(faulty.loss, reference.loss, strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    assert faulty.step_s == [(s, record[s]["step_s"]) for s in range(STEPS)]
    # The kill: one failure and one redo, both in step 2; no join (no --respawn).
    assert faulty.marks == {"failure": [2], "redo": [2]} and faulty.failure_steps == [2]
    assert reference.marks == {}
    # Committed tokens end at the whole run's; live replicas go 3 -> 2 (then 0 as they finish).
    total = STEPS * M * 2 * 32
    assert faulty.progress[-1][1] == reference.progress[-1][1] == total
    live = [n for _, n in faulty.replicas]
    assert live[:3] == [0, 3, 2] and reference.replicas[0] == (0.0, 1)


def test_plot_cli_writes_the_pngs(runs, tmp_path):
    pytest.importorskip("matplotlib")
    r = run_cli(["plot", str(runs["faulty"]), str(runs["reference"]), "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "loss_vs_step.png", "replicas_vs_time.png", "step_time.png", "tokens_vs_time.png",
    ]  # fmt: skip


def test_tensorboard_mirrors_the_record_once(runs):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["tb"]), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()

    def scalars(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    record = committed_steps(runs["faulty"] / "metrics.jsonl")
    # Every committed step once (whichever replica was the writer), with the record's figures.
    loss = scalars("train/loss")
    assert [s for s, _ in loss] == list(range(STEPS))
    for step, value in loss:
        assert value == pytest.approx(record[step]["loss"], rel=1e-6)
    for tag, field in (("train/lr", "lr"), ("train/step_s", "step_s"), ("train/mfu", "mfu")):
        assert [v for _, v in scalars(tag)] == pytest.approx(
            [record[s][field] for s in range(STEPS)], rel=1e-5
        )
    assert [v for _, v in scalars("replicas/live")] == [3, 3, 2, 2, 2, 2]
    evals = [r for r in read_metrics(runs["faulty"] / "metrics.jsonl") if r["kind"] == "eval"]
    assert scalars("val/loss") == [
        (r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in evals
    ]
    # The failure and the redo, as cumulative counts at the step in flight, and as text.
    assert scalars("events/failures") == scalars("events/redos") == [(2, 1)]
    # The recovery of that step, once (both survivors record it: a count per survivor said 2).
    assert scalars("events/recoveries") == [(2, 1)]
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/text_summary")]
    assert any("coordinator.member_dead" in t for t in texts)
    assert any("coordinator.redo" in t and "step=2" in t for t in texts)


def test_tensorboard_reads_the_steps_in_order_when_the_pen_comes_back(tmp_path):
    """Writers 0, 1, then 0 again, within a second or two, into one folder: TensorBoard reads a
    folder's event files in the order of their names, so replica 0 must not append steps 4-5 to
    its first file (named before replica 1's), and its new file must be named after replica 1's
    even when that one's name sorts later within the same second (another host, a larger pid: made
    here by renaming it one second ahead)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recover.dashboards import RecordMirror, TensorBoardBackend

    metrics, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    metrics.touch()
    mirrors = {r: RecordMirror(metrics, replica=r, backend=TensorBoardBackend(tb)) for r in (0, 1)}
    for step, writer in enumerate([0, 0, 1, 1, 0, 0]):
        with open(metrics, "a") as f:
            f.write(json.dumps({"kind": "step", "step": step, "loss": 10.0 - step,
                                "writer": writer}) + "\n")  # fmt: skip
        for mirror in mirrors.values():
            mirror.follow()
        if step == 1:
            zeros = set(tb.glob("events.out.tfevents.*"))
        if step == 3:  # replica 1 is gone; its file is named one second ahead of this clock
            mirrors.pop(1).close()
            (ones,) = set(tb.glob("events.out.tfevents.*")) - zeros
            parts = ones.name.split(".")
            parts[3] = str(int(time.time()) + 1)
            ones.rename(tb / ".".join(parts))
    mirrors[0].close()
    assert len(list(tb.glob("events.out.tfevents.*"))) == 3  # 0's, 1's, 0's again
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (s, 10.0 - s) for s in range(6)
    ]


def test_step_records_carry_achieved_flops_and_mfu(runs):
    record = committed_steps(runs["faulty"] / "metrics.jsonl")
    for step in range(STEPS):
        r = record[step]
        assert r["tflop_per_s"] > 0
        # MFU: the job's achieved FLOP/s over the peak of its live devices (one per replica).
        assert r["mfu"] == pytest.approx(r["tflop_per_s"] / (PEAK * r["replicas"]), rel=1e-3)
    (summary,) = [
        r for r in read_metrics(runs["faulty"] / "metrics.jsonl") if r["kind"] == "summary"
    ]
    assert summary["peak_tflops"] == PEAK and summary["tflop_per_s"] > 0
    assert summary["mfu"] == pytest.approx(summary["tflop_per_s"] / (PEAK * 2), rel=1e-3)
    # On a CPU without --peak-tflops: no MFU, never a guess.
    reference = committed_steps(runs["reference"] / "metrics.jsonl")
    assert all("mfu" not in r and r["tflop_per_s"] > 0 for r in reference.values())
    assert not events(runs["reference"], "coordinator.member_dead")


def test_known_peaks_and_the_step_line():
    from recover.training.console import format_step_line
    from recover.training.flops import device_peak_tflops, known_peak_tflops, mfu

    assert known_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert known_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert known_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert known_peak_tflops("Some Other Accelerator") is None
    assert device_peak_tflops("cpu") is None and device_peak_tflops("cpu", 5.0) == 5.0
    assert mfu(4e12, None, 8) is None
    assert math.isclose(mfu(4e12, 1.0, 8), 0.5)
    line = format_step_line(
        step=0, steps=10, loss=2.5, lr=1e-3, tok_per_s=1000, step_s=0.2, eta_s=5,
        flop_per_s=12.3e12, mfu=0.412,
    )  # fmt: skip
    assert "12.3 TFLOP/s | mfu 41.2% |" in line
    assert "mfu" not in format_step_line(
        step=0, steps=10, loss=2.5, lr=1e-3, tok_per_s=1000, step_s=0.2, eta_s=5, flop_per_s=5e9
    )


def test_dashboards_follow_the_pen_when_the_writer_dies(tiny_dataset, tmp_path, monkeypatch):
    # Replica 0 writes the step records until it is killed in step 3; replica 1 writes the rest
    # (and step 3's). Each step and evaluation still reaches TensorBoard exactly once, and the one
    # W&B run of the run folder (continued by replica 1 under the same id) once.
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B's own setting: nothing leaves the machine
    out, tb = tmp_path / "run", tmp_path / "tb"
    r = run_cli(
        ["train", "--data", str(tiny_dataset), "--out", str(out), *FLAGS, "--replicas", "3",
         "--fault", "kill:replica=0,step=3,phase=commit", "--tensorboard", str(tb),
         "--wandb", "recover-tests"],
        timeout=90,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    record = committed_steps(out / "metrics.jsonl")
    writers = {record[s]["writer"] for s in range(STEPS)}
    assert writers == {0, 1}, writers
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # one per writer
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (s, pytest.approx(record[s]["loss"], rel=1e-6)) for s in range(STEPS)
    ]
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 5]
    # Killed after its done report of step 3: the step commits, and the death is decided with
    # step 4 in flight (the coordinator's events carry the step; the file's order did not tell).
    assert [(e.step, e.value) for e in acc.Scalars("events/failures")] == [(4, 1)]

    # W&B: one run id for the folder, each writer's W&B client logging into its own offline file.
    # Every step reaches the W&B run with its value; replica 1 sends again the steps that replica
    # 0's client had not confirmed when replica 1 took the pen (at least once: at most twice).
    run_id = (out / "wandb_run_id").read_text().strip()
    files = sorted(
        (out / "wandb").glob(f"client-*/wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    )
    assert 1 <= len(files) <= 2, sorted((out / "wandb").rglob("*.wandb"))
    history = [h for f in files for h in wandb_history(f)]
    losses = [(h["trainer/step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert set(losses) == {(s, record[s]["loss"]) for s in range(STEPS)}
    assert all(losses.count(x) <= 2 for x in losses), losses
    assert sorted(set(h["trainer/step"] for h in history if "val/loss" in h)) == [2, 5]
    assert {(h["trainer/step"], h["events/failures"]) for h in history
            if "events/failures" in h} == {(4, 1)}  # fmt: skip
    tables = [
        json.loads(p.read_text())
        for p in (out / "wandb").glob("client-*/wandb/offline-run-*/files/media/table/*.json")
    ]
    texts = [text for t in tables for _, text in t["data"]]
    assert sum("member_dead" in text for text in texts) == 1
    assert leftover_processes("wandb-core") == [], "W&B's service outlived the run"


def wandb_history(path: Path) -> list[dict]:
    """The history rows (logged dicts) of a W&B run file: W&B writes its records as protobuf
    messages in a log of 32 KiB blocks (a 7-byte file header, then per chunk: crc32c, length,
    type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, rows, pending = path.read_bytes(), 32768, 7, [], b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == kind == 0:
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, last
            message = wandb_internal_pb2.Record()
            message.ParseFromString(pending)
            pending = b""
            if message.WhichOneof("record_type") == "history":
                items = message.history.item  # a key with "/" is kept as its parts
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_a_toml_job_file_reruns_the_reference(runs, tiny_dataset, tmp_path):
    # The reference run's flags as a job file; only --out on the command line.
    path = tmp_path / "job.toml"
    path.write_text(
        f'[train]\npreset = "tiny"\nseq_len = 32\nmicrobatch_size = 2\nmicrobatches = {M}\n'
        f"steps = {STEPS}\neval_every = 3\neval_batches = 2\nwarmup_steps = 2\n"
        f'[run]\ndata = "{tiny_dataset}"\nquiet = true\n'
    )
    out = tmp_path / "again"
    r = run_cli(["train", "--config", str(path), "--out", str(out)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step 0/" not in r.stdout  # [run] quiet = true
    again, reference = (committed_steps(p / "metrics.jsonl") for p in (out, runs["reference"]))
    assert [again[s]["loss"] for s in range(STEPS)] == [reference[s]["loss"] for s in range(STEPS)]
    # The multi-replica run's saved config.json is a job too: its flags come back.
    from recover.cli import parse_args

    a = parse_args(["train", "--config", str(runs["faulty"] / "config.json")])
    assert (a.replicas, a.steps, a.microbatches, a.peak_tflops) == (3, STEPS, M, PEAK)
    assert a.fault == ["kill:replica=2,step=2,phase=backward,microbatch=1"]  # (as it was read)
    assert Path(a.tensorboard) == runs["tb"].resolve() and a.data == tiny_dataset.resolve()
