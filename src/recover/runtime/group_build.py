"""The rendezvous of one epoch's group: a gloo or NCCL process group on the epoch's store prefix.

Job: the parts ``EpochGroup.build`` (recover.runtime.collective) puts together. ``_gloo`` and
``_nccl`` return the maker of one epoch's group, constructed directly on a ``PrefixStore`` named
after the epoch (``recover/runtime/collective/epoch<e>``) over the coordinator's shared
``TCPStore``: a ``ProcessGroupGloo`` for host buffers (the default) or, for buffers on a GPU, a
``ProcessGroupNCCL``. There is no ``init_process_group`` and no global default group, so groups
of several epochs coexist in one process. Every gloo group of a process gets its devices from
one choice (``gloo_devices``: the interfaces or the address of ``recover.addresses.PeerAddress``,
resolved and checked at the entry point; else gloo's default). ``_construct`` runs a maker under
the build's deadline, on a helper thread when the caller may give up early; ``_reach_probe`` and
``reach_host`` let a build that waits name the peers it cannot dial (recover.runtime.reach).

Invariants: a build ends by ``build_timeout_s`` (gloo's rendezvous bounds itself, an NCCL one is
bounded here); a build given up early ends on its own daemon thread, never on the caller's; an
NCCL build's override of ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is undone at once, under a lock.

What it must not do: run an op on a group or keep one: it hands the group to ``EpochGroup``,
which owns its ops and its teardown. The underscore names are the collective's internals, shared
with recover.runtime.collective (and its tests) only.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from recover.addresses import interface_ipv4
from recover.runtime.collective_config import CollectiveAborted, CollectiveConfig, ShouldAbort
from recover.runtime.reach import KEY as _REACH_KEY
from recover.runtime.reach import probe_peers

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

logger = logging.getLogger(__name__)

_STORE_PREFIX = "recover/runtime/collective/epoch"


def _gloo(
    prefixed: Store, rank: int, world_size: int, config: CollectiveConfig
) -> Callable[[], Any]:
    """The maker of one epoch's gloo group (host buffers)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (not in the stubs)
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
    prefixed: Store, rank: int, world_size: int, config: CollectiveConfig, device: torch.device
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
    store: Store, prefix: str, rank: int, world_size: int, config: CollectiveConfig
) -> Callable[[], dict[int, str]]:
    """The probe of one build: dial the peers that published an endpoint under `prefix`. It
    reads the store through a connection of its own (the build's is blocked in the rendezvous)."""

    def probe() -> dict[int, str]:
        try:
            try:
                client = store.clone()  # type: ignore[attr-defined]  # (TCPStore has it)
            except (RuntimeError, NotImplementedError):
                client = store
            # (torch.distributed re-exports PrefixStore implicitly: unseen by mypy --strict only)
            view = dist.PrefixStore(prefix, client)  # type: ignore[attr-defined, unused-ignore]
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
