"""The step machine's `Work` for a script's own model and optimizer (used by `recover.Replica`).

Job: give `recover.runtime.step_machine` what it needs of any model: the local gradient sum as a flat
snapshot (`recover.runtime.grads.GradientSum`), a parameter hash for the agreement check (with, opt-in, a
hash of one replayed microbatch: the data contract's check), and the committed state a joiner
receives. That state is the model's state dict taken with torch.distributed.checkpoint's helper
and the optimizer's own state dict (by position), each DTensor as this rank's shard, plus every
registered extra object's `state_dict()`.

Invariants: what a joiner loads is the source's committed state, bit for bit, laid out as the
joiner's own (DTensors rebuilt with the joiner's mesh and placements); taking the source's state
never changes it (an optimizer that never stepped sends None instead of being initialised).

Also the script's model as the library handles it at the edges of a job: FSDP2 units set to sum
(`sum_inside_fsdp`: the step divides by M once, at the commit), and the final model gathered and
written (`whole_state`, `save_safetensors`).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from recover.runtime.grads import GradientSum, laid_out_like, local_part

if TYPE_CHECKING:
    from recover.runtime.links import IntraReplica


class ReplicaProgress(Protocol):
    """What the data check reads of the script's replica (a `recover.Replica`)."""

    @property
    def step(self) -> int | None: ...  # the step in progress
    @property
    def microbatches_per_step(self) -> int: ...


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

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, Any],
        check_data: Callable[[int, int], Any] | None,
        replica: ReplicaProgress | None,
        *,
        one_rank: bool = True,
    ) -> None:
        """`one_rank`: the replica is this process alone (several ranks deal their ids over the
        shard dimension with padding passes, which the overlapped reduce cannot follow)."""
        self.model, self.optimizer, self.extra = model, optimizer, dict(extra)
        device = next(p.device for p in model.parameters())
        self.grads = GradientSum(model.parameters(), device=device)
        self.check_data = check_data
        self.replica = replica
        self.one_rank = one_rank

    def snapshot(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self.grads.snapshot(device)

    def clear(self) -> None:
        self.grads.clear()

    def nonfinite_ids(self) -> list[int]:
        return list(self.grads.nonfinite_ids)

    def overlap_grads(self) -> GradientSum | None:
        return self.grads if self.one_rank and self.grads.hookable else None

    def parameter_hash(self) -> str:
        phash = self.grads.parameter_hash()
        if self.check_data is None:
            return phash
        # The opt-in contract check: every replica replays one microbatch of this step itself;
        # a different hash means (step, j) is not a pure function of (step, j) somewhere.
        replica = self.replica
        step = replica.step if replica is not None else None
        if replica is None or step is None:  # (a Replica's check runs inside its steps)
            raise RuntimeError("the data check of parameter_hash() needs a replica inside a step")
        j = step % replica.microbatches_per_step
        batch = self.check_data(step, j)
        tensors = batch if isinstance(batch, list | tuple) else (batch,)
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(torch.as_tensor(t).detach().cpu().contiguous().numpy().tobytes())
        return f"{phash}/data({step},{j}):{digest.hexdigest()[:12]}"

    def transfer_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # The optimizer's own state dict, by position: the joiner runs the same script, so its
        # parameters come in the same order. One that never stepped has no state: None is sent
        # (creating it would take a zero step and change this replica's bias correction).
        optim = self.optimizer.state_dict() if self.optimizer.state else None
        if optim is not None:
            # Which values are DTensors (sent as their local part): the joiner makes exactly
            # those DTensors again. A plain tensor stays one, whatever its shape: an optimizer
            # working on the local shard keeps plain state (factored moments, a flat slice),
            # some of it shaped like the shard.
            optim["dtensors"] = [
                [i, k]
                for i, values in optim["state"].items()
                for k, v in values.items()
                if hasattr(v, "device_mesh")
            ]
        local: dict[str, Any] = _to_local(  # (a dict stays a dict)
            {
                "model": get_model_state_dict(self.model),
                "optimizer": optim,
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
            }
        )
        return local

    def load_transfer_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
        )

        own = get_model_state_dict(self.model)
        set_model_state_dict(self.model, _like(own, state["model"]))
        if state["optimizer"] is not None:
            # Loaded as torch's optimizers load their own state dict: the received tensors become
            # the state (no copy where dtype and device match). torch.distributed.checkpoint's
            # helper would first create the state by a zero step over every parameter (3-6 s on
            # a 124M-parameter AdamW model) and copy into it.
            self.optimizer.load_state_dict(self._laid_out(state["optimizer"]))
        for name, obj in self.extra.items():
            obj.load_state_dict(state["extra"][name])

    def _laid_out(self, optim: dict[str, Any]) -> dict[str, Any]:
        """A received optimizer state dict (local parts, by position) laid out like this rank's
        parameters: each value that was a DTensor at the source (`dtensors`) becomes a DTensor
        like its parameter; every other value is loaded as it came. (A sender that did not name
        them: the values shaped like a sharded parameter's local part.)"""
        optim = dict(optim)
        named = optim.pop("dtensors", None)
        was_dtensor = {(str(i), k) for i, k in named} if named is not None else None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {}
        for i, values in optim["state"].items():
            p = params[int(i)]
            device = local_part(p).device
            state[i] = {
                k: laid_out_like(p, v.to(device))
                if _was_sharded(p, v, (str(i), k), was_dtensor)
                else v
                for k, v in values.items()
            }
        return {**optim, "state": state}


def _was_sharded(
    p: torch.Tensor, value: Any, key: tuple[str, str], was_dtensor: set[tuple[str, str]] | None
) -> bool:
    """Whether a received optimizer value of parameter `p` was a DTensor at the source: named in
    `was_dtensor`, or (a sender that did not name them) shaped like p's local part."""
    if not isinstance(value, torch.Tensor) or not hasattr(p, "device_mesh"):
        return False
    if was_dtensor is not None:
        return key in was_dtensor
    return value.dim() > 0 and value.shape == local_part(p).shape


def whole_state(model: torch.nn.Module, intra: IntraReplica | None) -> dict[str, Any]:
    """The model's whole state on the CPU (on the first rank of a sharded replica: gathering
    it is a collective of the replica's ranks; the others get nothing). A replica cut into
    pipeline stages merges its stages' states, which name their parameters as the whole model
    does (a name held by two stages is refused: the merged model would lose one)."""
    if intra is None:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if intra.layout.pp == 1:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    # (cpu_offload would keep the values on the replica's first rank only: every stage's
    # state is needed, so each stage takes its whole state and moves it itself.)
    options = StateDictOptions(full_state_dict=True)
    state = {
        k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
        for k, v in get_model_state_dict(model, options=options).items()
    }
    # One rank per stage speaks for it (shard and tp coordinates 0: they hold the whole stage).
    speaks = intra.coordinate("shard") == 0 and intra.coordinate("tp") == 0
    stages = [s for s in intra.gather(state if speaks else None) if s is not None]
    merged: dict[str, Any] = {}
    for n, stage in enumerate(stages):
        twice = sorted(set(merged) & set(stage))
        if twice:
            from recover.runtime.usage import UsageError

            raise UsageError(
                f"pipeline stage {n} and an earlier stage both hold {twice[:3]}: name each "
                "stage's parameters as the whole model does (keep the whole model's module names "
                "in every stage)"
            )
        merged.update(stage)
    return merged if intra.rank == 0 else {}


def save_safetensors(state: dict[str, torch.Tensor], path: Path) -> bool:
    """Write `state` to `path` durably (a temporary file, fsync, rename); False, and nothing
    written, when a value is not finite."""
    from safetensors.torch import save_file

    tensors, storages = {}, set()
    for name, value in state.items():
        value = value.detach().contiguous()
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return False
        where = value.untyped_storage().data_ptr()
        if where in storages:  # tied weights: safetensors stores each storage once
            value = value.clone()
        storages.add(where)
        tensors[name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True


def sum_inside_fsdp(model: torch.nn.Module) -> None:
    """FSDP2 averages gradients over the shard ranks by default; the step sums over microbatches
    and divides by M once, at the commit, so every FSDP2 unit of the model must sum."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def explain_divergence(text: str) -> str:
    """The coordinator's divergence message, plus which half of the hashes differs when the data
    check was on ("PARAMS/data(step,j):BATCH", see ScriptWork.parameter_hash)."""
    held = re.findall(r"hold (\S+?)(?:;|\. )", text)
    if not held or not all("/data(" in h for h in held):
        return text
    params = {h.split("/data(")[0] for h in held}
    batches = {h.split("/data(")[1] for h in held}
    if len(batches) > 1:
        return (
            f"{text}. The data parts differ: the replicas' microbatch of that step is not the "
            "same, so (step, j) is not a pure function of (step, j) in this script (see the "
            "contract in docs/api.md)"
        )
    if len(params) > 1:
        return f"{text}. The data parts agree: the parameters themselves differ"
    return text
