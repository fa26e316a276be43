"""What a replica of several ranks is inside: FSDP2 (HSDP's shard dimension) or tensor parallel.

Job: the `ReplicaTrainer` contract for a replica made of K ranks, applied to the unchanged model
from outside. The recovery protocol does not change: each rank's snapshot is the part of the
gradient it holds, and the cross-replica reduce of that part runs among the ranks at the same
position in every live replica (see `intra.py`). Replicas of one run have the same layout, so
positions line up.

Layouts (one of them per run; the order in which they are applied is fixed and commented in each
`_parallelize`):

- `--shard S` (`ShardedTrainer`): `fully_shard` over the replica's mesh, every transformer block
  its own unit, then the root (embeddings, the tied head, the last norm). The replica's ids of a
  call are dealt round-robin to its ranks (rank k computes ids[k], ids[k + S], ...). FSDP2 needs
  every rank in every forward and backward, so a rank with one id fewer runs a padding pass on a
  real microbatch with its gradient scaled by 0 (exactly zero, no phase hook, no loss counted).
  After each backward FSDP2 reduce-scatters and adds into the sharded gradient with a plain sum.
- `--tp T` (`TensorParallelTrainer`): DTensor `parallelize_module` on every block: the q, k, v
  projections and the MLP's first layer column-wise, the two output projections row-wise (one
  all-reduce per sublayer in the forward, one in the backward). Every rank computes every id of
  the replica; embeddings, norms and the head stay whole on every rank, and their gradients are
  the same on every rank (their inputs are). Needs n_head divisible by T.

Invariants:
- the update equals the single-rank one up to summation order (tested: rtol 1e-4);
- the flat snapshot layout is the local parts in parameter order, then this rank's loss slot; at
  a commit the replica adds the slots of the ranks that count losses (each id once);
- the gradient norm for clipping counts every value once: sharded parts on every rank, whole
  (replicated) tensors on rank 0 only;
- `microbatch=K` in a fault names the K-th microbatch the targeted rank computes in the step.

Checkpoints and the final model hold the full state (torch.distributed.checkpoint's state_dict
helpers, keyed by parameter name); a checkpoint resumes into a replica of the same layout.
Dropout under TP draws each rank's attention masks for its own heads: deterministic per
(seed, step, j) and layout, but not the single-rank masks (use dropout 0 to compare layouts).
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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recover.config import TrainConfig
from recover.data.addressing import TokenDataset
from recover.model import GPT
from recover.trainer import ReplicaTrainer, local_part

_FULL = StateDictOptions(full_state_dict=True)


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


class MultiRankTrainer(ReplicaTrainer):
    """What every layout of several ranks shares: gradients as local parts, the replica's loss
    and gradient norm, and full-state checkpoints."""

    layout = ""  # the layout's name, as in the flags and the checkpoint

    def __init__(self, cfg: TrainConfig, dataset: TokenDataset, *, intra) -> None:
        self.intra = intra  # recover.intra.IntraReplica: the replica's own ranks and mesh
        super().__init__(cfg, dataset)

    counts_losses = True  # this rank's loss slot is part of the replica's loss

    def _set_grad(self, p: torch.Tensor, local: torch.Tensor) -> None:
        if isinstance(p, DTensor):
            local = DTensor.from_local(
                local,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        p.grad = local

    def _committed_loss_sum(self, flat_sum: torch.Tensor) -> float:
        mine = flat_sum[-1:].to(torch.float64).clone()
        if not self.counts_losses:
            mine.zero_()
        dist.all_reduce(mine, group=self.intra.group)
        return float(mine)

    def _clip_gradients(self, clip: float) -> float:
        sq = torch.zeros(1, dtype=torch.float64)
        grads = [p.grad for p in self.params if p.grad is not None]
        for g in grads:
            if _is_sharded(g) or self.intra.rank == 0:  # whole tensors: counted once
                sq += local_part(g).double().pow(2).sum()
        dist.all_reduce(sq, group=self.intra.group)
        norm = math.sqrt(float(sq))
        if norm > clip:
            scale = clip / (norm + 1e-6)
            for g in grads:
                local_part(g).mul_(scale)
        return norm

    def state_dict(self) -> dict:
        """The full model and optimizer state, gathered on every rank (a collective)."""
        return {
            "model": get_model_state_dict(self.model, options=_FULL),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=_FULL),
            "layout": {self.layout: self.intra.size},
        }

    def load_state_dict(self, state: dict) -> None:
        layout = state.get("layout")
        if layout != {self.layout: self.intra.size}:
            raise ValueError(
                f"checkpoint layout {layout or 'single rank'} differs from this replica's "
                f"({self.layout} {self.intra.size}); resume with the layout it was saved with"
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


class ShardedTrainer(MultiRankTrainer):
    """One model copy sharded over the S ranks of a replica by FSDP2."""

    layout = "shard"

    def __init__(self, cfg: TrainConfig, dataset: TokenDataset, *, intra) -> None:
        self._ordinal_step = -1
        self._ordinal = 0
        super().__init__(cfg, dataset, intra=intra)

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        # Fixed order: every block is its own FSDP unit (on GPUs its all-gather overlaps the
        # previous block's compute), then the root takes what is left. Sums, not means: the
        # trainer divides by M itself at the commit.
        units = [*model.transformer.h, model]
        for unit in units:
            fully_shard(unit, mesh=self.intra.mesh)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
        return model

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


class TensorParallelTrainer(MultiRankTrainer):
    """One model copy whose blocks are split over the T ranks of a replica (Megatron style)."""

    layout = "tp"

    @property
    def counts_losses(self) -> bool:  # every rank computes the same loss: count it once
        return self.intra.rank == 0

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        heads, size = model.config.n_head, self.intra.size
        if heads % size:
            raise ValueError(f"--tp {size} must divide the preset's n_head ({heads})")
        # Fixed order inside every block: attention's q, k, v column-wise (each rank gets whole
        # heads), its output projection row-wise; then the MLP the same way. Everything outside
        # the blocks stays whole on every rank.
        plan = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        }
        for block in model.transformer.h:
            parallelize_module(block, self.intra.mesh, plan)
        return model


TRAINERS = {"shard": ShardedTrainer, "tp": TensorParallelTrainer}
