"""The runtime's terminal lines go through the stdlib `logging` (recover.logs): `--log-level`
drops the step lines at warning and keeps warnings and errors; debug adds lines; INFO goes to
stdout and warnings to stderr, each with the process's prefix."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from conftest import TINY_TRAIN_FLAGS, child_env, finish, leftover_processes
from recover.cli import main
from recover.logs import process_prefix, replica_name, setup_logging


@pytest.fixture
def recover_logger():
    """Put the `recover` logger back as it was (a test that sets it up must not leak)."""
    log = logging.getLogger("recover")
    saved = (list(log.handlers), log.level, log.propagate)
    yield log
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


def test_levels_streams_and_prefix(recover_logger, capsys):
    setup_logging("info", prefix="[launcher] ")
    setup_logging("info", prefix="[launcher] ")  # set up again: replaced, not doubled
    log = logging.getLogger("recover.launch")
    log.debug("hidden")
    log.info("step 1/3")
    log.warning("replica 1 exited")
    out, err = capsys.readouterr()
    assert out == "[launcher] step 1/3\n" and err == "[launcher] replica 1 exited\n"
    setup_logging("error")
    log.warning("hidden")
    log.error("training failed")
    assert capsys.readouterr() == ("", "training failed\n")
    with pytest.raises(ValueError, match="--log-level must be one of debug, info"):
        setup_logging("loud")
    assert process_prefix("coordinator", {}) == "[coordinator] "
    assert process_prefix("coordinator", {"RECOVER_LAUNCHER_PID": "1"}) == ""  # it adds its own
    assert (replica_name(2), replica_name(2, 1, 2)) == ("replica 2", "replica 2 rank 1")


def test_debug_adds_the_resolved_job_to_a_one_replica_run(
    tiny_dataset, tmp_path, recover_logger, capsys
):
    flags = ["train", *TINY_TRAIN_FLAGS, "--steps", "2", "--data", str(tiny_dataset)]
    assert main([*flags, "--out", str(tmp_path / "info")]) == 0
    info = capsys.readouterr().out
    assert "step 1/2 |" in info and "job: " not in info
    assert main([*flags, "--out", str(tmp_path / "debug"), "--log-level", "debug"]) == 0
    debug = capsys.readouterr().out
    (line,) = [x for x in debug.splitlines() if x.startswith("job: ")]
    job = json.loads(line.removeprefix("job: "))
    assert job["train"]["steps"] == 2 and job["replica"]["log_level"] == "debug"
    assert "step 1/2 |" in debug


def test_warning_level_drops_the_step_lines_and_keeps_the_warnings(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "recover.cli", "train", *TINY_TRAIN_FLAGS, "--steps", "3",
            "--data", str(tiny_dataset), "--out", str(out), "--replicas", "2",
            "--fault", "exit:replica=1,step=1,phase=forward", "--log-level", "warning",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip
    r = finish(proc, timeout=90)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "step 0/3" not in r.stdout and "training tiny" not in r.stdout, r.stdout
    assert "admitted" not in r.stdout and "coordinator at" not in r.stdout  # INFO, everywhere
    assert "[replica 1] injecting fault: exit of replica 1" in r.stdout, r.stdout
    assert "[launcher] replica 1 exited with status 17" in r.stdout, r.stdout
    assert leftover_processes(str(out)) == []


def test_recover_run_takes_a_job_file_saves_the_resolved_job_and_obeys_its_level(tmp_path):
    (tmp_path / "job.toml").write_text('[launch]\nreplicas = 1\n[replica]\nlog_level = "warning"\n')
    script = ["--", sys.executable, "-c", "print('hello from the script')"]

    def recover_run(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "recover.cli", "run", *flags, *script]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
        )
        return finish(proc, timeout=60)

    quiet = recover_run("--config", str(tmp_path / "job.toml"), "--out", str(tmp_path / "a"))
    assert quiet.returncode == 0, quiet.stdout
    assert "[replica 0] hello from the script" in quiet.stdout  # a script's own output stays
    assert "[launcher]" not in quiet.stdout and "[coordinator]" not in quiet.stdout
    saved = json.loads((tmp_path / "a" / "job.json").read_text())
    assert saved["job"]["replica"]["log_level"] == "warning"
    assert saved["command"] == script[1:]
    # the saved job is a job file: the same job again, at info now
    again = recover_run(
        "--config", str(tmp_path / "a" / "job.json"), "--out", str(tmp_path / "b"),
        "--log-level", "info",
    )  # fmt: skip
    assert again.returncode == 0, again.stdout
    assert "[launcher] coordinator at" in again.stdout and "[replica 0] hello" in again.stdout
    assert leftover_processes(str(tmp_path)) == []
