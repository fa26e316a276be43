"""What is written around the trajectory survives: durable checkpoints, honest resume, no gaps.

Real processes: a one-replica run whose checkpoint writer is SIGKILLed inside a save (its fsync
blocked by a test-only `sitecustomize`, so the kill lands mid-save every time), then resumed; a
corrupt newest checkpoint (a shard altered, or truncated) skipped with a warning and an event; a
run whose checkpoints are all corrupt refused; a multi-replica resume that names its checkpoint; and `recover compare` failing
on a committed step with no record.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN_FLAGS, child_env, events, leftover_processes, run_cli
from recover.checkpoint.folders import LEGACY_MAGIC, remove_stale_tmp
from recover.checkpoint.state import CheckpointWriter, dcp_state, read_checkpoint
from recover.record import committed_steps
from recover.tooling.compare import compare_runs, missing_steps

# Blocks the fsync of one checkpoint's temporary file for ever: a writer stuck inside that save,
# with the payload written but not yet durable, when the test SIGKILLs it.
SLOW_DISK = """
import os, threading
_fsync = os.fsync
def _blocking_fsync(fd):
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if os.environ.get("RECOVER_TEST_BLOCK_FSYNC", "\\0") in name:
        threading.Event().wait()
    return _fsync(fd)
os.fsync = _blocking_fsync
"""


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", *TINY_TRAIN_FLAGS, "--data", str(data), "--out", str(out), *extra]


def corrupt(checkpoint: Path, *, truncate: bool = False) -> None:
    """Alter one byte of a checkpoint's shard file (or cut its last bytes off)."""
    (shard,) = checkpoint.glob("*.distcp")
    data = bytearray(shard.read_bytes())
    if truncate:
        del data[-100:]
    else:
        data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def uninterrupted(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    r = run_cli(train_args(tiny_dataset, out, "--steps", "8", "--ckpt-every", "2"))
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.timeout(90)
def test_a_writer_killed_mid_save_logs_no_save_and_its_tmp_is_removed_on_resume(
    tiny_dataset, uninterrupted, tmp_path
):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_DISK)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hooks), env.get("PYTHONPATH", "")])
    env["RECOVER_TEST_BLOCK_FSYNC"] = "step_00000004.tmp"
    out = tmp_path / "run"
    args = train_args(tiny_dataset, out, "--steps", "8", "--ckpt-every", "2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "recover.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    ckpts = out / "checkpoints"
    try:
        # The save of step 4 is stuck in its fsync; training went on to step 5 (whose commit
        # queues the save of step 6, which waits for the stuck one). Kill it there.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = list(ckpts.glob("step_00000004.tmp*")) if ckpts.is_dir() else []
            if tmps and 5 in committed_steps(out / "metrics.jsonl"):
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed mid-save"
        time.sleep(0.2)  # an event claiming the save would have been written by now
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    (tmp,) = ckpts.glob("step_00000004.tmp*")
    assert sorted(p.name for p in ckpts.glob("step_*") if ".tmp" not in p.name) == ["step_00000002"]
    # The only save announced is the one that is on disk.
    assert [e["step"] for e in events(out, "checkpoint_saved")] == [2]

    r = run_cli(train_args(tiny_dataset, out, "--steps", "8", "--ckpt-every", "2", "--resume"))
    assert r.returncode == 0, r.stderr
    assert not tmp.exists()
    assert [e["path"] for e in events(out, "checkpoint_tmp_removed")] == [str(tmp)]
    (resumed,) = events(out, "resumed")
    assert resumed["step"] == 2 and resumed["path"] == str(ckpts / "step_00000002")
    assert f"resuming at step 2 from {ckpts / 'step_00000002'}" in r.stdout
    # Every announced save of the resumed run names a file that landed (keep 2: 4 and 6 remain).
    assert [e["step"] for e in events(out, "checkpoint_saved")] == [2, 4, 6]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000006"]
    result = compare_runs(uninterrupted, out)
    assert result.passes(0.0), result
    assert leftover_processes(str(out)) == []


def test_a_corrupt_newest_checkpoint_is_skipped_loudly_for_the_older_one(
    tiny_dataset, uninterrupted, tmp_path
):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000006"]
    corrupt(ckpts / "step_00000006")
    r = run_cli(train_args(tiny_dataset, out, "--steps", "8", "--ckpt-every", "2", "--resume"))
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stderr and "step_00000006" in r.stderr and "corrupt" in r.stderr
    (bad,) = events(out, "checkpoint_corrupt")
    assert bad["path"] == str(ckpts / "step_00000006") and "checksum" in bad["error"]
    (resumed,) = events(out, "resumed")
    assert resumed["step"] == 4 and resumed["path"] == str(ckpts / "step_00000004")
    assert resumed["skipped"] == [str(ckpts / "step_00000006")]
    assert "resuming at step 4 from" in r.stdout
    assert compare_runs(uninterrupted, out).passes(0.0)  # steps 4..7 recomputed, same trajectory


def test_checkpoints_that_are_all_corrupt_are_refused_not_replaced_by_step_0(
    tiny_dataset, uninterrupted, tmp_path
):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    for i, ckpt in enumerate(sorted((out / "checkpoints").iterdir())):
        corrupt(ckpt, truncate=i == 0)
    before = (out / "metrics.jsonl").read_text()
    r = run_cli(train_args(tiny_dataset, out, "--steps", "8", "--ckpt-every", "2", "--resume"))
    assert r.returncode == 2
    assert "no valid checkpoint" in r.stderr, r.stderr
    assert "step_00000004" in r.stderr and "step_00000006" in r.stderr
    assert "bytes" in r.stderr and "checksum" in r.stderr  # truncated, and altered
    assert (out / "metrics.jsonl").read_text() == before  # nothing was trained or announced


def write_legacy_checkpoint(path: Path, content: dict) -> None:
    """The single-file form `recover train` wrote before DCP folders: b'RCVRCKP1', the SHA-256 of
    the payload, a torch.save of the full state (the optimizer's by parameter name, in groups)."""
    groups: list[dict] = []
    for name, hyper in content["optimizer"]["param_groups"].items():
        for group in groups:
            if all(group[k] == v for k, v in hyper.items()):
                group["params"].append(name)
                break
        else:
            groups.append({**hyper, "params": [name]})
    state = {
        **{k: content["meta"][k] for k in ("step", "train", "data_hash")},
        "model": content["model"],
        "optimizer": {"state": content["optimizer"]["state"], "param_groups": groups},
        "layout": {},
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path.write_bytes(LEGACY_MAGIC + hashlib.sha256(payload).digest() + payload)


def test_a_checkpoint_file_of_the_older_form_still_resumes(tiny_dataset, uninterrupted, tmp_path):
    # A run folder whose only checkpoint is a file of the older single-file form resumes from it
    # on the same trajectory, and its next checkpoints are DCP folders.
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    ckpts = out / "checkpoints"
    content = read_checkpoint(ckpts / "step_00000004")
    for folder in list(ckpts.iterdir()):
        shutil.rmtree(folder)
    write_legacy_checkpoint(ckpts / "step_00000004.ckpt", content)
    r = run_cli(train_args(tiny_dataset, out, "--steps", "8", "--ckpt-every", "2", "--resume"))
    assert r.returncode == 0, r.stderr
    (resumed,) = events(out, "resumed")
    assert resumed["step"] == 4 and resumed["path"] == str(ckpts / "step_00000004.ckpt")
    assert compare_runs(uninterrupted, out).passes(0.0)  # bit for bit
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004.ckpt", "step_00000006"]
    assert read_checkpoint(ckpts / "step_00000004.ckpt")["meta"]["step"] == 4  # the reader too


def test_compare_fails_on_a_committed_step_without_a_record(uninterrupted, tmp_path):
    lines = (uninterrupted / "metrics.jsonl").read_text().splitlines(keepends=True)

    def without(steps: set[int], name: str) -> Path:
        run = tmp_path / name
        shutil.copytree(uninterrupted, run)
        kept = [
            line
            for line in lines
            if not any('"kind":"step"' in line and f'"step":{s},' in line for s in steps)
        ]
        assert len(kept) == len(lines) - len(steps)
        (run / "metrics.jsonl").write_text("".join(kept))
        return run

    inner = without({2}, "inner")
    assert missing_steps(inner / "metrics.jsonl") == (2,)
    result = compare_runs(uninterrupted, inner)
    assert result.missing_b == (2,) and not result.passes(1.0)  # the loss of the rest agrees
    r = run_cli(["compare", str(inner), str(uninterrupted), "--rtol", "1"])
    assert r.returncode == 1 and "A: 2; B: none" in r.stdout and "FAIL" in r.stdout
    # The last step's record missing: the run's summary says it committed 8 steps.
    last = without({7}, "last")
    assert compare_runs(uninterrupted, last).missing_b == (7,)
    # A shorter run (killed, never finished) is no gap: compared on the steps both committed.
    short = without(set(), "short")
    kept = [ln for ln in lines if '"kind":"summary"' not in ln and '"step":7,' not in ln]
    (short / "metrics.jsonl").write_text("".join(kept))
    assert compare_runs(uninterrupted, short).missing_b == ()


@pytest.mark.timeout(120)
def test_a_multi_replica_resume_names_its_checkpoint(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    flags = ["--replicas", "2", "--ckpt-every", "2", "--eval-every", "0"]
    r = run_cli(train_args(tiny_dataset, out, "--steps", "3", *flags), timeout=90)
    assert r.returncode == 0, r.stdout[-3000:]
    r = run_cli(train_args(tiny_dataset, out, "--steps", "4", *flags, "--resume"), timeout=90)
    assert r.returncode == 0, r.stdout[-3000:]
    ckpt = out / "checkpoints" / "step_00000002"
    resumed = events(out, "resumed")
    assert len(resumed) == 2 and all(e["path"] == str(ckpt) and e["step"] == 2 for e in resumed)
    for replica in (0, 1):
        assert f"[replica {replica}] resuming at step 2 from {ckpt}" in r.stdout
    assert sorted(committed_steps(out / "metrics.jsonl")) == [0, 1, 2, 3]
    assert leftover_processes(str(out)) == []


def test_on_saved_runs_once_the_folder_is_in_place(tmp_path):
    seen = []

    def on_saved(saved):  # on the writer thread: the folder must already be complete and named
        files = [f for f in saved.path.iterdir()]
        assert sum(f.stat().st_size for f in files) == saved.bytes
        assert not list(tmp_path.glob("*.tmp*"))
        seen.append((saved.step, read_checkpoint(saved.path)["meta"]["step"]))

    model = torch.nn.Linear(10, 100)
    writer = CheckpointWriter(tmp_path, keep=2, on_saved=on_saved)
    writer.save(3, dcp_state(model), {})
    writer.save(6, dcp_state(model), {}, block=True)
    assert seen == [(3, 3), (6, 6)]


def test_only_temporaries_of_dead_writers_of_this_host_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its PID no longer exists (short of reuse within the test)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        host = socket.gethostname()
        names = {
            "dead": f"step_00000004.tmp.{host}.{dead.pid}",
            "old_form": f"step_00000002.ckpt.tmp{dead.pid}",
            "old_file": f"step_00000002.ckpt.tmp.{host}.{dead.pid}",
            "live": f"step_00000004.tmp.{host}.{live.pid}",
            "mine": f"step_00000004.tmp.{host}.{os.getpid()}",
            "other_host": f"step_00000004.tmp.another-host.example.{dead.pid}",
            "not_ours": "notes.tmp123",
        }
        for key, name in names.items():
            if key in ("old_form", "old_file", "not_ours"):  # files of the older form
                (tmp_path / name).write_bytes(b"partial")
            else:  # a folder that ranks were writing into
                (tmp_path / name).mkdir()
                (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
        removed = remove_stale_tmp(tmp_path)
        stale = [names[k] for k in ("dead", "old_form", "old_file")]
        assert sorted(p.name for p in removed) == sorted(stale)
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {names[k] for k in ("live", "mine", "other_host", "not_ours")}
    finally:
        live.kill()
        live.wait()


def test_compare_reads_steps_skipped_as_non_finite(uninterrupted, tmp_path):
    # A step skipped as non-finite is recorded with a null loss: the same skip in both runs
    # agrees, a skip in one run only is a difference (and never a crash of compare).
    lines = (uninterrupted / "metrics.jsonl").read_text().splitlines(keepends=True)

    def with_null_loss(name: str) -> Path:
        run = tmp_path / name
        shutil.copytree(uninterrupted, run)
        edited = [
            re.sub(r'"loss":[^,]+,', '"loss":null,', line)
            if '"kind":"step"' in line and '"step":3,' in line
            else line
            for line in lines
        ]
        (run / "metrics.jsonl").write_text("".join(edited))
        return run

    a, b = with_null_loss("a"), with_null_loss("b")
    assert committed_steps(a / "metrics.jsonl")[3]["loss"] is None
    assert compare_runs(a, b).passes(0.0)
    one_sided = compare_runs(uninterrupted, a)
    assert one_sided.max_loss_rel_diff == float("inf") and one_sided.worst_step == 3
