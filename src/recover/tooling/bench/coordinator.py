"""`recover bench coordinator`: the coordinator under R simulated replicas, with a kill and a hang.

Job: measure the control plane alone. One `recover coordinator serve` subprocess (the real server,
the real wire protocol), optionally N `recover coordinator relay` subprocesses in front of it
(replica r speaks to relay r * N // R), and D driver subprocesses that each simulate a block of
the R replicas on one asyncio loop. Each replica opens a session connection (register, then a
heartbeat every `heartbeat_s` that asks for a held reply, like `CoordinatorClient`) and an rpc
connection (done reports and wait_outcome long-polls), plus K-1 view watchers (the other ranks of
a replica of K ranks, each long-polling `wait_view`). Every request says which view version the
replica holds, so views come relative to it (a live-set delta, no plan when it holds the plan).
Every step a replica "computes" for `compute_s`, reports done for (step, attempt epoch) and waits
for the outcome, so all R done reports arrive in one burst.

Invariants: every process a run starts (the coordinator, its relays, the drivers) is reaped,
whatever fails, and a run whose processes fail or time out is a row with `failed`, not an
exception; the replicas' connections live only in the driver subprocesses (coordinator_driver.py).

Size: the benchmark's config, its processes, the samplers that watch them (CPU, etcd writes),
the figures merged from the drivers' parts, the per-message costs and the table, kept together
because each figure is defined over the processes and the window that this module sets up.

Faults (after `warmup_steps` commits and the measured steps): replica 0 is killed mid-step (both
connections dropped, as a SIGKILL does), then, once its death reached the survivors of its
driver, replica 1 hangs silently (its sockets stay open; it sends nothing). Survivors keep
reporting done, so the steps commit without a redo. Each driver stops when all of its survivors
saw both deaths and one more commit.

Figures (all on CLOCK_MONOTONIC, which every process on the machine shares):
- form_s: first register sent -> the last replica saw itself live in a running view;
- commit_s median / p99: done sent -> Committed received, per replica and failure-free step;
- heartbeat_rtt_s p99: heartbeat sent -> its reply (a held reply: minus the hold);
- coordinator_cpu, relay_cpu, driver_cpu: (utime + stime) of those processes over the measured
  steps / wall time, in cores (1.0 = one core busy), sampled from /proc/<pid>/stat every 0.1 s;
  relay and driver figures are the sum over their processes (`*_cpu_max`: the busiest one);
- false_deaths: `coordinator.member_dead` events (its --events file) of replicas never faulted;
- kill_detect_s: the drop -> the last survivor (of all drivers) saw an epoch without replica 0;
- hang_evict_s: the hung replica's last heartbeat -> the last survivor saw an epoch without it
  (the target is lease + 1 s).
Costs: the drivers and relays share the machine with the coordinator: when relay_cpu +
driver_cpu + coordinator_cpu nears the machine's cores, the figures are a bound set by the
simulation, not by the coordinator.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from recover.coordinator.etcd_local import start_local_etcd
from recover.coordinator.options import CoordinatorOptions
from recover.tooling.bench.common import cpu_seconds

__all__ = [
    "BenchCoordinatorConfig",
    "format_table",
    "message_costs",
    "run_once",
    "start_coordinator",
]

_FAULTED = (0, 1)  # replica 0 is killed, replica 1 hangs
# Run as a subprocess, never imported here: it imports this module (the config, _FAULTED).
_DRIVER_MODULE = "recover.tooling.bench.coordinator_driver"


@dataclass(frozen=True, kw_only=True)
class BenchCoordinatorConfig:
    replicas: int
    microbatches: int = 0  # 0: 2 x replicas
    ranks_per_replica: int = 1  # K: K-1 view watchers per replica
    steps: int = 8  # failure-free steps measured (the fault steps come on top)
    warmup_steps: int = 2
    compute_s: float = 1.0
    heartbeat_s: float = 0.1
    lease_s: float = CoordinatorOptions.lease_s
    faults: bool = True
    hold: bool = True  # heartbeats ask for held replies (pushed epochs), like CoordinatorClient
    relays: int = 0  # 0: every replica speaks to the coordinator itself
    drivers: int = 1  # processes that simulate the replicas (each a block of them)
    # The relays' upstream side only, simulated in one process (coordinator_tier.py): the
    # coordinator tier at an R this machine cannot simulate whole.
    upstream_only: bool = False
    relay_beat_s: float = 0.25  # how long the coordinator may hold a relay's beat
    # Keep the coordinator's state in a private etcd (serve --state) and count its writes
    # (etcd_writes_per_step): what the high-availability control plane costs etcd.
    etcd: bool = False
    form_timeout_s: float = 120.0
    step_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.replicas < (3 if self.faults else 1):
            raise ValueError(
                f"replicas must be >= 3 with faults (>= 1 without), got {self.replicas}"
            )
        for name in ("microbatches", "steps", "warmup_steps", "relays"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ranks_per_replica < 1:
            raise ValueError(f"ranks_per_replica must be >= 1, got {self.ranks_per_replica}")
        if not 1 <= self.drivers <= self.replicas:
            raise ValueError(f"drivers must be in 1..replicas, got {self.drivers}")
        if self.relays > self.replicas:
            raise ValueError(f"relays must be <= replicas, got {self.relays}")
        if self.upstream_only and self.relays < 1:
            raise ValueError("upstream_only needs relays >= 1")
        for name in ("compute_s", "heartbeat_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def m(self) -> int:
        return self.microbatches or 2 * self.replicas


# ---------------------------------------------------------------- processes


class _CpuSampler:
    """(t, cpu seconds) of some pids every 0.1 s, so that a window named afterwards can be read."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.samples = pids, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append((time.monotonic(), [cpu_seconds(p) for p in self.pids]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def cores(self, t0: float, t1: float) -> list[float | None]:
        """Per pid: cpu seconds over [t0, t1] / (t1 - t0), from the samples nearest the ends."""
        if not self.samples:
            return [None] * len(self.pids)
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        if b[0] <= a[0]:
            return [None] * len(self.pids)
        return [
            None if x is None or y is None else (y - x) / (b[0] - a[0])
            for x, y in zip(a[1], b[1], strict=True)
        ]


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float, what: str) -> dict:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.02)
    return json.loads(path.read_text())


def start_coordinator(
    cfg: BenchCoordinatorConfig,
    workdir: Path,
    procs: list[subprocess.Popen],
    state: str | None = None,
) -> tuple[subprocess.Popen, dict]:
    """A `recover coordinator serve` subprocess for `cfg` (added to `procs`, for the caller to
    reap); returns it and its address file's contents once it listens. `state`: its --state."""
    cmd = [
        sys.executable, "-m", "recover.cli", "coordinator", "serve",
        "--port", "0", "--no-store", "--replicas", str(cfg.replicas),
        "--lease", str(cfg.lease_s), "--min-replicas", "1",
        "--start-deadline", str(cfg.form_timeout_s), "--events", str(workdir / "events.jsonl"),
        "--address-file", str(workdir / "address.json"),
        *(["--state", state] if state else []),
    ]  # fmt: skip
    proc = _spawn(cmd, workdir / "coordinator.log")
    procs.append(proc)
    return proc, _wait_file(workdir / "address.json", proc, 60, "the coordinator")


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _false_deaths(events: Path, until: float) -> list[int]:
    dead = []
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("t_wall", 0) > until:
            break
        if e.get("name") == "coordinator.member_dead" and e.get("replica_id") not in _FAULTED:
            dead.append(e["replica_id"])
    return sorted(dead)


def run_once(cfg: BenchCoordinatorConfig) -> dict:
    """One measurement: a fresh coordinator, its relays, R replicas in D drivers, the faults;
    every process reaped, whatever fails."""
    row = {
        "replicas": cfg.replicas,
        "microbatches": cfg.m,
        "ranks": cfg.ranks_per_replica,
        "heartbeat_s": cfg.heartbeat_s,
        "relays": cfg.relays,
        "drivers": cfg.drivers,
    }
    procs: list[subprocess.Popen] = []
    sampler = None
    etcd = writes = None
    with tempfile.TemporaryDirectory(prefix="recover-bench-coord-") as tmp:
        work = Path(tmp)
        try:
            state = None
            if cfg.etcd:
                etcd = start_local_etcd(work / "etcd")
                state = f"{etcd.url}/bench"
                writes = _EtcdWrites(etcd.client_port)
            coord, info = start_coordinator(cfg, work, procs, state)
            addrs = [(info["host"], info["port"])]
            relays = []
            for i in range(cfg.relays):
                cmd = [
                    sys.executable, "-m", "recover.cli", "coordinator", "relay",
                    "--upstream", f"{info['host']}:{info['port']}", "--port", "0",
                    "--relay-id", f"relay{i}", "--address-file", str(work / f"relay{i}.json"),
                ]  # fmt: skip
                relays.append(_spawn(cmd, work / f"relay{i}.log"))
            procs += relays
            if relays:
                addrs = [
                    (a["host"], a["port"])
                    for a in (
                        _wait_file(work / f"relay{i}.json", p, 120, f"relay {i}")
                        for i, p in enumerate(relays)
                    )
                ]
            drivers = []
            for i in range(cfg.drivers):
                rids = [i * cfg.replicas // cfg.drivers, (i + 1) * cfg.replicas // cfg.drivers]
                spec = {"cfg": asdict(cfg), "addrs": addrs, "rids": rids}
                (work / f"part{i}.json").write_text(json.dumps(spec))
                cmd = [sys.executable, "-m", _DRIVER_MODULE]
                cmd += [str(work / f"part{i}.json"), str(work / f"out{i}.json")]
                drivers.append(_spawn(cmd, work / f"driver{i}.log"))
            procs += drivers
            sampler = _CpuSampler([p.pid for p in procs])
            limit = cfg.form_timeout_s + cfg.step_timeout_s * (cfg.warmup_steps + cfg.steps + 8)
            end = time.monotonic() + limit
            for p in drivers:
                p.wait(max(1.0, end - time.monotonic()))
            sampler.close()
            parts = []
            for i in range(cfg.drivers):
                path = work / f"out{i}.json"
                if not path.exists():
                    tail = (work / f"driver{i}.log").read_text()[-1500:]
                    raise RuntimeError(f"driver {i} wrote no result: {tail}")
                parts.append(json.loads(path.read_text()))
            failed = [p["failed"] for p in parts if "failed" in p]
            if failed:
                raise RuntimeError("; ".join(failed[:3]))
            row.update(_merge(cfg, parts, sampler, coord, relays, drivers))
            if writes is not None:
                t0 = max(p["window"][0] for p in parts)
                t1 = min(p["window"][1] for p in parts)
                row.update(writes.per_step(t0, t1, cfg.steps, "/bench/state"))
            t_end = min(p["t_wall_end"] for p in parts)
            _stop_all(procs)
            row["false_deaths"] = len(_false_deaths(work / "events.jsonl", t_end))
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
            row["failed"] = str(e)[:500]
        finally:
            if sampler is not None:
                sampler.close()
            _stop_all(procs)
            if writes is not None:
                writes.close()
            if etcd is not None:
                etcd.stop()
    return row


class _EtcdWrites:
    """etcd's count of writes (etcd_mvcc_put_total, from its /metrics) every 0.1 s, so that a
    window named afterwards can be read: the coordinator's state writes, elections included."""

    def __init__(self, port: int) -> None:
        self.port, self.samples = port, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _count(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=1) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("etcd_mvcc_put_total "):
                return int(float(line.split()[1]))
        return None

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            n = self._count()
            if n is not None:
                self.samples.append((time.monotonic(), n))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def between(self, t0: float, t1: float) -> int | None:
        if not self.samples:
            return None
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        return b[1] - a[1] if b[0] > a[0] else None

    def per_step(self, t0: float, t1: float, steps: int, key: str) -> dict:
        """etcd_writes_per_step and _per_s over the measured window [t0, t1] of `steps` steps,
        and etcd_state_bytes, the size of one state write now (compressed)."""
        self.close()
        n = self.between(t0, t1)
        return {
            "etcd_writes_per_step": None if n is None else n / max(1, steps),
            "etcd_writes_per_s": None if n is None else n / (t1 - t0),
            "etcd_state_bytes": self.state_bytes(key),
        }

    def state_bytes(self, key: str) -> int | None:
        from recover.coordinator.etcd import EtcdClient  # noqa: PLC0415

        got = EtcdClient((("127.0.0.1", self.port),)).get(key)
        return None if got is None else len(got[0])


def _merge(cfg, parts: list[dict], sampler: _CpuSampler, coord, relays, drivers) -> dict:
    commit = [s for p in parts for s in p["commit_s"]]
    hb = [s for p in parts for s in p["hb_rtt"]]
    t0 = max(p["window"][0] for p in parts)
    t1 = min(p["window"][1] for p in parts)
    cores = sampler.cores(t0, t1)
    n_relays = len(relays)
    relay_cores = [c for c in cores[1 : 1 + n_relays] if c is not None]
    driver_cores = [c for c in cores[1 + n_relays :] if c is not None]
    out = {
        "form_s": max(p["admitted_last"] for p in parts) - min(p["first_register"] for p in parts),
        "commit_s_median": statistics.median(commit) if commit else None,
        "commit_s_p99": _pct(commit, 0.99),
        "commit_samples": len(commit),
        "steady_steps": cfg.steps,
        "step_s_median": (t1 - t0) / max(1, cfg.steps),
        "coordinator_cpu": cores[0],
        "relay_cpu": sum(relay_cores) if relay_cores else None,
        "relay_cpu_max": max(relay_cores, default=None),
        "driver_cpu": sum(driver_cores) if driver_cores else None,
        "driver_cpu_max": max(driver_cores, default=None),
        "heartbeat_rtt_s_p99": _pct(hb, 0.99),
        "heartbeat_rtt_s_median": _pct(hb, 0.5),
        "evicted_replicas": sorted(r for p in parts for r in p["evicted"]),
        "errors": [e for p in parts for e in p["errors"]][:10],
        "reregistered": sum(p["reregistered"] for p in parts),
        "loadavg": os.getloadavg()[0],
    }
    if cfg.faults:
        faulter = next(p for p in parts if "t_kill" in p)
        out["kill_detect_s"] = max(p["saw_without"]["0"] for p in parts) - faulter["t_kill"]
        out["hang_evict_s"] = max(p["saw_without"]["1"] for p in parts) - faulter["t_hang"]
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def message_costs(replicas: int, microbatches: int = 0, repeats: int = 200) -> dict:
    """Per-message cost of the rules and the encoding in this process, no sockets: a run of R
    formed replicas; seconds per heartbeat (alone, and per member of a batch of R), per done
    report (mean over one step's burst of R, one by one and as one batch), per whole-state JSON
    save, per view encoding (whole, and relative to the previous version after a commit)."""
    from recover.coordinator import messages as proto
    from recover.coordinator.decide import decide, initial_state, view_of
    from recover.coordinator.state_store import state_to_json
    from recover.coordinator.views import ViewCache

    m = microbatches or 2 * replicas
    opts = CoordinatorOptions(expected_replicas=replicas, microbatches=m, start_deadline_s=1e9)
    s, now = initial_state(opts, 0.0), 0.0
    fp = {"model": "bench", "microbatches": m}
    for r in range(replicas):
        reg = proto.Register(replica_id=r, incarnation=f"i{r}", fingerprint=fp, next_step=0)
        s = decide(now, s, reg)[0]
    assert s.status == "running", s.status

    def per_call(fn, n):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    hb = proto.Heartbeat(replica_id=replicas // 2, incarnation=f"i{replicas // 2}", epoch=s.epoch)
    out = {"replicas": replicas, "microbatches": m}
    out["heartbeat_s"] = per_call(lambda: decide(now + 0.01, s, hb), repeats)
    batch = proto.Heartbeats(seen=tuple((r, f"i{r}", now + 0.01) for r in range(replicas)))
    out["heartbeat_in_batch_s"] = per_call(lambda: decide(now + 0.01, s, batch), 5) / replicas
    dones = [
        proto.ReportDone(replica_id=r, incarnation=f"i{r}", step=s.step, epoch=s.attempt_epoch)
        for r in range(replicas)
    ]

    def burst():
        st = s
        for msg in dones:
            st = decide(now, st, msg)[0]
        assert st.committed_step == s.step

    out["done_s"] = per_call(burst, max(1, repeats // 40)) / replicas
    per_relay = 128
    batches = [
        proto.ReportsDone(tuple(dones[i : i + per_relay])) for i in range(0, replicas, per_relay)
    ]

    def batched():
        st = s
        for msg in batches:
            st = decide(now, st, msg)[0]
        assert st.committed_step == s.step

    out["done_in_batch_s"] = per_call(batched, max(1, repeats // 40)) / replicas
    out["state_json_s"] = per_call(lambda: state_to_json(s), max(1, repeats // 20))
    cache = ViewCache()
    cache.publish(view_of(s), microbatches=m)
    out["view_bytes"] = len(cache.encoded(-1))
    out["view_encode_s"] = per_call(
        lambda: ViewCache().publish(view_of(s), microbatches=m) or cache.encoded(-1),
        max(1, repeats // 20),
    )
    after = decide(now, s, proto.ReportsDone(tuple(dones)))[0]  # a commit, the same plan
    cache.publish(view_of(after), microbatches=m)
    out["view_after_commit_bytes"] = len(cache.encoded(s.view_version))
    return out


def format_table(rows: list[dict]) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    head = (
        "| R | M | K | hb s | relays | form s | commit med / p99 s | hb rtt p99 s | coord CPU "
        "| relay CPU | driver CPU | false deaths | kill -> epoch s | hang evict s |\n|"
        + "---|"
        * 14
    )
    lines = [head]
    for r in rows:
        if "failed" in r:
            lines.append(
                f"| {r['replicas']} | | | | {r.get('relays', 0)} | failed: {r['failed'][:200]} |"
            )
            continue
        lines.append(
            f"| {r['replicas']} | {r['microbatches']} | {r['ranks']} | {r.get('heartbeat_s')} | "
            f"{r.get('relays', 0)} | {f(r.get('form_s'))} | "
            f"{f(r.get('commit_s_median'))} / {f(r.get('commit_s_p99'))} | "
            f"{f(r.get('heartbeat_rtt_s_p99'), '.3f')} | {f(r.get('coordinator_cpu'), '.0%')} | "
            f"{f(r.get('relay_cpu'), '.0%')} | {f(r.get('driver_cpu'), '.0%')} | "
            f"{r.get('false_deaths', '-')} | "
            f"{f(r.get('kill_detect_s'))} | {f(r.get('hang_evict_s'))} |"
        )
    return "\n".join(lines)
