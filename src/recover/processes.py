"""This host's processes, as the owners of temporary files: who wrote it, and is it still alive.

Job: name this host for a temporary file's name (a checkpoint's `step_N.tmp.HOST.PID`, a prepare's
`.NAME.tmp-PID-HOST-XXXX`), and tell whether a process of this host is still running, so that a
writer can remove the temporaries of writers that were killed, and only theirs (another host's
temporary may belong to a live writer there: it is never touched).
"""

from __future__ import annotations

import os
import socket


def host_name() -> str:
    """This host's name, fit for a file name."""
    return socket.gethostname().replace("/", "_") or "localhost"


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


__all__ = ["host_name", "process_alive"]
