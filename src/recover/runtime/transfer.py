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

Cost: one flat copy of the state (parameters plus two AdamW moments: about 12 bytes per
parameter) and one broadcast of it, bucketed by the collective; members that already hold the state receive it too (a
broadcast reaches every rank of the group), which costs them the same time as the joiners.
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


def _unflatten(obj, flat: torch.Tensor, offsets: list[int]):
    if isinstance(obj, dict) and "__tensor__" in obj:
        i = obj["__tensor__"]
        dtype = getattr(torch, obj["dtype"].removeprefix("torch."))
        # clone first: a byte slice need not be aligned for a wider dtype's view
        return flat[offsets[i] : offsets[i + 1]].clone().view(dtype).view(obj["shape"])
    if isinstance(obj, dict) and "__dict__" in obj:
        return {
            _unflatten(k, flat, offsets): _unflatten(v, flat, offsets) for k, v in obj["__dict__"]
        }
    if isinstance(obj, dict) and "__list__" in obj:
        items = [_unflatten(v, flat, offsets) for v in obj["__list__"]]
        return tuple(items) if obj["tuple"] else items
    return obj


def pack_state(work) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed state of `work` (its `transfer_state_dict()`) as (header, flat): a small
    uint8 JSON header that describes the state dict, and one flat uint8 tensor holding the bytes
    of every tensor of it in order (any dtype: fp32 moments, bf16 weights, integer counters).

    One torch.cat instead of pickling: the copy runs in torch with the GIL released, so the
    replica's heartbeat thread keeps beating while a large model is packed (a pickle of a GB-sized
    state into bytes holds the GIL for seconds and let the lease expire).
    """
    tensors: list[torch.Tensor] = []
    structure = _flatten(work.transfer_state_dict(), tensors)
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    sizes = [part.numel() for part in parts]
    header = json.dumps({"structure": structure, "sizes": sizes}).encode()
    return torch.tensor(list(header), dtype=torch.uint8), flat


def unpack_state(work, header: torch.Tensor, flat: torch.Tensor) -> None:
    meta = json.loads(bytes(header.tolist()).decode())
    offsets = [0]
    for n in meta["sizes"]:
        offsets.append(offsets[-1] + n)
    if offsets[-1] != flat.numel():
        raise ValueError(f"state transfer: {flat.numel()} bytes received, {offsets[-1]} described")
    work.load_transfer_state(_unflatten(meta["structure"], flat, offsets))


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
    header, flat = pack_state(work) if me == source else (None, None)
    sizes = torch.tensor(
        [header.numel(), flat.numel()] if header is not None else [0, 0],
        dtype=torch.int64,
        device=device,
    )
    group.broadcast(sizes, src=src_rank, should_abort=should_abort)
    if header is None:
        header = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
        flat = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
    else:
        header, flat = header.to(device), flat.to(device)
    group.broadcast(header, src=src_rank, should_abort=should_abort)
    group.broadcast(flat, src=src_rank, should_abort=should_abort)
    if me in joined:
        unpack_state(work, header, flat)
    nbytes = header.numel() + flat.numel()
    return TransferStats(bytes=nbytes, seconds=time.perf_counter() - t0, source=source)
