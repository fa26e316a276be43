"""A replica of several ranks that shard one model copy with FSDP2 (HSDP's shard dimension).

Job: the `ReplicaTrainer` contract for a replica made of S ranks. The model is wrapped with
`fully_shard` over the replica's own mesh (every transformer block, then the root, which holds
the embeddings, the tied head and the last norm); each rank keeps 1/S of every parameter, of its
gradient and of the optimizer state. The recovery protocol does not change: each rank's snapshot
is its gradient shard, and the cross-replica reduce of that shard runs among the ranks at the same
position in every live replica (see `intra.py`).

How a replica's microbatches are split: the replica's ids for the call are dealt round-robin to
its ranks (rank k computes ids[k], ids[k + S], ...). FSDP2 needs every rank of the mesh in every
forward and backward (they all-gather and reduce-scatter together), so a rank with one id fewer
runs a padding pass on a real microbatch with its gradient scaled by 0: exactly zero, no phase
hook, no loss counted. After each backward FSDP2 reduce-scatters and adds into the sharded
gradient with a plain sum (divide factor 1): the shard then holds its part of the sum over every
id the replica computed, as the single-rank trainer's gradient does.

Invariants:
- the update equals the single-rank one up to summation order (tested: rtol 1e-4);
- the flat snapshot layout is the local shards in parameter order, then this rank's loss sum;
  at a commit the ranks add their loss slots, so the committed loss counts each id once;
- `microbatch=K` in a fault names the K-th microbatch the targeted rank computes in the step.

Checkpoints hold the full state (gathered with torch.distributed.checkpoint's state_dict
helpers, keyed by parameter name) and resume into a replica of the same layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from recover.config import TrainConfig
from recover.data.addressing import TokenDataset
from recover.model import GPT
from recover.trainer import ReplicaTrainer, local_part

_FULL = StateDictOptions(full_state_dict=True)


class ShardedTrainer(ReplicaTrainer):
    """One model copy sharded over the S ranks of a replica (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, dataset: TokenDataset, *, intra) -> None:
        self.intra = intra  # recover.intra.IntraReplica: the replica's own ranks and mesh
        self._ordinal_step = -1
        self._ordinal = 0
        super().__init__(cfg, dataset)

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        # One fixed order: every block is its own FSDP unit (its all-gather overlaps the previous
        # block's compute on GPUs), then the root takes what is left. Sums, not means: the
        # trainer divides by M itself at the commit.
        units = [*model.transformer.h, model]
        for unit in units:
            fully_shard(unit, mesh=self.intra.mesh)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
        return model

    # ---- microbatches -------------------------------------------------------------------------
    def compute_microbatches(self, step: int, ids: Iterable[int], *, first_index: int = 0) -> None:
        ids = list(ids)
        size, rank = self.intra.size, self.intra.rank
        if step != self._ordinal_step:
            self._ordinal_step, self._ordinal = step, 0
        self.model.train()
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size]
            if rank < len(chunk):
                self._microbatch(step, chunk[rank], self._ordinal)
                self._ordinal += 1
            else:  # padding: keeps this rank in the mesh's collectives, adds exactly zero
                self._microbatch(step, chunk[0], None, weight=0.0)

    # ---- gradients ----------------------------------------------------------------------------
    def _set_grad(self, p: torch.Tensor, local: torch.Tensor) -> None:
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    def _committed_loss_sum(self, flat_sum: torch.Tensor) -> float:
        # Each position's slot holds the losses of the ids its ranks computed: add the positions.
        total = flat_sum[-1:].to(torch.float64).clone()
        dist.all_reduce(total, group=self.intra.group)
        return float(total)

    def _clip_gradients(self, clip: float) -> float:
        # The global norm of the whole gradient: add every rank's local squares (every parameter
        # is sharded, so no value is counted twice), then scale the local shards alike.
        local = [local_part(p.grad) for p in self.params if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64)
        for g in local:
            sq += g.double().pow(2).sum()
        dist.all_reduce(sq, group=self.intra.group)
        norm = math.sqrt(float(sq))
        if norm > clip:
            scale = clip / (norm + 1e-6)
            for g in local:
                g.mul_(scale)
        return norm

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full model and optimizer state, gathered on every rank (a collective)."""
        return {
            "model": get_model_state_dict(self.model, options=_FULL),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=_FULL),
            "layout": {"shard": self.intra.size},
        }

    def load_state_dict(self, state: dict) -> None:
        layout = state.get("layout")
        if layout != {"shard": self.intra.size}:
            raise ValueError(
                f"checkpoint layout {layout or 'single rank'} differs from this replica's "
                f"(shard {self.intra.size}); resume with the layout it was saved with"
            )
        set_model_state_dict(self.model, state["model"], options=_FULL)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=_FULL)

    def save_model(self, path: str | None) -> None:
        from safetensors.torch import save_model

        full = get_model_state_dict(self.model, options=_FULL)  # every rank takes part
        if path is None:
            return
        plain = GPT(self.model_config)
        plain.load_state_dict(full)
        save_model(plain, path)
