"""Inside a replica of several ranks: its own process group, its watchdog, its link to the
coordinator.

Job: make S processes act as one replica. The replica's ranks form their own gloo group (the
intra-replica group; torchrun, or the local launcher acting like it, gives each rank RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT), over which FSDP2 shards the model. The coordinator sees
the replica only: rank 0 (the leader) is its member. The other ranks (followers) act on what the
leader relays:

- at registration and after every step outcome the leader broadcasts the view (the plan and the
  epoch every rank of the replica then uses), so the ranks can never work on different plans;
- at the end of every attempt the ranks agree (all-gather) before anything is reported: the
  replica reports done only when every rank's cross-replica reduce succeeded (a commit needs every
  rank of every live replica); otherwise it reports the failure and every rank treats its reduce
  as failed (restore from the snapshot, redo);
- a stop (evicted, quorum lost, refused) is relayed too, so every rank leaves the same way.

Followers also watch the coordinator's view themselves (a read-only long poll, no membership) so
that their in-flight cross-replica collective aborts on a new epoch as fast as the leader's.

Fault isolation (the watchdog): every rank ticks a counter in the intra-replica store every
`interval`; a rank that sees a replica-mate's counter stand still for `deadline_s` (killed, hung,
or its host gone), or the store unreachable, writes an event, dumps its threads' stacks to stderr
and exits at once with status 7. The
leader's exit closes its coordinator session, so the coordinator declares the whole replica dead
within milliseconds of that; the other replicas recover as for a single-rank replica. A rank that
finishes marks itself done first, so a clean end is not mistaken for a death.

Costs per step: one small all-gather and one small broadcast inside the replica.

Size: the replica's own group, its watchdog and the relay of the coordinator's view to every rank
are one protocol among a replica's ranks; split, that protocol would be read in three places.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recover import exits
from recover.coordinator.client import (
    Channel,
    CoordinatorClient,
    CoordinatorUnreachable,
    Evicted,
    Leader,
    Outcome,
    PendingReport,
    QuorumLost,
    RequestRefused,
    StepCommitted,
    StepRedo,
    Stopped,
)
from recover.coordinator.protocol import View
from recover.runtime.env import RankEnv
from recover.runtime.layout import ReplicaLayout
from recover.runtime.stall import dump_stacks

_KEY = "recover/alive/"
# What gloo says when the other end of a connection is gone (measured: a SIGKILLed peer gives the
# first within milliseconds; see docs/design.md's measured facts).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")

log = logging.getLogger(__name__)


def replica_hash(hashes: list[str]) -> str:
    """One parameter fingerprint for a replica, from its ranks' fingerprints in rank order."""
    if len(hashes) == 1:
        return hashes[0]
    return hashlib.sha256("".join(hashes).encode()).hexdigest()[:16]


class IntraReplica:
    """The ranks of one replica: their group, their mesh, their watchdog."""

    def __init__(
        self,
        *,
        replica_id: int,
        layout: ReplicaLayout,
        ranks: RankEnv | None,
        timeout_s: float,
        watchdog_s: float,
        device: str = "cpu",
        emit: Callable[..., None] | None = None,
    ) -> None:
        size, flags = layout.ranks, layout.describe()
        if ranks is None:
            raise RuntimeError(
                f"{flags} needs one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and "
                f"MASTER_PORT set: start it under torchrun --nproc-per-node {size}, or with "
                "recover train / recover run"
            )
        rank, world = ranks.rank, ranks.world_size
        if world != size:
            raise RuntimeError(f"{flags} but WORLD_SIZE is {world}: one process per rank")
        self.replica_id, self.rank, self.size = replica_id, rank, size
        self.layout = layout
        self.deadline_s = watchdog_s
        self.emit = emit or (lambda name, **fields: None)
        # On GPUs: NCCL for the model's collectives, gloo for host tensors (the relay, the loss).
        cuda = device.startswith("cuda")
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo",
            init_method=f"tcp://{ranks.master_addr}:{ranks.master_port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.group = dist.group.WORLD
        self.mesh = init_device_mesh(
            "cuda" if cuda else "cpu",
            tuple(layout.dims.values()),
            mesh_dim_names=tuple(layout.dims),
        )
        # The watchdog's own store client (a blocked main-thread call never delays it).
        # (torch.distributed re-exports TCPStore implicitly: unseen by mypy --strict only)
        self._store = dist.TCPStore(  # type: ignore[attr-defined, unused-ignore]
            ranks.master_addr,
            ranks.master_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=max(1.0, watchdog_s / 2)),
        )
        self._stop = threading.Event()
        self._store.set(f"{_KEY}{rank}", "0")
        dist.barrier(group=self.group)  # every counter exists before anyone watches
        self._thread = threading.Thread(target=self._watch, name="replica-watchdog", daemon=True)
        self._thread.start()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def coordinate(self, dim: str) -> int:
        """This rank's index along mesh dimension `dim` (0 when the layout lacks it)."""
        return self.mesh.get_local_rank(dim) if dim in self.layout.dims else 0

    def submesh(self, dim: str) -> DeviceMesh:
        return self.mesh[dim] if len(self.layout.dims) > 1 else self.mesh

    # ---- collectives of the replica's control flow ---------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def relay(self, obj: Any = None) -> Any:
        """The leader's `obj`, on every rank."""
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    # ---- the watchdog --------------------------------------------------------------------------
    def _watch(self) -> None:
        interval = self.deadline_s / 5
        mates = [k for k in range(self.size) if k != self.rank]
        keys = [f"{_KEY}{k}" for k in mates]
        seen: dict[int, tuple[str | None, float]] = {k: (None, time.monotonic()) for k in mates}
        tick = 0
        while not self._stop.wait(interval):
            tick += 1
            try:
                self._store.set(f"{_KEY}{self.rank}", str(tick))
                values = self._store.multi_get(keys)
            except Exception as e:  # the store's host (the leader, or torchrun's agent) is gone
                if not self._stop.is_set():
                    self._lost(None, f"the replica's store is unreachable ({e})"[:300])
                return
            now = time.monotonic()
            for k, raw in zip(mates, values, strict=True):
                value = raw.decode()
                if value == "done":
                    continue
                last, since = seen[k]
                if value != last:
                    seen[k] = (value, now)
                elif now - since > self.deadline_s and not self._stop.is_set():
                    silent = f"rank {k} silent for {now - since:.2f} s"
                    self._lost(k, f"{silent} (deadline {self.deadline_s:g} s)")
                    return

    def _lost(self, mate: int | None, why: str) -> None:
        self.emit(
            "replica_mate_lost", replica=self.replica_id, rank=self.rank, mate=mate, reason=why
        )
        log.error(f"replica {self.replica_id} rank {self.rank}: {why}; stopping this replica")
        dump_stacks(f"replica {self.replica_id} rank {self.rank}")
        os._exit(exits.MATE_LOST)

    def finish(self) -> None:
        """A clean end: mark this rank done, wait for the others, stop watching."""
        self._store.set(f"{_KEY}{self.rank}", "done")
        dist.barrier(group=self.group)
        self._stop.set()
        self._thread.join(timeout=self.deadline_s)

    def on_error(self, error: BaseException) -> None:
        """The main thread failed. A collective inside the replica whose peer connection dropped
        means a mate died: stop now. Otherwise give the watchdog its deadline to find a lost mate
        (it then ends the process); return if none is lost (the error is then the caller's).
        The error's causes count too: a pipeline schedule re-raises a failed collective as an
        error of its own."""
        seen: list[BaseException] = []
        cause: BaseException | None = error
        while cause is not None and cause not in seen and len(seen) < 8:
            seen.append(cause)
            text = str(cause)
            if any(s in text for s in _PEER_GONE):
                first = text.splitlines()[0].split(". This is typically")[0]  # gloo's advice: cut
                self._lost(None, f"a collective inside the replica lost a peer: {first}"[:300])
            cause = cause.__cause__ or cause.__context__
        end = time.monotonic() + 2 * self.deadline_s
        while time.monotonic() < end and self._thread.is_alive():
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()


# ---------------------------------------------------------------- links to the coordinator


class SoloVote:
    """A replica of one rank's done report, sent; its answer read when asked (the step
    machine's `PendingVote`, over the client's `PendingReport`: no helper thread)."""

    def __init__(self, pending: PendingReport) -> None:
        self._pending = pending

    def wait_taken(self) -> None:
        self._pending.wait_taken()

    def may_commit(self) -> bool:
        return self._pending.may_commit()

    def result(self) -> tuple[bool, Outcome]:
        return True, self._pending.outcome()


class Answered:
    """A vote whose answer came at once (a `PendingVote` over a blocking report)."""

    def __init__(self, agreed: bool, outcome: Outcome) -> None:
        self._result = (agreed, outcome)

    def wait_taken(self) -> None:
        return None

    def may_commit(self) -> bool:
        return isinstance(self._result[1], StepCommitted)

    def result(self) -> tuple[bool, Outcome]:
        return self._result


class SoloLink:
    """A replica of one rank: the coordinator client itself (no relay, no agreement)."""

    rank = 0  # this process's rank in its replica

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client

    def gather(self, obj: Any) -> list[Any]:
        """`obj` of every rank of the replica, in rank order: this one's only."""
        return [obj]

    def register(self, *, fingerprint: dict[str, Any], next_step: int, deadline_s: float) -> View:
        return self.client.register(
            fingerprint=fingerprint, next_step=next_step, deadline_s=deadline_s
        )

    @property
    def store_address(self) -> tuple[str, int] | None:
        return self.client.store_address

    @property
    def evicted(self) -> bool:
        return self.client.evicted

    @property
    def coordinator_lost(self) -> str | None:
        return self.client.lost

    def live_view(self) -> View | None:
        return self.client.view

    def step_view(self) -> View | None:
        return self.client.view

    def report(
        self, *, step: int, epoch: int, failure: str | None, param_hash: str | None,
        throughput: float | None, leaving: bool = False, finite: bool = True, unreachable: dict[int, str] | None = None,
        deadline_s: float, on_taken: Callable[[], None] = lambda: None,
    ) -> tuple[bool, Outcome]:  # fmt: skip
        if failure is None:
            return True, self.client.report_done(
                step=step, epoch=epoch, param_hash=param_hash, throughput=throughput,
                leaving=leaving, finite=finite, deadline_s=deadline_s, on_taken=on_taken,
            )  # fmt: skip
        return False, self.client.report_failed(
            step=step, epoch=epoch, reason=failure, unreachable=unreachable, deadline_s=deadline_s
        )

    def start_done(
        self, *, step: int, epoch: int, param_hash: str | None, throughput: float | None,
        leaving: bool = False, finite: bool = True, deadline_s: float,
        on_taken: Callable[[], None] = lambda: None,
    ) -> SoloVote:  # fmt: skip
        """The done report sent, its answer read when the vote's `result()` is asked for."""
        return SoloVote(
            self.client.start_report_done(
                step=step, epoch=epoch, param_hash=param_hash, throughput=throughput,
                leaving=leaving, finite=finite, deadline_s=deadline_s, on_taken=on_taken,
            )
        )  # fmt: skip

    def agree(self, ok: bool) -> bool:
        return ok

    def leave(self, *, step: int) -> None:
        self.client.leave(step=step)

    def close(self) -> None:
        self.client.close()


_RAISES = {"evicted": Evicted, "quorum_lost": QuorumLost, "unreachable": CoordinatorUnreachable}


def _describe_error(e: BaseException) -> tuple[str, str, str]:
    if isinstance(e, RequestRefused):
        return ("refused", e.code, str(e))
    for kind, cls in _RAISES.items():
        if isinstance(e, cls):
            return (kind, "", str(e))
    return ("error", type(e).__name__, str(e))


def _raise_relayed(kind: str, code: str, why: str) -> None:
    if kind == "refused":
        raise RequestRefused(code, why)
    if kind in _RAISES:
        raise _RAISES[kind](why)
    raise RuntimeError(f"the replica's leader stopped: {code}: {why}")


class ReplicaLink:
    """Rank k of a replica of several ranks (see the module docstring). Rank 0 holds the
    coordinator membership; the others follow it and watch the view read-only."""

    def __init__(
        self,
        intra: IntraReplica,
        *,
        client: CoordinatorClient | None = None,
        host: str = "",
        port: int = 0,
        token: str | None = None,
        standbys: tuple[tuple[str, int], ...] = (),
    ) -> None:
        self.intra = intra
        self.client = client if intra.leader else None
        self._view: View | None = None
        self._store_address: tuple[str, int] | None = None
        self._watcher = None if intra.leader else _ViewWatcher(host, port, token, standbys)

    # ---- what every rank sees --------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.intra.rank

    def gather(self, obj: Any) -> list[Any]:
        return self.intra.gather(obj)

    @property
    def store_address(self) -> tuple[str, int] | None:
        return self._store_address

    @property
    def evicted(self) -> bool:
        return self.client.evicted if self.client is not None else False

    @property
    def coordinator_lost(self) -> str | None:
        """Why no coordinator answered for the grace (rank 0, which holds the membership); the
        other ranks follow rank 0's stop through the relay."""
        return self.client.lost if self.client is not None else None

    def live_view(self) -> View | None:
        """The newest view known on this rank (to abort collectives early); plans come from
        step_view() and outcomes, which are the same on every rank of the replica."""
        if self.client is not None:
            return self.client.view
        watcher = self._watcher  # (every rank but the first has one)
        return (watcher.latest() if watcher is not None else None) or self._view

    def step_view(self) -> View | None:
        return self._view

    # ---- the relayed calls -------------------------------------------------------------------
    def register(self, *, fingerprint: dict[str, Any], next_step: int, deadline_s: float) -> View:
        msg = None
        if self.client is not None:
            try:
                view = self.client.register(
                    fingerprint=fingerprint, next_step=next_step, deadline_s=deadline_s
                )
            except BaseException as e:
                self.intra.relay(("raise", *_describe_error(e)))
                raise
            msg = ("view", view.to_dict(), list(self.client.store_address or ()))
        return self._absorb(self.intra.relay(msg), store=True)

    def report(
        self, *, step: int, epoch: int, failure: str | None, param_hash: str | None,
        throughput: float | None, leaving: bool = False, finite: bool = True, unreachable: dict[int, str] | None = None,
        deadline_s: float, on_taken: Callable[[], None] = lambda: None,
    ) -> tuple[bool, Outcome]:  # fmt: skip
        """Agree inside the replica, then (leader) report for all of it and wait for the
        outcome, which every rank gets: (True if every rank's part succeeded, the outcome).
        `on_taken` runs when the replica's done report is on record: on the leader when the
        coordinator took it, on the others once they agreed. `leaving` is the same on every
        rank (agreed at the last step boundary); the replica's part is finite when every
        rank's is."""
        rows = self.intra.gather((failure, param_hash, finite, unreachable or {}))
        failures = [f"rank {k}: {f}" for k, (f, _, _, _) in enumerate(rows) if f is not None]
        named = {r: why for *_, u in rows for r, why in u.items()}  # any rank's verdict
        msg: tuple[Any, ...] | None = None
        if self.client is not None:
            try:
                if not failures:
                    hashes = [h for _, h, _, _ in rows]
                    out = self.client.report_done(
                        step=step,
                        epoch=epoch,
                        param_hash=None if None in hashes else replica_hash(hashes),
                        throughput=throughput,
                        leaving=leaving,
                        finite=all(ok for _, _, ok, _ in rows),
                        deadline_s=deadline_s,
                        on_taken=on_taken,
                    )
                else:
                    reason = "; ".join(failures)[:200]
                    out = self.client.report_failed(
                        step=step, epoch=epoch, reason=reason, unreachable=named,
                        deadline_s=deadline_s,
                    )  # fmt: skip
            except BaseException as e:
                self.intra.relay(("raise", *_describe_error(e)))
                raise
            # With the store's address: a standby that took over hosts a new one (every rank
            # builds the next epoch's group there).
            store = list(self.client.store_address or ())
            now = self.client.view
            if now is None:  # (a report comes after the registration, which set it)
                raise RuntimeError("a step report before this replica registered")
            if isinstance(out, StepCommitted):
                msg = ("committed", out.step, now.to_dict(), store)
            elif isinstance(out, StepRedo):
                msg = ("redo", out.step, out.view.to_dict(), store)
            else:
                msg = ("stopped", out.status, out.reason, now.to_dict(), store)
        elif not failures:
            on_taken()
        msg = self.intra.relay(msg)
        view = self._absorb(msg, store=True)
        kind = msg[0]
        if kind == "committed":
            return not failures, StepCommitted(msg[1])
        if kind == "redo":
            return not failures, StepRedo(msg[1], view)
        return not failures, Stopped(msg[1], msg[2])

    def start_done(
        self, *, step: int, epoch: int, param_hash: str | None, throughput: float | None,
        leaving: bool = False, finite: bool = True, deadline_s: float,
        on_taken: Callable[[], None] = lambda: None,
    ) -> Answered:  # fmt: skip
        """The done report, answered at once: the ranks agree and relay inside the replica,
        collectives that no other work may overlap (so an update waits for the outcome here)."""
        return Answered(
            *self.report(
                step=step, epoch=epoch, failure=None, param_hash=param_hash,
                throughput=throughput, leaving=leaving, finite=finite, deadline_s=deadline_s,
                on_taken=on_taken,
            )
        )  # fmt: skip

    def agree(self, ok: bool) -> bool:
        """True when `ok` holds on every rank of the replica."""
        return all(self.intra.gather(bool(ok)))

    def leave(self, *, step: int) -> None:
        self.intra.finish()
        if self.client is not None:
            self.client.leave(step=step)

    def close(self) -> None:
        self.intra.close()
        if self.client is not None:
            self.client.close()
        if self._watcher is not None:
            self._watcher.close()

    def _absorb(self, msg: tuple[Any, ...], *, store: bool = False) -> View:
        if msg[0] == "raise":
            _raise_relayed(*msg[1:])
        self._view = View.from_dict(msg[-2] if store else msg[-1])
        if store and msg[-1]:
            self._store_address = tuple(msg[-1])
        return self._view


class _ViewWatcher:
    """A read-only long poll of the coordinator's view (no membership, no effect on it)."""

    def __init__(
        self, host: str, port: int, token: str | None, standbys: tuple[tuple[str, int], ...] = ()
    ) -> None:
        # every coordinator's address: after a takeover it follows the new leader
        self._channel = Channel(host, port, 5.0, Leader([(host, port), *standbys]))
        self._token = token
        self._view: View | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="view-watcher", daemon=True)
        self._thread.start()

    def latest(self) -> View | None:
        return self._view

    def _loop(self) -> None:
        while not self._stop.is_set():
            epoch = self._view.epoch if self._view is not None else -1
            req: dict[str, Any] = {
                "kind": "wait_view",
                "newer_than_epoch": epoch,
                "deadline_s": 1.0,
            }
            if self._token is not None:
                req["token"] = self._token
            try:
                reply = self._channel.call(req, 1.0)
            except Exception:
                if self._stop.wait(0.2):
                    return
                continue
            if reply.get("view") is not None:
                self._view = View.from_dict(reply["view"])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3.0)
        self._channel.close()
