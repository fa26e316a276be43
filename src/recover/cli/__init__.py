"""The `recover` command line: the only place that reads flags and the environment.

Job: one parser with a subcommand per job (`build_parser`), a job file's values as the defaults
of its flags (`parse_args`), and the dispatch to each command's entry point, imported on use
(`main`). The commands live in one module per group: recover.cli.train (train, worker),
recover.cli.jobs (run, agent), recover.cli.views (export, sample, compare, status, plot), and
beside their packages: prepare (recover.data.cli), coordinator (recover.coordinator.cli), bench
and simulate (recover.tooling). Flags several commands share: recover.cli.flags. Each command
builds validated configs and passes them down; errors a user can fix are printed as one
`error: ...` line with exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recover.cli.flags import train_config_from_args, usage_error
from recover.cli.train import run_worker_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recover",
        description="ReCoVer: resilient LLM pre-training that survives replica failures in-step.",
    )
    from recover import __version__

    parser.add_argument("--version", action="version", version=f"recover {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from recover.cli.jobs import add_job_parsers
    from recover.cli.train import add_train_parsers
    from recover.cli.views import add_view_parsers
    from recover.coordinator.cli import add_coordinator_parser
    from recover.data.cli import add_prepare_parser
    from recover.tooling.bench import add_bench_parser
    from recover.tooling.simulate.cli import add_simulate_parser

    add_train_parsers(sub)
    add_job_parsers(sub)
    add_view_parsers(sub)
    add_prepare_parser(sub)
    add_coordinator_parser(sub)
    add_bench_parser(sub)
    add_simulate_parser(sub)
    return parser


# command -> (module, function): handlers are imported on use, so `recover train` never pays
# for the simulator's imports and the launcher path stays torch-free.
HANDLERS = {
    "train": ("recover.cli.train", "run_train"),
    "compare": ("recover.cli.views", "run_compare"),
    "plot": ("recover.tooling.plot", "run_plot"),
    "status": ("recover.cli.views", "run_status"),
    "run": ("recover.cli.jobs", "run_script"),
    "agent": ("recover.cli.jobs", "run_agent"),
    "export": ("recover.cli.views", "run_export"),
    "sample": ("recover.cli.views", "run_sample"),
    "worker": ("recover.cli.train", "run_worker_cli"),
    "coordinator": ("recover.coordinator.cli", "run_coordinator_cli"),
    "simulate": ("recover.tooling.simulate.cli", "run_simulate"),
    "bench": ("recover.tooling.bench", "run_bench"),
    "prepare": ("recover.data.cli", "run_prepare"),
}


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The parser of the (sub)command `args` came from, and its words: ("coordinator", "serve")."""
    words: list[str] = []
    while True:
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not sub or getattr(args, sub[0].dest, None) is None:
            return parser, tuple(words)
        words.append(getattr(args, sub[0].dest))
        parser = sub[0].choices[words[-1]]


# commands that take a job file (--config); their parsed args carry the resolved job
JOB_COMMANDS = (("train",), ("run",), ("coordinator", "serve"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a job file's values (`--config`) as the defaults of its flags:
    the flags given override the file; `args.resolved_job` is the job both describe, as a job
    file's tables. ValueError for a bad job file."""
    from recover.jobconfig import job_defaults, read_job_file, resolved_job

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = _undotted(parser, argv)
    args = parser.parse_args(argv)
    args.argv = argv  # (what resumes it, said on a stop)
    command, words = _command_parser(parser, args)
    if words not in JOB_COMMANDS:
        return args
    sections = _sections(words)
    if args.config is not None:
        tables = read_job_file(Path(args.config))
        command.set_defaults(
            **job_defaults(command, tables, source=str(args.config), sections=sections)
        )
        args = parser.parse_args(argv)
    args.resolved_job = resolved_job(command, args, sections)
    return args


def _undotted(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with a job command's `--TABLE.KEY VALUE` overrides written as their flags
    (recover.jobconfig.dotted_flags); other commands' words as they are."""
    from recover.jobconfig import dotted_flags

    words = [w for w in argv[:2] if not w.startswith("-")]
    for job in JOB_COMMANDS:
        if tuple(words[: len(job)]) == job:
            command = parser
            for word in job:
                sub = next(a for a in command._actions if isinstance(a, argparse._SubParsersAction))
                command = sub.choices[word]
            return dotted_flags(command, argv, _sections(job))
    return argv


def _sections(words: tuple[str, ...]) -> dict[str, str]:
    """A job command's flag groups -> its job file's tables (`coordinator serve` has one)."""
    from recover.jobconfig import COORDINATOR_SECTIONS, SECTIONS

    return COORDINATOR_SECTIONS if words == ("coordinator", "serve") else SECTIONS


def main(argv: list[str] | None = None) -> int:
    from importlib import import_module

    try:
        args = parse_args(argv)
    except ValueError as e:  # a bad job file
        return usage_error(str(e))
    if args.command in ("worker", "coordinator"):
        from recover.runtime.env import die_with_launcher

        die_with_launcher()
    module, function = HANDLERS[args.command]
    return getattr(import_module(module), function)(args)


__all__ = ["build_parser", "main", "parse_args", "run_worker_cli", "train_config_from_args"]
