"""Live state transfer to joining replicas, over the new epoch's group (no disk round trip).

Job: when the coordinator admits joiners at a step boundary, every member of the new epoch calls
`transfer_state` before the step. The members that hold the committed state (the sources: the
members that are not joiners) each send a share of it straight to every joiner, point to point,
in parallel; the joiners load it. The step counter and the learning-rate schedule need no
transfer: the step comes with the view and lr(step) is a pure function.

How (gloo): (1) every member's digest of its state's header (structure, sizes and every value
that is not a tensor) goes to every member in one small all-gather, and the sources whose digest
equals the lowest source's (the lead's) serve; (2) the lead broadcasts its header; (3) the state,
taken as its tensors' bytes one after the other, is cut into one contiguous byte range per
server (`compute_shares`), and each server sends its range, tensor by tensor, from where it lies
to each joiner, which receives it straight into fresh buffers that become the tensors it loads.
A server whose state is on a GPU (a gloo group sends host memory) copies only its range to the
host, after the header went out, into one pinned buffer with all copies in flight at once
(`_staged`; on an H200, gpt2-124m: 0.31-0.35 s per source, against 0.79-0.82 s when each copied
its whole state to pageable memory tensor by tensor, and the transfer 1.14-1.23 s against
1.61-1.76 s).
On an NCCL group (not yet run on GPUs) the lead broadcasts the state instead (`broadcast_state`):
NCCL builds a communicator per pair on a first send, outside the group build's deadline.

Invariants: a joiner computes nothing before it has loaded the committed state, and loads only
once every byte arrived; the payload is bit for bit the servers' `transfer_state_dict()` (the step
machine's `Work`), and the servers hold the same committed state (docs/design.md invariant 4,
agreement, checked by the parameter hash; a source whose header differs from the lead's does not
serve); in a replica of several ranks each rank transfers the part it holds, over the group of
its position, to the joiner's rank at the same position. The joiner receives into fresh buffers,
never into the tensors it holds (its model's; in one run of the benchmark that took 0.49 s
against 0.63 s into fresh buffers, and this choice stands anyway): a failed
op's buffers are unusable (docs/design.md: the collective keeps them until its group is torn down,
and a receive still posted may write into them until then), and a late write into a model
tensor would land after the next transfer's load. A failure during the transfer is a
collective failure like any other: every op goes through `EpochGroup`, so an error, a deadline
or a newer epoch aborts it and a dead or hung source holds nobody past `op_deadline_s`; the caller
reports it and the step is redone in the next epoch, where the transfer is repeated. A server
whose sends all completed may see no failure (it sends only to the joiners): it learns of it
from its reduce in the same epoch, which the next epoch aborts.

Cost: the state once per joiner (parameters plus two AdamW moments: about 12 bytes per
parameter; a tensor the state dict holds twice, such as tied embeddings, is sent once), each
server sending 1/S of it, and a handful of bytes to the members that hold it already (before,
a broadcast sent the whole state to them too). Measured (`benchmarks/transfer_speed.py`,
gpt2-124m, 1,423 MiB of distinct state, 3 processes on 2 cores over loopback, median of 3, side by
side): 0.47 s from two sources, 0.49 s from one, 1.56 s by the earlier broadcast, 11.9 s packed.
On loopback the copy through the kernel is the bound, not the number of streams, so a second
source helps little here; across nodes each source's link adds its bandwidth. Sending tensor by
tensor matters: the same bytes as one message into one fresh buffer took 4.8 s from one source
and 0.91 s from two. In the running system (`recover bench rejoin`, gpt2-124m, 975 MiB, three
live replicas serving on 2 cores) a joiner's transfer took 0.87-1.09 s, its load included
(`TransferStats.load_s`, 0.07-0.11 s: the built-in trainer's optimizer adopts the received
buffers; through torch's state-dict helper the load alone had taken 2.0 s).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import ShouldAbort

_DIGEST_WORDS = 5  # the header's length, then its sha256 as four int64


class TransferableState(Protocol):
    """What the transfer needs of a replica's model side (recover.runtime.step_machine.Work)."""

    def transfer_state_dict(self) -> dict[str, Any]: ...
    def load_transfer_state(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class TransferStats:
    bytes: int  # the state's bytes (header and tensors, each shared tensor once)
    seconds: float
    source: int  # replica id of the lead source (whose header the joiners load)
    sources: tuple[int, ...] = ()  # replica ids of the sources that sent a share
    sent: int = 0  # bytes this member sent
    load_s: float = 0.0  # of `seconds`, the joiner's load of what it received into its state
    # Of `seconds`, until the lead's header was in: on a joiner, the sources' preparation and
    # the wait for them (sources still finishing their step); then the bytes, then the load.
    header_s: float = 0.0
    prepare_s: float = 0.0  # of `seconds`, this member's own: its state as bytes on the device


def _flatten(
    obj: object, tensors: list[torch.Tensor], seen: dict[tuple[object, ...], int] | None = None
) -> object:
    """The structure of a state dict with each tensor replaced by its index in `tensors`; a
    tensor that is the very same view as an earlier one (tied weights) gets the earlier index."""
    if isinstance(obj, torch.Tensor):
        key: tuple[object, ...] | None = None
        if seen is not None and obj.numel() > 0:
            key = (obj.data_ptr(), obj.device, obj.dtype, tuple(obj.shape), tuple(obj.stride()))
            if key in seen:
                return {"__tensor__": seen[key], "shape": list(obj.shape), "dtype": str(obj.dtype)}
        tensors.append(obj)
        if seen is not None and key is not None:
            seen[key] = len(tensors) - 1
        return {"__tensor__": len(tensors) - 1, "shape": list(obj.shape), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {
            "__dict__": [
                [_flatten(k, tensors, seen), _flatten(v, tensors, seen)] for k, v in obj.items()
            ]
        }
    if isinstance(obj, list | tuple):
        return {
            "__list__": [_flatten(v, tensors, seen) for v in obj],
            "tuple": isinstance(obj, tuple),
        }
    return obj


def _unflatten(obj: Any, parts: list[torch.Tensor]) -> Any:
    """The state dict of `_flatten`'s structure, each tensor a view of its received bytes."""
    if isinstance(obj, dict) and "__tensor__" in obj:
        dtype = getattr(torch, obj["dtype"].removeprefix("torch."))
        return parts[obj["__tensor__"]].view(dtype).view(obj["shape"])
    if isinstance(obj, dict) and "__dict__" in obj:
        return {_unflatten(k, parts): _unflatten(v, parts) for k, v in obj["__dict__"]}
    if isinstance(obj, dict) and "__list__" in obj:
        items = [_unflatten(v, parts) for v in obj["__list__"]]
        return tuple(items) if obj["tuple"] else items
    return obj


def _bytes_where_they_lie(work: TransferableState) -> tuple[bytes, list[torch.Tensor]]:
    """(header, parts): a JSON header that describes `work.transfer_state_dict()`, and each
    distinct tensor's bytes as a flat uint8 tensor on the tensor's own device (a view when it is
    contiguous, no copy)."""
    tensors: list[torch.Tensor] = []
    structure = _flatten(work.transfer_state_dict(), tensors, {})
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    header = json.dumps({"structure": structure, "sizes": [p.numel() for p in parts]})
    return header.encode(), parts


def _staged(pieces: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`pieces` on `device`: those there already as they are; the others (a GPU's bytes for a
    gloo group) copied into one fresh host buffer, pinned where CUDA is present so that every
    copy is in flight at once, then waited for once. (Copied one by one into pageable memory,
    gpt2-124m's state took 0.8 s per source on an H200, half its transfer.)"""
    away = [i for i, t in enumerate(pieces) if t.device != device]
    if not away:
        return pieces
    pinned = device.type == "cpu" and torch.cuda.is_available()
    total = sum(pieces[i].numel() for i in away)
    buffer = torch.empty(total, dtype=torch.uint8, device=device, pin_memory=pinned)
    staged, offset = list(pieces), 0
    for i in away:
        n = pieces[i].numel()
        staged[i] = buffer[offset : offset + n]
        staged[i].copy_(pieces[i], non_blocking=pinned)
        offset += n
    if pinned:
        torch.cuda.synchronize()
    return staged


def describe_state(
    work: TransferableState, device: torch.device
) -> tuple[bytes, list[torch.Tensor]]:
    """The committed state of `work` (its `transfer_state_dict()`) as (header, parts): a JSON
    header that describes the state dict, and each distinct tensor's bytes on `device` (views
    where possible)."""
    header, parts = _bytes_where_they_lie(work)
    return header, _staged(parts, device)


def compute_shares(sizes: list[int], servers: int) -> list[list[tuple[int, int, int]]]:
    """Pure: what each of `servers` sources sends, as `(part, start, stop)` byte ranges of the
    parts of `sizes` bytes. The parts, one after the other, are cut into `servers` contiguous
    ranges that differ in size by at most one byte (so a part may be split between two)."""
    if servers < 1 or any(n < 0 for n in sizes):
        raise ValueError(f"bad share request: {servers=}, sizes with a negative: {sizes}")
    total = sum(sizes)
    bounds = [total * k // servers for k in range(servers + 1)]
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(servers)]
    offset, k = 0, 0
    for part, n in enumerate(sizes):
        start = 0
        while start < n:
            while offset + start >= bounds[k + 1]:
                k += 1
            stop = min(n, bounds[k + 1] - offset)
            shares[k].append((part, start, stop))
            start = stop
        offset += n
    return shares


def _load(work: TransferableState, meta: dict[str, Any], parts: list[torch.Tensor]) -> float:
    """A joiner's load of the received state (its header's structure over the received bytes)
    into `work`; returns how long it took."""
    t0 = time.perf_counter()
    work.load_transfer_state(_unflatten(meta["structure"], parts))
    return time.perf_counter() - t0


def _digest(header: bytes) -> torch.Tensor:
    words = torch.frombuffer(bytearray(hashlib.sha256(header).digest()), dtype=torch.int64)
    return torch.cat([torch.tensor([len(header)], dtype=torch.int64), words])


def transfer_state(
    group: EpochGroup,
    work: TransferableState,
    *,
    members: list[int],
    joined: list[int],
    me: int,
    should_abort: ShouldAbort,
) -> TransferStats:
    """Send the committed state from the sources (the members not in `joined`) to the joiners,
    a share from each source (gloo), and load it on the joiners.

    Raises CollectiveAborted (from the group) on a fault; the caller treats it as a failed attempt.
    """
    sources = [r for r in members if r not in joined]
    if not sources:
        raise RuntimeError(f"no member of {members} holds the committed state (joined: {joined})")
    if group.device.type != "cpu":
        return broadcast_state(
            group, work, members=members, joined=joined, me=me, should_abort=should_abort
        )
    t0 = time.perf_counter()
    # A source's bytes stay where they lie until its share is known: only its share is copied
    # to the group's device (host memory for a GPU replica's gloo group).
    header, parts = _bytes_where_they_lie(work) if me in sources else (b"", [])
    prepare_s = time.perf_counter() - t0
    mine = _digest(header) if me in sources else torch.zeros(_DIGEST_WORDS, dtype=torch.int64)
    table = torch.empty(_DIGEST_WORDS * len(members), dtype=torch.int64)
    group.allgather(table, mine, should_abort=should_abort)
    table = table.view(len(members), _DIGEST_WORDS)
    lead = sources[0]
    agreed = table[members.index(lead)]
    servers = [s for s in sources if torch.equal(table[members.index(s)], agreed)]
    raw = torch.empty(int(agreed[0]), dtype=torch.uint8)
    if me == lead:
        raw.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    group.broadcast(raw, src=members.index(lead), should_abort=should_abort)
    meta = json.loads(bytes(raw.numpy()).decode())
    header_s = time.perf_counter() - t0
    shares = compute_shares(meta["sizes"], len(servers))
    sends: list[tuple[torch.Tensor, int]] = []
    recvs: list[tuple[torch.Tensor, int]] = []
    if me in servers:
        t1 = time.perf_counter()
        pieces = _staged([parts[p][a:b] for p, a, b in shares[servers.index(me)]], group.device)
        prepare_s += time.perf_counter() - t1
        for joiner in joined:
            to = members.index(joiner)
            sends += [(piece, to) for piece in pieces]
    if me in joined:  # received straight into fresh buffers (see Invariants), no packing
        parts = [torch.empty(n, dtype=torch.uint8) for n in meta["sizes"]]
        for server, share in zip(servers, shares, strict=True):
            recvs += [(parts[p][a:b], members.index(server)) for p, a, b in share]
    if sends or recvs:
        group.send_recv(sends, recvs, should_abort=should_abort)
    load_s = _load(work, meta, parts) if me in joined else 0.0
    return TransferStats(
        bytes=raw.numel() + sum(meta["sizes"]),
        seconds=time.perf_counter() - t0,
        source=lead,
        sources=tuple(servers),
        sent=sum(t.numel() for t, _ in sends),
        load_s=load_s,
        header_s=header_s,
        prepare_s=prepare_s,
    )


def broadcast_state(
    group: EpochGroup,
    work: TransferableState,
    *,
    members: list[int],
    joined: list[int],
    me: int,
    should_abort: ShouldAbort,
) -> TransferStats:
    """The lead source broadcasts the whole state to the group (every member receives it, the
    ones that hold it too), bucketed by the collective; the joiners load it. The path of NCCL
    groups."""
    source = next(r for r in members if r not in joined)
    src_rank = members.index(source)
    t0 = time.perf_counter()
    device = group.device  # host memory for gloo, this rank's GPU for NCCL
    header, parts = describe_state(work, device) if me == source else (b"", [])
    prepare_s = time.perf_counter() - t0
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    group.broadcast(size, src=src_rank, should_abort=should_abort)
    raw = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
    if me == source:
        raw.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    group.broadcast(raw, src=src_rank, should_abort=should_abort)
    meta = json.loads(bytes(raw.cpu().numpy()).decode())
    header_s = time.perf_counter() - t0
    if me != source:
        parts = [torch.empty(n, dtype=torch.uint8, device=device) for n in meta["sizes"]]
    group.broadcast_many(parts, src=src_rank, should_abort=should_abort)
    load_s = _load(work, meta, parts) if me in joined else 0.0
    nbytes = raw.numel() + sum(p.numel() for p in parts)
    sent = nbytes * (len(members) - 1) if me == source else 0
    return TransferStats(
        bytes=nbytes, seconds=time.perf_counter() - t0, source=source, sources=(source,),
        sent=sent, load_s=load_s, header_s=header_s, prepare_s=prepare_s,
    )  # fmt: skip
