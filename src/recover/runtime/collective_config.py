"""The cross-replica collective's configuration, its abort, and the pure rules it decides by.

Job: ``CollectiveConfig`` (the deadlines, poll intervals, bucket size and gloo address of every
group a process builds, checked once when made), ``CollectiveAborted`` (the one exception a
failed build or op of the collective raises, with its kind), and the pure functions the
collective (recover.runtime.collective) applies: ``compute_buckets`` (how a buffer is cut into
async ops) and ``compute_verdict`` (whether an in-flight op must be abandoned, and why).

Invariants: a ``CollectiveConfig`` that exists is valid (``__post_init__`` raises a
``ValueError`` naming the field otherwise), and its ``pg_timeout_s`` is at least its
``op_deadline_s``, so the collective's own deadline fires before gloo's; a verdict prefers a
transport error to the caller's abort reason, and that to the deadline; a ``CollectiveAborted``
has one of the kinds of ``AbortKind``.

What it must not do: touch a process group, a store, a socket, a thread or the clock: everything
here is a value or a pure function of values, tested without processes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from recover.checks import is_number

AbortKind = Literal["error", "deadline", "epoch", "unreachable"]
ShouldAbort = Callable[[], str | None]

_ABORT_KINDS = ("error", "deadline", "epoch", "unreachable")
_PEER_PATTERN = re.compile(r"\[([0-9A-Za-z.:_-]+)\]:(\d+)")


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
    # (gloo ops wake the wait as they complete instead: EpochGroup._hint_completions)
    poll_interval_s: float = 0.0005  # sleep between two looks at the in-flight Work objects,
    # growing with the op's age (1/20 of it) up to poll_interval_max_s: an op that waits long (a
    # slower peer) is then noticed complete at most 5% late, and a waiting rank wakes 200 times a
    # second instead of 2,000 (4% of a core each, measured on this project's 2-core machine).
    poll_interval_max_s: float = 0.005
    abort_check_interval_s: float = 0.005  # how often should_abort() is asked (it may be an RPC)
    bucket_bytes: int = 25 * 2**20  # bytes per async op; 0 = the whole buffer in one op
    # Bytes per bucket of the step's reduce (recover.runtime.overlap), which starts buckets during
    # the last backward pass as their gradients become final: smaller buckets start sooner, more
    # of them cost more ops. 0 = the gradients in one op.
    step_bucket_bytes: int = 2**20
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
        for name in ("bucket_bytes", "step_bucket_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
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
