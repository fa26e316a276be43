"""The README's commands, taken from the file itself, so that none can drift from the code.

Every line of the README's bash blocks is read here: each `recover` command parses with recover's
own parser (a misspelt flag or value fails), the scripts a `recover run` line names exist among
the examples, the environment a `torchrun` line sets is the one the script API reads, the install
lines pin torch, and the test line is the one `.ci/run` runs. With -m slow, every command this
machine can run is run as written but for its placeholders (a minute, the Quickstart's training
most of it); `.ci/run` runs the Quickstart's first command itself, set-up included. The test
line is this suite; the install lines for other indexes cannot reach them here.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from recover.cli import build_parser
from recover.runtime.env import COORDINATOR_ENV, REPLICA_ENV

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def bash_lines(text: str) -> list[str]:
    """The command lines of the text's ```bash blocks (continuations joined, comments dropped)."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def commands(line: str) -> list[list[str]]:
    return [shlex.split(part) for part in line.split("&&")]


LINES = bash_lines(README)


def _parses(argv: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"recover {shlex.join(argv)}: {err.getvalue()}") from e


def test_the_readme_has_its_commands():
    """The extraction sees the Quickstart's two commands and the script lines."""
    assert len(LINES) >= 7, LINES
    assert any("recover train" in line for line in LINES)
    assert any(line.endswith(".venv/bin/pytest") for line in LINES)


@pytest.mark.parametrize("line", LINES)
def test_every_readme_command_is_one_recover_takes(line):
    for argv in commands(line):
        env = {}
        while argv and re.fullmatch(r"[A-Z_]+=\S+", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        tool = Path(argv[0]).name
        if tool == "recover":
            before, _, script = shlex.join(argv[1:]).partition(" -- ")
            _parses(shlex.split(before))
            if script:  # `recover run ... -- python SCRIPT ARGS`: a script of examples/
                words = shlex.split(script)
                assert words[0] == "python", line
                assert (ROOT / "examples" / words[1]).exists() or words[1] == "train.py", line
        elif tool == "torchrun":
            assert set(env) == {COORDINATOR_ENV, REPLICA_ENV}, line
        elif tool == "pip":
            assert "torch==2.13.0" in argv or "-e" in argv, line
        elif tool == "pytest":
            assert line in (ROOT / ".ci" / "run").read_text(), "CI runs another test command"
        else:
            assert argv[:3] == ["python3", "-m", "venv"], f"a command no test knows: {line}"


def test_ci_runs_the_quickstart_as_the_readme_writes_it():
    (first,) = [line for line in LINES if "recover train" in line and "--fault" in line]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "quickstart" in ci and "README.md" in ci, "CI does not run the Quickstart"
    assert first.startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0")


def _runnable(line: str, *, venv_bin: Path, script_args: list[str], coordinator: str) -> list[str]:
    """The last command of a README line, with its placeholders given values: the venv's
    recover, an example for train.py, small arguments for ARGS, a live coordinator for
    HOST:PORT, one replica and one rank for R and N."""
    argv = commands(line)[-1]
    out: list[str] = []
    for word in argv:
        if word.startswith(".venv/bin/"):
            word = str(venv_bin / word.removeprefix(".venv/bin/"))
        elif word in ("train.py", "train_fsdp.py", "train_pipeline.py"):
            word = str(ROOT / "examples" / ("train_custom.py" if word == "train.py" else word))
        elif word == "ARGS":
            out += script_args
            continue
        word = {"R": "0", "N": "1"}.get(word, word.replace("HOST:PORT", coordinator))
        word = word.replace("RECOVER_REPLICA_ID=R", "RECOVER_REPLICA_ID=0")
        out.append(word)
    return out


@pytest.mark.slow  # five runs, the Quickstart's a minute of training; the test above parses them
@pytest.mark.process
@pytest.mark.timeout(900)
def test_every_readme_command_that_can_run_here_runs(custom_token_file, tmp_path):
    """Every README command that this machine can run, as written but for its placeholders: the
    Quickstart's training (its set-up is CI's), the three `recover run` lines and the `torchrun` line
    against a coordinator. The test command is this suite; the other indexes are unreachable."""
    import json
    import os
    import subprocess
    import sys
    import time

    from conftest import child_env, finish, leftover_processes
    from recover.record import read_metrics

    venv_bin = Path(sys.executable).parent
    address = tmp_path / "coordinator.json"
    serve = subprocess.Popen(
        [sys.executable, "-m", "recover.cli", "coordinator", "serve", "--replicas", "1",
         "--port", "0", "--address-file", str(address)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not address.exists() and serve.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the file its coordinator writes once it listens
        assert address.exists(), serve.stdout.read() if serve.poll() is not None else "no address"
        info = json.loads(address.read_text())
        runnable = [
            line for line in LINES
            if "recover train" in line or "recover run" in line or "torchrun" in line
        ]  # fmt: skip
        assert len(runnable) == 5, runnable
        ran: list[str] = []
        for i, line in enumerate(runnable):
            cwd = tmp_path / f"line{i}"
            cwd.mkdir()
            args = ["--data", str(custom_token_file), "--steps", "12", "--microbatches", "4",
                    "--batch", "2", "--seq-len", "32", "--out", str(cwd / "result")]  # fmt: skip
            argv = _runnable(
                line, venv_bin=venv_bin, script_args=args,
                coordinator=f"127.0.0.1:{info['port']}",
            )  # fmt: skip
            env = child_env()
            while "=" in argv[0]:
                name, _, value = argv.pop(0).partition("=")
                env[name] = value
            env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
            proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            r = finish(proc, 600)
            assert r.returncode == 0, f"{line}\n{r.stdout[-3000:]}"
            assert "Traceback" not in r.stdout, r.stdout[-3000:]
            if "--fault kill" in line:  # the fault fired, and the run survived it
                assert "killed by SIGKILL" in r.stdout, r.stdout[-3000:]
            if "recover run" in line or "recover train" in line:  # its record: each step once
                (record,) = cwd.glob("runs/*/metrics.jsonl")
                steps = [x["step"] for x in read_metrics(record) if x.get("kind") == "step"]
                total = 300 if "recover train" in line else 12  # the Quickstart's, or ARGS'
                assert sorted(steps) == list(range(total)), (line, sorted(steps)[-5:])
            ran.append(argv[0])
            assert leftover_processes(str(cwd)) == []
        assert [Path(a).name for a in ran] == [*["recover"] * 4, "torchrun"]
    finally:
        if serve.poll() is None:
            serve.terminate()
        serve.wait(timeout=30)
