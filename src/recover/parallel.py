"""What a replica of several ranks is inside: FSDP2 (HSDP's shard dimension) or tensor parallel.

Job: the `ReplicaTrainer` contract for a replica made of K ranks, applied to the unchanged model
from outside. The recovery protocol does not change: each rank's snapshot is the part of the
gradient it holds, and the cross-replica reduce of that part runs among the ranks at the same
position in every live replica (see `intra.py`). Replicas of one run have the same layout, so
positions line up.

Layouts (the order in which each is applied is fixed and commented where it is applied):

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
- `--shard S --tp T` (`ShardedTensorParallelTrainer`, S x T ranks): TP inside each group of T
  ranks, FSDP2 across the S groups (torch's 2-D recipe); ids dealt over the shard dimension.
- `--pp P` (`PipelineTrainer`, alone for now): P consecutive GPipe stages; see the class.

Invariants:
- the update equals the single-rank one up to summation order (tested: rtol 1e-4);
- the flat snapshot layout is the local parts in parameter order, then this rank's loss slot; at
  a commit the replica adds the slots of the ranks that count losses (each id once);
- the gradient norm for clipping counts every value once: along each mesh dimension, a gradient
  sharded on it counts on every rank, one replicated on it on coordinate 0 only;
- `microbatch=K` in a fault names the K-th microbatch the targeted rank computes in the step.

Checkpoints and the final model hold the full state (torch.distributed.checkpoint's state_dict
helpers, keyed by parameter name); a checkpoint resumes into a replica of the same layout.
Dropout under TP draws each rank's attention masks for its own heads: deterministic per
(seed, step, j) and layout, but not the single-rank masks (use dropout 0 to compare layouts).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recover.config import TrainConfig, describe_layout
from recover.data.addressing import TokenDataset, microbatch_seed
from recover.model import GPT, embed, lm_loss
from recover.trainer import ReplicaTrainer, local_part

_FULL = StateDictOptions(full_state_dict=True)


def _laid_out_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's part) as a tensor laid out like parameter `p`: a DTensor with p's
    mesh, placements and global shape when p is one, else `local` itself."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


class MultiRankTrainer(ReplicaTrainer):
    """What every layout of several ranks shares: gradients as local parts, the replica's loss
    and gradient norm, and full-state checkpoints."""

    layout = ""  # the layout's name, as in the flags and the checkpoint

    def __init__(
        self, cfg: TrainConfig, dataset: TokenDataset, *, intra, device: str = "cpu"
    ) -> None:
        self.intra = intra  # recover.intra.IntraReplica: the replica's own ranks and mesh
        self._ordinal_step, self._ordinal = -1, 0
        super().__init__(cfg, dataset, device=device)

    def _next_ordinal(self, step: int) -> int:
        """The phase hook's index of this rank's next microbatch: the K-th it computes in the
        step (its own count: the ranks of a replica do not compute the same ids)."""
        if step != self._ordinal_step:
            self._ordinal_step, self._ordinal = step, 0
        self._ordinal += 1
        return self._ordinal - 1

    @property
    def counts_losses(self) -> bool:
        """Whether this rank's loss slot is part of the replica's loss: ranks split the ids over
        the shard dimension and compute the same loss along tp."""
        return self.intra.coordinate("tp") == 0

    def _set_grad(self, p: torch.Tensor, local: torch.Tensor) -> None:
        p.grad = _laid_out_like(p, local)

    def _committed_loss_sum(self, flat_sum: torch.Tensor) -> float:
        mine = flat_sum[-1:].to(self.device, torch.float64, copy=True)
        if not self.counts_losses:
            mine.zero_()
        dist.all_reduce(mine, group=self.intra.group)
        return float(mine)

    def _counted_in_norm(self, p: torch.Tensor) -> bool:
        """Whether this rank adds p's gradient to the global norm, so that every value counts
        once: along each dimension of the replica's mesh, a gradient sharded on it counts on
        every rank, one replicated on it (or not laid out on it) on coordinate 0 only."""
        g = p.grad
        placed = {}
        if isinstance(g, DTensor):
            names = g.device_mesh.mesh_dim_names or ()
            placed = dict(zip(names, g.placements, strict=True))
        return all(
            (dim in placed and not placed[dim].is_replicate()) or self.intra.coordinate(dim) == 0
            for dim in self.intra.dims
        )

    def _clip_gradients(self, clip: float) -> float:
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        with_grad = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in with_grad]
        for p in with_grad:
            if self._counted_in_norm(p):
                sq += local_part(p.grad).double().pow(2).sum()
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
            "layout": dict(self.intra.dims),
        }

    def load_state_dict(self, state: dict) -> None:
        self._check_layout(state)
        set_model_state_dict(self.model, state["model"], options=_FULL)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=_FULL)

    def transfer_state_dict(self) -> dict:
        """The part of the committed state this rank holds (no collective): its parameters'
        local parts and its optimizer state's, for the joiner's rank at the same position."""
        opt = self.optimizer.state_dict()
        state = {
            i: {k: local_part(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in opt["state"].items()
        }
        return {
            "model": {n: local_part(p.detach()) for n, p in self.model.named_parameters()},
            "optimizer": {"state": state, "param_groups": opt["param_groups"]},
        }

    def load_transfer_state(self, state: dict) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                local_part(p).copy_(state["model"][name])
        # The optimizer's moments of a DTensor parameter are DTensors laid out like it.
        ordered = [p for group in self.optimizer.param_groups for p in group["params"]]
        opt = state["optimizer"]
        for i, s in opt["state"].items():
            p = ordered[int(i)]
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # ("step" is a scalar)
                    s[k] = _laid_out_like(p, v.view_as(local_part(p)))
        self.optimizer.load_state_dict(opt)

    def _check_layout(self, state: dict) -> None:
        layout = state.get("layout")
        if layout != self.intra.dims:
            saved, mine = describe_layout(layout), describe_layout(self.intra.dims)
            raise ValueError(
                f"the checkpoint was saved by replicas of {saved}, this replica is {mine}; "
                f"resume with {saved}"
            )

    def _whole_model(self) -> GPT:
        """A plain GPT holding the whole model (a collective: every rank takes part)."""
        whole = GPT(self.model_config)
        whole.load_state_dict(get_model_state_dict(self.model, options=_FULL))
        return whole

    def save_model(self, path: str | None) -> None:
        from safetensors.torch import save_model

        whole = self._whole_model()
        if path is not None:
            save_model(whole, path)


def _fully_shard(model: GPT, mesh) -> GPT:
    """FSDP2 over `mesh`, in one fixed order: every block its own unit (on GPUs its all-gather
    overlaps the previous block's compute), then the root takes what is left (embeddings, the
    tied head, the last norm). Sums, not means: the trainer divides by M at the commit."""
    units = [*model.transformer.h, model]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def _tensor_parallel(model: GPT, mesh) -> GPT:
    """Split every block over `mesh`, in one fixed order inside each block: attention's q, k, v
    column-wise (each rank gets whole heads), its output projection row-wise; then the MLP the
    same way. Everything outside the blocks stays whole on every rank."""
    plan = {  # (recover.config.check_layout_fits checked that T divides n_head)
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for block in model.transformer.h:
        parallelize_module(block, mesh, plan)
    return model


class ShardedTrainer(MultiRankTrainer):
    """One model copy sharded over the S ranks of a replica by FSDP2."""

    layout = "shard"

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        return _fully_shard(model, self.intra.submesh("shard"))

    def compute_microbatches(self, step: int, ids: Iterable[int], *, first_index: int = 0) -> None:
        ids = list(ids)
        size, rank = self.intra.dims["shard"], self.intra.coordinate("shard")
        self.model.train()
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size]
            if rank < len(chunk):
                self._microbatch(step, chunk[rank], self._next_ordinal(step))
            else:  # padding: keeps this rank in the mesh's collectives, adds exactly zero
                self._microbatch(step, chunk[0], None, weight=0.0)


class ShardedTensorParallelTrainer(ShardedTrainer):
    """Both at once (`--shard S --tp T`, S x T ranks): TP inside each group of T ranks, then FSDP2
    across the S groups. The ids are dealt over the shard dimension; the T ranks of a group
    compute the same ids."""

    layout = "shard+tp"

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        # TP first (it rewrites the blocks' parameters as DTensors on the tp mesh), then FSDP2
        # shards those over the shard mesh: the order torch's 2-D (FSDP + TP) recipe needs.
        _tensor_parallel(model, self.intra.submesh("tp"))
        return _fully_shard(model, self.intra.submesh("shard"))


class TensorParallelTrainer(MultiRankTrainer):
    """One model copy whose blocks are split over the T ranks of a replica (Megatron style)."""

    layout = "tp"

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        return _tensor_parallel(model, self.intra.submesh("tp"))


class _Stage(nn.Module):
    """The layers of one pipeline stage, under the whole model's parameter names."""

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        n = model.config.n_layer
        lo, hi = stage * n // stages, (stage + 1) * n // stages  # contiguous, balanced
        self.first, self.last = stage == 0, stage == stages - 1
        parts: dict[str, nn.Module] = {}
        if self.first:
            parts.update(wte=model.transformer.wte, wpe=model.transformer.wpe)
            parts.update(drop=model.transformer.drop)
        parts["h"] = nn.ModuleDict({str(i): model.transformer.h[i] for i in range(lo, hi)})
        if self.last:
            parts["ln_f"] = model.transformer.ln_f
            self.lm_head = model.lm_head  # tied to wte: the first stage holds the other copy
        self.transformer = nn.ModuleDict(parts)
        self.before_forward: Callable[[], Callable[[torch.Tensor], None]] | None = None
        self.autocast: Callable = contextlib.nullcontext  # the trainer's, set after building

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        after = self.before_forward() if self.before_forward is not None else None
        with self.autocast():
            if self.first:
                x = embed(self.transformer, x)
            for block in self.transformer["h"].values():
                x = block(x)
            if self.last:
                x = self.lm_head(self.transformer["ln_f"](x))
        x = x.float()  # what travels between stages and into the loss: fp32, as declared
        if after is not None:
            after(x)
        return x


class PipelineTrainer(MultiRankTrainer):
    """One model copy cut into P consecutive stages, one per rank of the replica (GPipe).

    The replica's ids of a call are the pipeline's microbatches, in order. The tied embedding
    and head live on the first and the last stage: after each call their gradient contributions
    are summed between those two ranks, so both copies get the same update and stay tied. Dropout
    is seeded per (seed, step, j) at the start of every stage's forward of microbatch j.
    """

    layout = "pp"

    def __init__(
        self, cfg: TrainConfig, dataset: TokenDataset, *, intra, device: str = "cpu"
    ) -> None:
        super().__init__(cfg, dataset, intra=intra, device=device)
        stage: _Stage = self.model
        stage.autocast = self.autocast
        self._tied = stage.lm_head.weight if stage.last else stage.transformer["wte"].weight
        # Every rank takes part in creating the group of the two ends (a collective).
        self._tie_group = dist.new_group([0, intra.size - 1])
        # Shapes given up front (static): no inference pass through the stage at the first step.
        mb, seq, width = cfg.microbatch_size, cfg.seq_len, self.model_config.n_embd
        # (requires_grad: a stage's received activations need their gradient sent back.)
        hidden = torch.empty(mb, seq, width, device="meta", requires_grad=True)
        self._pipe = PipelineStage(
            stage, intra.rank, intra.size, self.device, group=intra.group,
            input_args=torch.empty(mb, seq, dtype=torch.long, device="meta") if stage.first
            else hidden,
            output_args=torch.empty(mb, seq, self.model_config.vocab_size, device="meta")
            if stage.last else hidden,
            output_grads=None if stage.last else hidden,
            input_grads=None if stage.first else hidden,
        )  # fmt: skip

    @property
    def counts_losses(self) -> bool:
        return self.model.last

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        # (recover.config.check_layout_fits checked that every stage gets a layer)
        return _Stage(model, self.intra.rank, self.intra.size)

    def _counted_in_norm(self, p: torch.Tensor) -> bool:
        return not (self.model.last and p is self._tied)  # the tied copy counts on stage 0

    def compute_microbatches(self, step: int, ids: Iterable[int], *, first_index: int = 0) -> None:
        ids = list(ids)
        if not ids:
            return
        stage: _Stage = self.model
        stage.train()
        calls = iter(ids)

        def before_forward():
            j, index = next(calls), self._next_ordinal(step)
            torch.manual_seed(microbatch_seed(self.cfg.seed, step, j))  # dropout of (step, j)
            self.phase_hook("forward", step, index)

            def after(out: torch.Tensor) -> None:
                def on_backward(grad: torch.Tensor) -> None:
                    self.phase_hook("backward", step, index)
                    self.phase_hook("done", step, index)

                if out.requires_grad:
                    out.register_hook(on_backward)

            return after

        tied_before = self._tied.grad.clone() if self._tied.grad is not None else None
        stage.before_forward = before_forward
        try:
            schedule = ScheduleGPipe(
                self._pipe, n_microbatches=len(ids), loss_fn=lm_loss, scale_grads=False
            )
            if stage.first:
                schedule.step(torch.cat([self._tokens(step, j)[0] for j in ids]))
            elif stage.last:
                losses: list[torch.Tensor] = []
                schedule.step(
                    target=torch.cat([self._tokens(step, j)[1] for j in ids]), losses=losses
                )
                self.loss_sum += sum(float(x.detach()) for x in losses)
            else:
                schedule.step()
        finally:
            stage.before_forward = None
        self._sum_tied(tied_before)

    def _sum_tied(self, before: torch.Tensor | None) -> None:
        """Add the two ends' new contributions to the tied weight's gradient, on both ends."""
        stage: _Stage = self.model
        if not (stage.first or stage.last):
            return
        grad = self._tied.grad if self._tied.grad is not None else torch.zeros_like(self._tied)
        delta = grad - before if before is not None else grad.clone()
        dist.all_reduce(delta, group=self._tie_group)
        self._tied.grad = delta if before is None else before + delta

    # ---- evaluation and state: through the whole model, gathered --------------------------------
    def _whole_model(self) -> GPT:
        """A plain GPT holding every stage's parameters (a collective: all ranks take part)."""
        parts = self.intra.gather({k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        whole = GPT(self.model_config)
        state = {}
        for part in parts:
            state.update(part)
        state["transformer.wte.weight"] = state["lm_head.weight"]  # tied: one tensor
        whole.load_state_dict(state)
        return whole

    def evaluate(self) -> float:
        stage, self.model = self.model, self._whole_model()
        try:
            return super().evaluate()
        finally:
            self.model = stage

    def state_dict(self) -> dict:
        return {
            "model": self._whole_model().state_dict(),
            "optimizer_stages": self.intra.gather(self.optimizer.state_dict()),
            "layout": dict(self.intra.dims),
        }

    def load_state_dict(self, state: dict) -> None:
        self._check_layout(state)
        mine = self.model.state_dict()
        self.model.load_state_dict({k: state["model"][k] for k in mine})
        self.optimizer.load_state_dict(state["optimizer_stages"][self.intra.rank])


TRAINERS = {
    "shard": ShardedTrainer,
    "tp": TensorParallelTrainer,
    "pp": PipelineTrainer,
    "shard+tp": ShardedTensorParallelTrainer,
}
