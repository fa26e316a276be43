"""Warm starts: replica processes forked from one process that has already imported torch.

Job: a replica process of `recover train` spends most of its start-up importing torch and the
trainer (1.5-2.5 s of CPU each on this project's machine, more than a tiny model's whole run).
The local launcher starts one *zygote* (`python -m recover.zygote`) that imports those modules
once and then forks each replica process on request, so a replica starts, and a dead one is
respawned, without paying the import again. Forking is safe here because the zygote has imported
modules and done nothing else: one thread (OMP_NUM_THREADS=1 is set before torch loads), no
process group, no CUDA context, no open files besides its socket.

Protocol (a socketpair between the launcher and the zygote; one JSON object per line):
- launcher -> zygote: {"module": M, "argv": [...], "env": {...}} with the write end of the child's
  output pipe attached (SCM_RIGHTS); the zygote forks, and the child runs `M.main(argv)`
  (recover's own commands) with exactly that environment, in its own session, its output on that
  pipe. Instead of "module": "script": PATH runs what `python PATH ARGV...` runs (runpy, as
  `__main__`, the script's folder first on sys.path, exit handlers run at the end), and
  "run_module": M what `python -m M ARGV...` runs: a user's training script under `recover run`.
  With "stdin": true a second fd comes with the request, the read end of a pipe that becomes the
  child's stdin (a standby replica waits there for its promotion); else stdin is /dev/null.
  "name" (optional): the process name the child takes ("replica 2", "coordinator"), so that
  `ps`, `top` and /proc/PID/comm tell the forked processes apart;
- zygote -> launcher: {"pid": P} for each request, in order; {"exit": P, "status": S} when a
  child ends (S as subprocess reports it: the exit code, or -N for signal N).

`ForkedProcess` is the launcher's handle on a forked child, with the part of `subprocess.Popen`'s
interface the launcher uses (pid, poll, wait, send_signal, terminate, kill, returncode, stdout).
The zygote dies with the launcher, and its children with it (Linux parent-death signal), so no
process outlives a SIGKILLed launcher.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from recover.runtime.env import die_with_launcher, die_with_parent, name_process

__all__ = ["ForkedProcess", "Zygote"]

_READY = b"ready\n"


# ---- the zygote process ---------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """Fork a child per request until the launcher's end of the socket closes."""
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd fires
    buffer, fds = b"", []  # a request may arrive in pieces; its fd comes with the first
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock, children)
        if sock not in ready:
            continue
        data, more, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        if not data:  # the launcher is gone: so is this zygote (its children get SIGTERM)
            return
        buffer += data
        fds += more
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            out_fd = fds.pop(0)
            in_fd = fds.pop(0) if request.get("stdin") else -1
            pid = _fork(request, out_fd, in_fd, sock, wake_r, wake_w)
            os.close(out_fd)
            if in_fd >= 0:
                os.close(in_fd)
            children.add(pid)
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            sock.sendall(json.dumps({"exit": pid, "status": code}).encode() + b"\n")


def _fork(request: dict, out_fd: int, in_fd: int, sock: socket.socket, *closing: int) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    # The child: become the process the launcher asked for, then never return to the loop.
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in closing:
            os.close(fd)
        os.setsid()  # its own session, like start_new_session=True
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        if in_fd < 0:
            in_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(in_fd, 0)
        os.close(in_fd)
        die_with_parent(zygote)  # none of its children outlives the zygote
        if request.get("name"):
            name_process(request["name"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "RECOVER_LAUNCHER_PID" in os.environ:  # its parent is this zygote, which dies with
            os.environ["RECOVER_LAUNCHER_PID"] = str(zygote)  # the launcher
        code = _run(request)
    except SystemExit as e:  # as the interpreter treats it at exit
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports it (a program may hook it)
        code = 1
    finally:
        if "script" in request or "run_module" in request:
            atexit._run_exitfuncs()  # what the interpreter's own exit runs for a program
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def _run(request: dict) -> int | None:
    """Run what the request names, as the matching `python ...` command line would."""
    argv = request["argv"]
    if "script" in request:  # python SCRIPT ARGV...
        script = request["script"]
        sys.argv = [script, *argv]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        return 0
    if "run_module" in request:  # python -m MODULE ARGV... (as a program)
        sys.argv = [request["run_module"], *argv]
        sys.path[0] = os.getcwd()
        runpy.run_module(request["run_module"], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = [request["module"], *argv]  # recover's own entry point: its main(argv)
    return importlib.import_module(request["module"]).main(argv)


def _main() -> None:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)

    die_with_launcher()
    for name in sys.argv[3:]:  # (argv[2]: the tag, for people reading `ps`)
        module, _, warm = name.partition(":")
        try:
            loaded = importlib.import_module(module)
        except Exception as e:  # a --preload of the user's: one line, and the launcher goes cold
            print(f"recover zygote: importing {module} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)  # fmt: skip
            os._exit(1)
        if warm:  # MODULE:FUNCTION: also call it, for what it imports lazily (a CLI's parsers)
            getattr(loaded, warm)()
    # Forking is safe only from one thread: a module that started one (a --preload's pool, any
    # native thread) would leave each child a copy of it stopped mid-way.
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        print(f"recover zygote: the imports ({', '.join(sys.argv[3:])}) started {threads - 1} "
              "thread(s): forking would copy them half-done", file=sys.stderr, flush=True)  # fmt: skip
        os._exit(1)
    sock.sendall(_READY)
    _serve(sock)
    os._exit(0)  # nothing to flush or tear down: skip the interpreter's (slow with torch) exit


# ---- the launcher's side --------------------------------------------------------------------


class ForkedProcess:
    """A child forked by the zygote, handled like a `subprocess.Popen` (the parts used here)."""

    def __init__(self, zygote: Zygote, stdout, stdin=None) -> None:
        self._zygote = zygote
        self.stdout = stdout
        self.stdin = stdin  # a text stream to the child's stdin, when spawned with stdin=True
        self.pid: int | None = None
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(["recover zygote child", str(self.pid)], timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # never signal a pid the zygote already reaped
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended_with(self, status: int) -> None:
        self.returncode = status
        self._ended.set()
        if self._zygote.on_exit is not None:
            self._zygote.on_exit()


class Zygote:
    """The launcher's zygote: `start` it once, then `spawn` replica processes from it."""

    def __init__(
        self,
        preload: list[str],
        env: dict[str, str],
        *,
        tag: str = "",
        timeout_s: float = 120.0,
        on_exit: Callable[[], None] | None = None,
    ):
        """`preload`: module names the zygote imports before it forks anything; `MODULE:FUNCTION`
        also calls FUNCTION() once (no arguments), for modules it imports only when called.
        `tag`: a word on the zygote's command line, which its children share (they are not
        exec'ed): the local launcher puts the run folder there. `on_exit`: called (from a
        reader thread) once a child's end is known, after its returncode is set."""
        self.on_exit = on_exit
        ours, theirs = socket.socketpair()
        self._sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "recover.zygote", str(theirs.fileno()), tag, *preload],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._lock = threading.Lock()  # one request in flight: replies come in request order
        self._pending: list[ForkedProcess] = []
        self._by_pid: dict[int, ForkedProcess] = {}
        self._spawned = threading.Condition()
        self._buffer = b""
        self._ready_deadline = time.monotonic() + timeout_s
        self._reader: threading.Thread | None = None

    def _await_ready(self) -> None:
        while not self._buffer.startswith(_READY):
            left = self._ready_deadline - time.monotonic()
            ready, _, _ = select.select([self._sock], [], [], max(0.0, left))
            chunk = self._sock.recv(4096) if ready else b""
            if not chunk:
                raise RuntimeError("the zygote did not start (see the launcher's output)")
            self._buffer += chunk
        self._buffer = self._buffer[len(_READY) :]
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def spawn(
        self,
        module: str | None,
        argv: list[str],
        env: dict[str, str],
        *,
        script: str = "",
        stdin: bool = False,
        name: str = "",
    ) -> ForkedProcess:
        """Fork a process with exactly `env`, its output on the returned handle's stdout: it
        runs `module.main(argv)` (recover's own commands), or with `script`, what `python SCRIPT
        ARGV...` runs (a path), or `python -m MODULE ARGV...` (`script="-m"`). With `stdin`, the
        handle's stdin is a pipe to the child's (line-buffered text); else it reads /dev/null.
        `name`: the process name the child takes (what `ps` and /proc/PID/comm show)."""
        with self._lock:
            if self._reader is None:
                self._await_ready()
            read_fd, write_fd = os.pipe()
            child_in, our_in = os.pipe() if stdin else (-1, -1)
            proc = ForkedProcess(
                self,
                os.fdopen(read_fd, "r", errors="replace"),
                os.fdopen(our_in, "w", buffering=1) if stdin else None,
            )
            with self._spawned:
                self._pending.append(proc)
            try:
                what = {"module": module}
                if script == "-m":
                    what = {"run_module": module}
                elif script:
                    what = {"script": script}
                request = {**what, "argv": argv, "env": env, "stdin": stdin, "name": name}
                line = json.dumps(request).encode() + b"\n"
                socket.send_fds(self._sock, [line], [write_fd] + ([child_in] if stdin else []))
            finally:
                os.close(write_fd)
                if stdin:
                    os.close(child_in)
            with self._spawned:
                if not self._spawned.wait_for(lambda: proc.pid is not None, timeout=30.0):
                    raise RuntimeError("the zygote did not fork a replica process in 30 s")
            return proc

    def _read(self) -> None:
        while True:
            while b"\n" not in self._buffer:
                try:
                    chunk = self._sock.recv(1 << 16)
                except OSError:  # closed by close(): the zygote is being ended
                    chunk = b""
                if not chunk:  # the zygote died: every child it had is ended with it
                    self._zygote_gone()
                    return
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\n", 1)
            msg = json.loads(line)
            with self._spawned:
                if "pid" in msg:
                    proc = self._pending.pop(0)
                    proc.pid = msg["pid"]
                    self._by_pid[proc.pid] = proc
                    self._spawned.notify_all()
                else:
                    # (the zygote reports a child's pid before its exit: always known here)
                    self._by_pid.pop(msg["exit"])._ended_with(msg["status"])

    def _zygote_gone(self) -> None:
        with self._spawned:
            for proc in [*self._by_pid.values(), *self._pending]:
                if proc.returncode is None:
                    proc._ended_with(-signal.SIGKILL)
            self._by_pid.clear()
            self._spawned.notify_all()

    def close(self) -> None:
        """End the zygote (its remaining children get SIGTERM by their parent-death signal)."""
        try:
            # shutdown, not only close: the reader thread's blocked recv holds the socket open,
            # and the zygote sees its EOF only once the connection itself is shut.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        finally:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    _main()
