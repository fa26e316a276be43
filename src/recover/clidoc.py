"""docs/cli.md: the command reference, written from the parsers themselves.

Job: walk `recover`'s argparse parsers (every command and subcommand) and render each as a
Markdown section: its description, its usage line, and a table of its arguments with their help
(defaults included, as the help texts state them). The file is generated, so it cannot drift from
the code: `python -m recover.clidoc > docs/cli.md` writes it, and a test checks that the
file equals what this module renders. (An entry point beside `recover.cli`, whose parsers it
reads.)
"""

from __future__ import annotations

import argparse
import sys

HEADER = """# Command reference

Every `recover` command and its arguments, as `recover COMMAND --help` prints them. This file is
generated from the parsers (`python -m recover.clidoc > docs/cli.md`; a test checks that
it is current). docs/running.md shows the commands in use; docs/api.md, docs/multinode.md and
docs/checkpoints.md explain them.
"""


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the top level and every subcommand, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def render(parser: argparse.ArgumentParser) -> str:
    """The Markdown reference of `parser` and every subcommand under it."""
    out = [HEADER]
    for path, sub in commands(parser):
        name = " ".join(("recover", *path))
        out.append(f"## `{name}`\n")
        if sub.description:
            out.append(_cell(sub.description) + "\n")
        out.append(f"```\n{_usage(sub)}\n```\n")
        rows = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    rows.append((f"`{choice.dest}`", choice.help or ""))
                continue
            flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}`"
            if action.metavar and action.option_strings:
                flags += f" {action.metavar}"
            rows.append((flags, action.help or ""))
        if rows:
            out.append("| argument | what it does |\n|---|---|")
            out.extend(f"| {_cell(flag)} | {_cell(text)} |" for flag, text in rows)
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    from recover.cli import build_parser

    sys.stdout.write(render(build_parser()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
