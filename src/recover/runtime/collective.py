"""Fault-tolerant cross-replica collective: one group per epoch, async ops, deadlines, abandon.

Job: sum (or broadcast) a flat buffer across the live replicas of one epoch without ever hanging
and without ever handing back a partially reduced buffer as if it were whole (docs/design.md,
invariants 3 "no corruption" and 5 "bounded waits").

How:

* ``EpochGroup.build`` constructs a ``ProcessGroupGloo`` (host buffers; the default) or, for
  buffers on a GPU, a ``ProcessGroupNCCL`` directly on a ``PrefixStore`` named after the epoch
  (``recover/runtime/collective/epoch<e>``) over the coordinator's shared ``TCPStore``. There is no
  ``init_process_group`` and no global default group, so groups of several epochs coexist in one
  process. The rendezvous is bounded by ``build_timeout_s``. Every gloo group of a process gets
  its devices from one choice (``gloo_devices``: the interfaces or the address of
  ``recover.addresses.PeerAddress``, resolved and checked at the entry point; else gloo's default). An NCCL group is torn down with
  ``abort()`` (ncclCommAbort), which also ends its in-flight kernels.
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

Costs and limits: polling costs one ``is_completed`` per in-flight bucket per poll (microseconds);
the poll interval grows with the op's age from ``poll_interval_s`` to ``poll_interval_max_s``.
``should_abort`` must be cheap (a flag or one store round trip). The peer named in
an ``error`` abort is the socket address gloo printed, not a rank. gloo has no shrink for this, so
every membership change costs a fresh rendezvous (milliseconds on loopback). NCCL groups are
built fresh per epoch too (docs/running.md, "Replicas of several ranks"); their path has not run on GPUs.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from recover.addresses import interface_ipv4
from recover.checks import is_int, is_number
from recover.runtime.reach import KEY as _REACH_KEY
from recover.runtime.reach import ReachListener, probe_peers

logger = logging.getLogger(__name__)

AbortKind = Literal["error", "deadline", "epoch", "unreachable"]
ShouldAbort = Callable[[], str | None]

_ABORT_KINDS = ("error", "deadline", "epoch", "unreachable")
_STORE_PREFIX = "recover/runtime/collective/epoch"
_PEER_PATTERN = re.compile(r"\[([0-9A-Za-z.:_-]+)\]:(\d+)")
# torch 2.13 does not export the all-gather's options from torch.distributed.
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions


class CollectiveAborted(RuntimeError):
    """A collective (or a group build) gave up; the buffer it touched must be discarded.

    ``kind`` is ``"error"`` (the transport failed: ``detail`` holds gloo's text and ``peer`` the
    remote address gloo named, if any), ``"deadline"`` (no completion within the deadline) or
    ``"epoch"`` (the caller's ``should_abort`` returned a reason, e.g. a newer epoch was announced)
    or ``"unreachable"`` (a build: ``unreachable`` maps the ranks this rank cannot dial to why).
    What to do next: restore the snapshot, wait for the coordinator's next view, build its group.
    """

    def __init__(
        self,
        kind: AbortKind,
        detail: str,
        *,
        epoch: int | None = None,
        peer: str | None = None,
        unreachable: dict[int, str] | None = None,
    ) -> None:
        if kind not in _ABORT_KINDS:
            raise ValueError(f"kind must be one of {_ABORT_KINDS}, got {kind!r}")
        where = f" (epoch {epoch})" if epoch is not None else ""
        super().__init__(f"collective aborted{where}: {kind}: {detail}")
        self.kind: AbortKind = kind
        self.detail = detail
        self.epoch = epoch
        self.peer = peer
        self.unreachable = dict(unreachable or {})


@dataclass(frozen=True, kw_only=True)
class CollectiveConfig:
    """Deadlines and bucketing of the cross-replica collective (all times in seconds)."""

    build_timeout_s: float = 10.0  # rendezvous of a new epoch's group: peers must show up by then
    # A build still waiting after reach_after_s dials the peers that reached it (recover.runtime.
    # reach), each within reach_timeout_s: one that cannot be dialled ends the build at once
    # (kind "unreachable", the peers named) instead of at build_timeout_s.
    reach_after_s: float = 1.0
    reach_timeout_s: float = 1.0
    op_deadline_s: float = 30.0  # an op not complete by then is abandoned
    # gloo's own timeout: a backstop that bounds how long an abandoned op keeps its worker threads
    # (and so the background teardown) busy. Must be >= op_deadline_s so our deadline fires first.
    pg_timeout_s: float = 60.0
    poll_interval_s: float = 0.0005  # sleep between two looks at the in-flight Work objects,
    # growing with the op's age (1/20 of it) up to poll_interval_max_s: an op that waits long (a
    # slower peer) is then noticed complete at most 5% late, and a waiting rank wakes 200 times a
    # second instead of 2,000 (4% of a core each, measured on this project's 2-core machine).
    poll_interval_max_s: float = 0.005
    abort_check_interval_s: float = 0.005  # how often should_abort() is asked (it may be an RPC)
    bucket_bytes: int = 25 * 2**20  # bytes per async op; 0 = the whole buffer in one op
    # Where gloo's device binds, i.e. the address peers dial (recover.addresses.PeerAddress, one
    # choice per process): on these interfaces (--ifname, RECOVER_IFNAME, GLOO_SOCKET_IFNAME), or
    # on this address; neither: gloo's default, this host's name (a local run).
    gloo_interfaces: tuple[str, ...] = ()
    gloo_hostname: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "build_timeout_s",
            "reach_after_s",
            "reach_timeout_s",
            "op_deadline_s",
            "pg_timeout_s",
            "poll_interval_s",
            "poll_interval_max_s",
            "abort_check_interval_s",
        ):
            value = getattr(self, name)
            if not is_number(value) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.pg_timeout_s < self.op_deadline_s:
            raise ValueError(
                f"pg_timeout_s must be >= op_deadline_s ({self.op_deadline_s}), "
                f"got {self.pg_timeout_s}"
            )
        if (
            isinstance(self.bucket_bytes, bool)
            or not isinstance(self.bucket_bytes, int)
            or self.bucket_bytes < 0
        ):
            raise ValueError(f"bucket_bytes must be an int >= 0, got {self.bucket_bytes!r}")
        if self.gloo_hostname is not None and (
            not isinstance(self.gloo_hostname, str) or not self.gloo_hostname
        ):
            raise ValueError(
                f"gloo_hostname must be None or a non-empty str, got {self.gloo_hostname!r}"
            )
        if not isinstance(self.gloo_interfaces, tuple) or not all(
            isinstance(n, str) and n for n in self.gloo_interfaces
        ):
            raise ValueError(
                f"gloo_interfaces must be a tuple of interface names, got {self.gloo_interfaces!r}"
            )
        if self.gloo_interfaces and self.gloo_hostname is not None:
            raise ValueError("give gloo_interfaces or gloo_hostname, not both")


def _as_device(device: torch.device | str | None) -> torch.device:
    """Where a group's buffers live: the CPU when None (gloo), else the given device."""
    return torch.device("cpu") if device is None else torch.device(device)


def compute_buckets(numel: int, element_size: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Pure: ``(start, stop)`` element ranges covering ``0..numel`` in buckets of ``bucket_bytes``."""
    if numel < 0 or element_size < 1 or bucket_bytes < 0:
        raise ValueError(f"bad bucket request: {numel=}, {element_size=}, {bucket_bytes=}")
    if numel == 0:
        return []
    per_bucket = numel if bucket_bytes == 0 else max(1, bucket_bytes // element_size)
    return [(start, min(start + per_bucket, numel)) for start in range(0, numel, per_bucket)]


def compute_verdict(
    *,
    elapsed_s: float,
    deadline_s: float,
    error_text: str | None,
    abort_reason: str | None,
    epoch: int | None = None,
) -> CollectiveAborted | None:
    """Pure: whether an in-flight op must be abandoned, and why.

    Precedence: a transport error (most specific), then the caller's abort reason, then the deadline.
    """
    if error_text is not None:
        match = _PEER_PATTERN.search(error_text)
        peer = f"{match.group(1)}:{match.group(2)}" if match else None
        return CollectiveAborted("error", error_text, epoch=epoch, peer=peer)
    if abort_reason:
        return CollectiveAborted("epoch", abort_reason, epoch=epoch)
    if elapsed_s >= deadline_s:
        return CollectiveAborted(
            "deadline",
            f"not complete after {elapsed_s:.3f} s (deadline {deadline_s} s)",
            epoch=epoch,
        )
    return None


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


def _gloo(prefixed, rank: int, world_size: int, config: CollectiveConfig) -> Callable[[], Any]:
    """The maker of one epoch's gloo group (host buffers)."""
    options = dist.ProcessGroupGloo._Options()
    # The constructor's timeout bounds the rendezvous (full-mesh connect); ops get pg_timeout_s.
    options._timeout = datetime.timedelta(seconds=config.build_timeout_s)
    options._devices = gloo_devices(config)
    return lambda: dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def gloo_devices(config: CollectiveConfig) -> list[Any]:
    """The gloo devices of every group this process builds: one per interface asked for (as
    torch does with GLOO_SOCKET_IFNAME), else one bound to `gloo_hostname`, else gloo's default
    (this host's name, which a stock /etc/hosts maps to loopback: fine on one host only)."""
    make = dist.ProcessGroupGloo.create_device
    if config.gloo_interfaces:
        return [make(interface=name) for name in config.gloo_interfaces]
    if config.gloo_hostname is not None:
        return [make(hostname=config.gloo_hostname)]
    return [dist.ProcessGroupGloo.create_default_device()]


_ENV_LOCK = threading.Lock()
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def _nccl(
    prefixed, rank: int, world_size: int, config: CollectiveConfig, device: torch.device
) -> Callable[[], Any]:
    """The maker of one epoch's NCCL group (buffers on this rank's GPU).

    The communicator is made here, eagerly on `device`, so that its rendezvous (the NCCL unique
    id travels through the epoch's store prefix) falls under the build's deadline rather than
    inside the first reduce. torch's own NCCL error handling would end the process when a peer
    dies (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3: abort and crash): for these groups it is
    off (0, read by the constructor), so an error only marks the op failed and this module's
    polling, abandon and ncclCommAbort (the group's ``abort()``) handle it like gloo's errors.
    Not yet run on GPUs in this project (see docs/running.md, "Replicas of several ranks").
    """
    if not dist.is_nccl_available():
        raise RuntimeError("the cross-replica reduce over NCCL needs a torch built with NCCL")

    def make() -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=config.pg_timeout_s)
        with _ENV_LOCK:
            saved = os.environ.get(_NCCL_ERROR_HANDLING)
            os.environ[_NCCL_ERROR_HANDLING] = "0"
            try:
                pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            finally:
                if saved is None:
                    del os.environ[_NCCL_ERROR_HANDLING]
                else:
                    os.environ[_NCCL_ERROR_HANDLING] = saved
        pg.eager_connect_single_device(device)
        return pg

    return make


def _construct(
    make: Callable[[], Any],
    config: CollectiveConfig,
    epoch: int,
    should_abort: ShouldAbort | None,
    *,
    bounded: bool,
    probe: Callable[[], dict[int, str]] | None = None,
) -> Any:
    """make(), on a helper thread when it must be abandoned early: when should_abort fires, when
    `probe` (called once, after reach_after_s) names peers that cannot be dialled, or after
    build_timeout_s if the maker does not bound itself (`bounded`: gloo's rendezvous has its own
    timeout; NCCL's waits on the store). An abandoned build ends on its thread."""
    if should_abort is None and probe is None and bounded:
        return make()
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["pg"] = make()
        except BaseException as exc:  # handed to the caller below, or dropped if it gave up
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=f"group-build-epoch{epoch}", daemon=True).start()
    started = time.monotonic()
    give_up = started + config.build_timeout_s
    while not done.wait(config.abort_check_interval_s):
        reason = should_abort() if should_abort is not None else None
        if reason is not None:
            raise CollectiveAborted("epoch", f"group build abandoned: {reason}", epoch=epoch)
        if probe is not None and time.monotonic() - started > config.reach_after_s:
            unreachable, probe = probe(), None
            if unreachable and not done.is_set():
                raise _unreachable(unreachable, epoch, "group build abandoned")
        if not bounded and time.monotonic() > give_up:
            raise CollectiveAborted(
                "deadline",
                f"group build not complete after build_timeout_s {config.build_timeout_s}",
                epoch=epoch,
            )
    if "error" in box:
        # A rendezvous that failed at once (e.g. "connect: Network is unreachable") says which
        # address failed, not which peer: the probe names the peers this rank cannot dial.
        unreachable = probe() if probe is not None else {}
        if unreachable:
            raise _unreachable(unreachable, epoch, "group build failed", f" (gloo: {box['error']})")
        raise box["error"]
    return box["pg"]


def _unreachable(
    unreachable: dict[int, str], epoch: int, what: str, cause: str = ""
) -> CollectiveAborted:
    named = "; ".join(f"rank {k}: {why}" for k, why in sorted(unreachable.items()))
    return CollectiveAborted(
        "unreachable",
        f"{what}: peers cannot be dialled: {named}{cause}",
        epoch=epoch,
        unreachable=unreachable,
    )


def _reach_probe(
    store: dist.Store, prefix: str, rank: int, world_size: int, config: CollectiveConfig
) -> Callable[[], dict[int, str]]:
    """The probe of one build: dial the peers that published an endpoint under `prefix`. It
    reads the store through a connection of its own (the build's is blocked in the rendezvous)."""

    def probe() -> dict[int, str]:
        try:
            try:
                client = store.clone()
            except (RuntimeError, NotImplementedError):
                client = store
            view = dist.PrefixStore(prefix, client)
            endpoints = {}
            for k in range(world_size):
                key = f"{_REACH_KEY}{k}"
                if k != rank and view.check([key]):
                    endpoints[k] = view.get(key).decode()
        except (RuntimeError, ValueError) as e:  # the store itself failed: not a verdict
            logger.debug("reach probe skipped: %s", e)
            return {}
        return probe_peers(endpoints, config.reach_timeout_s)

    return probe


def reach_host(config: CollectiveConfig) -> str | None:
    """The address this process's gloo device binds (what peers dial), for its reach listener:
    the first interface's IPv4 address, the configured hostname, or this host's name."""
    if config.gloo_interfaces:
        return interface_ipv4(config.gloo_interfaces[0])
    if config.gloo_hostname is not None:
        return config.gloo_hostname
    return socket.gethostname()


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
        self._poison: CollectiveAborted | None = None
        self._in_flight: list[Any] = []
        self._graveyard: list[Any] = []
        self._teardown_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.teardown_s: float | None = None  # set by the teardown thread when it finishes

    @classmethod
    def build(
        cls,
        store: dist.Store,
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
            own_client = store.clone()
        except (RuntimeError, NotImplementedError):
            own_client = store
        prefixed = dist.PrefixStore(f"{scope}{_STORE_PREFIX}{epoch}", own_client)
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
        opts_factory = self._allreduce_options
        self._run([flat], lambda chunk: self._pg.allreduce([chunk], opts_factory()), should_abort)

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

    def _allreduce_options(self) -> dist.AllreduceOptions:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = datetime.timedelta(seconds=self.config.pg_timeout_s)
        return opts

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
            raise CollectiveAborted(
                self._poison.kind,
                f"group of epoch {self.epoch} is poisoned ({self._poison.detail})",
                epoch=self.epoch,
                peer=self._poison.peer,
            )
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
        while True:
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
            time.sleep(min(config.poll_interval_max_s, max(config.poll_interval_s, age / 20)))


class StoreFollower:
    """The TCPStore of the coordinator that leads now, for `GroupCache`: a new leader (a
    standby that took over) hosts a new store, and the next epoch's group is built there.
    `address()` gives the store's current (host, port); a client is made once per address."""

    def __init__(self, address: Callable[[], tuple[str, int]], timeout_s: float) -> None:
        self._address = address
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._at: tuple[str, int] | None = None
        self._store: dist.Store | None = None

    def __call__(self) -> dist.Store:
        at = tuple(self._address())
        if at != self._at:
            self._store = dist.TCPStore(at[0], at[1], is_master=False, timeout=self._timeout)
            self._at = at
        return self._store


class GroupCache:
    """Holds this rank's group of the newest epoch; building a newer one abandons the older ones.

    Fencing: asking for an epoch older than the newest one built raises ``CollectiveAborted``
    (kind ``"epoch"``); a rank never goes back to an old epoch.
    """

    def __init__(
        self,
        store: dist.Store | Callable[[], dist.Store],
        *,
        config: CollectiveConfig | None = None,
        scope: str = "",
        device: torch.device | str | None = None,
    ) -> None:
        self._store = store  # or a callable: the store of the coordinator that leads now
        self.device = _as_device(device)
        self._scope = scope  # see EpochGroup.build
        self._config = config if config is not None else CollectiveConfig()
        self._current: EpochGroup | None = None
        self._newest_epoch: int | None = None  # a failed build still burns its epoch
        self.teardown_threads: list[threading.Thread] = []
        self._reach: ReachListener | None = None  # made at the first gloo build of >1 rank

    @property
    def current(self) -> EpochGroup | None:
        return self._current

    @property
    def config(self) -> CollectiveConfig:
        return self._config

    def get(
        self, *, epoch: int, rank: int, world_size: int, should_abort: ShouldAbort | None = None
    ) -> EpochGroup:
        """The group of ``epoch`` (built on first use, bounded by build_timeout_s)."""
        newest = self._newest_epoch
        if newest is not None and epoch < newest:
            raise CollectiveAborted(
                "epoch", f"epoch {epoch} is older than epoch {newest}", epoch=epoch
            )
        current = self._current
        if current is not None and current.epoch == epoch:
            if (rank, world_size) != (current.rank, current.world_size):
                raise ValueError(
                    f"epoch {epoch} was built as rank {current.rank}/{current.world_size}, "
                    f"asked for rank {rank}/{world_size}"
                )
            return current
        if newest is not None and epoch == newest:
            raise CollectiveAborted(
                "epoch",
                f"the build of epoch {epoch} failed earlier; wait for a newer epoch",
                epoch=epoch,
            )
        self.abandon_all()
        self._newest_epoch = epoch
        if self._reach is None and self.device.type == "cpu" and world_size > 1:
            host = reach_host(self._config)
            self._reach = ReachListener(host) if host else None
        group = EpochGroup.build(
            self._store() if callable(self._store) else self._store,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            config=self._config,
            should_abort=should_abort,
            scope=self._scope,
            device=self.device,
            reach=self._reach,
        )
        self._current = group
        return group

    def close(self) -> None:
        """Abandon the groups and stop the reach listener (the cache is not used again)."""
        self.abandon_all()
        if self._reach is not None:
            self._reach.close()

    def wait_closed(self, timeout_s: float | None = None) -> list[threading.Thread]:
        """Abandon the current group and wait for every group torn down in the background to be
        gone, at most `timeout_s` (default: gloo's own timeout and a second, by which every
        teardown has ended). Returns the teardown threads still alive.

        Why a process waits for this before it ends: a teardown thread spends its time inside the
        group's destructor with the GIL released; one that finishes while the interpreter is
        finalizing cannot take the GIL back, and CPython then aborts the whole process (SIGABRT,
        "terminate called without an active exception"). A destructor ends when its peers'
        connections close (a dead or exited peer: milliseconds) or at gloo's timeout (a stopped
        one)."""
        self.abandon_all()
        bound = self._config.pg_timeout_s + 1.0 if timeout_s is None else timeout_s
        end = time.monotonic() + bound
        for thread in self.teardown_threads:
            thread.join(max(0.0, end - time.monotonic()))
        return [t for t in self.teardown_threads if t.is_alive()]

    def abandon_all(self) -> None:
        """Abandon the current group (teardown in the background); never blocks."""
        if self._current is not None:
            thread = self._current.abandon()
            if thread is not None and thread not in self.teardown_threads:
                self.teardown_threads.append(thread)
            self._current = None
