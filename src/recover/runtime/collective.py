"""Fault-tolerant cross-replica collective: one group per epoch, async ops, deadlines, abandon.

Job: sum (or broadcast) a flat buffer across the live replicas of one epoch without ever hanging
and without ever handing back a partially reduced buffer as if it were whole (docs/design.md,
invariants 3 "no corruption" and 5 "bounded waits"). Its configuration, the abort it raises and
the pure rules it decides by are in recover.runtime.collective_config; the rendezvous of a group
in recover.runtime.group_build; the cache of this rank's newest group in
recover.runtime.group_cache.

How:

* ``EpochGroup.build`` rendezvouses the ranks of one epoch on the epoch's own prefix of the
  coordinator's store (recover.runtime.group_build): a gloo group for host buffers (the default)
  or an NCCL group for buffers on a GPU, bounded by ``build_timeout_s``. An NCCL group is torn
  down with ``abort()`` (ncclCommAbort), which also ends its in-flight kernels.
* ``allreduce_sum`` / ``broadcast`` split the buffer into buckets of ``bucket_bytes``, issue them
  back to back as async gloo ops (each returns a ``Work``), then poll: ``Work.is_completed()``
  every ``poll_interval_s`` (longer as the op ages), the caller's ``should_abort()`` every
  ``abort_check_interval_s`` (it returns a reason when the coordinator announced a newer epoch),
  and the clock against
  ``op_deadline_s``. A failed ``Work`` is seen without blocking: in torch 2.13 it reports
  ``is_completed() == True`` and its ``wait()`` then raises the transport error at once
  (``is_success()`` / ``exception()`` exist but are deprecated, so they are not used).
* The first error, abort or deadline *poisons* the group: the in-flight ``Work`` objects and the
  buffer go to the group's graveyard (kept referenced, never waited on again: gloo's worker threads
  may still write into the buffer until they time out), every later op raises at once, and the
  teardown is scheduled on a daemon thread (``abandon``). Destroying a gloo group whose op is still
  blocked joins its worker threads, which can take until ``pg_timeout_s``; on that thread it costs
  the trainer nothing (the destructor releases the GIL). Tearing a group down also closes its
  connections, which wakes peers that were still blocked in the same op.

Why the polling matters (measured, torch 2.13 CPU gloo): when a rank is SIGKILLed mid-reduce its
ring neighbours get "Connection closed by peer" within milliseconds, but a rank that is not its
neighbour stays blocked until the neighbours tear their group down or gloo's own timeout fires;
a stopped (SIGSTOP) peer produces no error at all. So detection comes from three sources: errors,
the epoch watch and the deadline.

Invariants: the caller's buffer is either completely reduced (the call returned) or must be
discarded (the call raised ``CollectiveAborted``); a group is used for exactly one epoch and never
rebuilt under the same prefix; no method of this module blocks the caller longer than
``build_timeout_s`` (build) or ``op_deadline_s`` plus one poll (ops).

What it must not do: wait again on an op of a poisoned group, let the caller read a buffer after
a raise, or tear a group down on the caller's thread.

Costs and limits: polling costs one ``is_completed`` per in-flight bucket per poll (microseconds).
A gloo wait sleeps until an op completes (each op's future sets an event) or the next abort
check; where an op has no such future (NCCL's completes once queued; ``send_recv``'s waits), the
poll interval grows with the op's age from ``poll_interval_s`` to ``poll_interval_max_s``.
``should_abort`` must be cheap (a flag or one store round trip). The peer named in
an ``error`` abort is the socket address gloo printed, not a rank. gloo has no shrink for this, so
every membership change costs a fresh rendezvous (milliseconds on loopback). NCCL groups are
built fresh per epoch too (docs/running.md, "Replicas of several ranks"); their path has not run on GPUs.

Size: over 400 lines because ``EpochGroup`` is one object: its ops share one
issue-poll-poison path (``_run_issued``, ``_wait_in_flight``, ``abandon``), and the rules of
that path (what poisons a group, what goes to the graveyard, when the teardown runs) can be
checked only where the ops, the path and the teardown are read together. ``_PeerWaits`` is
``send_recv``'s in-flight op on that same path.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from recover.checks import is_int
from recover.runtime.collective_config import (
    CollectiveAborted,
    CollectiveConfig,
    ShouldAbort,
    _as_device,
    compute_buckets,
    compute_verdict,
)
from recover.runtime.group_build import (
    _STORE_PREFIX,
    _construct,
    _gloo,
    _nccl,
    _reach_probe,
)
from recover.runtime.reach import KEY as _REACH_KEY
from recover.runtime.reach import ReachListener

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

logger = logging.getLogger(__name__)

# torch 2.13 does not export the all-gather's options from torch.distributed.
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions


def _teardown(epoch: int, holder: list[Any], on_done: Callable[[float], None]) -> None:
    """Runs on a daemon thread: drop the group and its dead ops here, never on the trainer's thread.

    ``holder`` is ``[(pg, graveyard)]``; it is emptied here so that this frame holds the only
    references and the destructors run at the points chosen below.
    """
    started = time.monotonic()
    pg, graveyard = holder.pop()
    try:
        pg.abort()
    except Exception as exc:  # gloo may refuse abort; the destructor below still runs
        logger.debug("epoch %d: gloo abort failed: %r", epoch, exc)
    try:
        # Work objects first, then the group (its destructor joins gloo's worker threads, which
        # may be blocked until pg_timeout_s), then the buffers those threads may still write into.
        graveyard[:] = [item for item in graveyard if not isinstance(item, dist.Work)]
        del pg
        graveyard.clear()
    except Exception as exc:  # a teardown error must never reach the trainer
        logger.debug("epoch %d: teardown error: %r", epoch, exc)
    seconds = time.monotonic() - started
    logger.debug("epoch %d: group torn down in %.3f s", epoch, seconds)
    on_done(seconds)


class _PeerWaits:
    """The send and receive ops of one ``send_recv`` call, as one in-flight op for the polling.

    gloo reports a send's or a receive's completion only from its ``wait()`` (``is_completed()``
    stays False until then), and a ``wait`` whose timeout expires fails every pair of the group's
    context, so it cannot be used to poll. So a daemon thread per peer waits for that peer's ops
    in order (``wait`` releases the GIL), and this object reads their outcome: complete when
    every thread finished or one failed (a dead peer is then seen at once, not after the live
    peers' ops). A thread whose op never completes ends by gloo's own timeout (pg_timeout_s)
    or when the peer's connection closes; it holds its ops (and so their buffers) until then.
    """

    def __init__(self) -> None:
        self._works: dict[int, list[Any]] = {}
        self._left = 0
        self._error_text: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def add(self, peer: int, work: Any) -> None:
        self._works.setdefault(peer, []).append(work)

    def start(self) -> None:
        """Start a thread per peer; the ops are theirs from now on."""
        works, self._works = self._works, {}
        self._left = len(works)
        if not works:
            self._done.set()
        for peer, ops in works.items():
            threading.Thread(
                target=self._wait_all, args=(ops,), name=f"recover-p2p-peer{peer}", daemon=True
            ).start()

    def _wait_all(self, ops: list[Any]) -> None:
        try:
            while ops:
                ops[0].wait()  # blocks until this op completes or fails (GIL released)
                ops.pop(0)
        except RuntimeError as exc:
            with self._lock:
                if self._error_text is None:
                    self._error_text = str(exc)
            self._done.set()
            return
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Returns when every op succeeded; raises the first failure's text (call once completed)."""
        if self._error_text is not None:
            raise RuntimeError(self._error_text)


class EpochGroup:
    """The cross-replica process group of one epoch. Build with ``EpochGroup.build``."""

    def __init__(
        self,
        *,
        pg: Any,
        epoch: int,
        rank: int,
        world_size: int,
        config: CollectiveConfig,
        device: torch.device | None = None,
    ) -> None:
        self._pg: Any = pg
        self.device = _as_device(device)
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.config = config
        # The options of every sum of this group (the process group copies them into each op):
        # made once, not a few Python objects per bucket.
        self._sum_options = dist.AllreduceOptions()
        self._sum_options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # (the stubs differ)
        self._sum_options.timeout = datetime.timedelta(seconds=config.pg_timeout_s)
        self._poison: CollectiveAborted | None = None
        self._in_flight: list[Any] = []
        self._graveyard: list[Any] = []
        self._teardown_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.teardown_s: float | None = None  # set by the teardown thread when it finishes

    @classmethod
    def build(
        cls,
        store: Store,
        *,
        epoch: int,
        rank: int,
        world_size: int,
        config: CollectiveConfig | None = None,
        should_abort: ShouldAbort | None = None,
        scope: str = "",
        device: torch.device | str | None = None,
        reach: ReachListener | None = None,
    ) -> EpochGroup:
        """Rendezvous with the ``world_size`` ranks of ``epoch`` on ``store``; bounded by build_timeout_s.

        ``device`` is where the group's buffers live: the CPU (None, the default) gives a gloo
        group; a CUDA device an NCCL group on that GPU (each rank of the group on its own GPU).

        ``scope`` separates groups of the same epoch on one store: in replicas of several ranks,
        the ranks at one position of every replica form their own group of each epoch.

        With ``should_abort``, the rendezvous runs on a helper thread and the caller gives up
        (``CollectiveAborted("epoch")``) as soon as the callback returns a reason: a peer that died
        after the epoch was announced never shows up, and the coordinator's next epoch says so
        long before build_timeout_s. The abandoned rendezvous ends on its thread by its timeout.

        Raises ``CollectiveAborted("deadline")`` if the peers do not all show up in time and
        ``CollectiveAborted("error")`` if the rendezvous fails otherwise. Each epoch may be built
        once per store: a failed build means the epoch is dead and the coordinator must declare a
        new one. The group talks to the store through its own ``store.clone()`` (when the store
        supports it), so a blocked rendezvous never holds up other users of ``store``. The call
        releases the GIL while it waits.

        With ``reach`` (this rank's probe listener, gloo groups only), the rank publishes its
        endpoint under the epoch's prefix, and a build still waiting after ``reach_after_s``
        dials the peers that published theirs: one that cannot be dialled ends the build with
        ``CollectiveAborted("unreachable")`` naming those ranks (recover.runtime.reach).
        """
        config = config if config is not None else CollectiveConfig()
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if not is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        # A store client serialises its calls: a rendezvous blocked in wait() on the trainer's own
        # client would stall every other thread using it (heartbeats) until build_timeout_s. So
        # the group gets its own connection when the store can clone itself.
        try:
            own_client = store.clone()  # type: ignore[attr-defined]  # (TCPStore has it)
        except (RuntimeError, NotImplementedError):
            own_client = store
        # (torch.distributed re-exports PrefixStore implicitly: unseen by mypy --strict only)
        prefixed = dist.PrefixStore(  # type: ignore[attr-defined, unused-ignore]
            f"{scope}{_STORE_PREFIX}{epoch}", own_client
        )
        device = _as_device(device)
        if device.type == "cuda":
            make, bounded = _nccl(prefixed, rank, world_size, config, device), False
        elif device.type == "cpu":
            make, bounded = _gloo(prefixed, rank, world_size, config), True
        else:
            raise ValueError(f"device must be the CPU or a CUDA device, got {device}")
        probe = None
        if reach is not None and reach.endpoint is not None and world_size > 1:
            prefixed.set(f"{_REACH_KEY}{rank}", reach.endpoint)
            probe = _reach_probe(store, f"{scope}{_STORE_PREFIX}{epoch}", rank, world_size, config)
        started = time.monotonic()
        try:
            pg = _construct(make, config, epoch, should_abort, bounded=bounded, probe=probe)
        except CollectiveAborted:
            raise
        except dist.DistStoreError as exc:
            raise CollectiveAborted(
                "deadline",
                f"group build not complete after {time.monotonic() - started:.3f} s "
                f"(build_timeout_s {config.build_timeout_s}): {exc}",
                epoch=epoch,
            ) from None
        except RuntimeError as exc:
            raise CollectiveAborted("error", f"group build failed: {exc}", epoch=epoch) from None
        pg.set_timeout(datetime.timedelta(seconds=config.pg_timeout_s))
        logger.debug(
            "epoch %d: rank %d/%d built in %.3f s",
            epoch,
            rank,
            world_size,
            time.monotonic() - started,
        )
        return cls(
            pg=pg, epoch=epoch, rank=rank, world_size=world_size, config=config, device=device
        )

    @property
    def poisoned(self) -> CollectiveAborted | None:
        """The abort that poisoned this group, or None while it is usable."""
        return self._poison

    def allreduce_sum(self, flat: torch.Tensor, *, should_abort: ShouldAbort) -> None:
        """Sum ``flat`` in place across the group, or raise ``CollectiveAborted``.

        ``flat`` is a contiguous 1-D buffer on the group's device, made for this attempt only:
        after a raise it is partially reduced, belongs to the graveyard, and must never be read
        again.
        ``should_abort`` is first called right after the buckets are issued (unless they have
        already completed), then every ``abort_check_interval_s``; a non-empty return aborts with
        kind ``"epoch"``. A raise poisons the group and schedules its teardown (``abandon``).
        One op at a time per group, from one thread.
        """
        self._check_buffer(flat, name="flat", one_dim=True)
        opts = self._sum_options
        self._run([flat], lambda chunk: self._pg.allreduce([chunk], opts), should_abort)

    def start_allreduce(self, chunk: torch.Tensor) -> None:
        """Issue the in-place sum of ``chunk`` (a slice of an attempt's buffer) now and return:
        the next ``finish_allreduce`` waits for it with the rest. The step's reduce starts its
        buckets this way during the last backward pass (recover.runtime.overlap). Every rank
        must issue the same sizes in the same order. Raises ``CollectiveAborted`` on a poisoned
        group, and RuntimeError when gloo refuses to issue."""
        self._raise_if_poisoned()
        self._in_flight.append(self._pg.allreduce([chunk], self._sum_options))

    def finish_allreduce(
        self, flat: torch.Tensor, *, issue_rest: Callable[[], None], should_abort: ShouldAbort
    ) -> None:
        """Issue what ``issue_rest()`` starts (with ``start_allreduce``), then wait for every op in
        flight: ``flat`` (the buffer the started ops sum) is whole on return, and on a raise it
        is the graveyard's, as for ``allreduce_sum``."""
        self._check_buffer(flat, name="flat", one_dim=True)
        self._run_issued([flat], issue_rest, should_abort)

    def drop_in_flight(self, reason: str) -> None:
        """Poison the group and abandon the ops started and never waited for (a step left during
        its last backward pass): their buffers go to the graveyard. A no-op with none in flight."""
        if not self._in_flight:
            return
        self._graveyard.extend(self._in_flight)
        self._in_flight.clear()
        if self._poison is None:
            self._poison = CollectiveAborted("epoch", reason, epoch=self.epoch)
        self.abandon()

    def broadcast(self, tensor: torch.Tensor, *, src: int, should_abort: ShouldAbort) -> None:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor`` in place, same abort rules."""
        self.broadcast_many([tensor], src=src, should_abort=should_abort)

    def broadcast_many(
        self, tensors: list[torch.Tensor], *, src: int, should_abort: ShouldAbort
    ) -> None:
        """Broadcast every tensor of the list (each in place, from rank ``src``), all in flight
        together and waited for as one op (same abort rules): a state of many tensors moves
        without being packed into one buffer first."""
        if not is_int(src) or not 0 <= src < self.world_size:
            raise ValueError(f"src must be an int in [0, {self.world_size}), got {src!r}")
        for tensor in tensors:
            self._check_buffer(tensor, name="tensor", one_dim=False)

        def issue(chunk: torch.Tensor) -> Any:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            opts.rootTensor = 0
            opts.timeout = datetime.timedelta(seconds=self.config.pg_timeout_s)
            return self._pg.broadcast([chunk], opts)

        self._run([tensor.view(-1) for tensor in tensors], issue, should_abort)

    def alltoall(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        *,
        out_splits: list[int],
        in_splits: list[int],
        should_abort: ShouldAbort,
    ) -> None:
        """Send ``inp[sum(in_splits[:r]):][:in_splits[r]]`` to rank r and receive rank r's part
        into ``out`` at ``sum(out_splits[:r])``, as one op (same abort rules as
        ``allreduce_sum``; ``out`` is the buffer a failure leaves unusable). The deterministic
        reduce's exchange (recover.runtime.tree_sum)."""
        self._check_buffer(out, name="out", one_dim=True)
        self._check_buffer(inp, name="inp", one_dim=True)
        for name, splits, buf in (("out_splits", out_splits, out), ("in_splits", in_splits, inp)):
            if len(splits) != self.world_size or sum(splits) != buf.numel():
                raise ValueError(
                    f"{name} must hold {self.world_size} sizes adding up to {buf.numel()}, "
                    f"got {splits}"
                )

        def issue() -> None:
            opts = dist.AllToAllOptions()
            opts.timeout = datetime.timedelta(seconds=self.config.pg_timeout_s)
            self._in_flight.append(self._pg.alltoall_base(out, inp, out_splits, in_splits, opts))

        self._run_issued([out, inp], issue, should_abort)

    def allgather(self, out: torch.Tensor, inp: torch.Tensor, *, should_abort: ShouldAbort) -> None:
        """Every rank's ``inp`` (all of one size), in rank order, into every rank's ``out``, as
        one op (same abort rules)."""
        self._check_buffer(out, name="out", one_dim=True)
        self._check_buffer(inp, name="inp", one_dim=True)
        if out.numel() != inp.numel() * self.world_size:
            raise ValueError(
                f"out must hold {self.world_size} x {inp.numel()} values, got {out.numel()}"
            )

        def issue() -> None:
            opts = _AllgatherOptions()
            opts.timeout = datetime.timedelta(seconds=self.config.pg_timeout_s)
            self._in_flight.append(self._pg._allgather_base(out, inp, opts))

        self._run_issued([out, inp], issue, should_abort)

    def send_recv(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        *,
        should_abort: ShouldAbort,
    ) -> None:
        """Point to point: send every ``(tensor, dst)`` and receive every ``(tensor, src)`` into
        its tensor in place, all in flight together and waited for as one op (same abort rules;
        the receive buffers are the ones a failure leaves unusable). The k-th send from one rank
        to another matches the k-th receive of the other from the first, so both sides list
        the ops between them in the same order, with the same sizes. Ranks with no op here
        need not call it. gloo groups only (an NCCL group would build a communicator per pair
        on first use, outside the build's deadline)."""
        if self.device.type != "cpu":
            raise ValueError(f"send_recv needs a gloo group (host buffers), not {self.device}")
        for name, ops in (("sends", sends), ("recvs", recvs)):
            for tensor, peer in ops:
                self._check_buffer(tensor, name=name, one_dim=False)
                if not is_int(peer) or peer == self.rank:
                    raise ValueError(f"{name}: a peer must be another rank's int, got {peer!r}")
                if not 0 <= peer < self.world_size:
                    raise ValueError(f"{name}: peer {peer} is not in [0, {self.world_size})")

        def issue() -> None:
            waits = _PeerWaits()
            self._in_flight.append(waits)  # before any op: a refused issue leaves it the ops
            tags: dict[tuple[str, int], int] = {}
            try:
                for kind, ops in (("send", sends), ("recv", recvs)):
                    for tensor, peer in ops:
                        tag = tags[kind, peer] = tags.get((kind, peer), -1) + 1
                        if kind == "send":
                            waits.add(peer, self._pg.send([tensor.view(-1)], peer, tag))
                        else:
                            waits.add(peer, self._pg.recv([tensor.view(-1)], peer, tag))
            finally:
                waits.start()  # the issued ops are waited for (and kept) even after a refusal

        self._run_issued([t for t, _ in (*recvs, *sends)], issue, should_abort)

    def abandon(self) -> threading.Thread | None:
        """Poison the group and tear it down on a daemon thread; never blocks. Idempotent.

        Returns the teardown thread (join it with a timeout to measure or wait), or None when
        the group was already torn down by an earlier call.
        """
        with self._lock:
            if self._poison is None:
                self._poison = CollectiveAborted("epoch", "group abandoned", epoch=self.epoch)
            if self._pg is None:
                return self._teardown_thread
            holder = [(self._pg, self._graveyard)]  # the thread will hold the only references
            self._pg, self._graveyard = None, []
            thread = threading.Thread(
                target=_teardown,
                args=(self.epoch, holder, self._record_teardown),
                name=f"recover-teardown-epoch{self.epoch}",
                daemon=True,
            )
            del holder
            self._teardown_thread = thread
        thread.start()
        return thread

    # ---- internals -------------------------------------------------------------------------

    def _record_teardown(self, seconds: float) -> None:
        self.teardown_s = seconds

    def _check_buffer(self, tensor: torch.Tensor, *, name: str, one_dim: bool) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if one_dim and tensor.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(f"{name} must be a contiguous tensor on {self.device}")

    def _run(
        self,
        flats: list[torch.Tensor],
        issue: Callable[[torch.Tensor], Any],
        should_abort: ShouldAbort,
    ) -> None:
        """Issue one op per bucket of every buffer, then wait for them all (``_run_issued``)."""

        def issue_all() -> None:
            for flat in flats:
                size = self.config.bucket_bytes
                for start, stop in compute_buckets(flat.numel(), flat.element_size(), size):
                    self._in_flight.append(issue(flat[start:stop]))

        self._run_issued(flats, issue_all, should_abort)

    def _run_issued(
        self, flats: list[torch.Tensor], issue_all: Callable[[], None], should_abort: ShouldAbort
    ) -> None:
        """`issue_all()` puts its ops in ``_in_flight``; wait for them, or poison the group and
        send them and ``flats`` (the buffers they touch) to the graveyard."""
        if self._poison is not None:
            self._graveyard.extend(self._in_flight)  # (ops started before the poison)
            self._in_flight.clear()
        self._raise_if_poisoned()
        verdict: CollectiveAborted | None = None
        caller_error: BaseException | None = None
        try:
            issue_all()
            verdict = self._wait_in_flight(should_abort)
        except RuntimeError as exc:  # gloo refused to issue (e.g. its connections are closed)
            verdict = compute_verdict(
                elapsed_s=0.0,
                deadline_s=1.0,
                error_text=str(exc),
                abort_reason=None,
                epoch=self.epoch,
            )
        except BaseException as exc:  # should_abort raised, or KeyboardInterrupt: poison, re-raise
            caller_error = exc
            verdict = CollectiveAborted("epoch", f"interrupted: {exc!r}", epoch=self.epoch)
        if verdict is None:
            self._in_flight.clear()
            return
        # No Work object may stay referenced by this frame or the exception: the graveyard owns them.
        self._graveyard.extend(self._in_flight)
        self._graveyard.extend(flats)
        self._in_flight.clear()
        del flats
        # A copy: the raised exception's traceback pins the caller's frames (and buffer).
        self._poison = CollectiveAborted(
            verdict.kind, verdict.detail, epoch=verdict.epoch, peer=verdict.peer
        )
        logger.debug("epoch %d: rank %d abandons op: %s", self.epoch, self.rank, verdict)
        self.abandon()
        if caller_error is not None:
            raise caller_error
        raise verdict

    def _raise_if_poisoned(self) -> None:
        if self._poison is not None:
            raise CollectiveAborted(
                self._poison.kind,
                f"group of epoch {self.epoch} is poisoned ({self._poison.detail})",
                epoch=self.epoch,
                peer=self._poison.peer,
            )

    def _silent_error(self, work: Any) -> str | None:
        """The error of a completed op whose wait() did not raise. gloo's wait() raises; an NCCL
        op's does not when torch's NCCL error handling is off (as for these groups): a failed
        one also reports is_completed(), and only its exception() tells. (Work.exception() is
        deprecated in torch 2.13, with no replacement that does not wait for the watchdog.)"""
        if self.device.type != "cuda":
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            error = work.exception()
        return None if error is None else str(error)

    def _wait_in_flight(self, should_abort: ShouldAbort) -> CollectiveAborted | None:
        """Poll the in-flight ops; return None when all completed, else the verdict. Never raises."""
        config = self.config
        started = time.monotonic()
        next_abort_check = started
        pending = 0
        done = threading.Event()
        hinted = self._hint_completions(done)
        while True:
            done.clear()  # (before the look: a completion after it wakes the wait below)
            error_text: str | None = None
            while pending < len(self._in_flight) and self._in_flight[pending].is_completed():
                try:
                    self._in_flight[pending].wait()  # completed: returns or raises at once
                except RuntimeError as exc:
                    error_text = str(exc)
                    break
                error_text = self._silent_error(self._in_flight[pending])
                if error_text is not None:
                    break
                pending += 1
            if error_text is None and pending == len(self._in_flight):
                return None
            now = time.monotonic()
            reason: str | None = None
            if error_text is None and now >= next_abort_check:
                reason = should_abort()
                next_abort_check = now + config.abort_check_interval_s
            verdict = compute_verdict(
                elapsed_s=now - started,
                deadline_s=config.op_deadline_s,
                error_text=error_text,
                abort_reason=reason,
                epoch=self.epoch,
            )
            if verdict is not None:
                return verdict
            age = now - started
            if hinted:  # woken by the next completion, else at the next abort check
                done.wait(max(0.0, min(config.poll_interval_max_s, next_abort_check - now)))
            else:
                time.sleep(min(config.poll_interval_max_s, max(config.poll_interval_s, age / 20)))

    def _hint_completions(self, done: threading.Event) -> bool:
        """Have each in-flight op set `done` as it completes (its future's callback, on gloo's
        thread), so that `_wait_in_flight` waits for that, looking again only at the abort checks,
        instead of looking every 0.5 ms: a step's reduce woke its rank about 25 times, and the
        wait's end is seen as it happens, not up to one poll late. Only for gloo ops (an NCCL op's
        future completes once the op is queued on its stream, not done); False where an op has no
        future (send_recv's waits, a stand-in): the wait then polls."""
        if self.device.type != "cpu":
            return False
        for work in self._in_flight:
            try:
                work.get_future().add_done_callback(lambda _f: done.set())
            except (AttributeError, RuntimeError):
                return False
        return True
