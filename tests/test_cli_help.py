"""Every flag of every `recover` command has help text, and every command's --help prints."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from recover.cli import build_parser
from recover.clidoc import commands

COMMANDS = list(commands(build_parser()))


def test_every_option_of_every_command_has_help():
    missing = []
    for path, parser in COMMANDS:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if action.help is argparse.SUPPRESS or not (action.help or "").strip():
                name = "/".join(action.option_strings) or action.dest
                missing.append(f"recover {' '.join(path)} {name}".replace("  ", " "))
    assert not missing, "options without help: " + ", ".join(missing)


def test_the_walk_reaches_nested_commands():
    paths = {" ".join(p) for p, _ in COMMANDS}
    assert {
        "train",
        "coordinator serve",
        "coordinator status",
        "bench balance",
        "simulate",
    } <= paths


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "recover")
def test_help_prints(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        build_parser().parse_args([*path, "--help"])
    assert done.value.code == 0
    assert "usage: recover" in out.getvalue()


def test_the_coordinators_settings_are_declared_once_and_travel_as_json():
    """A setting that `recover train` and `coordinator serve` both offer has one default, one
    help and one check (CoordinatorOptions); the launcher hands its coordinator the object as
    JSON, which `serve --options` reads back whole; M is the replicas' to declare."""
    from recover.coordinator.cli import serve_options
    from recover.coordinator.options import CoordinatorOptions
    from recover.launch.config import LaunchConfig

    parser = build_parser()
    serve = serve_options(parser.parse_args(["coordinator", "serve", "--replicas", "2"]))
    train = parser.parse_args(["train"])
    assert serve == CoordinatorOptions(expected_replicas=2)
    launcher_flags = ("min_replicas", "lease_s", "balance")
    assert {n: getattr(train, n) for n in launcher_flags} == {
        n: getattr(serve, n) for n in launcher_flags
    }
    helps = {}
    for argv in (["coordinator", "serve", "--help"], ["train", "--help"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            parser.parse_args(argv)
        text = " ".join(out.getvalue().split())
        helps[argv[0]] = text[text.index("--lease S ") :].split(" --", 1)[0]
    assert helps["coordinator"] == helps["train"]
    assert "(default: 1)" in helps["train"]

    # The launcher's coordinator: the job's settings, one JSON object, M not among them.
    lc = LaunchConfig(replicas=3, min_replicas=2, lease_s=2.5, balance="equal")
    text = lc.coordinator_options().settings_json()
    assert "microbatches" not in json.loads(text)
    args = parser.parse_args(["coordinator", "serve", "--options", text, "--lease", "3"])
    got = serve_options(args)
    assert (got.expected_replicas, got.min_replicas, got.balance) == (3, 2, "equal")
    assert got.lease_s == 3.0 and got.microbatches == 0  # a flag said over it; M learned
    for argv, message in (
        (["--options", '{"expected_replicas": 2, "microbatches": 8}'], "M comes from the replicas"),
        (["--options", '{"expected_replicas": 2, "lease": 2}'], r"unknown fields \['lease'\]"),
        (["--options", "[2]"], "must be a JSON object"),
        (["--replicas", "2", "--lease", "0"], "--lease must be a finite number > 0"),
        (["--replicas", "2", "--min-replicas", "3"], "--min-replicas .3. must be <="),
        ([], "--replicas is required"),
    ):
        with pytest.raises(ValueError, match=message):
            serve_options(parser.parse_args(["coordinator", "serve", *argv]))


def test_recover_help_names_every_benchmark():
    """`recover --help` lists every `recover bench` subcommand (it once named 4 of the 7)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(out.getvalue().split())  # (argparse wraps the line)
    benchmarks = [p for p, _ in COMMANDS if len(p) == 2 and p[0] == "bench"]
    assert len(benchmarks) >= 7
    for _, name in benchmarks:
        assert name in text.split("bench benchmarks (", 1)[1].split(")", 1)[0], (name, text)


def test_the_readme_installs_a_pinned_torch_from_the_right_index():
    """The README's install lines (they cannot run here: no other index is reachable): the CPU
    line takes the pinned torch from PyTorch's CPU wheel index, the GPU line the same pin from
    the default index, and the Quickstart's commands pin it too."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    pins = set(re.findall(r"pip install torch==([0-9.]+)", readme))
    assert len(pins) == 1, pins  # one torch version everywhere
    cpu = [line for line in readme.splitlines() if "download.pytorch.org/whl/cpu" in line]
    assert cpu and all("--index-url https://download.pytorch.org/whl/cpu" in c for c in cpu), cpu
    assert all(f"torch=={pins.pop()}" in c for c in cpu)
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) >= 4 and all("torch==" in c for c in commands), commands


def test_docs_cli_md_is_what_the_parsers_generate():
    """docs/cli.md, the command reference, is generated from the parsers: a flag added, renamed
    or re-described without regenerating it fails here (regenerate: python -m
    recover.clidoc > docs/cli.md)."""
    from pathlib import Path

    from recover.clidoc import render

    written = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert written == render(build_parser()), (
        "docs/cli.md is stale: python -m recover.clidoc > docs/cli.md"
    )


def test_the_wheel_and_the_sdist_hold_the_package_and_the_wheel_runs(tmp_path):
    """The two artefacts of a release, built offline by setuptools (what `python -m build` runs)
    from a copy of the tracked files: the wheel holds every module of src/recover and the
    license, and installed into a folder of its own it runs (the package imported from there,
    `recover --help`); the sdist holds the sources with their tests, docs and examples."""
    import os
    import shutil
    import subprocess
    import sys
    import tarfile
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    tree = tmp_path / "tree"
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (root / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, tree / name)
    build = "from setuptools import build_meta as b; b.build_wheel('dist'); b.build_sdist('dist')"
    r = subprocess.run([sys.executable, "-c", build], cwd=tree, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tree / "dist").glob("*.whl")
    (sdist,) = (tree / "dist").glob("*.tar.gz")
    modules = {p.relative_to(root / "src").as_posix() for p in (root / "src").rglob("*.py")}
    inside = set(zipfile.ZipFile(wheel).namelist())
    assert modules <= inside, sorted(modules - inside)
    assert any(n.endswith("licenses/LICENSE") for n in inside)
    top = sdist.name.removesuffix(".tar.gz")
    held = set(tarfile.open(sdist).getnames())
    for needed in ("LICENSE", "README.md", "src/recover/cli/__init__.py", "tests/conftest.py",
                   "tests/hosts.py", "docs/cli.md", "examples/train_custom.py"):  # fmt: skip
        assert f"{top}/{needed}" in held, needed
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
         str(site), str(wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run(
        [sys.executable, "-c", "import recover, recover.cli; print(recover.__file__)"],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith(str(site)), r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "recover.cli", "--help"], env=env,
                       capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and "usage: recover" in r.stdout, r.stderr[-2000:]
