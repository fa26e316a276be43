"""This rank's group of the newest epoch, on the store of the coordinator that leads now.

Job: ``GroupCache`` hands the step machine the ``EpochGroup`` (recover.runtime.collective) of
the epoch it asks for, built on first use, and abandons the older ones (their teardown runs in
the background); it holds the rank's reach listener (recover.runtime.reach), made at its first
gloo build of more than one rank. ``StoreFollower`` gives it the ``TCPStore`` of the coordinator
that leads now: a new leader (a standby that took over) hosts a new store, and the next epoch's
group is built there.

Invariants: fencing: asking for an epoch older than the newest one asked for raises
``CollectiveAborted`` (kind ``"epoch"``), and so does asking again for an epoch whose build
failed (a failed build burns its epoch); at most one group is current; every group the cache
abandoned keeps its teardown thread in ``teardown_threads``, so that ``wait_closed`` can wait for
it before the process ends.

What it must not do: run an op, or wait without a bound: ``get`` is bounded by the build's
deadline, ``abandon_all`` never waits, and ``wait_closed`` waits at most ``pg_timeout_s`` and a
second unless told otherwise.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import (
    CollectiveAborted,
    CollectiveConfig,
    ShouldAbort,
    _as_device,
)
from recover.runtime.group_build import reach_host
from recover.runtime.reach import ReachListener

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store


class StoreFollower:
    """The TCPStore of the coordinator that leads now, for `GroupCache`: a new leader (a
    standby that took over) hosts a new store, and the next epoch's group is built there.
    `address()` gives the store's current (host, port); a client is made once per address."""

    def __init__(self, address: Callable[[], tuple[str, int] | None], timeout_s: float) -> None:
        self._address = address
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._at: tuple[str, int] | None = None
        self._store: Store | None = None

    def __call__(self) -> Store:
        address = self._address()
        if address is None:  # (the registration gives it, before any group is built)
            raise RuntimeError("no store address: this replica has not registered")
        at = (str(address[0]), int(address[1]))  # (a relayed address comes as a list)
        if at != self._at or self._store is None:
            # (torch.distributed re-exports TCPStore implicitly: unseen by mypy --strict only)
            self._store = dist.TCPStore(  # type: ignore[attr-defined, unused-ignore]
                at[0], at[1], is_master=False, timeout=self._timeout
            )
            self._at = at
        return self._store


class GroupCache:
    """Holds this rank's group of the newest epoch; building a newer one abandons the older ones.

    Fencing: asking for an epoch older than the newest one built raises ``CollectiveAborted``
    (kind ``"epoch"``); a rank never goes back to an old epoch.
    """

    def __init__(
        self,
        store: Store | Callable[[], Store],
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
