"""Tests of the live state transfer (src/recover/runtime/transfer.py) over real gloo groups.

Pure parts (the shares of the sources, the state's description); then real processes
(multiprocessing, a TCPStore hosted by the test process, the test playing the coordinator):
two live replicas send a joiner its state, a share from each, bit for bit; a source SIGKILLed or
SIGSTOPped in the middle of its share fails the attempt without hanging anyone, and the transfer
redone in the next epoch from the surviving source gives the joiner the exact state. Every child
is reaped in a finally block.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import CollectiveAborted, CollectiveConfig
from recover.runtime.transfer import _unflatten, compute_shares, describe_state, transfer_state

STORE_TIMEOUT = datetime.timedelta(seconds=15)


# ---- pure parts -------------------------------------------------------------------------------


@pytest.mark.unit
@given(sizes=st.lists(st.integers(0, 300), max_size=12), servers=st.integers(1, 5))
def test_shares_cover_every_byte_once_and_differ_by_at_most_one(sizes, servers) -> None:
    shares = compute_shares(sizes, servers)
    assert len(shares) == servers
    covered = [(p, i) for share in shares for p, a, b in share for i in range(a, b)]
    assert covered == [(p, i) for p, n in enumerate(sizes) for i in range(n)]  # once, in order
    amounts = [sum(b - a for _, a, b in share) for share in shares]
    assert max(amounts) - min(amounts) <= 1
    assert all(a < b for share in shares for _, a, b in share)  # no empty piece


@pytest.mark.unit
def test_a_tensor_held_twice_is_described_once_and_comes_back_shared() -> None:
    class Tied:
        def __init__(self) -> None:
            self.w = torch.arange(12, dtype=torch.float32).view(3, 4)
            self.t = torch.arange(6, dtype=torch.int64).view(2, 3).t()  # not contiguous

        def transfer_state_dict(self) -> dict:
            return {"a": self.w, "b": self.w, "t": self.t, "lr": 0.5, "rows": (self.w[1],)}

    header, parts = describe_state(Tied(), torch.device("cpu"))
    assert len(parts) == 3  # w once, t, and the row (another view: sent on its own)
    state = _unflatten(json.loads(header)["structure"], parts)
    assert state["a"] is not state["b"] and state["a"].data_ptr() == state["b"].data_ptr()
    assert torch.equal(state["a"], Tied().w) and torch.equal(state["t"], Tied().t)
    assert state["lr"] == 0.5 and torch.equal(state["rows"][0], Tied().w[1])


# ---- real processes ---------------------------------------------------------------------------

# Ranks: the joiner is the middle one, so the sources (0 and 2) are not the first ranks in a row;
# the victim is the second source.
JOINER, VICTIM = 1, 2


class _Work:
    """A model with tied weights, AdamW moments, a bf16 buffer and a non-contiguous int64 buffer
    (about 8 MB of state); `seed` decides every value, `stepped` whether the optimizer holds
    state yet."""

    def __init__(self, seed: int, *, stepped: bool) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Embedding(256, 512), torch.nn.Linear(512, 1024))
        self.head = torch.nn.Linear(512, 256, bias=False)
        self.head.weight = self.model[0].weight  # tied: one tensor, two names in the state dict
        self.model.register_buffer("low", torch.randn(64, 3).to(torch.bfloat16))
        self.model.register_buffer("index", torch.randperm(12).view(3, 4).t())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        if stepped:
            for p in self.model.parameters():
                p.grad = torch.randn_like(p)
            self.optimizer.step()
        self.loads = 0

    def transfer_state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_transfer_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loads += 1

    def scramble(self) -> None:
        """Change every parameter and moment (a joiner's state before the next transfer)."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(-1.5)
            for moments in self.optimizer.state.values():
                moments["exp_avg"].add_(1.0)

    def digest(self) -> str:
        """Every byte and every other value of the state (its description, hashed)."""
        header, parts = describe_state(self, torch.device("cpu"))
        h = hashlib.sha256(header)
        for part in parts:
            h.update(part.numpy().tobytes())
        return h.hexdigest()


def _child(rank: int, port: int, out: Any, fault: str) -> None:
    """Epoch 1: both sources serve; epoch 2: the second source's state differs (another learning
    rate) and only the lead serves; epoch 3: the second source dies or hangs halfway through its
    share; epoch 4 (announced by the test): the survivors redo the transfer."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    work = _Work(seed=rank + 7 if rank == JOINER else 0, stepped=rank != JOINER)
    config = CollectiveConfig(build_timeout_s=10, op_deadline_s=2.0, pg_timeout_s=60)

    def report(epoch: int, stats=None, **more) -> None:
        if stats is not None:
            more |= {"sources": list(stats.sources), "sent": stats.sent, "bytes": stats.bytes}
        out.put({"rank": rank, "epoch": epoch, "loads": work.loads, **more})

    def transfer(epoch: int, members: list[int], should_abort) -> None:
        group = EpochGroup.build(
            store, epoch=epoch, rank=members.index(rank), world_size=len(members), config=config
        )
        if epoch == 3 and rank == VICTIM:
            send_recv = group.send_recv

            def fail_halfway(sends, recvs, *, should_abort) -> None:
                # Send the first half of this source's share, then die (or hang) for real: the
                # joiner has posted every receive, and the rest of this share never comes.
                assert sends and not recvs
                send_recv(sends[: len(sends) // 2], [], should_abort=should_abort)
                store.set("victim_time", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

            group.send_recv = fail_halfway
        before = work.digest()
        t0 = time.monotonic()
        try:
            stats = transfer_state(
                group, work, members=members, joined=[JOINER], me=rank, should_abort=should_abort
            )
        except CollectiveAborted as exc:
            report(epoch, aborted=exc.kind, after_s=time.monotonic() - t0, t=time.time())
        else:
            payload = sum(p.numel() for p in describe_state(work, torch.device("cpu"))[1])
            report(epoch, stats, before=before, after=work.digest(), payload=payload)
        group.abandon()

    def never() -> None:
        return None

    def announced() -> str | None:  # the coordinator's word: one store round trip
        epoch = store.add("epoch", 0)
        return f"epoch {epoch} announced" if epoch > 3 else None

    transfer(1, [0, 1, 2], never)
    if rank == JOINER:
        work.scramble()
    if rank == VICTIM:
        work.optimizer.param_groups[0]["lr"] = 5e-3
    transfer(2, [0, 1, 2], never)
    if rank == JOINER:
        work.scramble()
    if rank == VICTIM:
        work.optimizer.param_groups[0]["lr"] = 1e-3
    transfer(3, [0, 1, 2], announced)
    store.wait(["live"], datetime.timedelta(seconds=30))
    transfer(4, [int(r) for r in store.get("live").decode().split(",")], never)


def _host_store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
    )


def _collect_until(out: Any, reports: list, done, procs: list, deadline_s: float = 60) -> None:
    """Read reports until `done()`; fail at once when a child other than the victim died."""
    end = time.monotonic() + deadline_s
    while not done():
        codes = [p.exitcode for p in procs]
        crashed = any(c not in (None, 0) for i, c in enumerate(codes) if i != VICTIM)
        if crashed or time.monotonic() > end:
            raise AssertionError(f"reports so far {reports}; exit codes {codes}")
        try:
            reports.append(out.get(timeout=0.5))
        except queue.Empty:
            continue


def _report(reports: list[dict[str, Any]], rank: int, epoch: int) -> dict[str, Any] | None:
    return next((r for r in reports if r["rank"] == rank and r["epoch"] == epoch), None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_two_sources_send_a_share_each_bit_for_bit_and_one_that_fails_mid_share_is_redone(
    fault: str,
) -> None:
    store = _host_store()
    store.add("epoch", 3)
    # A fork server that imported torch once (it ends with this process): three children
    # importing it at once on two loaded cores took most of a minute to start, and building an
    # optimizer imports torch._dynamo (6 s at load 8).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", __name__])
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, store.port, out, fault), daemon=True) for r in range(3)
    ]
    reports: list[dict[str, Any]] = []
    try:
        for p in procs:
            p.start()
        # The joiner gives up on its own in epoch 3: on the closed connection of a killed
        # source, at the op deadline (2 s) for a stopped one; nobody announced a new epoch yet.
        _collect_until(out, reports, lambda: _report(reports, JOINER, 3), procs)
        # The coordinator's part: announce epoch 4 without the victim, then end it for good.
        store.set("live", f"0,{JOINER}")
        store.add("epoch", 1)
        procs[VICTIM].kill()  # (SIGKILL by PID; already dead after a kill)
        procs[VICTIM].join(timeout=10)
        assert procs[VICTIM].exitcode == -signal.SIGKILL
        done = lambda: _report(reports, 0, 4) and _report(reports, JOINER, 4)  # noqa: E731
        _collect_until(out, reports, done, procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL by PID: also ends a SIGSTOPped child
        for p in procs:
            p.join(timeout=10)

    # Epoch 1: both live replicas served, half of the tensors' bytes each (the tied weights
    # once), the joiner nothing; it holds the sources' state bit for bit.
    lead, joiner, other = (_report(reports, r, 1) for r in (0, JOINER, VICTIM))
    assert lead["before"] == other["before"] != joiner["before"]
    assert joiner["after"] == lead["before"] and joiner["loads"] == 1
    assert lead["sources"] == joiner["sources"] == other["sources"] == [0, VICTIM]
    sent = [lead["sent"], other["sent"]]
    assert sum(sent) == joiner["payload"] and abs(sent[0] - sent[1]) <= 1, (sent, joiner)
    assert joiner["sent"] == 0
    # Epoch 2: the second source's state differs from the lead's; the lead alone serves.
    joiner, other = _report(reports, JOINER, 2), _report(reports, VICTIM, 2)
    assert joiner["before"] != lead["before"]  # scrambled since epoch 1
    assert joiner["sources"] == [0] and other["sent"] == 0
    assert joiner["after"] == lead["before"] and joiner["loads"] == 2
    # Epoch 3: the victim sent half its share and died (or hung): the joiner loaded nothing.
    failed = _report(reports, JOINER, 3)
    assert "aborted" in failed and failed["loads"] == 2, failed
    assert _report(reports, VICTIM, 3) is None  # it never finished its share
    victim_time = float(store.get("victim_time").decode())
    if fault == "kill":
        assert failed["aborted"] == "error", failed
        assert failed["t"] - victim_time < 5.0, failed  # the close, not a deadline or timeout
    else:
        assert failed["aborted"] == "deadline" and 2.0 <= failed["after_s"] < 6.0, failed
    # Epoch 4: the redo from the surviving source gives the joiner the exact state.
    redo = _report(reports, JOINER, 4)
    assert redo["before"] != lead["before"] and redo["sources"] == [0]
    assert redo["after"] == lead["before"] and redo["loads"] == 3


def test_a_scripts_joiner_adopts_the_optimizer_state_without_a_step():
    """recover.Replica's Work (a script's own model and optimizer): a fresh joiner loads a live
    replica's transfer through the transfer's byte form without any optimizer step (the DCP
    helper took a zero step over every parameter first), and both then step to the same bits."""
    from recover.runtime.script_work import ScriptWork

    def replica_of(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
        return model, optimizer, ScriptWork(model, optimizer, {}, None, None)

    def step(model, optimizer):
        model(torch.ones(3, 8)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    live_model, live_opt, live = replica_of(0)
    step(live_model, live_opt)
    model, opt, joiner = replica_of(1)  # different weights: all must come with the state
    header, parts = describe_state(live, torch.device("cpu"))
    steps = []
    opt.register_step_pre_hook(lambda *args: steps.append(1))
    joiner.load_transfer_state(
        _unflatten(json.loads(header)["structure"], [p.clone() for p in parts])
    )
    assert steps == []
    step(live_model, live_opt)
    step(model, opt)
    assert all(
        torch.equal(a, b) for a, b in zip(live_model.parameters(), model.parameters(), strict=True)
    )
