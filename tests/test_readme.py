"""The README's commands, taken from the file itself, so that none can drift from the code.

Every line of the README's bash blocks is read here: each `recover` command parses with recover's
own parser (a misspelt flag or value fails), the scripts a `recover run` line names exist among
the examples, the environment a `torchrun` line sets is the one the script API reads, the install
lines pin torch, and the test line is the one `.ci/run` runs. `.ci/run` runs the Quickstart's
first command as the README writes it (it trains for a minute, past this suite's budget); the
shapes of the other lines run under faults in tests/test_api.py.
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
