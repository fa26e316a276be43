"""Tests of the fault-tolerant cross-replica collective (src/recover/runtime/collective.py,
collective_config.py, group_build.py, group_cache.py).

Tiers: pure functions (config, buckets, verdict); in-process groups (two ranks on two threads,
or one rank); real processes (multiprocessing spawn, a TCPStore hosted by the test process) that
are SIGKILLed or SIGSTOPped mid-collective. Every child is reaped in a finally block.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import (
    CollectiveAborted,
    CollectiveConfig,
    compute_buckets,
    compute_verdict,
)
from recover.runtime.group_build import _construct
from recover.runtime.group_cache import GroupCache

STORE_TIMEOUT = datetime.timedelta(seconds=15)


# ---- pure parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("build_timeout_s", 0),
        ("op_deadline_s", -1.0),
        ("pg_timeout_s", 0.5),  # below op_deadline_s
        ("poll_interval_s", "fast"),
        ("abort_check_interval_s", 0),
        ("bucket_bytes", -1),
        ("bucket_bytes", 1.5),
        ("gloo_hostname", ""),
    ],
)
def test_config_rejects_bad_field_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        CollectiveConfig(**{field: value})


@given(
    numel=st.integers(0, 5000),
    element_size=st.sampled_from([1, 2, 4, 8]),
    bucket_bytes=st.integers(0, 9000),
)
def test_buckets_cover_every_element_once(numel: int, element_size: int, bucket_bytes: int) -> None:
    buckets = compute_buckets(numel, element_size, bucket_bytes)
    covered = [i for start, stop in buckets for i in range(start, stop)]
    assert covered == list(range(numel))
    if bucket_bytes == 0:
        assert len(buckets) == (1 if numel else 0)
    else:
        assert all(
            (stop - start) * element_size <= max(bucket_bytes, element_size)
            for start, stop in buckets
        )


def test_verdict_precedence_error_then_epoch_then_deadline() -> None:
    text = "[pair.cc:553] Connection closed by peer [127.0.0.1]:4242. This is typically"
    err = compute_verdict(elapsed_s=9, deadline_s=1, error_text=text, abort_reason="epoch 3")
    assert err is not None and err.kind == "error" and err.peer == "127.0.0.1:4242"
    assert text in err.detail
    ep = compute_verdict(elapsed_s=9, deadline_s=1, error_text=None, abort_reason="epoch 3")
    assert ep is not None and ep.kind == "epoch" and ep.detail == "epoch 3"
    dl = compute_verdict(elapsed_s=1.0, deadline_s=1.0, error_text=None, abort_reason=None)
    assert dl is not None and dl.kind == "deadline"
    assert compute_verdict(elapsed_s=0.99, deadline_s=1, error_text=None, abort_reason="") is None


# ---- in-process groups ------------------------------------------------------------------------


def _host_store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
    )


def _build_pair(
    store: dist.Store, epoch: int, config: CollectiveConfig
) -> tuple[EpochGroup, EpochGroup]:
    """Ranks 0 and 1 of one epoch in this process (rank 0 built on a helper thread)."""
    box: dict[str, Any] = {}

    def build_rank0() -> None:
        try:
            box["g"] = EpochGroup.build(store, epoch=epoch, rank=0, world_size=2, config=config)
        except Exception as exc:  # recorded and re-raised below
            box["e"] = exc

    thread = threading.Thread(target=build_rank0, daemon=True)
    thread.start()
    g1 = EpochGroup.build(store, epoch=epoch, rank=1, world_size=2, config=config)
    thread.join(timeout=config.build_timeout_s + 2)
    if "e" in box:
        raise box["e"]
    return box["g"], g1


@pytest.mark.timeout(30)
def test_abort_poisons_refuses_at_once_and_graveyard_keeps_buffer() -> None:
    store = _host_store()
    config = CollectiveConfig(build_timeout_s=5, op_deadline_s=5, pg_timeout_s=20)
    g0, g1 = _build_pair(store, epoch=1, config=config)
    try:
        buf = torch.ones(1 << 16)
        ref = weakref.ref(buf)
        freed_on: list[int] = []
        weakref.finalize(buf, lambda: freed_on.append(threading.get_ident()))
        t0 = time.monotonic()
        with pytest.raises(CollectiveAborted) as info:
            # rank 1 never joins; the epoch watch fires at its first look
            g0.allreduce_sum(buf, should_abort=lambda: "epoch 2 announced")
        assert time.monotonic() - t0 < 1.0
        assert info.value.kind == "epoch" and info.value.epoch == 1
        del info  # its traceback pins the frame that held the buffer
        poison = g0.poisoned
        assert poison is not None and (poison.kind, poison.detail) == ("epoch", "epoch 2 announced")
        del buf
        gc.collect()
        teardown0 = g0.abandon()  # idempotent: the abort already scheduled it
        assert teardown0 is not None
        # gloo's worker thread is still blocked on rank 1 (its group is alive), so the teardown
        # cannot have finished and the buffer it may write into must still be referenced.
        assert teardown0.is_alive() and ref() is not None
        t0 = time.monotonic()
        with pytest.raises(CollectiveAborted) as again:
            g0.allreduce_sum(torch.ones(8), should_abort=lambda: None)
        with pytest.raises(CollectiveAborted):
            g0.broadcast(torch.ones(8), src=0, should_abort=lambda: None)
        # At once: an order of magnitude under the op deadline a live group would wait (not a
        # fixed number of ms, which a loaded or slower CPU can miss).
        assert time.monotonic() - t0 < config.op_deadline_s / 10
        assert again.value.kind == "epoch" and "poisoned" in again.value.detail
    finally:
        teardown1 = g1.abandon()
    # Closing rank 1's connections releases rank 0's blocked worker: both teardowns finish.
    for thread in (teardown0, teardown1):
        assert thread is not None
        thread.join(timeout=15)
        assert not thread.is_alive()
    del again
    gc.collect()
    assert ref() is None
    assert freed_on and freed_on[0] != threading.get_ident()  # never freed on the caller's thread


@pytest.mark.timeout(20)
def test_build_deadline_when_peer_never_shows_up() -> None:
    store = _host_store()
    config = CollectiveConfig(build_timeout_s=0.5, op_deadline_s=1, pg_timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(CollectiveAborted) as info:
        EpochGroup.build(store, epoch=7, rank=0, world_size=2, config=config)
    assert info.value.kind == "deadline"
    assert 0.4 < time.monotonic() - t0 < 3.0


@pytest.mark.timeout(20)
def test_a_build_without_its_own_timeout_is_bounded_and_abandoned_on_a_new_epoch() -> None:
    # NCCL's rendezvous waits on the store with no timeout of its own: _construct bounds it by
    # build_timeout_s, and gives up at once when should_abort names a newer epoch.
    config = CollectiveConfig(build_timeout_s=0.5, op_deadline_s=1, pg_timeout_s=5)
    release = threading.Event()  # the stuck "rendezvous"; set at the end to end its thread

    def stuck() -> Any:
        release.wait(30)
        return object()

    try:
        t0 = time.monotonic()
        with pytest.raises(CollectiveAborted) as info:
            _construct(stuck, config, 3, None, bounded=False)
        assert info.value.kind == "deadline" and 0.4 < time.monotonic() - t0 < 2.0
        calls = iter([None, None, "epoch 4 announced"])
        t0 = time.monotonic()
        with pytest.raises(CollectiveAborted) as info:
            _construct(stuck, config, 3, lambda: next(calls), bounded=False)
        assert info.value.kind == "epoch" and time.monotonic() - t0 < 0.4
        assert "epoch 4 announced" in info.value.detail
        made = _construct(lambda: "group", config, 3, None, bounded=False)
        assert made == "group"
    finally:
        release.set()


class _FailedQuietly:
    """A completed op whose wait() returns although it failed: an NCCL op with torch's NCCL
    error handling off (as for the cross-replica NCCL groups)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True

    def exception(self) -> Exception:
        return RuntimeError("NCCL error: remote process exited or there was a network error")


def test_a_failed_op_whose_wait_returns_is_an_error_on_nccl_groups() -> None:
    config = CollectiveConfig()
    nccl = EpochGroup(pg=None, epoch=3, rank=0, world_size=2, config=config, device="cuda")
    nccl._in_flight = [_FailedQuietly()]
    verdict = nccl._wait_in_flight(lambda: None)
    assert verdict is not None and verdict.kind == "error", verdict
    assert "remote process exited" in verdict.detail
    # gloo reports failures through wait(); its groups do not ask the deprecated exception().
    gloo = EpochGroup(pg=None, epoch=3, rank=0, world_size=2, config=config)
    gloo._in_flight = [_FailedQuietly()]
    assert gloo._wait_in_flight(lambda: None) is None


@pytest.mark.timeout(30)
def test_a_gloo_wait_is_woken_by_the_ops_completion_not_a_short_poll(monkeypatch) -> None:
    """A rank waiting for a slower peer's reduce sleeps until an op completes (its future's
    callback) or the next abort check, instead of looking every 0.5 ms; the sum is exact."""
    import recover.runtime.collective as collective

    store = _host_store()
    config = CollectiveConfig(build_timeout_s=5, op_deadline_s=10, pg_timeout_s=20)
    g0, g1 = _build_pair(store, epoch=1, config=config)
    naps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(collective.time, "sleep", lambda s: (naps.append(s), real_sleep(s)))
    try:
        a, b = torch.full((1 << 12,), 1.0), torch.full((1 << 12,), 2.0)
        checks = []
        late = threading.Thread(
            target=lambda: (real_sleep(0.3), g1.allreduce_sum(b, should_abort=lambda: None))
        )
        late.start()
        g0.allreduce_sum(a, should_abort=lambda: checks.append(1))
        late.join(10)
        assert torch.equal(a, torch.full_like(a, 3.0)) and torch.equal(b, a)
        assert naps == []  # never the short poll: woken by the completion
        # It still asked for an abort at the abort checks' pace while it waited (5 ms).
        assert 10 <= len(checks) <= 0.3 / config.abort_check_interval_s + 20, len(checks)
    finally:
        for g in (g0, g1):
            g.abandon().join(timeout=10)


@pytest.mark.timeout(20)
def test_buffers_must_live_on_the_groups_device() -> None:
    store = _host_store()
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        EpochGroup.build(store, epoch=1, rank=0, world_size=1, device="meta")
    group = EpochGroup.build(store, epoch=2, rank=0, world_size=1)  # gloo, host memory
    assert group.device == torch.device("cpu")
    with pytest.raises(ValueError, match="contiguous tensor on cpu"):
        group.allreduce_sum(torch.ones(4, device="meta"), should_abort=lambda: None)
    x = torch.ones(4)
    group.allreduce_sum(x, should_abort=lambda: None)
    assert torch.equal(x, torch.ones(4))
    group.abandon().join(timeout=10)


@pytest.mark.timeout(20)
def test_group_cache_fences_old_epochs_and_abandons_older_groups() -> None:
    store = _host_store()
    cache = GroupCache(store, config=CollectiveConfig(build_timeout_s=5))
    g3 = cache.get(epoch=3, rank=0, world_size=1)
    assert cache.get(epoch=3, rank=0, world_size=1) is g3
    with pytest.raises(ValueError, match="rank"):
        cache.get(epoch=3, rank=1, world_size=2)
    with pytest.raises(CollectiveAborted) as info:
        cache.get(epoch=2, rank=0, world_size=1)
    assert info.value.kind == "epoch"
    g4 = cache.get(epoch=4, rank=0, world_size=1)
    assert g4 is not g3 and g3.poisoned is not None and g4.poisoned is None
    x = torch.arange(10, dtype=torch.float32)
    g4.allreduce_sum(x, should_abort=lambda: None)  # one rank: the sum is the input
    assert torch.equal(x, torch.arange(10, dtype=torch.float32))
    with pytest.raises(CollectiveAborted):
        g3.allreduce_sum(torch.ones(4), should_abort=lambda: None)
    cache.abandon_all()
    for thread in cache.teardown_threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


# ---- real processes ---------------------------------------------------------------------------


def _ints(rank: int, n: int) -> torch.Tensor:
    """Integer-valued float32 data: sums are exact in any order, so equality is meaningful."""
    return ((torch.arange(n, dtype=torch.int64) * (rank + 3)) % 1009 - 500).to(torch.float32)


def _child(scenario: str, rank: int, port: int, out: Any, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    world = args["world"]
    device = torch.device("cpu")  # gloo groups; on "cuda", NCCL groups, rank k on GPU k
    if args.get("device") == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    if scenario == "sum":
        _child_sum(store, rank, world, out, device)
    elif scenario == "sigkill":
        _child_sigkill(store, rank, world, out, args, device)
    elif scenario == "sigstop":
        _child_sigstop(store, rank, world, out, args)


def _child_sum(store: dist.Store, rank: int, world: int, out: Any, device: torch.device) -> None:
    n = 100_003  # odd, so the last bucket is short
    one, many = (
        EpochGroup.build(
            store, epoch=e, rank=rank, world_size=world, config=CollectiveConfig(bucket_bytes=b),
            device=device,
        )
        for e, b in ((1, 0), (2, 4000))
    )  # fmt: skip
    expected = sum(_ints(r, n) for r in range(world))
    x_one, x_many = _ints(rank, n).to(device), _ints(rank, n).to(device)
    one.allreduce_sum(x_one, should_abort=lambda: None)
    many.allreduce_sum(x_many, should_abort=lambda: None)
    gen = torch.Generator().manual_seed(rank)
    rnd = torch.randn(n, generator=gen).to(device)
    rnd_one, rnd_many = rnd.clone(), rnd.clone()
    one.allreduce_sum(rnd_one, should_abort=lambda: None)
    many.allreduce_sum(rnd_many, should_abort=lambda: None)
    rnd_expected = sum(
        torch.randn(n, generator=torch.Generator().manual_seed(r)).double() for r in range(world)
    )
    payload = _ints(rank, 3 * 1001).view(3, 1001).to(device)
    many.broadcast(payload, src=1, should_abort=lambda: None)
    x_one, x_many, rnd_one, rnd_many, payload = (
        t.cpu() for t in (x_one, x_many, rnd_one, rnd_many, payload)
    )
    out.put(
        {
            "rank": rank,
            "one_exact": torch.equal(x_one, expected),
            "many_exact": torch.equal(x_many, expected),
            "rnd_close": torch.allclose(rnd_one.double(), rnd_expected, atol=1e-5)
            and torch.allclose(rnd_many.double(), rnd_expected, atol=1e-5),
            "broadcast_ok": torch.equal(payload, _ints(1, 3 * 1001).view(3, 1001)),
        }
    )


def _child_sigkill(
    store: dist.Store, rank: int, world: int, out: Any, args: dict[str, Any], device: torch.device
) -> None:
    config = CollectiveConfig(
        build_timeout_s=10, op_deadline_s=10, pg_timeout_s=60, bucket_bytes=4 * 2**20
    )
    cache = GroupCache(store, config=config, device=device)
    old = cache.get(epoch=1, rank=rank, world_size=world)
    snapshot = _ints(rank, args["numel"]).to(device)
    flat = snapshot.clone()  # this attempt's buffer

    def should_abort() -> str | None:
        epoch = store.add("epoch", 0)  # one store round trip, never blocks
        return f"epoch {epoch} announced" if epoch > 1 else None

    def die() -> str | None:  # the victim: first look after issuing its buckets
        store.set("kill_time", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        return None

    try:
        old.allreduce_sum(flat, should_abort=die if rank == args["victim"] else should_abort)
        out.put({"rank": rank, "aborted": False})
        return
    except CollectiveAborted as exc:
        t_raise, kind, detail = time.time(), exc.kind, exc.detail
    t0 = time.monotonic()
    try:
        old.allreduce_sum(snapshot.clone(), should_abort=should_abort)
        refused = False
    except CollectiveAborted:
        refused = True
    refuse_s = time.monotonic() - t0
    store.wait(["live"], datetime.timedelta(seconds=10))  # the coordinator's new view
    live = [int(r) for r in store.get("live").decode().split(",")]
    t0 = time.monotonic()
    new = cache.get(epoch=2, rank=live.index(rank), world_size=len(live))
    rebuild_s = time.monotonic() - t0
    fresh = snapshot.clone()  # redo from the snapshot, never from `flat`
    t0 = time.monotonic()
    new.allreduce_sum(fresh, should_abort=lambda: None)
    redo_s = time.monotonic() - t0
    expected = sum(_ints(r, args["numel"]) for r in live)
    fresh = fresh.cpu()
    teardown = cache.teardown_threads[0]
    teardown.join(timeout=20)
    out.put(
        {
            "rank": rank,
            "aborted": True,
            "kind": kind,
            "detail": detail[:200],
            "t_raise": t_raise,
            "refused": refused,
            "refuse_s": refuse_s,
            "rebuild_s": rebuild_s,
            "redo_s": redo_s,
            "redo_exact": torch.equal(fresh, expected),
            "teardown_done": not teardown.is_alive(),
            "teardown_s": old.teardown_s,
            "old_poisoned": old.poisoned is not None,
        }
    )
    cache.abandon_all()
    for thread in cache.teardown_threads:
        thread.join(timeout=10)


def _child_sigstop(
    store: dist.Store, rank: int, world: int, out: Any, args: dict[str, Any]
) -> None:
    config = CollectiveConfig(build_timeout_s=10, op_deadline_s=args["deadline"], pg_timeout_s=120)
    group = EpochGroup.build(store, epoch=1, rank=rank, world_size=world, config=config)
    if rank == args["victim"]:
        os.kill(os.getpid(), signal.SIGSTOP)  # hangs: holds its sockets open, never joins
        return
    t0 = time.monotonic()
    try:
        group.allreduce_sum(_ints(rank, 1 << 20), should_abort=lambda: None)
        out.put({"rank": rank, "aborted": False})
        return
    except CollectiveAborted as exc:
        elapsed, kind = time.monotonic() - t0, exc.kind
    t1 = time.monotonic()
    try:
        group.allreduce_sum(torch.ones(4), should_abort=lambda: None)
        refused = False
    except CollectiveAborted:
        refused = True
    out.put(
        {
            "rank": rank,
            "aborted": True,
            "kind": kind,
            "elapsed_s": elapsed,
            "refused": refused,
            "refuse_s": time.monotonic() - t1,
        }
    )
    # The teardown was scheduled at the abort; it ends once the hung peer's sockets close.
    teardown = group.abandon()
    assert teardown is not None
    store.wait(["victim_killed"], datetime.timedelta(seconds=15))
    t2 = time.monotonic()
    teardown.join(timeout=15)
    out.put(
        {
            "rank": rank,
            "teardown_done": not teardown.is_alive(),
            "teardown_after_kill_s": time.monotonic() - t2,
        }
    )


def _start(
    scenario: str, store: dist.TCPStore, world: int, args: dict[str, Any]
) -> tuple[list[Any], Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(scenario, r, store.port, out, {"world": world, **args}),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs, out


def _collect(out: Any, count: int, deadline_s: float, procs: list[Any]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    end = time.monotonic() + deadline_s
    while len(results) < count:
        left = end - time.monotonic()
        if left <= 0:
            codes = [p.exitcode for p in procs]
            raise AssertionError(
                f"got {len(results)}/{count} reports in {deadline_s} s; exit codes {codes}"
            )
        try:
            results.append(out.get(timeout=min(left, 0.5)))
        except queue.Empty:
            continue
    return results


def _reap(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL by PID: also ends a SIGSTOPped child
    for p in procs:
        p.join(timeout=10)


def _gpus(n: int):
    """The NCCL variant of a test: n processes, each on its own GPU (NCCL refuses two ranks of
    one communicator on one GPU). Skipped where fewer GPUs are visible."""
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= n
    return pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not enough, reason=f"needs {n} GPUs for NCCL groups"),
        ],
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["cpu", _gpus(3)])
def test_allreduce_exact_sum_bucketing_and_broadcast_three_processes(device: str) -> None:
    assert len(compute_buckets(100_003, 4, 4000)) > 1  # the bucketed group really splits
    store = _host_store()
    procs, out = _start("sum", store, 3, {"device": device})
    try:
        results = _collect(out, 3, 40, procs)
    finally:
        _reap(procs)
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    for r in results:
        assert r["one_exact"] and r["many_exact"], r
        assert r["rnd_close"] and r["broadcast_ok"], r


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["cpu", _gpus(3)])
def test_sigkill_mid_reduce_survivors_abort_fast_and_redo_in_next_epoch(device: str) -> None:
    store = _host_store()
    store.add("epoch", 1)
    victim, world = 1, 3
    args = {"victim": victim, "numel": 4 * 2**20, "device": device}
    procs, out = _start("sigkill", store, world, args)
    try:
        procs[victim].join(timeout=40)
        assert procs[victim].exitcode == -signal.SIGKILL
        # the coordinator's part: announce epoch 2 without the victim (ranks renumbered 0, 1)
        store.set("live", ",".join(str(r) for r in range(world) if r != victim))
        store.add("epoch", 1)
        results = _collect(out, world - 1, 30, procs)
    finally:
        _reap(procs)
    kill_time = float(store.get("kill_time").decode())
    for r in results:
        assert r["aborted"], r
        assert r["kind"] in ("error", "epoch"), r
        detect_s = r["t_raise"] - kill_time
        assert detect_s < 3.0, (detect_s, r)  # not gloo's pg_timeout_s (60 s)
        # refused at once: well under the 10 s op deadline of _child_sigkill's groups
        assert r["refused"] and r["refuse_s"] < 10 / 10 and r["old_poisoned"], r
        assert r["redo_exact"], r
        assert r["rebuild_s"] < 1.0, r
        assert r["teardown_done"] and r["teardown_s"] is not None, r


@pytest.mark.timeout(60)
def test_sigstopped_peer_hits_deadline_not_gloo_timeout() -> None:
    # pg_timeout_s is 120 s: without the deadline polling the survivors would block past this
    # test's timeout.
    store = _host_store()
    victim, world, deadline = 2, 3, 1.0
    procs, out = _start("sigstop", store, world, {"victim": victim, "deadline": deadline})
    try:
        first = _collect(out, world - 1, 40, procs)
        procs[victim].kill()
        procs[victim].join(timeout=10)
        store.set("victim_killed", "1")
        second = _collect(out, world - 1, 30, procs)
    finally:
        _reap(procs)
    for r in first:
        assert r["aborted"] and r["kind"] == "deadline", r
        assert deadline <= r["elapsed_s"] < deadline + 1.5, r
        assert r["refused"] and r["refuse_s"] < deadline / 10, r  # at once, not a deadline
    for r in second:
        assert r["teardown_done"], r
