"""Warm starts (recover.zygote): processes forked from one that imported torch once behave like
processes started afresh: their own session, exactly the environment asked for, their output on
their own pipe, their exit status (a signal as -N), and none outlives the zygote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from recover.coordinator.channel import request_once
from recover.zygote import Zygote

# A long-lived child that needs no peers: a coordinator that waits (up to 30 s) for a replica.
SERVE = ["coordinator", "serve", "--port", "0", "--no-store", "--replicas", "1",
         "--start-deadline", "30"]  # fmt: skip


@pytest.fixture
def zygote(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ended: list[int] = []  # children whose end the zygote reported, in order (on_exit)
    z = Zygote(
        ["recover.cli", "recover.coordinator.server"],
        env,
        tag=str(tmp_path),
        on_exit=lambda: ended.append(1),
    )
    z.ended = ended
    try:
        yield z
    finally:
        z.close()
        assert z.proc.returncode == 0


def _env(**extra) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1", **extra}


def _address(path, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, "the forked coordinator never listened"
        time.sleep(0.02)
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    """Running (a zombie, ended and waiting to be reaped by init, is not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forked_process_gets_its_argv_env_output_and_status(zygote, tmp_path):
    p = zygote.spawn("recover.cli", ["--version"], _env())
    assert p.stdout.read().strip() == "recover 0.1.0"
    assert p.wait(timeout=30) == 0 and p.poll() == 0
    # Exactly the environment asked for (nothing of the zygote's own), in its own session.
    events = tmp_path / "events.jsonl"
    addr = tmp_path / "addr.json"
    assert zygote.ended == [1]  # the launcher's supervising loop is woken by each end
    q = zygote.spawn(
        "recover.cli",
        [*SERVE, "--events", str(events), "--address-file", str(addr)],
        _env(RECOVER_TOKEN="forked-secret"),  # read by the forked coordinator, not the zygote
        name="coordinator",
    )
    info = _address(addr)
    assert info["pid"] == q.pid and os.getsid(q.pid) == q.pid
    host, port = info["host"], info["port"]
    status = request_once(host, port, {"kind": "status"}, token="forked-secret")
    assert status.get("code") != "unauthorized" and "members" in str(status), status
    refused = request_once(host, port, {"kind": "status"}, token="another")
    assert refused["ok"] is False and refused["code"] == "unauthorized", refused
    # Its command line is the zygote's: the tag (the run folder) names every process of a run.
    assert str(tmp_path) in open(f"/proc/{q.pid}/cmdline").read()
    # Its process name is the one asked for (ps, top, and the benchmarks' CPU by role read it).
    assert open(f"/proc/{q.pid}/comm").read().strip() == "coordinator"
    with pytest.raises(subprocess.TimeoutExpired):
        q.wait(timeout=0.2)
    q.kill()
    assert q.wait(timeout=30) == -signal.SIGKILL and zygote.ended == [1, 1]
    q.kill()  # a reaped child is never signalled again (its pid may belong to another process)


def test_children_end_with_the_zygote(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    z = Zygote(["recover.cli"], env, tag=str(tmp_path))
    addr = tmp_path / "addr.json"
    try:
        q = z.spawn("recover.cli", [*SERVE, "--address-file", str(addr)], _env())
        _address(addr)
        os.kill(z.proc.pid, signal.SIGKILL)  # as when its launcher is SIGKILLed
        z.proc.wait(timeout=30)
        # The launcher learns that the child is gone; the child got its parent-death SIGTERM.
        assert q.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while _alive(q.pid):
            assert time.monotonic() < deadline, "a forked child outlived its zygote"
            time.sleep(0.05)
    finally:
        z.close()
        if _alive(q.pid):
            os.kill(q.pid, signal.SIGKILL)


def test_a_zygote_that_cannot_start_says_so(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    z = Zygote(["recover.no_such_module"], env, tag=str(tmp_path), timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="the zygote did not start"):
            z.spawn("recover.cli", ["--version"], _env())
    finally:
        z.close()
    assert z.proc.returncode not in (None, 0)


def test_a_forked_script_runs_as_python_would_run_it(zygote, tmp_path):
    """`recover run`'s warm start: `python SCRIPT ARGS` forked from the zygote runs the script as
    __main__ with its argv, its folder first on sys.path, its exit status and exit handlers, and
    an uncaught exception reaches its own sys.excepthook (recover.Replica hooks it)."""
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: print('exit handler ran', flush=True))\n"
        "here = os.path.dirname(os.path.abspath(__file__))\n"
        "print(__name__, sys.argv[1:], sys.path[0] == here, flush=True)\n"
        "if sys.argv[1] == 'raise':\n"
        "    sys.excepthook = lambda *e: (print('hooked', e[1], flush=True), os._exit(7))\n"
        "    raise RuntimeError('lost mate')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    p = zygote.spawn(None, ["3", "x"], _env(), script=str(script))
    assert p.stdout.read().splitlines() == ["__main__ ['3', 'x'] True", "exit handler ran"]
    assert p.wait(timeout=30) == 3
    q = zygote.spawn(None, ["raise"], _env(), script=str(script))
    assert q.stdout.read().splitlines() == ["__main__ ['raise'] True", "hooked lost mate"]
    assert q.wait(timeout=30) == 7


def test_a_forked_child_reads_the_stdin_pipe_it_was_given(zygote, tmp_path):
    """A standby's channel: with stdin=True the child reads what the launcher writes on the
    handle's stdin, and sees its end when the launcher closes it; without, it reads nothing."""
    script = tmp_path / "echo.py"
    script.write_text(
        "import sys\n"
        "for line in sys.stdin:\n"
        "    print('got', line.strip(), flush=True)\n"
        "print('end of input', flush=True)\n"
    )
    p = zygote.spawn(None, [], _env(), script=str(script), stdin=True)
    p.stdin.write("replica 2\n")
    assert p.stdout.readline() == "got replica 2\n"  # (line-buffered: no flush needed)
    p.stdin.close()
    assert p.stdout.read() == "end of input\n" and p.wait(timeout=30) == 0
    q = zygote.spawn(None, [], _env(), script=str(script))
    assert q.stdin is None and q.stdout.read() == "end of input\n" and q.wait(timeout=30) == 0


def test_the_launchers_preload_leaves_a_replica_nothing_to_import(tmp_path):
    """What a forked replica would otherwise import again in every process (1.6 s of CPU each
    for torch._dynamo, which building a torch optimizer pulls in; the CLI's subcommand parsers,
    which `MODULE:FUNCTION` preloads by calling the parser builder) is in the zygote already."""
    from recover.launch import LocalLauncher

    script = tmp_path / "replica.py"
    script.write_text(
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())\n"
        "import recover.cli\n"
        "recover.cli.build_parser()\n"
        "print(sorted(set(sys.modules) - before), flush=True)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    z = Zygote(list(LocalLauncher.WARM_MODULES), env, tag=str(tmp_path))
    try:
        p = z.spawn(None, [], _env(), script=str(script))
        assert p.stdout.read().splitlines() == ["[]"]
        assert p.wait(timeout=30) == 0
    finally:
        z.close()


def test_a_preload_that_starts_a_thread_or_fails_to_import_stops_the_warm_start(tmp_path, capfd):
    """Forking copies only the calling thread: after a module that started one, each child
    would hold a copy of it stopped mid-way. Such a preload, and one that fails to import, ends
    the zygote (status 1) with a line naming it, and the launcher then starts processes afresh
    (`recover run` below)."""
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "spins.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    (pkg / "broken.py").write_text("raise ImportError('needs a GPU library')\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(pkg)}
    for module, said in (
        (
            "spins",
            "the imports (json, spins) started 1 thread(s): forking would copy them half-done",
        ),
        ("broken", "importing broken failed: ImportError: needs a GPU library"),
    ):
        z = Zygote(["json", module], env, tag=str(tmp_path), timeout_s=60)
        try:
            with pytest.raises(RuntimeError, match="the zygote did not start"):
                z.spawn("recover.cli", ["--version"], _env())
        finally:
            z.close()
        assert z.proc.returncode == 1, module
        assert said in capfd.readouterr().err, module  # (the zygote's stderr is the launcher's)


@pytest.mark.timeout(60)
def test_recover_run_preloads_a_scripts_module_and_checks_the_flag(tmp_path):
    """`recover run --preload MODULE`: each forked process finds MODULE imported already, and a
    preload the zygote refuses leaves the processes started afresh; a name that is not a module,
    one this Python cannot find, or --preload with --cold-start is refused before anything
    starts, in one line."""
    import sys

    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "heavy_model.py").write_text("WEIGHTS = 1\n")
    (pkg / "broken.py").write_text("raise ImportError('needs a GPU library')\n")
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('preloaded:', 'heavy_model' in sys.modules, flush=True)\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(pkg)}

    def run(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "recover.cli", "run", "--out", str(tmp_path / "run"),
               *flags, "--", sys.executable, str(script)]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=env)

    r = run("--preload", "heavy_model")
    assert "preloaded: True" in r.stdout + r.stderr, r.stdout + r.stderr
    r = run("--preload", "heavy_model", "--preload", "broken")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "warm start off" in out and "preloaded: False" in out, out
    for flags, said in (
        (["--preload", "heavy-model"], "--preload 'heavy-model': not a module name"),
        (["--preload", "no_such_pkg.sub"], "--preload no_such_pkg.sub: no module 'no_such_pkg'"),
        (["--preload", "heavy_model", "--cold-start"], "drop --cold-start"),
    ):
        r = run(*flags)
        assert r.returncode == 2 and said in r.stderr, (flags, r.stderr)
