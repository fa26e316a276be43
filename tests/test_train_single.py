"""One-replica training: determinism, kill + resume on the same trajectory, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN_FLAGS, child_env, cli_here, run_cli
from recover.record import committed_steps
from recover.tooling.compare import compare_runs


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", *TINY_TRAIN_FLAGS, "--data", str(data), "--out", str(out), *extra]


@pytest.fixture(scope="module")
def run_a(tiny_dataset, tmp_path_factory) -> Path:
    """A run of 8 steps with the default seed, which both tests below compare another with."""
    out = tmp_path_factory.mktemp("single") / "A"
    r = run_cli(train_args(tiny_dataset, out, "--steps", "8"))
    assert r.returncode == 0, r.stderr
    return out


def test_two_runs_are_identical_and_compare_passes_at_rtol_0(run_a, tiny_dataset, tmp_path):
    r = run_cli(train_args(tiny_dataset, tmp_path / "B", "--steps", "8"))
    assert r.returncode == 0, r.stderr
    steps = committed_steps(run_a / "metrics.jsonl")
    assert sorted(steps) == list(range(8))
    assert all(s["microbatches"] == 4 for s in steps.values())
    assert (run_a / "final" / "model.safetensors").exists()
    config = json.loads((run_a / "config.json").read_text())
    assert config["train"]["microbatches"] == 4
    r = cli_here(["compare", str(run_a), str(tmp_path / "B"), "--rtol", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout


def test_compare_fails_on_a_different_trajectory(run_a, tiny_dataset, tmp_path):
    """Another seed, 3 steps: compared over the steps the two runs share."""
    r = run_cli(train_args(tiny_dataset, tmp_path / "B", "--steps", "3", "--seed", "2"))
    assert r.returncode == 0, r.stderr
    result = compare_runs(run_a, tmp_path / "B")
    assert result.common_steps == 3
    assert result.max_loss_rel_diff > 1e-4 and result.param_rel_l2 > 1e-3
    r = cli_here(["compare", str(run_a), str(tmp_path / "B")])
    assert r.returncode == 1 and "FAIL" in r.stdout


@pytest.mark.timeout(90)
def test_kill_mid_run_then_resume_gives_the_uninterrupted_trajectory(tiny_dataset, tmp_path):
    steps = "16"
    r = run_cli(train_args(tiny_dataset, tmp_path / "full", "--steps", steps), timeout=60)
    assert r.returncode == 0, r.stderr

    killed = tmp_path / "killed"
    args = train_args(tiny_dataset, killed, "--steps", steps, "--ckpt-every", "3")
    proc = subprocess.Popen(
        [sys.executable, "-m", "recover.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=child_env(),
    )
    try:
        # Kill once step 8 is committed: checkpoints at 3 and 6 exist, steps 6..8 are redone.
        deadline = time.monotonic() + 45
        metrics = killed / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and 8 in committed_steps(metrics):
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert 15 not in committed_steps(killed / "metrics.jsonl")

    r = run_cli(train_args(tiny_dataset, killed, "--steps", steps, "--ckpt-every", "3", "--resume"))
    assert r.returncode == 0, r.stderr
    assert "resuming at step" in r.stdout
    result = compare_runs(tmp_path / "full", killed)
    assert result.common_steps == 16
    assert result.max_loss_rel_diff == 0.0
    assert result.param_rel_l2 == 0.0


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--preset", "huge"], "--preset"),
        (["--steps", "0"], "--steps"),
        (["--microbatches", "-1"], "--microbatches"),
        (["--microbatch-size", "0"], "--microbatch-size"),
        (["--seq-len", "0"], "--seq-len"),
        (["--lr", "0"], "--lr"),
        (["--dropout", "1.5"], "--dropout"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(tiny_dataset, tmp_path, flags, needle):
    from recover.cli import main

    out = tmp_path / "run"
    code = main(train_args(tiny_dataset, out, *flags))
    assert code == 2
    assert not out.exists(), "nothing may be written for a refused config"


def test_bad_flag_message(tiny_dataset, tmp_path, capsys):
    from recover.cli import main

    assert main(train_args(tiny_dataset, tmp_path / "x", "--preset", "huge")) == 2
    err = capsys.readouterr().err
    assert "--preset" in err and "tiny" in err and "gpt2-124m" in err


def test_out_folder_holding_another_run_is_refused(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    assert run_cli(train_args(tiny_dataset, out, "--steps", "2")).returncode == 0
    before = (out / "metrics.jsonl").read_text()
    r = run_cli(train_args(tiny_dataset, out, "--steps", "2"))
    assert r.returncode == 2
    assert str(out) in r.stderr and "--resume" in r.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_out_folder_with_other_files_is_refused(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run_cli(train_args(tiny_dataset, out, "--steps", "2"))
    assert r.returncode == 2 and "other files" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_resume_with_other_settings_is_refused(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    assert (
        run_cli(train_args(tiny_dataset, out, "--steps", "2", "--ckpt-every", "1")).returncode == 0
    )
    r = run_cli(train_args(tiny_dataset, out, "--steps", "4", "--seed", "9", "--resume"))
    assert r.returncode == 2 and "--seed" in r.stderr


def test_corrupt_checkpoint_gives_a_clear_error(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    r = run_cli(train_args(tiny_dataset, out, "--steps", "4", "--ckpt-every", "2"))
    assert r.returncode == 0, r.stderr
    ckpts = sorted((out / "checkpoints").iterdir())
    assert ckpts, "a checkpoint at step 2 was expected"
    newest = ckpts[-1]
    (shard,) = newest.glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = run_cli(train_args(tiny_dataset, out, "--steps", "6", "--ckpt-every", "2", "--resume"))
    assert r.returncode == 2
    assert "corrupt" in r.stderr and newest.name in r.stderr


def test_resume_of_a_missing_run_is_refused(tiny_dataset, tmp_path):
    r = run_cli(train_args(tiny_dataset, tmp_path / "none", "--steps", "2", "--resume"))
    assert r.returncode == 2 and "no run" in r.stderr


def test_a_refused_run_folder_is_refused_before_torch_is_imported(tiny_dataset, tmp_path):
    """The one-replica run trains in the launcher's process, which imports torch (seconds): the
    run folder's refusals come first, so a wrong --out or --resume is said at once."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cmd = [sys.executable, "-X", "importtime", "-m", "recover.cli",
           *train_args(tiny_dataset, out, "--steps", "2")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 2 and "other files" in r.stderr, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "recover.cli.train" in imported and "torch" not in imported


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_nccl_cross_reduce_without_gpus_is_refused_before_anything_starts(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    r = run_cli(train_args(tiny_dataset, out, "--replicas", "2", "--cross-reduce", "nccl"))
    assert r.returncode == 2 and "2 processes, 0 GPUs visible" in r.stderr, r.stderr
    assert not out.exists()


def test_version_and_a_warmup_longer_than_the_run_is_warned(tiny_dataset, tmp_path):
    from conftest import TINY_TRAIN_FLAGS, run_cli

    version = run_cli(["--version"])
    assert version.returncode == 0 and version.stdout.startswith("recover ")
    r = run_cli(["train", *TINY_TRAIN_FLAGS, "--steps", "2", "--warmup-steps", "5",
                 "--data", str(tiny_dataset), "--out", str(tmp_path / "run")])  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--warmup-steps 5 >= --steps 2: the learning rate never reaches its peak" in r.stderr


def test_a_new_run_starts_from_another_runs_checkpoint(tiny_dataset, tmp_path):
    """--init-from: run B (two replicas, a new run folder) starts from the weights of run A's
    newest checkpoint, with a fresh optimizer at step 0: its first committed loss is that of
    A's trained weights (well below a fresh model's on the same microbatches, A's own step 0),
    the replicas agree (--init-from is part of what they must share), and it is recorded. A
    path with no checkpoint is refused in one line."""
    a, b = tmp_path / "A", tmp_path / "B"
    r = run_cli(train_args(tiny_dataset, a, "--steps", "6", "--ckpt-every", "4"))
    assert r.returncode == 0, r.stderr
    r = run_cli(
        train_args(tiny_dataset, b, "--steps", "2", "--replicas", "2", "--init-from", str(a))
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    fresh, started = (
        committed_steps(a / "metrics.jsonl")[0],
        committed_steps(b / "metrics.jsonl")[0],
    )
    assert started["loss"] < fresh["loss"] - 0.3, (started["loss"], fresh["loss"])
    events = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    inits = [e["path"] for e in events if e.get("name") == "initialized_from"]  # (per replica)
    assert inits == [str(a / "checkpoints" / "step_00000004")] * 2, inits
    assert json.loads((b / "config.json").read_text())["train"]["init_from"] == str(a)
    r = run_cli(
        train_args(tiny_dataset, tmp_path / "C", "--steps", "2", "--init-from", str(b / "x"))
    )
    assert r.returncode == 2 and "no checkpoint there" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
