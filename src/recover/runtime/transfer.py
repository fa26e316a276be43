"""Live state transfer to joining replicas, over the new epoch's group (no disk round trip).

Job: when the coordinator admits joiners at a step boundary, every member of the new epoch calls
`transfer_state` before the step: the source (the lowest member that is not a joiner) packs the
committed model and optimizer state, and one bucketed broadcast through the fault-tolerant
collective copies it to everyone; the joiners load it. The step counter and the learning-rate
schedule need no transfer: the step comes with the view and lr(step) is a pure function.

Invariants: a joiner computes nothing before it has loaded the committed state; the payload is the
source's `transfer_state_dict()` (the step machine's `Work`), bit for bit (in a replica of several ranks: the part this rank
holds, sent over the group of its position to the joiner's rank at the same position). A failure
during the transfer is a collective failure like any other (the caller reports it and the step is
redone in the next epoch, where the transfer is repeated).

Cost: one broadcast of the state (parameters plus two AdamW moments: about 12 bytes per
parameter), every tensor sent from where it lies and received straight into a fresh buffer that
becomes the joiner's tensor (no packing into one buffer, no unpacking copy: before, those two
copies took most of the time), all in flight together and bucketed by the collective; members
that already hold the state receive it too (a broadcast reaches every rank of the group), which
costs them the same time as the joiners.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from recover.runtime.collective import EpochGroup, ShouldAbort


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float
    source: int  # replica id of the sender


def _flatten(obj, tensors: list[torch.Tensor]):
    """The structure of a state dict with each tensor replaced by its index in `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1, "shape": list(obj.shape), "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {"__dict__": [[_flatten(k, tensors), _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return {"__list__": [_flatten(v, tensors) for v in obj], "tuple": isinstance(obj, tuple)}
    return obj


def _unflatten(obj, parts: list[torch.Tensor]):
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


def _bytes_of(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on `device`: a view when it is contiguous and
    there already (no copy), a copy otherwise."""
    t = tensor.detach()
    if t.device != device:
        t = t.to(device)
    return t.contiguous().reshape(-1).view(torch.uint8)


def describe_state(work, device: torch.device) -> tuple[bytes, list[torch.Tensor]]:
    """The committed state of `work` (its `transfer_state_dict()`) as (header, parts): a JSON
    header that describes the state dict, and each tensor's bytes (views where possible)."""
    tensors: list[torch.Tensor] = []
    structure = _flatten(work.transfer_state_dict(), tensors)
    parts = [_bytes_of(t, device) for t in tensors]
    header = json.dumps({"structure": structure, "sizes": [p.numel() for p in parts]})
    return header.encode(), parts


def transfer_state(
    group: EpochGroup,
    work,
    *,
    members: list[int],
    joined: list[int],
    me: int,
    should_abort: ShouldAbort,
) -> TransferStats:
    """Broadcast the committed state from the lowest non-joining member to the whole group.

    Raises CollectiveAborted (from the group) on a fault; the caller treats it as a failed attempt.
    """
    sources = [r for r in members if r not in joined]
    if not sources:
        raise RuntimeError(f"no member of {members} holds the committed state (joined: {joined})")
    source = sources[0]
    src_rank = members.index(source)
    t0 = time.perf_counter()
    device = group.device  # host memory for gloo, this rank's GPU for NCCL
    header, parts = describe_state(work, device) if me == source else (b"", [])
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    group.broadcast(size, src=src_rank, should_abort=should_abort)
    raw = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
    if me == source:
        raw.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    group.broadcast(raw, src=src_rank, should_abort=should_abort)
    meta = json.loads(bytes(raw.cpu().numpy()).decode())
    if me != source:  # received straight into their final buffers: no packing, no unpacking
        parts = [torch.empty(n, dtype=torch.uint8, device=device) for n in meta["sizes"]]
    group.broadcast_many(parts, src=src_rank, should_abort=should_abort)
    if me in joined:
        work.load_transfer_state(_unflatten(meta["structure"], parts))
    nbytes = raw.numel() + sum(p.numel() for p in parts)
    return TransferStats(bytes=nbytes, seconds=time.perf_counter() - t0, source=source)
