"""`recover bench coordinator`'s driver subprocess: a block of the simulated replicas on one loop.

Job: `python -m recover.tooling.bench.coordinator_driver SPEC OUT`, one process per driver,
started by `coordinator.run_once`. SPEC gives the config, the addresses (the coordinator's, or its
relays') and this driver's block of replica ids; the driver runs those replicas on one asyncio
loop through forming, the warm-up, the measured steps and, where its block holds replicas 0 and
1, the kill and the hang, then writes what it measured to OUT as JSON (CLOCK_MONOTONIC times,
commit and heartbeat samples, evictions, errors), or `{"failed": ...}`. The method, the faults
and the figures built from these parts: coordinator.py. `_Conn` and `_parse_view` also serve
coordinator_tier.py's simulated relays.

Invariants: a simulated replica is the wire protocol's client side without torch: it registers,
heartbeats (asking for held replies, as CoordinatorClient does), reports done and long-polls the
outcome, and merges the views it gets as CoordinatorClient does (protocol.merge_view), dropping a
relative view based on another epoch than its own. Replies are not validated, the plan is cut
off unread and a live set is decoded once per epoch per driver, so that the drivers stay cheap
next to the coordinator they load. OUT appears whole or not at all (written, then renamed).

Must not: start processes, or merge figures across drivers (the parent does both).
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from recover.coordinator.protocol import MAX_FRAME
from recover.coordinator.views import split_plan
from recover.tooling.bench.coordinator import _FAULTED, BenchCoordinatorConfig

# ---------------------------------------------------------------- wire (asyncio, no validation)

_HEADER = struct.Struct(">I")
_VIEW_AT = b',"view":'
_LIVE_AT = b',"live_runs":['
_HB_OK = b'{"ok":true,"reason":"heartbeat"}'


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Conn:
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_FRAME + 8)
        return cls(reader, writer)

    async def call(self, req: dict) -> tuple[dict, bytes | None]:
        """A request -> (the reply without its view, the view's bytes or None)."""
        body = json.dumps(req, separators=(",", ":")).encode()
        self.writer.write(_HEADER.pack(len(body)) + body)
        (n,) = _HEADER.unpack(await self.reader.readexactly(4))
        body = await self.reader.readexactly(n)
        if body == _HB_OK:
            return {"ok": True}, None
        at = body.find(_VIEW_AT)  # the view is spliced in last; quotes in strings are escaped
        if at < 0:
            return json.loads(body), None
        return json.loads(body[:at] + b"}"), body[at + len(_VIEW_AT) : -1]

    def drop(self) -> None:
        self.writer.transport.abort()  # RST, like a killed process's sockets


def _parse_view(body: bytes) -> tuple[dict, bytes | None]:
    """A view's bytes -> (its fields without the plan and the live set, the live set's runs).

    Decoding the plan and the live set of every reply would make the drivers the bottleneck:
    the plan is cut off unread (the simulated replicas compute nothing with it) and `live` is
    decoded once per epoch per driver (`_Driver.lives`)."""
    rest, _ = split_plan(body)
    live = None
    i = rest.find(_LIVE_AT)
    if i >= 0:
        j = rest.index(b"]", i)
        live, rest = rest[i + len(_LIVE_AT) : j], rest[:i] + rest[j + 1 :]
    return json.loads(rest), live


@dataclass
class _Replica:
    rid: int
    inc: str = field(default_factory=lambda: uuid.uuid4().hex)
    epoch: int = 0
    version: int = -1
    live: frozenset = frozenset()
    status: str = "forming"
    step: int = 0
    attempt_epoch: int = 0
    silent: bool = False
    dead: bool = False
    evicted: str | None = None
    without: dict[int, float] = field(default_factory=dict)  # victim -> first seen without it
    admitted_at: float | None = None
    last_hb_sent: float = 0.0
    conns: list[_Conn] = field(default_factory=list)


class _Driver:
    """A block of simulated replicas on this process's loop (one driver subprocess)."""

    def __init__(self, cfg: BenchCoordinatorConfig, rids: range, addrs: list[tuple[str, int]]):
        self.cfg, self.addrs = cfg, addrs
        self.replicas = [_Replica(rid=r) for r in rids]
        self.lives: dict[int, frozenset] = {}  # epoch -> live set (decoded once per epoch)
        self.hb_rtt: list[float] = []
        self.commit_s: list[tuple[int, float]] = []  # (step, seconds)
        self.commits: dict[int, float] = {}  # step -> first seen committed
        self.stop = asyncio.Event()
        self.errors: list[str] = []
        self.reregistered = 0  # pending replicas that expired and registered again
        self.first_register: float | None = None
        self.fp = {"model": "bench", "microbatches": cfg.m}

    def addr(self, rid: int) -> tuple[str, int]:
        return self.addrs[rid * len(self.addrs) // self.cfg.replicas]

    def member(self, rep: _Replica, req: dict) -> dict:
        req["replica_id"], req["incarnation"], req["view_version"] = rep.rid, rep.inc, rep.version
        return req

    def absorb(self, rep: _Replica, body: bytes | None) -> None:
        """A reply's view, merged as CoordinatorClient does (protocol.merge_view)."""
        if body is None:
            return
        v, live_bytes = _parse_view(body)
        if v["version"] < rep.version:
            return
        epoch = v["epoch"]
        if epoch != rep.epoch or not rep.live:
            live = self.lives.get(epoch)
            if live is None:
                if live_bytes is not None:  # runs: start, stop, start, stop, ...
                    ends = [int(x) for x in live_bytes.split(b",") if x]
                    live = frozenset(
                        r for a, b in zip(ends[::2], ends[1::2], strict=True) for r in range(a, b)
                    )
                else:
                    base = v["live_from"]
                    if base["epoch"] != rep.epoch or rep.epoch not in self.lives:
                        return  # meant for another view than ours: dropped, as the client does
                    live = (self.lives[rep.epoch] - set(base["gone"])) | set(base["new"])
                self.lives[epoch] = live
            now = time.monotonic()
            rep.live, rep.epoch = live, epoch
            for victim in _FAULTED:
                if victim not in live and victim not in rep.without and rep.admitted_at:
                    rep.without[victim] = now
        rep.version = v["version"]
        rep.status, rep.step, rep.attempt_epoch = v["status"], v["step"], v["attempt_epoch"]
        if rep.admitted_at is None and rep.status == "running" and rep.rid in rep.live:
            rep.admitted_at = time.monotonic()

    async def session(self, rep: _Replica, started: asyncio.Event) -> None:
        conn = await _Conn.open(*self.addr(rep.rid))
        rep.conns.append(conn)
        req = {"kind": "register", "fingerprint": self.fp, "next_step": 0}
        self.first_register = self.first_register or time.monotonic()
        reply, view = await conn.call(self.member(rep, req))
        if not reply.get("ok"):
            self.errors.append(f"replica {rep.rid} register refused: {reply.get('reason')}")
            return
        self.absorb(rep, view)
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
            if self.cfg.hold:  # as CoordinatorClient does: epoch changes are pushed
                req["hold_s"] = period
            t0 = rep.last_hb_sent = time.monotonic()
            try:
                reply, view = await conn.call(req)
            except (ConnectionError, asyncio.IncompleteReadError):
                return
            rtt = time.monotonic() - t0
            if not self.cfg.hold:
                self.hb_rtt.append(rtt)
            elif view is None:  # held for `period`: the rest is the round trip
                self.hb_rtt.append(max(0.0, rtt - period))
            if not reply.get("ok") and reply.get("code") == "expired":  # as CoordinatorClient
                self.reregistered += 1
                req = {"kind": "register", "fingerprint": self.fp, "next_step": 0}
                reply, view = await conn.call(self.member(rep, req))
            if not reply.get("ok") and reply.get("code") in ("evicted", "unknown"):
                rep.evicted = reply.get("reason", "")
                return  # fenced: a real replica exits
            self.absorb(rep, view)

    async def watcher(self, rep: _Replica) -> None:
        conn = await _Conn.open(*self.addr(rep.rid))
        rep.conns.append(conn)
        epoch = -1
        while not self.stop.is_set() and not rep.dead:
            req = {"kind": "wait_view", "newer_than_epoch": epoch, "deadline_s": 1.0}
            try:
                _, view = await conn.call(req)
            except (ConnectionError, asyncio.IncompleteReadError):
                return
            if view is not None:
                epoch = _parse_view(view)[0]["epoch"]

    async def worker(self, rep: _Replica, started: asyncio.Event) -> None:
        await started.wait()
        conn = await _Conn.open(*self.addr(rep.rid))
        rep.conns.append(conn)
        while rep.admitted_at is None and not self.stop.is_set():  # wait until the run forms
            req = self.member(rep, {"kind": "wait_view", "newer_than_epoch": rep.epoch})
            req["deadline_s"] = 5.0  # as CoordinatorClient polls (_POLL_CHUNK_S)
            self.absorb(rep, (await conn.call(req))[1])
        while not self.stop.is_set() and not rep.dead:
            await asyncio.sleep(self.cfg.compute_s)
            if rep.dead or rep.silent:
                return
            step, epoch = rep.step, rep.attempt_epoch
            t0 = time.monotonic()
            try:
                req = self.member(rep, {"kind": "done", "step": step, "epoch": epoch})
                reply, view = await conn.call(req)
                self.absorb(rep, view)
                while reply.get("ok"):
                    req = {"kind": "wait_outcome", "step": step, "epoch": epoch, "deadline_s": 5}
                    reply, view = await conn.call(self.member(rep, req))
                    self.absorb(rep, view)
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
        """When the last survivor here first saw an epoch without `victim` (or None)."""
        times = [rep.without.get(victim) for rep in self.survivors()]
        return None if None in times else max(times, default=0.0)


async def _drive_part(cfg: BenchCoordinatorConfig, rids: range, addrs: list) -> dict:
    """Drive replicas `rids` through forming, the warm-up, the measured steps and the faults
    (the faults only where this part holds replicas 0 and 1); returns what it measured."""
    d = _Driver(cfg, rids, addrs)
    tasks = []
    for rep in d.replicas:
        started = asyncio.Event()
        tasks.append(asyncio.create_task(d.session(rep, started)))
        tasks.append(asyncio.create_task(d.worker(rep, started)))
        for _ in range(cfg.ranks_per_replica - 1):
            tasks.append(asyncio.create_task(d.watcher(rep)))
    out: dict = {"rids": [rids.start, rids.stop]}
    try:
        await d.until(
            lambda: all(r.admitted_at is not None for r in d.replicas) or d.errors,
            cfg.form_timeout_s,
            "forming",
        )
        if d.errors:
            raise RuntimeError("; ".join(d.errors[:5]))
        out["first_register"] = d.first_register
        out["admitted_last"] = max(r.admitted_at for r in d.replicas)
        first = max(r.step for r in d.replicas)
        warm, last = first + cfg.warmup_steps, first + cfg.warmup_steps + cfg.steps
        await d.until(lambda: warm in d.commits, cfg.step_timeout_s, "warmup")
        hb_from = len(d.hb_rtt)
        await d.until(lambda: last in d.commits, cfg.step_timeout_s * (cfg.steps + 1), "steps")
        out["window"] = [d.commits[warm], d.commits[last]]
        out["commit_s"] = [s for step, s in d.commit_s if warm < step <= last]
        out["hb_rtt"] = d.hb_rtt[hb_from:]
        faulter = cfg.faults and rids.start == 0
        if cfg.faults:
            if faulter:  # the kill: drop both connections mid-compute, as a SIGKILL would
                await d.until(
                    lambda: time.monotonic() - max(d.commits.values()) > cfg.compute_s / 2,
                    cfg.step_timeout_s,
                    "mid-step",
                )
                victim = d.replicas[0]
                victim.dead = True
                out["t_kill"] = time.monotonic()
                for c in victim.conns:
                    c.drop()
            await d.until(lambda: d.all_saw_without(0) is not None, cfg.step_timeout_s, "kill")
            if faulter:  # the hang: replica 1 stops sending anything; its sockets stay open
                hung = d.replicas[1]
                hung.silent = True
                await asyncio.sleep(cfg.heartbeat_s * 2)  # an in-flight heartbeat completes
                out["t_hang"] = hung.last_hb_sent
            # The faulting part hangs replica 1 only once its own survivors saw the kill: the
            # others, which may have seen it sooner, wait for that too.
            wait = cfg.step_timeout_s * (1 if faulter else 2)
            await d.until(lambda: d.all_saw_without(1) is not None, wait, "hang")
            out["saw_without"] = {str(v): d.all_saw_without(v) for v in _FAULTED}
            n = max(d.commits)
            await d.until(lambda: n + 1 in d.commits, cfg.step_timeout_s, "commit after faults")
        out["evicted"] = sorted(
            r.rid for r in d.replicas if r.evicted is not None and r.rid not in _FAULTED
        )
        out["errors"] = d.errors[:10]
        out["reregistered"] = d.reregistered
        out["t_wall_end"] = time.time()  # deaths after this are the teardown's
    finally:
        d.stop.set()
        for rep in d.replicas:
            for c in rep.conns:
                c.drop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def _part_main(argv: list[str]) -> int:
    """A driver subprocess: `python -m recover.tooling.bench.coordinator_driver SPEC OUT`."""
    spec = json.loads(Path(argv[0]).read_text())
    cfg = BenchCoordinatorConfig(**spec["cfg"])
    addrs = [tuple(a) for a in spec["addrs"]]
    try:
        out = asyncio.run(_drive_part(cfg, range(*spec["rids"]), addrs))
    except (RuntimeError, TimeoutError, OSError) as e:
        out = {"failed": f"{type(e).__name__}: {e}"[:500]}
    tmp = argv[1] + ".tmp"
    Path(tmp).write_text(json.dumps(out))
    os.replace(tmp, argv[1])
    return 0 if "failed" not in out else 1


if __name__ == "__main__":
    raise SystemExit(_part_main(sys.argv[1:]))
