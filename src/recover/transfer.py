"""Live state transfer to joining replicas, over the new epoch's group (no disk round trip).

Job: when the coordinator admits joiners at a step boundary, every member of the new epoch calls
`transfer_state` before the step: the source (the lowest member that is not a joiner) packs the
committed model and optimizer state, and one bucketed broadcast through the fault-tolerant
collective copies it to everyone; the joiners load it. The step counter and the learning-rate
schedule need no transfer: the step comes with the view and lr(step) is a pure function.

Invariants: a joiner computes nothing before it has loaded the committed state; the payload is the
source's `ReplicaTrainer.state_dict()`, bit for bit. A failure during the transfer is a collective
failure like any other (the caller reports it and the step is redone in the next epoch, where the
transfer is repeated).

Cost: one serialisation of the state (parameters plus two AdamW moments: about 12 bytes per
parameter) and one broadcast of it; members that already hold the state receive it too (a
broadcast reaches every rank of the group), which costs them the same time as the joiners.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import torch

from recover.collective import EpochGroup, ShouldAbort
from recover.trainer import ReplicaTrainer


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float
    source: int  # replica id of the sender


def pack_state(trainer: ReplicaTrainer) -> torch.Tensor:
    """The trainer's committed state as a flat uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack_state(trainer: ReplicaTrainer, payload: torch.Tensor) -> None:
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)
    trainer.load_state_dict(state)


def transfer_state(
    group: EpochGroup,
    trainer: ReplicaTrainer,
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
    payload = pack_state(trainer) if me == source else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    group.broadcast(size, src=src_rank, should_abort=should_abort)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast(payload, src=src_rank, should_abort=should_abort)
    if me in joined:
        unpack_state(trainer, payload)
    return TransferStats(bytes=int(size.item()), seconds=time.perf_counter() - t0, source=source)
