"""`recover bench coordinator --relays N --upstream-only`: the coordinator tier alone, at any R.

Job: measure what the coordinator does behind N relays when R is more than this machine can
simulate whole (replicas and relays: about 60% of a core per 1,024 replicas at 0.5 s heartbeats,
docs/coordinator.md). One `recover coordinator serve` subprocess, and one driver process that
speaks, for each of the N relays, exactly what a relay sends upstream: its registrations (one
rpc connection per relay, in order), its held `relay_beat` (every `relay_beat_s`, held until the
view changes), one `done_batch` per step for its live replicas, `process_exit` for the killed
replica and `lease_expired` for the hung one (the relay's own lease judgment is measured by the
whole benchmark, not here).

Figures: form_s (first register -> every relay saw all of its replicas live); commit_s median /
p99 per relay and step (done_batch sent -> the relay saw the commit); coordinator_cpu and
driver_cpu over the measured steps; false_deaths; kill_detect_s (process_exit sent -> the last
relay saw an epoch without the replica); expiry_publish_s (lease_expired sent -> the last relay
saw it). What a replica adds behind its relay (one more hop, measured whole at smaller R):
kill -> epoch at every replica minus kill -> epoch at every relay.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from recover.coordinator.etcd_local import start_local_etcd
from recover.tooling.bench.coordinator import (
    BenchCoordinatorConfig,
    _CpuSampler,
    _EtcdWrites,
    _false_deaths,
    _pct,
    _stop_all,
    start_coordinator,
)
from recover.tooling.bench.coordinator_driver import _Conn, _parse_view

__all__ = ["run_tier"]


@dataclass
class _Relay:
    """One simulated relay: its replicas and its copy of the coordinator's view."""

    name: str
    rids: range
    incs: dict[int, str] = field(default_factory=dict)
    version: int = -1
    epoch: int = -1
    live: frozenset = frozenset()
    status: str = "forming"
    step: int = 0
    attempt_epoch: int = 0
    committed_step: int = -1
    without: dict[int, float] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class _Tier:
    def __init__(self, cfg: BenchCoordinatorConfig, host: str, port: int) -> None:
        self.cfg, self.host, self.port = cfg, host, port
        n, r = cfg.relays, cfg.replicas
        self.relays = [
            _Relay(name=f"relay{i}", rids=range(i * r // n, (i + 1) * r // n)) for i in range(n)
        ]
        self.lives: dict[int, frozenset] = {}
        self.stop = asyncio.Event()
        self.commit_s: list[tuple[int, float]] = []
        self.commits: dict[int, float] = {}
        self.fp = {"model": "bench", "microbatches": cfg.m}

    def absorb(self, rel: _Relay, body: bytes | None) -> None:
        if body is None:
            return
        v, runs = _parse_view(body)
        if v["version"] < rel.version:
            return
        epoch = v["epoch"]
        if epoch != rel.epoch:
            live = self.lives.get(epoch)
            if live is None:
                if runs is not None:
                    ends = [int(x) for x in runs.split(b",") if x]
                    pairs = zip(ends[::2], ends[1::2], strict=True)
                    live = frozenset(x for a, b in pairs for x in range(a, b))
                else:
                    base = v["live_from"]
                    if base["epoch"] != rel.epoch or rel.epoch not in self.lives:
                        return
                    live = (self.lives[rel.epoch] - set(base["gone"])) | set(base["new"])
                self.lives[epoch] = live
            rel.live, rel.epoch = live, epoch
            now = time.monotonic()
            for victim in (0, 1):
                if victim not in live and victim not in rel.without and rel.status == "running":
                    rel.without[victim] = now
        rel.version = v["version"]
        rel.status, rel.step = v["status"], v["step"]
        rel.attempt_epoch, rel.committed_step = v["attempt_epoch"], v["committed_step"]
        rel.changed.set()

    def up(self, rel: _Relay, req: dict) -> dict:
        req["relay"], req["view_version"] = rel.name, rel.version
        return req

    async def beats(self, rel: _Relay, conn: _Conn) -> None:
        while not self.stop.is_set():
            req = {"kind": "relay_beat", "hold_s": self.cfg.relay_beat_s, "seen": []}
            try:
                head, view = await conn.call(self.up(rel, req))
            except (ConnectionError, asyncio.IncompleteReadError):
                return
            self.absorb(rel, view)

    async def until_changed(self, rel: _Relay, pred, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not pred():
            rel.changed.clear()
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{rel.name}: timed out")
            try:
                await asyncio.wait_for(rel.changed.wait(), remaining)
            except TimeoutError:
                pass

    async def run_relay(self, rel: _Relay, rpc: _Conn, first: list, formed: list) -> None:
        first.append(time.monotonic())
        for r in rel.rids:
            rel.incs[r] = uuid.uuid4().hex
            req = {"kind": "register", "replica_id": r, "incarnation": rel.incs[r]}
            req.update(fingerprint=self.fp, next_step=0)
            head, view = await rpc.call(self.up(rel, req))
            if not head.get("ok"):
                raise RuntimeError(f"{rel.name}: register of {r} refused: {head}")
            self.absorb(rel, view)
        mine = set(rel.rids)
        await self.until_changed(
            rel, lambda: rel.status == "running" and mine <= rel.live, self.cfg.form_timeout_s
        )
        formed.append(time.monotonic())
        while not self.stop.is_set():
            await asyncio.sleep(self.cfg.compute_s)
            step, epoch = rel.step, rel.attempt_epoch
            rows = [[r, rel.incs[r], None, None] for r in rel.rids if r in rel.live]
            req = {"kind": "done_batch", "step": step, "epoch": epoch, "reports": rows}
            t0 = time.monotonic()
            try:
                head, view = await rpc.call(self.up(rel, req))
            except (ConnectionError, asyncio.IncompleteReadError):
                return
            self.absorb(rel, view)
            await self.until_changed(
                rel, lambda s=step: rel.committed_step >= s or rel.step != s, 30.0
            )
            if rel.committed_step >= step:
                now = time.monotonic()
                self.commit_s.append((step, now - t0))
                self.commits.setdefault(step, now)


async def _drive_tier(cfg: BenchCoordinatorConfig, host: str, port: int) -> dict:
    t = _Tier(cfg, host, port)
    tasks, conns, first, formed = [], [], [], []
    out: dict = {}
    try:
        for rel in t.relays:
            beat, rpc = await _Conn.open(host, port), await _Conn.open(host, port)
            conns += [beat, rpc]
            t.absorb(rel, (await beat.call(t.up(rel, {"kind": "relay_beat", "seen": []})))[1])
            tasks.append(asyncio.create_task(t.beats(rel, beat)))
            tasks.append(asyncio.create_task(t.run_relay(rel, rpc, first, formed)))

        async def until(pred, timeout_s, what):
            end = time.monotonic() + timeout_s
            while not pred():
                for task in tasks:
                    if task.done() and task.exception() is not None:
                        raise RuntimeError(f"{what}: {task.exception()!r}")
                if time.monotonic() > end:
                    raise TimeoutError(f"{what} did not happen within {timeout_s} s")
                await asyncio.sleep(0.01)

        await until(lambda: len(formed) == len(t.relays), cfg.form_timeout_s, "forming")
        out["form_s"] = max(formed) - min(first)
        await until(lambda: bool(t.commits), cfg.step_timeout_s, "the first commit")
        start = min(t.commits)
        warm, last = start + cfg.warmup_steps, start + cfg.warmup_steps + cfg.steps
        await until(lambda: warm in t.commits, cfg.step_timeout_s, "warmup")
        await until(lambda: last in t.commits, cfg.step_timeout_s * (cfg.steps + 1), "steps")
        out["window"] = [t.commits[warm], t.commits[last]]
        out["commit_s"] = [s for step, s in t.commit_s if warm < step <= last]
        if cfg.faults:
            rel0, rpc0 = t.relays[0], conns[1]
            await until(
                lambda: time.monotonic() - t.commits[last] > cfg.compute_s / 2,
                cfg.step_timeout_s,
                "mid-step",
            )
            for victim, kind, key in ((0, "process_exit", "t_kill"), (1, "lease_expired", "t_x")):
                req = {"kind": kind, "replica_id": victim, "incarnation": rel0.incs[victim]}
                out[key] = time.monotonic()
                await rpc0.call(t.up(rel0, req))
                await until(
                    lambda v=victim: all(v in r.without for r in t.relays), cfg.step_timeout_s, kind
                )
            out["kill_detect_s"] = max(r.without[0] for r in t.relays) - out.pop("t_kill")
            out["expiry_publish_s"] = max(r.without[1] for r in t.relays) - out.pop("t_x")
            n = max(t.commits)
            await until(lambda: n + 1 in t.commits, cfg.step_timeout_s, "commit after faults")
        out["t_wall_end"] = time.time()
    finally:
        t.stop.set()
        for c in conns:
            c.drop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def run_tier(cfg: BenchCoordinatorConfig) -> dict:
    """One measurement of the coordinator tier: a fresh coordinator, N simulated relays in this
    process, the faults; the coordinator reaped whatever fails."""
    row = {
        "replicas": cfg.replicas,
        "microbatches": cfg.m,
        "ranks": cfg.ranks_per_replica,
        "heartbeat_s": None,
        "relays": cfg.relays,
        "upstream_only": True,
        "relay_beat_s": cfg.relay_beat_s,
    }
    procs: list[subprocess.Popen] = []
    sampler = None
    etcd = writes = None
    with tempfile.TemporaryDirectory(prefix="recover-bench-tier-") as tmp:
        work = Path(tmp)
        try:
            state = None
            if cfg.etcd:  # the state in a private etcd; its writes counted (coordinator.py)
                etcd = start_local_etcd(work / "etcd")
                state = f"{etcd.url}/bench"
                writes = _EtcdWrites(etcd.client_port)
            coord, info = start_coordinator(cfg, work, procs, state)
            sampler = _CpuSampler([coord.pid, os.getpid()])
            out = asyncio.run(_drive_tier(cfg, info["host"], info["port"]))
            sampler.close()
            commit = out.pop("commit_s")
            t0, t1 = out.pop("window")
            cores = sampler.cores(t0, t1)
            row.update(
                form_s=out["form_s"],
                commit_s_median=statistics.median(commit) if commit else None,
                commit_s_p99=_pct(commit, 0.99),
                commit_samples=len(commit),
                steady_steps=cfg.steps,
                step_s_median=(t1 - t0) / max(1, cfg.steps),
                coordinator_cpu=cores[0],
                driver_cpu=cores[1],
                kill_detect_s=out.get("kill_detect_s"),
                expiry_publish_s=out.get("expiry_publish_s"),
                loadavg=os.getloadavg()[0],
            )
            if writes is not None:
                row.update(writes.per_step(t0, t1, cfg.steps, "/bench/state"))
            _stop_all(procs)
            row["false_deaths"] = len(_false_deaths(work / "events.jsonl", out["t_wall_end"]))
        except (RuntimeError, TimeoutError, OSError) as e:
            row["failed"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            if sampler is not None:
                sampler.close()
            _stop_all(procs)
            if writes is not None:
                writes.close()
            if etcd is not None:
                etcd.stop()
    return row


def _main() -> None:  # pragma: no cover - a manual entry for one row
    import sys

    cfg = BenchCoordinatorConfig(**json.loads(sys.argv[1]))
    print(json.dumps(run_tier(cfg)))


if __name__ == "__main__":  # pragma: no cover
    _main()
