"""The runtime's human output: the stdlib `logging`, set up once per process at its entry point.

Job: `setup_logging(level, prefix)` gives the `recover` logger (every module logs to a child of
it, `logging.getLogger(__name__)`) one handler: DEBUG and INFO lines go to stdout, WARNING and
above to stderr, as the prints they replace did. The format is the process's prefix and the
message, so the terminal reads as before: the step line is an INFO record of exactly its text.

Invariants: only the `recover` logger is configured (a script's own root logging is left alone,
and `recover` records do not reach it twice); setting it up again replaces the handler, never adds
one. The streams are looked up at each record, so a caller that swaps sys.stdout (pytest's capsys)
still sees the lines. A process that its launcher started gets no prefix of its own: the launcher
already prefixes each of its lines with `[replica R]` or `[coordinator]` (`process_prefix`).
Nothing here reads the environment; the entry point passes what it read.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

LOG_LEVELS = ("debug", "info", "warning", "error")
LAUNCHER_PID_ENV = "RECOVER_LAUNCHER_PID"  # set by the local launcher in every child's environment


class _ConsoleHandler(logging.Handler):
    """INFO and below to the current sys.stdout, WARNING and above to the current sys.stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging's own convention: report, never raise into the caller
            self.handleError(record)


def setup_logging(level: str = "info", *, prefix: str = "", timestamps: bool = False) -> None:
    """Route the `recover` logger's records at `level` and above to the terminal, each line
    starting with `prefix` (then the time, with `timestamps`). ValueError for an unknown level."""
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    when = "%(asctime)s.%(msecs)03d " if timestamps else ""
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter(f"{prefix}{when}%(message)s", datefmt="%H:%M:%S"))
    log = logging.getLogger("recover")
    for old in [h for h in log.handlers if isinstance(h, _ConsoleHandler)]:
        log.removeHandler(old)
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


def process_prefix(name: str, environ: Mapping[str, str]) -> str:
    """`[name] `, or nothing when the local launcher started this process (it adds its own)."""
    return "" if LAUNCHER_PID_ENV in environ else f"[{name}] "


def replica_name(replica: int, rank: int = 0, ranks: int = 1) -> str:
    """How a replica process is named on the terminal: `replica R`, or `replica R rank K`."""
    return f"replica {replica}" + (f" rank {rank}" if ranks > 1 else "")
