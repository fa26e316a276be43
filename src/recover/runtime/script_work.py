"""The step machine's `Work` for a script's own model and optimizer (used by `recover.Replica`).

Job: give `recover.runtime.step_machine` what it needs of any model: the local gradient sum as a flat
snapshot (`recover.runtime.grads.GradientSum`), a parameter hash for the agreement check (with, opt-in, a
hash of one replayed microbatch: the data contract's check), and the committed state a joiner
receives. That state is the model's and the optimizer's state dicts taken with
torch.distributed.checkpoint's helpers (so FSDP2/DTensor state travels as this rank's shards) plus
every registered extra object's `state_dict()`.

Invariants: what a joiner loads is the source's committed state, bit for bit, laid out as the
joiner's own (DTensors rebuilt with the joiner's mesh and placements); taking the source's state
never changes it (an optimizer that never stepped sends None instead of being initialised).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from recover.runtime.grads import GradientSum, laid_out_like, local_part


def _to_local(state: Any) -> Any:
    """A state dict with every DTensor replaced by this rank's local part (what is sent)."""
    if isinstance(state, dict):
        return {k: _to_local(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_to_local(v) for v in state)
    if isinstance(state, torch.Tensor):
        return local_part(state).detach()
    return state


def _like(template: Any, received: Any) -> Any:
    """`received` (local parts) laid out like `template` (this rank's own state dict)."""
    if isinstance(received, dict) and isinstance(template, dict):
        return {k: _like(template.get(k), v) for k, v in received.items()}
    if isinstance(received, list | tuple) and isinstance(template, list | tuple):
        return type(received)(_like(t, v) for t, v in zip(template, received, strict=False))
    if isinstance(received, torch.Tensor) and isinstance(template, torch.Tensor):
        local = received.to(local_part(template).device)
        return laid_out_like(template, local) if hasattr(template, "device_mesh") else local
    return received


class ScriptWork:
    """The step machine's `Work` for a script's model and optimizer (recover.runtime.step_machine)."""

    def __init__(self, model, optimizer, extra: Mapping[str, Any], check_data, replica) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, dict(extra)
        device = next(p.device for p in model.parameters())
        self.grads = GradientSum(model.parameters(), device=device)
        self.check_data = check_data
        self.replica = replica

    def snapshot(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self.grads.snapshot(device)

    def clear(self) -> None:
        self.grads.clear()

    def nonfinite_ids(self) -> list[int]:
        return list(self.grads.nonfinite_ids)

    def parameter_hash(self) -> str:
        phash = self.grads.parameter_hash()
        if self.check_data is None:
            return phash
        # The opt-in contract check: every replica replays one microbatch of this step itself;
        # a different hash means (step, j) is not a pure function of (step, j) somewhere.
        step = self.replica.step
        j = step % self.replica.microbatches_per_step
        batch = self.check_data(step, j)
        tensors = batch if isinstance(batch, list | tuple) else (batch,)
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(torch.as_tensor(t).detach().cpu().contiguous().numpy().tobytes())
        return f"{phash}/data({step},{j}):{digest.hexdigest()[:12]}"

    def transfer_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # An optimizer that never stepped has no state; get_optimizer_state_dict would create it
        # (with one zero step) and so change this replica's bias correction: send None instead.
        optim = (
            get_optimizer_state_dict(self.model, self.optimizer) if self.optimizer.state else None
        )
        return _to_local(
            {
                "model": get_model_state_dict(self.model),
                "optimizer": optim,
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
            }
        )

    def load_transfer_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        own = get_model_state_dict(self.model)
        set_model_state_dict(self.model, _like(own, state["model"]))
        if state["optimizer"] is not None:
            # (creates this optimizer's empty state by one zero step, which the load overwrites)
            self.replica._internal_step = True
            try:
                own = get_optimizer_state_dict(self.model, self.optimizer)
            finally:
                self.replica._internal_step = False
            set_optimizer_state_dict(self.model, self.optimizer, _like(own, state["optimizer"]))
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])
