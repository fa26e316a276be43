"""Measure the fault-tolerant collective's recovery costs on this machine; print JSON.

Method: W ranks (spawned processes, torch.set_num_threads(1)) build the epoch-1 group on a TCPStore
hosted here and all-reduce a float32 buffer of NUMEL elements in 4 MiB buckets. Rank 1 SIGKILLs
itself at its first epoch check, i.e. right after issuing its buckets. This process sees the death
and, in mode "watch", announces epoch 2 at once (store key "epoch"); in mode "nowatch" it never
does, so survivors learn only from gloo errors (or the op deadline). Per survivor we record how
the abort came (error / epoch / deadline) and its delay after the kill, whether it is a ring
neighbour of the victim, then the epoch-2 build time among the survivors (ranks renumbered), the
redo time, and the old group's teardown time (measured on the teardown thread).

Run: .venv/bin/python benchmarks/collective_facts.py [--world 4] [--trials 3] [--out facts.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from recover.runtime.collective_config import CollectiveAborted, CollectiveConfig
from recover.runtime.group_cache import GroupCache

VICTIM = 1
NUMEL = 4 * 2**20
STORE_TIMEOUT = datetime.timedelta(seconds=30)


def _worker(rank: int, world: int, port: int, mode: str, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    config = CollectiveConfig(op_deadline_s=10, pg_timeout_s=60, bucket_bytes=4 * 2**20)
    cache = GroupCache(store, config=config)
    old = cache.get(epoch=1, rank=rank, world_size=world)
    snapshot = torch.full((NUMEL,), float(rank + 1))

    def watch() -> str | None:
        epoch = store.add("epoch", 0)
        return f"epoch {epoch} announced" if epoch > 1 else None

    def die() -> str | None:
        store.set("kill_time", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        return None

    should_abort = die if rank == VICTIM else (watch if mode == "watch" else lambda: None)
    try:
        old.allreduce_sum(snapshot.clone(), should_abort=should_abort)
        out.put({"rank": rank, "kind": "completed"})
        return
    except CollectiveAborted as exc:
        t_raise, kind = time.time(), exc.kind
    store.wait(["live"], STORE_TIMEOUT)
    live = [int(r) for r in store.get("live").decode().split(",")]
    t0 = time.monotonic()
    new = cache.get(epoch=2, rank=live.index(rank), world_size=len(live))
    rebuild_s = time.monotonic() - t0
    fresh = snapshot.clone()
    t0 = time.monotonic()
    new.allreduce_sum(fresh, should_abort=lambda: None)
    redo_s = time.monotonic() - t0
    exact = bool(torch.all(fresh == float(sum(r + 1 for r in live))))
    cache.teardown_threads[0].join(timeout=60)
    out.put(
        {
            "rank": rank,
            "kind": kind,
            "t_raise": t_raise,
            "rebuild_s": rebuild_s,
            "redo_s": redo_s,
            "redo_exact": exact,
            "teardown_s": old.teardown_s,
        }
    )
    cache.abandon_all()
    for thread in cache.teardown_threads:
        thread.join(timeout=10)


def _trial(world: int, mode: str) -> list[dict[str, Any]]:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
    )
    store.add("epoch", 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world, store.port, mode, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        while procs[VICTIM].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.001)  # polling the child's exit code: the coordinator's lease, idealised
        store.set("live", ",".join(str(r) for r in range(world) if r != VICTIM))
        if mode == "watch":
            store.add("epoch", 1)
        results = []
        while len(results) < world - 1 and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=0.5))
            except queue.Empty:
                continue
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    kill_time = float(store.get("kill_time").decode())
    for r in results:
        r["detect_ms"] = (r.pop("t_raise") - kill_time) * 1e3 if "t_raise" in r else None
        r["ring_neighbour"] = r["rank"] in ((VICTIM - 1) % world, (VICTIM + 1) % world)
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    trials = {
        mode: [_trial(args.world, mode) for _ in range(args.trials)]
        for mode in ("watch", "nowatch")
    }

    def median(mode: str, key: str, neighbour: bool | None = None) -> float | None:
        values = [
            r[key]
            for trial in trials[mode]
            for r in trial
            if r.get(key) is not None and (neighbour is None or r["ring_neighbour"] == neighbour)
        ]
        return statistics.median(values) if values else None

    summary = {
        mode: {
            "detect_ms_neighbour": median(mode, "detect_ms", True),
            "detect_ms_non_neighbour": median(mode, "detect_ms", False),
            "rebuild_ms": (median(mode, "rebuild_s") or 0) * 1e3,
            "redo_ms": (median(mode, "redo_s") or 0) * 1e3,
            "teardown_ms": (median(mode, "teardown_s") or 0) * 1e3,
        }
        for mode in trials
    }
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "world": args.world,
        "victim": VICTIM,
        "numel": NUMEL,
        "summary_medians": summary,
        "trials": trials,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
