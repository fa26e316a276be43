"""Supervising replica processes: what the local launcher and the node agent share.

Job: start child processes (forked from a zygote that imported torch once, or exec'ed), echo
their output with a prefix, end them politely and reap every one (no orphans); and the restart
rule for replica processes: which exits are a replica's death, when a dead replica is started
again, how many times. `recover train`/`recover run` (launch.LocalLauncher: one machine, its own
coordinator) and `recover agent` (agent.NodeAgent: one node of many, the ids its coordinator
gives it) are both a ProcessHost driving a ReplicaSupervisor; neither has a copy of the rule.

Restart rule (ReplicaSupervisor):
- a replica of K ranks is K processes; it has ended when all have; its first non-zero exit in
  an incarnation is its death (its other ranks stop by themselves: their watchdog);
- a dead replica is started again `respawn_delay_s` after its death, once every rank of the old
  incarnation is gone, at most `max_restarts` times; never once the run is finishing (a replica
  finished, or the run stopped for good);
- a replica whose id is given back (`release`: the node agent lost it, or drained) is no longer
  watched: its exits are not deaths and it is never restarted.

It must not touch the trajectory: it only starts, watches and stops processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from recover import exits
from recover.zygote import Zygote

__all__ = [
    "RECOVER",
    "Death",
    "ProcessHost",
    "ReplicaSupervisor",
    "check_command_interpreter",
    "describe_exit",
    "end_politely",
    "free_ports",
    "is_stopped",
    "launcher_path",
    "proc_name",
]

# How a launcher or an agent starts recover's own commands: this Python, this package.
RECOVER = (sys.executable, "-m", "recover.cli")

log = logging.getLogger("recover.launch")


def _pump(stream, prefix: list[str], console: TextIO | None, ended: threading.Event) -> None:
    """Echo a child's lines with `prefix[0]` (a promoted standby's label changes); set `ended`
    when its output closes (it exited, as a rule)."""
    for line in iter(stream.readline, ""):
        if console is not None:
            console.write(prefix[0] + line)
            console.flush()
    stream.close()
    ended.set()


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago (held open together while drawn)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launcher_path(environ: Mapping[str, str]) -> str:
    """`environ`'s PATH with this interpreter's folder first: a child's `python` (or `pip`...)
    is then the launcher's, its virtual environment's, whether or not it was activated."""
    here = os.path.dirname(sys.executable)
    rest = [p for p in environ.get("PATH", os.defpath).split(os.pathsep) if p and p != here]
    return os.pathsep.join([here, *rest])


def _same_interpreter(program: str, path: str) -> bool:
    """Whether `program` (a command's first word, found on `path`) is this interpreter: a
    `python...` of this interpreter's folder (a venv's python, python3 and python3.X)."""
    found = shutil.which(program, path=path)
    if found is None:
        return False
    found = os.path.abspath(found)
    return os.path.dirname(found) == os.path.dirname(sys.executable) and (
        found == sys.executable or os.path.basename(found).startswith("python")
    )


def check_command_interpreter(command: list[str], environ: Mapping[str, str]) -> None:
    """ValueError, in one line, when `command` runs a Python that is not the launcher's and
    cannot import torch and recover (every replica would fail with the same ImportError)."""
    path = launcher_path(environ)
    program = shutil.which(command[0], path=path) if command else None
    if program is None or _same_interpreter(command[0], path):
        return
    if not os.path.basename(program).startswith("python"):
        return  # another program: it may start a Python of its own
    probe = subprocess.run(
        [program, "-c", "import torch, recover"], capture_output=True, text=True, timeout=300,
        env={**environ, "PATH": path},
    )  # fmt: skip
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["it failed"])[-1]
        raise ValueError(
            f"the command's {command[0]!r} is {program}, which cannot import torch and recover "
            f"({why}); run it with the Python that has them, e.g. {sys.executable}"
        )


def forkable(command: list[str], path: str | None = None):
    """(module, argv, script) for Zygote.spawn when `command` is one the zygote can run as this
    interpreter would: recover's own (`python -m recover.cli ...`), `python SCRIPT ...` or
    `python -m MODULE ...` with this very interpreter (found on the children's `path`); None
    otherwise (it is exec'ed)."""
    if tuple(command[: len(RECOVER)]) == RECOVER:
        return RECOVER[2], list(command[len(RECOVER) :]), ""
    if len(command) < 2 or not _same_interpreter(command[0], path or launcher_path(os.environ)):
        return None
    if command[1] == "-m" and len(command) > 2:
        return command[2], list(command[3:]), "-m"
    if not command[1].startswith("-") and command[1].endswith(".py"):
        return None, list(command[2:]), command[1]
    return None


def proc_name(replica: int, rank: int) -> str:
    """The name of rank `rank` of replica `replica` in a host's process table."""
    return f"replica {replica}" if rank == 0 else f"replica {replica}.{rank}"


def is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def end_politely(proc: subprocess.Popen) -> None:
    """SIGTERM a child (it then stops at its next step boundary), but SIGKILL one that is stopped
    (SIGSTOP: a hung replica, fenced meanwhile): woken, it would act as a member it no longer is."""
    try:
        if is_stopped(proc.pid):
            proc.kill()
        else:
            proc.terminate()
    except ProcessLookupError:
        pass


def describe_exit(replica: int, incarnation: int, code: int) -> str:
    """One death of a replica process, for a summary line."""
    who = f"replica {replica}" + (f" (restart {incarnation})" if incarnation else "")
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = exits.MEANINGS.get(code, f"exited with status {code}")
    return f"{who} {how}"


class ProcessHost:
    """A table of child processes: started (warm from a zygote where it can), echoed with a
    prefix, ended politely, reaped. Subclasses name what a zygote pre-imports (WARM_MODULES)."""

    WARM_MODULES: tuple[str, ...] = ()

    def __init__(self, *, console: TextIO | None, token: str) -> None:
        self.console = console
        self.token = token
        self.children: dict[str, subprocess.Popen] = {}
        self._pumps: list[threading.Thread] = []
        self._zygote: Zygote | None = None
        self._prefixes: dict[int, list[str]] = {}  # id(process) -> its output prefix
        # Set when a child may have ended (its output closed, or the zygote reported its end):
        # a supervising loop waits on it (`wait_for_change`) instead of polling at a short period.
        self.child_ended = threading.Event()

    def start_zygote(self, tag: str, preload: Sequence[str] = ()) -> None:
        """Start the zygote (recover.zygote) now, so that its import overlaps whatever starts
        next; the first child forked waits for it. `tag` goes on its command line (and its
        children's), so every process of the job names it; `preload`: the user's modules it
        imports after WARM_MODULES (--preload)."""
        if self.WARM_MODULES:
            modules = [*self.WARM_MODULES, *preload]
            self._zygote = Zygote(modules, self.child_env(), tag=tag, on_exit=self.child_ended.set)

    def child_env(self, extra_env: dict | None = None) -> dict[str, str]:
        """The environment of every process this host starts (the zygote's too)."""
        env = dict(os.environ, **(extra_env or {}))
        env["PATH"] = launcher_path(env)  # `python` in a command is the launcher's (its venv)
        env["RECOVER_LAUNCHER_PID"] = str(os.getpid())  # children die with their launcher
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def say(self, line: str, level: int = logging.INFO) -> None:
        """A line of this host's (the log prefix names it); with no console (--quiet), only
        warnings and errors."""
        if self.console is not None or level >= logging.WARNING:
            log.log(level, line)

    def spawn(
        self,
        name: str,
        command: list[str],
        prefix: str,
        extra_env: dict | None = None,
        *,
        stdin: bool = False,
    ) -> subprocess.Popen:
        """Start `command` as child `name`; with `stdin`, its stdin is a pipe (proc.stdin)."""
        from recover.runtime.env import TOKEN_ENV

        env = self.child_env(extra_env)
        env[TOKEN_ENV] = self.token  # never on the command line, where `ps` would show it
        how = forkable(command, env["PATH"])
        if self._zygote is not None and how is not None:
            try:  # forked, torch already imported: recover's own commands, or a Python script
                module, argv, script = how
                proc = self._zygote.spawn(module, argv, env, script=script, stdin=stdin, name=name)
            except RuntimeError as e:  # start afresh from now on (slower, same result)
                self.say(f"warm start off: {e}", logging.WARNING)
                self._zygote = None
            else:
                return self.adopt(name, proc, prefix)
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
            # Its own session: a terminal's Ctrl-C reaches the launcher only, which then stops
            # the replicas in order (they die with it anyway: recover.runtime.env).
            start_new_session=True,
        )
        return self.adopt(name, proc, prefix)

    def adopt(self, name: str, proc, prefix: str):
        """Supervise `proc` as `name` and echo its output with `prefix`."""
        self.children[name] = proc
        self._prefixes[id(proc)] = box = [prefix]
        pump = threading.Thread(
            target=_pump, args=(proc.stdout, box, self.console, self.child_ended), daemon=True
        )
        pump.start()
        self._pumps.append(pump)
        return proc

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep until a child may have ended, or `timeout_s` passes (what else a supervising
        loop watches, timers and hung processes, it sees at that period)."""
        self.child_ended.wait(timeout_s)
        self.child_ended.clear()  # (cleared before the caller looks: nothing set later is lost)

    def reap_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`, every child still alive; wait for each."""
        import time

        alive = [p for p in self.children.values() if p.poll() is None]
        for p in alive:
            end_politely(p)
        deadline = time.monotonic() + grace_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close_host(self) -> None:
        """After reap_all: the zygote ends, and the echo threads (every pipe is closed now)."""
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        for pump in self._pumps:
            pump.join(timeout=2.0)


@dataclass(frozen=True)
class Death:
    """A process of a replica that exited: `first` when it is the replica's death in this
    incarnation (the first non-zero exit), which the restart rule acts on."""

    replica: int
    rank: int
    incarnation: int
    code: int
    first: bool


class ReplicaSupervisor:
    """The restart rule (module docstring) over the replicas a host runs.

    The host says which replicas it runs (`hosting`, `release`), reads exits with `reap`, asks
    `schedule` whether a death is restarted, and starts what `due` returns as a new
    incarnation. It holds no processes: `proc(r, k)` is the host's process of rank k of r."""

    def __init__(
        self,
        ranks: int,
        respawn_delay_s: float | None,
        max_restarts: int,
        proc: Callable[[int, int], subprocess.Popen],
    ) -> None:
        self.ranks = ranks
        self.respawn_delay_s = respawn_delay_s
        self.max_restarts = max_restarts
        self._proc = proc
        self.alive: dict[int, set[int]] = {}  # replica -> its ranks still running
        self.incarnation: dict[int, int] = {}
        self.codes: list[tuple[int, int, int]] = []  # (replica, incarnation, status) per exit
        self._dead: set[int] = set()  # replicas whose death was read in this incarnation
        self.respawn_at: dict[int, float] = {}

    def hosting(self, r: int) -> None:
        """Replica r's processes were just started (its first incarnation here)."""
        self.alive[r] = set(range(self.ranks))
        self.incarnation.setdefault(r, 0)

    def release(self, r: int) -> None:
        """Replica r is no longer this host's: not watched, never restarted."""
        self.alive.pop(r, None)
        self.respawn_at.pop(r, None)
        self._dead.discard(r)

    def running(self) -> bool:
        """Whether a process runs or a restart is pending."""
        return any(self.alive.values()) or bool(self.respawn_at)

    def running_ranks(self) -> list[tuple[int, int]]:
        return sorted((r, k) for r, ranks in self.alive.items() for k in ranks)

    def reap(self) -> list[Death]:
        """The exits since the last call, each recorded in `codes`."""
        out = []
        for r, k in self.running_ranks():
            code = self._proc(r, k).poll()
            if code is None:
                continue
            self.alive[r].discard(k)
            self.codes.append((r, self.incarnation[r], code))
            first = code != 0 and r not in self._dead
            if first:
                self._dead.add(r)
            out.append(Death(r, k, self.incarnation[r], code, first))
        return out

    def schedule(self, r: int, now: float, *, finishing: bool) -> bool:
        """After replica r's death: whether it is restarted (then at `now` + the delay)."""
        if (
            self.respawn_delay_s is None
            or finishing
            or r not in self.alive
            or self.incarnation[r] >= self.max_restarts
        ):
            return False
        self.respawn_at[r] = now + self.respawn_delay_s
        return True

    def cancel_restarts(self) -> None:
        self.respawn_at.clear()

    def due(self, now: float) -> list[int]:
        """Replicas to start again now (every rank of the old incarnation gone), each counted
        as a new incarnation and running from the caller's start."""
        out = []
        for r, at in sorted(self.respawn_at.items()):
            if now >= at and not self.alive.get(r):
                del self.respawn_at[r]
                self.incarnation[r] += 1
                self._dead.discard(r)
                self.alive[r] = set(range(self.ranks))
                out.append(r)
        return out
