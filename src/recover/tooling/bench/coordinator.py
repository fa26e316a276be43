"""`recover bench coordinator`: the coordinator under R simulated replicas, with a kill and a hang.

Job: measure the control plane alone. One `recover coordinator serve` subprocess (the real server,
the real wire protocol); in this process, R lightweight replicas on one asyncio loop. Each replica
opens a session connection (register, then a heartbeat every `heartbeat_s`) and an rpc connection
(done reports and wait_outcome long-polls), plus K-1 view watchers (the other ranks of a replica
of K ranks, each long-polling `wait_view`). Every step a replica "computes" for `compute_s`,
reports done for (step, attempt epoch) and waits for the outcome.

Faults (after `warmup_steps` commits): replica 0 is killed (both connections dropped, as a
SIGKILL does), then, once its death has been published, replica 1 hangs silently (its sockets stay
open; it sends nothing). Survivors keep reporting done, so the steps commit without a redo.

Figures (all from this process's clock, except the coordinator's CPU):
- form_s: first register sent -> the last replica saw itself live in a running view;
- commit_s median / p99: done sent -> Committed received, per replica and failure-free step;
- heartbeat_rtt_s p99: heartbeat sent -> its reply (a held reply: minus the hold);
- coordinator_cpu: (utime + stime) of the coordinator pid over the steady window / wall time, in
  cores (1.0 = one core busy), from /proc/<pid>/stat;
- false_deaths: `coordinator.member_dead` events (its --events file) of replicas never faulted;
- kill_detect_s: the drop -> the last survivor saw an epoch without the killed replica;
- hang_evict_s: the hung replica's last heartbeat -> the last survivor saw an epoch without it
  (the target is lease + 1 s).
Costs: one process drives all replicas, so at large R this process can be the bottleneck: its
own CPU (`driver_cpu`) is reported beside the coordinator's; near 1.0 the figures are a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from recover.coordinator.protocol import MAX_FRAME

__all__ = ["BenchCoordinatorConfig", "add_coordinator_bench_parser", "bench_coordinator"]

_HEADER = struct.Struct(">I")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, kw_only=True)
class BenchCoordinatorConfig:
    replicas: int
    microbatches: int = 0  # 0: 2 x replicas
    ranks_per_replica: int = 1  # K: K-1 view watchers per replica
    steps: int = 8  # failure-free steps measured (the fault steps come on top)
    warmup_steps: int = 2
    compute_s: float = 1.0
    heartbeat_s: float = 0.1
    lease_s: float = 1.0
    faults: bool = True
    hold: bool = True  # heartbeats ask for held replies (pushed epochs), like CoordinatorClient
    form_timeout_s: float = 120.0
    step_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.replicas < (3 if self.faults else 1):
            raise ValueError(
                f"replicas must be >= 3 with faults (>= 1 without), got {self.replicas}"
            )
        for name in ("microbatches", "steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ranks_per_replica < 1:
            raise ValueError(f"ranks_per_replica must be >= 1, got {self.ranks_per_replica}")
        for name in ("compute_s", "heartbeat_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def m(self) -> int:
        return self.microbatches or 2 * self.replicas


# ---------------------------------------------------------------- wire (asyncio, no validation)


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Conn:
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_FRAME + 8)
        return cls(reader, writer)

    async def call(self, req: dict) -> dict:
        body = json.dumps(req, separators=(",", ":")).encode()
        self.writer.write(_HEADER.pack(len(body)) + body)
        (n,) = _HEADER.unpack(await self.reader.readexactly(4))
        return _parse_reply(await self.reader.readexactly(n))

    def drop(self) -> None:
        self.writer.transport.abort()  # RST, like a killed process's sockets


_VIEW_AT = b',"view":{"epoch":'
_VIEW_HEAD = re.compile(rb'^\{"epoch":(\d+),"live":\[([0-9,]*)\],"step":(\d+),')
_VIEW_MID = re.compile(rb'"status":"(\w+)","committed_step":(-?\d+),"attempt_epoch":(\d+),')
_VIEW_VERSION = re.compile(rb'\],"version":(\d+),"reason":')


def _parse_reply(body: bytes) -> dict:
    """A reply, with its view reduced to what a simulated replica reads.

    The server splices the view in last (`,"view":{...}}`); decoding the whole view (its plan is
    O(R) JSON) for every reply would make this one driver process the bottleneck, so the view's
    scalars are read with anchored patterns (JSON strings escape quotes: a reason cannot fake
    them) and `live` is decoded only when asked (`view["live"]()`)."""
    at = body.find(_VIEW_AT)
    if at < 0:
        return json.loads(body)
    reply = json.loads(body[:at] + b"}")
    raw = body[at + 8 : -1]
    head, mid, ver = _VIEW_HEAD.match(raw), _VIEW_MID.search(raw), _VIEW_VERSION.search(raw)
    if head is None or mid is None or ver is None:  # an unknown layout: decode it all
        v = json.loads(raw)
        reply["view"] = {**v, "live": lambda v=v: tuple(v["live"])}
        return reply
    live = head.group(2)
    reply["view"] = {
        "epoch": int(head.group(1)),
        "live": lambda: tuple(int(x) for x in live.split(b",")) if live else (),
        "step": int(head.group(3)),
        "status": mid.group(1).decode(),
        "committed_step": int(mid.group(2)),
        "attempt_epoch": int(mid.group(3)),
        "version": int(ver.group(1)),
    }
    return reply


@dataclass
class _Replica:
    rid: int
    inc: str = field(default_factory=lambda: uuid.uuid4().hex)
    epoch: int = 0
    version: int = -1
    live: tuple[int, ...] = ()
    status: str = "forming"
    step: int = 0
    attempt_epoch: int = 0
    silent: bool = False
    dead: bool = False
    evicted: str | None = None
    seen_epoch_at: dict[int, float] = field(default_factory=dict)  # epoch -> first seen
    admitted_at: float | None = None
    last_hb_sent: float = 0.0
    conns: list[_Conn] = field(default_factory=list)

    def absorb(self, reply: dict) -> None:
        v = reply.get("view")
        if v is None or v.get("version", 0) < self.version:
            return
        self.version = v.get("version", 0)
        self.status, self.step, self.attempt_epoch = v["status"], v["step"], v["attempt_epoch"]
        if v["epoch"] != self.epoch or not self.live:
            self.live = v["live"]()
        if v["epoch"] != self.epoch:
            self.epoch = v["epoch"]
            self.seen_epoch_at.setdefault(self.epoch, time.monotonic())
        if self.admitted_at is None and self.status == "running" and self.rid in self.live:
            self.admitted_at = time.monotonic()


class _Driver:
    def __init__(self, cfg: BenchCoordinatorConfig, host: str, port: int) -> None:
        self.cfg, self.host, self.port = cfg, host, port
        self.replicas = [_Replica(rid=r) for r in range(cfg.replicas)]
        self.hb_rtt: list[float] = []
        self.commit_s: list[tuple[int, float]] = []  # (step, seconds)
        self.commits: dict[int, float] = {}  # step -> first seen committed
        self.stop = asyncio.Event()
        self.errors: list[str] = []
        self.reregistered = 0  # pending replicas that expired and registered again
        self.fp = {"model": "bench", "microbatches": cfg.m}

    def member(self, rep: _Replica, req: dict) -> dict:
        req["replica_id"], req["incarnation"] = rep.rid, rep.inc
        return req

    async def session(self, rep: _Replica, started: asyncio.Event) -> None:
        conn = await _Conn.open(self.host, self.port)
        rep.conns.append(conn)
        req = {"kind": "register", "fingerprint": self.fp, "next_step": 0}
        reply = await conn.call(self.member(rep, req))
        if not reply.get("ok"):
            self.errors.append(f"replica {rep.rid} register refused: {reply.get('reason')}")
            return
        rep.absorb(reply)
        started.set()
        period = self.cfg.heartbeat_s
        # Spread the replicas' heartbeats over the period, as independent processes would be.
        next_at = time.monotonic() + period * (rep.rid * 0.618 % 1.0)
        while not self.stop.is_set() and not rep.dead:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at = time.monotonic() + period
            if rep.silent or rep.dead:
                if rep.dead:
                    return
                continue
            req = self.member(rep, {"kind": "heartbeat", "epoch": rep.epoch})
            req["view_version"] = rep.version
            if self.cfg.hold:  # as CoordinatorClient does: epoch changes are pushed
                req["hold_s"] = period
            t0 = rep.last_hb_sent = time.monotonic()
            try:
                reply = await conn.call(req)
            except (ConnectionError, asyncio.IncompleteReadError):
                return
            rtt = time.monotonic() - t0
            if not self.cfg.hold:
                self.hb_rtt.append(rtt)
            elif "view" not in reply:  # held for `period`: the rest is the round trip
                self.hb_rtt.append(max(0.0, rtt - period))
            if not reply.get("ok") and reply.get("code") == "expired":  # as CoordinatorClient
                self.reregistered += 1
                req = {"kind": "register", "fingerprint": self.fp, "next_step": 0}
                reply = await conn.call(self.member(rep, req))
            if not reply.get("ok") and reply.get("code") in ("evicted", "unknown"):
                rep.evicted = reply.get("reason", "")
                return  # fenced: a real replica exits
            rep.absorb(reply)

    async def watcher(self, rep: _Replica) -> None:
        conn = await _Conn.open(self.host, self.port)
        rep.conns.append(conn)
        epoch = -1
        while not self.stop.is_set() and not rep.dead:
            req = {"kind": "wait_view", "newer_than_epoch": epoch, "deadline_s": 1.0}
            try:
                reply = await conn.call(req)
            except (ConnectionError, asyncio.IncompleteReadError):
                return
            if reply.get("view") is not None:
                epoch = reply["view"]["epoch"]

    async def worker(self, rep: _Replica, started: asyncio.Event) -> None:
        await started.wait()
        conn = await _Conn.open(self.host, self.port)
        rep.conns.append(conn)
        while rep.admitted_at is None and not self.stop.is_set():  # wait until the run forms
            req = self.member(rep, {"kind": "wait_view", "newer_than_epoch": rep.epoch})
            req["deadline_s"] = 1.0
            rep.absorb(await conn.call(req))
        while not self.stop.is_set() and not rep.dead:
            await asyncio.sleep(self.cfg.compute_s)
            if rep.dead or rep.silent:
                return
            step, epoch = rep.step, rep.attempt_epoch
            t0 = time.monotonic()
            try:
                reply = await conn.call(
                    self.member(rep, {"kind": "done", "step": step, "epoch": epoch})
                )
                rep.absorb(reply)
                while True:
                    req = {"kind": "wait_outcome", "step": step, "epoch": epoch, "deadline_s": 5}
                    reply = await conn.call(self.member(rep, req))
                    rep.absorb(reply)
                    if reply.get("outcome") != "timeout":
                        break
            except (ConnectionError, asyncio.IncompleteReadError):
                return
            if rep.dead:
                return
            if reply.get("outcome") == "committed":
                now = time.monotonic()
                self.commit_s.append((step, now - t0))
                self.commits.setdefault(step, now)
            elif not reply.get("ok"):
                self.errors.append(f"replica {rep.rid}: {reply.get('code')}: {reply.get('reason')}")
                if reply.get("code") in ("evicted", "unknown"):
                    rep.evicted = reply.get("reason", "")
                    return

    def survivors(self) -> list[_Replica]:
        return [r for r in self.replicas if not r.dead and not r.silent]

    async def until(self, pred, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > end:
                raise TimeoutError(f"{what} did not happen within {timeout_s} s")
            await asyncio.sleep(0.01)

    def all_saw_without(self, victim: int) -> float | None:
        """When the last survivor first saw an epoch whose live set lacks `victim` (or None)."""
        times = []
        for rep in self.survivors():
            if victim in rep.live:
                return None
            times.append(min(t for e, t in rep.seen_epoch_at.items() if e == rep.epoch))
        return max(times) if times else None


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / _CLK_TCK  # utime, stime


def _driver_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _drive(cfg: BenchCoordinatorConfig, host: str, port: int, pid: int) -> dict:
    d = _Driver(cfg, host, port)
    tasks = []
    t_start = time.monotonic()
    for rep in d.replicas:
        started = asyncio.Event()
        tasks.append(asyncio.create_task(d.session(rep, started)))
        tasks.append(asyncio.create_task(d.worker(rep, started)))
        for _ in range(cfg.ranks_per_replica - 1):
            tasks.append(asyncio.create_task(d.watcher(rep)))
    result: dict = {}
    try:
        await d.until(
            lambda: all(r.admitted_at is not None for r in d.replicas) or d.errors,
            cfg.form_timeout_s,
            "forming",
        )
        if d.errors:
            raise RuntimeError("; ".join(d.errors[:5]))
        result["form_s"] = max(r.admitted_at for r in d.replicas) - t_start
        first = max(r.step for r in d.replicas)
        await d.until(lambda: first + cfg.warmup_steps in d.commits, cfg.step_timeout_s, "warmup")
        cpu0, drv0, t0 = _cpu_s(pid), _driver_cpu_s(), time.monotonic()
        steady_from = first + cfg.warmup_steps + 1
        last = steady_from + cfg.steps - 1
        await d.until(
            lambda: last in d.commits, cfg.step_timeout_s * (cfg.steps + 1), "steady steps"
        )
        cpu1, drv1, t1 = _cpu_s(pid), _driver_cpu_s(), time.monotonic()
        steady = [s for step, s in d.commit_s if steady_from <= step <= last]
        result.update(
            commit_s_median=statistics.median(steady) if steady else None,
            commit_s_p99=_pct(steady, 0.99),
            commit_samples=len(steady),
            steady_steps=cfg.steps,
            step_s_median=(t1 - t0) / max(1, cfg.steps),
            coordinator_cpu=(cpu1 - cpu0) / (t1 - t0),
            driver_cpu=(drv1 - drv0) / (t1 - t0),
        )
        hb_steady = list(d.hb_rtt)
        if cfg.faults:
            # The kill: drop both connections mid-compute, as a SIGKILL would.
            await d.until(
                lambda: (
                    d.commits and time.monotonic() - max(d.commits.values()) > cfg.compute_s / 2
                ),
                cfg.step_timeout_s,
                "mid-step",
            )
            victim = d.replicas[0]
            victim.dead = True
            t_kill = time.monotonic()
            for c in victim.conns:
                c.drop()
            await d.until(lambda: d.all_saw_without(0) is not None, cfg.step_timeout_s, "kill")
            result["kill_detect_s"] = d.all_saw_without(0) - t_kill
            # The hang: replica 1 stops sending anything; its sockets stay open.
            hung = d.replicas[1]
            hung.silent = True
            await asyncio.sleep(cfg.heartbeat_s * 2)  # an in-flight heartbeat completes
            t_hang = hung.last_hb_sent
            await d.until(lambda: d.all_saw_without(1) is not None, cfg.step_timeout_s, "hang")
            result["hang_evict_s"] = d.all_saw_without(1) - t_hang
            n = max(d.commits)
            await d.until(lambda: n + 1 in d.commits, cfg.step_timeout_s, "commit after faults")
        result["heartbeat_rtt_s_p99"] = _pct(hb_steady, 0.99)
        result["heartbeat_rtt_s_median"] = _pct(hb_steady, 0.5)
        result["evicted_replicas"] = sorted(
            r.rid for r in d.replicas if r.evicted is not None and r.rid > (1 if cfg.faults else -1)
        )
        result["errors"] = d.errors[:10]
        result["reregistered"] = d.reregistered
        result["t_wall_end"] = time.time()  # deaths after this are the teardown's
    finally:
        d.stop.set()
        for rep in d.replicas:
            for c in rep.conns:
                c.drop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return result


def _false_deaths(events: Path, faulted: set[int], until: float) -> list[int]:
    dead = []
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("t_wall", 0) > until:
            break
        if e.get("name") == "coordinator.member_dead" and e.get("replica_id") not in faulted:
            dead.append(e["replica_id"])
    return sorted(dead)


def start_coordinator(cfg: BenchCoordinatorConfig, workdir: Path) -> tuple[subprocess.Popen, dict]:
    """A `recover coordinator serve` subprocess on 127.0.0.1; returns (process, address info)."""
    addr = workdir / "address.json"
    cmd = [
        sys.executable,
        "-m",
        "recover.coordinator.cli",
        "coordinator",
        "serve",
        "--port",
        "0",
        "--no-store",
        "--replicas",
        str(cfg.replicas),
        "--microbatches",
        str(cfg.m),
        "--lease",
        str(cfg.lease_s),
        "--min-replicas",
        "1",
        "--start-deadline",
        str(cfg.form_timeout_s),
        "--events",
        str(workdir / "events.jsonl"),
        "--address-file",
        str(addr),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(workdir / "coordinator.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    end = time.monotonic() + 60.0
    while not addr.exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            proc.wait()
            tail = (workdir / "coordinator.log").read_text()[-2000:]
            raise RuntimeError(f"coordinator did not start: {tail}")
        time.sleep(0.02)
    return proc, json.loads(addr.read_text())


def run_once(cfg: BenchCoordinatorConfig) -> dict:
    """One measurement: a fresh coordinator, R replicas, the faults; every process reaped."""
    with tempfile.TemporaryDirectory(prefix="recover-bench-coord-") as tmp:
        workdir = Path(tmp)
        proc, info = start_coordinator(cfg, workdir)
        try:
            result = asyncio.run(_drive(cfg, info["host"], info["port"], proc.pid))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        faulted = {0, 1} if cfg.faults else set()
        until = result.pop("t_wall_end")
        result["false_deaths"] = len(_false_deaths(workdir / "events.jsonl", faulted, until))
    return {
        "replicas": cfg.replicas,
        "microbatches": cfg.m,
        "ranks": cfg.ranks_per_replica,
        "heartbeat_s": cfg.heartbeat_s,
        **result,
    }


def message_costs(replicas: int, microbatches: int = 0, repeats: int = 200) -> dict:
    """Per-message cost of the rules and the encoding in this process, no sockets: a run of R
    formed replicas; seconds per heartbeat (alone, and per member of a batch of R), per done
    report (mean over one step's burst of R), per whole-state JSON save, per view encoding."""
    from recover.coordinator import protocol as proto
    from recover.coordinator.decide import decide, initial_state, view_of
    from recover.coordinator.state_store import CoordinatorOptions, state_to_json

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
    if hasattr(proto, "Heartbeats"):
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
    out["state_json_s"] = per_call(lambda: state_to_json(s), max(1, repeats // 20))
    view_json = json.dumps(view_of(s).to_dict(), separators=(",", ":"))
    out["view_bytes"] = len(view_json)
    out["view_encode_s"] = per_call(
        lambda: json.dumps(view_of(s).to_dict(), separators=(",", ":")), max(1, repeats // 20)
    )
    return out


def format_table(rows: list[dict]) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    head = (
        "| R | M | K | hb s | form s | commit med / p99 s | hb rtt p99 s | coord CPU | driver CPU "
        "| false deaths | kill -> epoch s | hang evict s |\n|" + "---|" * 12
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['microbatches']} | {r['ranks']} | {r.get('heartbeat_s', 0.1)} | "
            f"{f(r.get('form_s'))} | "
            f"{f(r.get('commit_s_median'))} / {f(r.get('commit_s_p99'))} | "
            f"{f(r.get('heartbeat_rtt_s_p99'), '.3f')} | {f(r.get('coordinator_cpu'), '.0%')} | "
            f"{f(r.get('driver_cpu'), '.0%')} | {r.get('false_deaths', '-')} | "
            f"{f(r.get('kill_detect_s'))} | {f(r.get('hang_evict_s'))} |"
        )
    return "\n".join(lines)


def add_coordinator_bench_parser(sub) -> None:
    p = sub.add_parser("coordinator", help="the coordinator under R simulated replicas")
    p.add_argument("--replicas", default="64", help="R, or a comma list (default: 64)")
    p.add_argument("--microbatches", type=int, default=0, help="M (default: 2 x R)")
    p.add_argument("--ranks-per-replica", type=int, default=1, help="K: K-1 view watchers each")
    p.add_argument("--steps", type=int, default=8, help="failure-free steps measured")
    p.add_argument("--compute", type=float, default=1.0, help="seconds of 'compute' per step")
    p.add_argument("--lease", type=float, default=1.0)
    p.add_argument(
        "--heartbeat", type=float, default=0.1, help="heartbeat period = hold (default 0.1 s)"
    )
    p.add_argument(
        "--costs", action="store_true", help="also time the rules per message in-process (no I/O)"
    )
    p.add_argument("--no-faults", action="store_true", help="skip the kill and the hang")
    p.add_argument("--out", default="bench-coordinator.json", metavar="FILE")


def run_coordinator_bench(args: argparse.Namespace) -> int:
    from recover.tooling.bench.common import machine_info

    rows = []
    try:
        sizes = [int(x) for x in str(args.replicas).split(",")]
        cfgs = [
            BenchCoordinatorConfig(
                replicas=r,
                microbatches=args.microbatches,
                ranks_per_replica=args.ranks_per_replica,
                steps=args.steps,
                compute_s=args.compute,
                lease_s=args.lease,
                heartbeat_s=args.heartbeat,
                faults=not args.no_faults,
            )
            for r in sizes
        ]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for cfg in cfgs:
        try:
            row = run_once(cfg)
        except (RuntimeError, TimeoutError) as e:
            row = {"replicas": cfg.replicas, "microbatches": cfg.m, "ranks": cfg.ranks_per_replica}
            row["failed"] = str(e)[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(format_table(rows))
    costs = [message_costs(cfg.replicas, cfg.microbatches) for cfg in cfgs] if args.costs else []
    for c in costs:
        print(json.dumps(c))
    result = {
        "benchmark": "coordinator",
        "machine": machine_info(),
        "loadavg_at_end": os.getloadavg(),
        "method": __doc__,
        "rows": rows,
        "message_costs": costs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


bench_coordinator = run_coordinator_bench
