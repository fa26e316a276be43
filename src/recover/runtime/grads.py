"""A rank's local gradient sum, as the step machine sees it: the `.grad` of a parameter list.

Job: turn the gradients that backward passes accumulated in `p.grad` (plus the sum of the counted
microbatch losses) into one flat fp32 snapshot, and the committed flat sum back into `p.grad`.
Works for any module: plain tensors, and DTensors (FSDP2 shards, tensor-parallel splits), of which
this rank's local part is taken and restored with the parameter's own layout.

Layout of a flat buffer: the local parts of the parameters in list order, then one slot holding
the loss sum (so the committed loss travels with the gradient through one reduce).

Cost: one flat copy per attempt (the snapshot, reduced in place); at a commit the gradients
are views of the committed buffer (a copy only across devices or to another dtype).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import cast

import torch


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: the local shard of a DTensor, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of `grad` laid out as parameter `p` is: a DTensor gradient whose
    placements differ from its parameter's (a module that leaves its weight's gradient replicated
    or partial over the tensor-parallel ranks while the weight is sharded) is redistributed to
    the parameter's first, a collective over p's mesh that every rank of the replica makes."""
    if hasattr(grad, "placements") and hasattr(p, "placements"):
        from torch.distributed.tensor import DTensor

        g, w = cast(DTensor, grad), cast(DTensor, p)
        if tuple(g.placements) != tuple(w.placements):
            grad = g.redistribute(w.device_mesh, w.placements)
    return local_part(grad)


def laid_out_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's part) as a tensor laid out like parameter `p`: a DTensor with p's
    mesh, placements and global shape when p is one, else `local` itself."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    d = cast(DTensor, p)
    return DTensor.from_local(
        local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
    )


@contextmanager
def set_aside(params: list[torch.Tensor]) -> Iterator[None]:
    """Run a pipeline schedule over `params` with their gradient sum so far set aside, then add
    it back to what the schedule left: a new schedule drops FSDP2 parameters' gradients (after
    its shape inference, even with static shapes), so the sum of a step's earlier parts (a redo
    of lost ids runs a second schedule) would otherwise be lost. Nothing is added back when the
    schedule raises: that attempt is abandoned with its gradients."""
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    yield
    for p, before in zip(params, kept, strict=True):
        if before is not None:
            added = local_grad(p, p.grad) if p.grad is not None else 0
            p.grad = laid_out_like(p, local_grad(p, before) + added)


class GradientSum:
    """This rank's sum over the microbatches it computed in a step: `p.grad` and `loss_sum`."""

    def __init__(self, params: Iterable[torch.Tensor], *, device: torch.device | str) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameter that requires a gradient")
        self.device = torch.device(device)
        # Each parameter's values in a flat buffer (its local part), and the total: this rank's.
        self.ranges: list[tuple[int, int]] = []
        offset = 0
        for p in self.params:
            n = local_part(p).numel()
            self.ranges.append((offset, offset + n))
            offset += n
        self.numel = offset
        self.loss_sum = 0.0
        self.nonfinite_ids: list[int] = []  # ids of this step whose loss was not finite
        # Microbatches counted since the last clear (the step's reduce starts its buckets during
        # the pass of the attempt's last one: recover.runtime.overlap).
        self.counted = 0
        # Whether the step's reduce may follow p.grad with hooks: every parameter a plain tensor
        # (FSDP2 and tensor parallelism write the gradients of DTensors themselves).
        self.hookable = not any(hasattr(p, "device_mesh") for p in self.params)

    def add_loss(self, j: int, loss: float) -> None:
        """Count microbatch j's loss in the sum (and remember j if the loss is not finite), after
        its backward pass."""
        self.loss_sum += loss
        self.counted += 1
        if not math.isfinite(loss):
            self.nonfinite_ids.append(j)

    def snapshot(self, device: torch.device | str | None = None) -> torch.Tensor:
        """A fresh flat fp32 copy of the local gradient sum and loss sum (numel + 1 values), on
        `device` (default: the gradients' own): the attempt's one buffer, which the cross-replica
        reduce sums in place (`p.grad`, the local sum, is never touched by it)."""
        flat = torch.empty(self.numel + 1, dtype=torch.float32, device=device or self.device)
        for i in range(len(self.params)):  # every value written once
            self.write_part(flat, i)
        flat[-1] = self.loss_sum
        return flat

    def write_part(self, flat: torch.Tensor, i: int) -> None:
        """Write parameter i's local gradient into its range of `flat` (the snapshot's layout): a
        copy, or zeros where it has no gradient."""
        start, stop = self.ranges[i]
        p = self.params[i]
        if p.grad is not None:
            flat[start:stop].copy_(local_grad(p, p.grad).reshape(-1))
        else:
            flat[start:stop].zero_()

    def load(self, flat: torch.Tensor, *, divide_by: float = 1.0) -> None:
        """Set every `p.grad` from a flat buffer of the snapshot's layout, divided by `divide_by`
        (M at a commit: the mean over the step's microbatches).

        The buffer is taken over, not copied, where it can be (same device, fp32 parameters):
        each `p.grad` is a view of it, divided in place; its last slot (the loss sum) is left
        as it was. A caller reads what it needs of the buffer first."""
        if flat.numel() != self.numel + 1:
            raise ValueError(f"flat buffer has {flat.numel()} values, expected {self.numel + 1}")
        flat = flat.to(self.device)  # gloo's sum is in host memory; a no-op on the same device
        parts = [local_part(p) for p in self.params]
        # Where every part is the buffer's dtype, one division over the gradient values (the same
        # bits as one per part: a division is exact to the rounding, element by element) instead
        # of one op per parameter; a part of another dtype is converted first, then divided.
        at_once = divide_by != 1.0 and all(part.dtype == flat.dtype for part in parts)
        if at_once:
            flat[:-1].div_(divide_by)
        for p, part, (start, stop) in zip(self.params, parts, self.ranges, strict=True):
            g = flat[start:stop].view_as(part)
            if g.dtype != part.dtype:
                g = g.to(part.dtype)
            if divide_by != 1.0 and not at_once:
                g.div_(divide_by)
            p.grad = laid_out_like(p, g)

    def hold(self) -> tuple[list[torch.Tensor | None], float, list[int], int]:
        """The local sum as it is (each `p.grad` by reference, no copy), for `put_back`: `load`
        and `clear` replace the `.grad` tensors, they never write into them, so what is held
        stays the sum."""
        return [p.grad for p in self.params], self.loss_sum, list(self.nonfinite_ids), self.counted

    def put_back(self, held: tuple[list[torch.Tensor | None], float, list[int], int]) -> None:
        """Make the local sum what `hold()` gave (an update applied during the vote, undone)."""
        tensors, self.loss_sum, nonfinite, self.counted = held
        self.nonfinite_ids = list(nonfinite)
        for p, g in zip(self.params, tensors, strict=True):
            p.grad = g

    def clear(self) -> None:
        for p in self.params:
            p.grad = None
        self.loss_sum = 0.0
        self.nonfinite_ids = []
        self.counted = 0

    def leftover(self) -> list[int]:
        """Indices of parameters whose `.grad` holds non-zero values (before a step begins, the
        sum must be empty: anything there would be added to the step's gradient)."""
        return [
            i
            for i, p in enumerate(self.params)
            if p.grad is not None and bool(local_part(p.grad).ne(0).any())
        ]

    def flat_parameters(self) -> torch.Tensor:
        """This rank's parameter values, flat (the local shards in a sharded replica)."""
        return torch.cat([local_part(p.detach()).reshape(-1).float().cpu() for p in self.params])

    def parameter_hash(self) -> str:
        """A cheap, exact fingerprint of this rank's parameters (sha256 of their bytes, 16 hex)."""
        # hashlib reads the array through the buffer protocol (no copy) and releases the GIL.
        flat = self.flat_parameters().numpy()
        return hashlib.sha256(flat).hexdigest()[:16]  # type: ignore[arg-type]  # (a buffer)
