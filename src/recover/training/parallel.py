"""What a replica of several ranks is inside: FSDP2 (HSDP's shard dimension), tensor parallel,
pipeline parallel, and their combinations.

Job: the `ReplicaTrainer` contract for a replica made of K ranks, applied to the unchanged model
from outside. The recovery protocol does not change: each rank's snapshot is the part of the
gradient it holds, and the cross-replica reduce of that part runs among the ranks at the same
position in every live replica (see `recover.runtime.links`). Replicas of one run have the same layout, so
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
- `--pp P` (`PipelineTrainer`): P consecutive GPipe stages; with `--shard` and/or `--tp` each
  stage is itself sharded and/or split over the ranks at its stage; see the class.

Invariants:
- the update equals the single-rank one up to summation order (tested: rtol 1e-4);
- the flat snapshot layout is the local parts in parameter order, then this rank's loss slot; at
  a commit the replica adds the slots of the ranks that count losses (each id once);
- the gradient norm for clipping counts every value once: along each mesh dimension, a gradient
  sharded on it counts on every rank, one replicated on it on coordinate 0 only;
- `microbatch=K` in a fault names the K-th microbatch the targeted rank computes in the step.

Checkpoints are DCP folders to which every rank writes its own shards, over the replica's own
checkpoint group (recover.checkpoint); any layout loads them. The final model holds the
full state, gathered.
Dropout under TP draws each rank's attention masks for its own heads: deterministic per
(seed, step, j) and layout, but not the single-rank masks (use dropout 0 to compare layouts).

Size: the layouts inside a replica (FSDP2, TP, PP and their combinations) share one trainer base;
each class is short, and their differences read best next to each other.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recover.data.addressing import TokenDataset, microbatch_seed
from recover.data.windows import seed_generators
from recover.policy import deal_round_robin
from recover.runtime.grads import laid_out_like, local_part, set_aside
from recover.runtime.layout import ReplicaLayout
from recover.runtime.update_guard import on_every_rank
from recover.training.config import TrainConfig
from recover.training.model import GPT, embed, lm_loss
from recover.training.trainer import FULL_STATE, ReplicaTrainer, check_layout_free

_FULL = FULL_STATE
# The last pipeline stage's copy of the tied embedding, by its name in the whole model.
_TIED = {"lm_head.weight": "transformer.wte.weight"}


class MultiRankTrainer(ReplicaTrainer):
    """What every layout of several ranks shares: gradients as local parts, the replica's loss
    and gradient norm, and full-state checkpoints."""

    def __init__(
        self, cfg: TrainConfig, dataset: TokenDataset, *, intra, device: str = "cpu"
    ) -> None:
        self.intra = intra  # recover.runtime.links.IntraReplica: the replica's own ranks and mesh
        self._ordinal_step, self._ordinal = -1, 0
        super().__init__(cfg, dataset, device=device)
        # For checkpoints alone: a save's background collectives never meet the training's.
        self.checkpoint_group = dist.new_group(backend="gloo")

    def overlap_grads(self) -> None:
        """Never: ranks of a replica run padding passes, pipeline schedules and their own
        gradient collectives, which the overlapped reduce does not follow."""
        return None

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

    def _committed_loss_sum(self, flat_sum: torch.Tensor) -> float:
        mine = flat_sum[-1:].to(self.device, torch.float64, copy=True)
        if not self.counts_losses:
            mine.zero_()
        dist.all_reduce(mine, group=self.intra.group)
        return float(mine)

    def _counted_in_norm(self, p: torch.Tensor) -> bool:
        """Whether this rank adds p's gradient to the global norm, so that every value counts
        once: along each dimension of the replica's mesh, a gradient sharded on it counts on
        every rank, one replicated on it (or not laid out on it) on coordinate 0 only. Pipeline
        stages hold different parameters: along pp every rank counts (PipelineTrainer drops the
        tied head's second copy)."""
        g = p.grad
        placed = {}
        if isinstance(g, DTensor):
            names = g.device_mesh.mesh_dim_names or ()
            placed = dict(zip(names, g.placements, strict=True))
        return all(
            (dim in placed and not placed[dim].is_replicate()) or self.intra.coordinate(dim) == 0
            for dim in self.intra.layout.dims
            if dim != "pp"
        )

    def _all_ranks(self, ok: bool) -> bool:
        return on_every_rank(ok, self.intra.group, self.device)

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
        """The full model and optimizer state in the layout-free form (ReplicaTrainer.state_dict),
        gathered on every rank (a collective)."""
        return {
            "model": get_model_state_dict(self.model, options=_FULL),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=_FULL),
            "layout": self.intra.layout.dims,
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a checkpoint of any layout: each rank takes its part of the full state (its
        shards, its TP slices, its stage's parameters)."""
        check_layout_free(state, self.intra.layout)
        set_model_state_dict(self.model, self._own_model_state(state["model"]), options=_FULL)
        set_optimizer_state_dict(
            self.model, self.optimizer, self._own_optimizer_state(state), options=_FULL
        )

    def _own_model_state(self, whole: dict) -> dict:
        return whole

    def _own_optimizer_state(self, state: dict) -> dict:
        return state["optimizer"]

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
                    s[k] = laid_out_like(p, v.view_as(local_part(p)))
        self.optimizer.load_state_dict(opt)

    def _whole_model(self) -> GPT:
        """A plain GPT holding the whole model (a collective: every rank takes part)."""
        whole = GPT(self.model_config)
        whole.load_state_dict(get_model_state_dict(self.model, options=_FULL))
        return whole

    def save_model(self, path: str | None) -> None:
        from safetensors.torch import save_model

        self.check_finite_model()
        whole = self._whole_model()
        if path is not None:
            save_model(whole, path)


def _fully_shard(blocks: Iterable[nn.Module], root: nn.Module, mesh) -> nn.Module:
    """FSDP2 over `mesh`, in one fixed order: every block its own unit (on GPUs its all-gather
    overlaps the previous block's compute), then the root takes what is left (embeddings, the
    tied head, the last norm). Sums, not means: the trainer divides by M at the commit."""
    units = [*blocks, root]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return root


def _tensor_parallel(blocks: Iterable[nn.Module], mesh) -> None:
    """Split every block over `mesh`, in one fixed order inside each block: attention's q, k, v
    column-wise (each rank gets whole heads), its output projection row-wise; then the MLP the
    same way. Everything outside the blocks stays whole on every rank."""
    plan = {  # (recover.training.config.check_layout_fits checked that T divides n_head)
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    for block in blocks:
        parallelize_module(block, mesh, plan)


class ShardedTrainer(MultiRankTrainer):
    """One model copy sharded over the S ranks of a replica by FSDP2."""

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        return _fully_shard(model.transformer.h, model, self.intra.submesh("shard"))

    def compute_microbatches(self, step: int, ids: Iterable[int], *, first_index: int = 0) -> None:
        self.model.train()
        for j, real in deal_round_robin(
            list(ids), self.intra.layout.shard, self.intra.coordinate("shard")
        ):
            if real:
                self._microbatch(step, j, self._next_ordinal(step))
            else:  # padding: keeps this rank in the mesh's collectives, adds exactly zero
                self._microbatch(step, j, None, weight=0.0)


class ShardedTensorParallelTrainer(ShardedTrainer):
    """Both at once (`--shard S --tp T`, S x T ranks): TP inside each group of T ranks, then FSDP2
    across the S groups. The ids are dealt over the shard dimension; the T ranks of a group
    compute the same ids."""

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        # TP first (it rewrites the blocks' parameters as DTensors on the tp mesh), then FSDP2
        # shards those over the shard mesh: the order torch's 2-D (FSDP + TP) recipe needs.
        _tensor_parallel(model.transformer.h, self.intra.submesh("tp"))
        return _fully_shard(model.transformer.h, model, self.intra.submesh("shard"))


class TensorParallelTrainer(MultiRankTrainer):
    """One model copy whose blocks are split over the T ranks of a replica (Megatron style)."""

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        _tensor_parallel(model.transformer.h, self.intra.submesh("tp"))
        return model


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
    """One model copy cut into P consecutive stages (GPipe), each stage alone on one rank or, with
    `--shard` and/or `--tp`, itself sharded by FSDP2 and/or split by TP over the ranks at its
    stage (`--pp P --shard S --tp T`: P x S x T ranks, mesh order pp, shard, tp).

    The replica's ids of a call are the pipeline's microbatches, in order; with `--shard S` they
    are dealt round-robin over the S shard coordinates first (as in ShardedTrainer), each running
    its own pipeline, padded to the same length with zero-weight passes. The ranks of one stage
    along tp compute the same microbatches. The tied embedding and head live on the first and the
    last stage: after each call their gradient contributions are summed between the two ranks at
    the same (shard, tp) position of those stages, so both copies get the same update and stay
    tied. Dropout is seeded per (seed, step, j) at the start of every stage's forward of j.
    """

    def __init__(
        self, cfg: TrainConfig, dataset: TokenDataset, *, intra, device: str = "cpu"
    ) -> None:
        super().__init__(cfg, dataset, intra=intra, device=device)
        stage: _Stage = self.model
        stage.autocast = self.autocast
        self._tied = stage.lm_head.weight if stage.last else stage.transformer["wte"].weight
        self._tie_group = self._tie_groups()
        # Shapes given up front (static): no inference pass through the stage at the first step.
        mb, seq, width = cfg.microbatch_size, cfg.seq_len, self.model_config.n_embd
        # (requires_grad: a stage's received activations need their gradient sent back.)
        hidden = torch.empty(mb, seq, width, device="meta", requires_grad=True)
        pp = intra.submesh("pp")
        self._pipe = PipelineStage(
            stage, pp.get_local_rank(), pp.size(), self.device, group=pp.get_group(),
            input_args=torch.empty(mb, seq, dtype=torch.long, device="meta") if stage.first
            else hidden,
            output_args=torch.empty(mb, seq, self.model_config.vocab_size, device="meta")
            if stage.last else hidden,
            output_grads=None if stage.last else hidden,
            input_grads=None if stage.first else hidden,
        )  # fmt: skip

    def _tie_groups(self):
        """This rank's group of the two ends: the first and the last stage's ranks at its
        (shard, tp) position. Every rank creates every such group, in one order (collectives)."""
        ranks = self.intra.mesh.mesh.reshape(self.intra.layout.pp, -1)  # pp is the outermost
        mine = None
        for column in range(ranks.shape[1]):
            ends = [int(ranks[0, column]), int(ranks[-1, column])]
            group = dist.new_group(ends)
            if self.intra.rank in ends:
                mine = group
        return mine

    @property
    def counts_losses(self) -> bool:
        return self.model.last and self.intra.coordinate("tp") == 0

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        # (recover.training.config.check_layout_fits checked that every stage gets a layer)
        stage = _Stage(model, self.intra.coordinate("pp"), self.intra.layout.pp)
        blocks = list(stage.transformer["h"].values())
        # Cut first (each rank keeps its stage only), then TP inside the stage, then FSDP2 over
        # the stage's shard ranks: the order of ShardedTensorParallelTrainer, per stage.
        if self.intra.layout.tp > 1:
            _tensor_parallel(blocks, self.intra.submesh("tp"))
        if self.intra.layout.shard > 1:
            _fully_shard(blocks, stage, self.intra.submesh("shard"))
        return stage

    def _counted_in_norm(self, p: torch.Tensor) -> bool:
        if self.model.last and p is self._tied:
            return False  # the tied copy counts on the first stage
        return super()._counted_in_norm(p)

    def compute_microbatches(self, step: int, ids: Iterable[int], *, first_index: int = 0) -> None:
        ids = list(ids)
        if not ids:
            return
        stage: _Stage = self.model
        stage.train()
        shards = self.intra.layout.shard
        plan = deal_round_robin(ids, shards, self.intra.coordinate("shard"))  # [(id, real)]
        forwards, weights = iter(plan), iter(plan)

        def before_forward():
            j, real = next(forwards)
            seed_generators(microbatch_seed(self.cfg.seed, step, j))  # dropout of (step, j)
            if not real:  # a padding pass: no phase hook
                return None
            index = self._next_ordinal(step)
            self.phase_hook("forward", step, index)

            def after(out: torch.Tensor) -> None:
                def on_backward(grad: torch.Tensor) -> None:
                    self.phase_hook("backward", step, index)
                    self.phase_hook("done", step, index)

                if out.requires_grad:
                    out.register_hook(on_backward)

            return after

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            _, real = next(weights)  # the schedule computes the losses in microbatch order
            loss = lm_loss(logits, targets)
            return loss if real else loss * 0.0  # padding: its gradient is exactly zero

        # The gradient sum so far is set aside (recover.runtime.grads.set_aside): what the call
        # adds is then exactly the gradients it leaves, which the tied ends need on their own.
        with set_aside(self.params):
            stage.before_forward = before_forward
            try:
                schedule = ScheduleGPipe(
                    self._pipe, n_microbatches=len(plan), loss_fn=loss_fn, scale_grads=False
                )
                if stage.first:
                    schedule.step(torch.cat([self._tokens(step, j)[0] for j, _ in plan]))
                elif stage.last:
                    losses: list[torch.Tensor] = []
                    schedule.step(
                        target=torch.cat([self._tokens(step, j)[1] for j, _ in plan]),
                        losses=losses,
                    )
                    for x, (j, real) in zip(losses, plan, strict=True):
                        if real:
                            self.grads.add_loss(j, float(x.detach()))
                else:
                    schedule.step()
            finally:
                stage.before_forward = None
            self._sum_tied()

    def _sum_tied(self) -> None:
        """Sum this call's contributions to the tied weight between the two ends, on both (on
        local parts: under FSDP2 both copies are sharded alike over the same shard ranks)."""
        stage: _Stage = self.model
        if not (stage.first or stage.last):
            return
        grad = self._tied.grad
        added = local_part(grad) if grad is not None else torch.zeros_like(local_part(self._tied))
        dist.all_reduce(added, group=self._tie_group)
        self._tied.grad = laid_out_like(self._tied, added)

    # ---- evaluation and state: through the whole model, gathered --------------------------------
    def _stage_leader(self) -> bool:
        """Whether this rank speaks for its stage: shard and tp coordinates 0."""
        return self.intra.coordinate("shard") == 0 and self.intra.coordinate("tp") == 0

    def _gather_stages(self, part: dict) -> list[dict]:
        """Every stage's `part` (a collective: all ranks take part), in stage order."""
        rows = self.intra.gather(part if self._stage_leader() else None)
        return [row for row in rows if row is not None]  # rank order is stage order (pp outermost)

    def _whole_model(self) -> GPT:
        """A plain GPT holding every stage's parameters (a collective: all ranks take part)."""
        mine = get_model_state_dict(self.model, options=_FULL)
        state = {}
        for part in self._gather_stages({k: v.detach().cpu() for k, v in mine.items()}):
            state.update(part)
        state["transformer.wte.weight"] = state["lm_head.weight"]  # tied: one tensor
        whole = GPT(self.model_config)
        whole.load_state_dict(state)
        return whole

    def evaluate(self) -> float:
        stage, self.model = self.model, self._whole_model()
        try:
            return super().evaluate()
        finally:
            self.model = stage

    def state_dict(self) -> dict:
        """The whole model and the optimizer state of every stage merged by parameter name (the
        layout-free form): the last stage's copy of the tied embedding is the first stage's
        `transformer.wte.weight` (their gradients are summed, so their states are equal)."""
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        stages = self._gather_stages(optimizer)
        merged: dict = {"state": {}, "param_groups": []}
        for part in stages:
            for name, s in part["state"].items():
                merged["state"].setdefault(_TIED.get(name, name), s)
            for i, group in enumerate(part["param_groups"]):
                if i == len(merged["param_groups"]):
                    merged["param_groups"].append({**group, "params": []})
                names = [_TIED.get(n, n) for n in group["params"]]
                have = merged["param_groups"][i]["params"]
                have.extend(n for n in names if n not in have)
        return {
            "model": self._whole_model().state_dict(),
            "optimizer": merged,
            "layout": self.intra.layout.dims,
        }

    def _own_model_state(self, whole: dict) -> dict:
        names = self.model.state_dict().keys()  # this stage's parameter names (no gathering)
        return {k: whole[k] for k in names}

    def _own_optimizer_state(self, state: dict) -> dict:
        if "optimizer_stages" in state:  # the older per-stage form (same layout: checked)
            return state["optimizer_stages"][self.intra.coordinate("pp")]
        whole = state["optimizer"]
        # This stage's parameter names, group by group (a fresh optimizer has no state yet).
        mine = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        names = [n for group in mine["param_groups"] for n in group["params"]]
        return {
            "state": {
                n: whole["state"][_TIED.get(n, n)]
                for n in names
                if _TIED.get(n, n) in whole["state"]
            },
            "param_groups": [
                {**saved, "params": group["params"]}
                for saved, group in zip(whole["param_groups"], mine["param_groups"], strict=True)
            ],
        }


def trainer_class(layout: ReplicaLayout) -> type[MultiRankTrainer]:
    """The trainer of a layout of several ranks."""
    if layout.pp > 1:
        return PipelineTrainer  # stages, each sharded and/or split as the other flags say
    if layout.shard > 1 and layout.tp > 1:
        return ShardedTensorParallelTrainer
    if layout.shard > 1:
        return ShardedTrainer
    if layout.tp > 1:
        return TensorParallelTrainer
    raise ValueError("a replica of one rank has no multi-rank trainer")
