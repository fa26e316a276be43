"""The work of one replica: compute microbatches into a gradient sum, and apply a committed step.

Job: hold one model copy and its optimizer; `compute_microbatches(step, ids)` adds the gradients
of those microbatch ids to the local sum; `snapshot()` hands out that sum as one flat
buffer (the snapshot); `apply_commit(step, flat_sum)` turns the sum of all M microbatches into an
optimizer update. How the sum over replicas is formed (alone, or through the fault-tolerant
all-reduce) is not this module's business: it never talks to other processes.

Invariants:
- the update of step t is `AdamW(clip(sum_{j<M} g(t, j) / M))` at lr(t), whoever computed which j;
- microbatch (t, j) reads the tokens of `microbatch_tokens(seed, t, j)` and seeds torch's RNG
  (dropout) from `microbatch_seed(seed, t, j)` right before its forward pass;
- the flat layout is the model's parameter order, followed by one slot holding the sum of the
  microbatch losses (so the committed loss travels with the gradient through one reduce).

Cost: one forward/backward per microbatch; one flat copy of the gradients per snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from recover.checkpoint.folders import ResumePoint
from recover.checkpoint.state import dcp_state, load_dcp_state
from recover.data.addressing import (
    TokenDataset,
    microbatch_seed,
    microbatch_tokens,
    validation_batches,
)
from recover.data.windows import seed_generators
from recover.runtime.grads import GradientSum
from recover.runtime.layout import ReplicaLayout
from recover.runtime.spec import DEVICES
from recover.runtime.update_guard import UpdateGuard, all_finite
from recover.training.config import TrainConfig, compute_lr
from recover.training.model import GPT, build_config

# Full (unsharded) state dicts keyed by parameter name: the form of the older single-file
# checkpoints, of the final model, and of the state a joiner receives from a one-rank replica.
FULL_STATE = StateDictOptions(full_state_dict=True)
# The tied head is saved once, as the embedding (the last pipeline stage's copy too).
CHECKPOINT_ALIASES = {"lm_head.weight": "transformer.wte.weight"}


def is_layout_free(state: dict) -> bool:
    """Whether `state` is in the layout-free form (optimizer state keyed by parameter name), not
    the older per-layout form (by position, or per pipeline stage)."""
    optimizer = state.get("optimizer")
    return optimizer is not None and not any(isinstance(k, int) for k in optimizer["state"])


def check_layout_free(state: dict, layout: ReplicaLayout) -> None:
    """ValueError unless `state` is in the layout-free form (any layout loads it), or was saved
    by this very layout in the older form."""
    if not is_layout_free(state):
        saved = ReplicaLayout.from_dims(state.get("layout"))
        if saved != layout:
            raise ValueError(
                f"the checkpoint was saved by replicas of {saved.describe()} in the older form "
                f"that only that layout loads; resume with {saved.describe()}"
            )


# A hook called at declared points of the step: (phase, step, index of the microbatch in this
# call's list or None); phases "forward", "backward", "done" (microbatch finished) and
# "optimizer". Fault injection plugs in here; it is a no-op by default.
PhaseHook = Callable[[str, int, int | None], None]


def _no_hook(phase: str, step: int, index: int | None) -> None:
    return None


def pick_device(name: str, index: int = 0) -> str:
    """`--device` (auto, cpu, cuda) -> a torch device string for this process. A CUDA process
    takes GPU `index` (recover.runtime.env.device_index: the local launcher's numbering, else
    torchrun's LOCAL_RANK) modulo the visible GPUs, and makes it the current device."""
    if name not in DEVICES:
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to this process")
    index %= torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


@dataclass(frozen=True)
class CommitStats:
    step: int
    loss: float  # mean loss over the M microbatches of the step
    lr: float
    grad_norm: float  # global norm of the averaged gradient, before clipping
    # Why no update was applied, or "" when one was: "non-finite" (the sum was not finite) or
    # "non-finite update" (the sum was, the state the optimizer made of it was not: undone).
    skipped: str = ""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite gradient or loss: the run stopped, with the
    parameters of the last finite step (lower the learning rate, or check the data)."""


class ReplicaTrainer:
    """One model copy, its optimizer and its local gradient sum."""

    # The replica's own group for checkpoints (recover.checkpoint): none for one rank.
    checkpoint_group = None

    def __init__(
        self,
        cfg: TrainConfig,
        dataset: TokenDataset,
        *,
        device: str = "cpu",
        phase_hook: PhaseHook | None = None,
    ) -> None:
        self.cfg = cfg
        self.dataset = dataset
        self.device = torch.device(device)
        self.phase_hook = phase_hook or _no_hook
        # Same initial parameters on every replica: initialise from the run's seed.
        torch.manual_seed(cfg.seed)
        model_cfg = build_config(
            cfg.preset, vocab_size=dataset.vocab_size, block_size=cfg.seq_len, dropout=cfg.dropout
        )
        self.model_config = model_cfg
        self.consecutive_skips = 0  # steps in a row skipped as non-finite
        model = GPT(model_cfg).to(self.device)
        self.model_values = model.num_params()  # of the whole model, whatever this rank holds
        self.model = self._parallelize(model)
        self.params = list(self.model.parameters())
        # The local sum the step machine snapshots (recover.runtime.grads): this rank's p.grad parts.
        self.grads = GradientSum(self.params, device=self.device)
        self.numel = self.grads.numel  # this rank's values
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            foreach=False,  # one summation order everywhere: replicas must agree bit for bit
        )
        self._eval_set: list | None = None
        # What the update produced is checked, and undone when it is not finite (update_guard).
        self.update_guard = UpdateGuard(self.optimizer)

    def _parallelize(self, model: GPT) -> torch.nn.Module:
        """What a replica is inside: one rank holding the whole model here (see parallel.py)."""
        return model

    # ---- microbatches -------------------------------------------------------------------------
    def compute_microbatches(self, step: int, ids: Iterable[int], *, first_index: int = 0) -> None:
        """Add the gradients and losses of microbatch ids `(step, j)` to the local sum.

        `first_index` numbers the ids for the phase hook: the position of the first id among all
        ids this replica has computed in the step (ids reassigned during recovery come after its
        own), so a fault can target "the K-th microbatch this replica computes in step t".
        """
        self.model.train()
        for index, j in enumerate(ids, start=first_index):
            self._microbatch(step, j, index)

    def _microbatch(self, step: int, j: int, index: int | None, *, weight: float = 1.0) -> None:
        """Forward and backward of microbatch (step, j), its gradient scaled by `weight` (0 for a
        padding pass that only keeps the ranks of a sharded replica in lockstep; index None then:
        no phase hook fires and its loss is not counted)."""
        x, y = self._tokens(step, j)
        seed_generators(microbatch_seed(self.cfg.seed, step, j))  # dropout of (step, j)
        if index is not None:
            self.phase_hook("forward", step, index)
        with self.autocast():
            _, loss = self.model(x, y)
        if index is not None:
            self.phase_hook("backward", step, index)
        (loss * weight if weight != 1.0 else loss).backward()  # accumulates into p.grad
        if index is not None:
            self.grads.add_loss(j, float(loss.detach()))
            self.phase_hook("done", step, index)

    def autocast(self):
        """The forward pass's precision: bf16 autocast with --precision bf16 (parameters,
        gradients and their sums stay fp32), else a no-op."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"
        )

    def _tokens(self, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of microbatch (step, j), on this trainer's device."""
        x, y = microbatch_tokens(
            self.dataset,
            seed=self.cfg.seed,
            step=step,
            j=j,
            microbatches=self.cfg.microbatches,
            microbatch_size=self.cfg.microbatch_size,
            seq_len=self.cfg.seq_len,
        )
        return x.to(self.device), y.to(self.device)

    # ---- the step machine's Work (recover.runtime.step_machine) ---------------------------------------
    def snapshot(self, device: torch.device | str | None = None) -> torch.Tensor:
        """A fresh flat fp32 copy of the local gradient sum and loss sum (numel + 1 values)."""
        return self.grads.snapshot(device)

    def clear(self) -> None:
        self.grads.clear()

    def parameter_hash(self) -> str:
        return self.grads.parameter_hash()

    def nonfinite_ids(self) -> list[int]:
        return list(self.grads.nonfinite_ids)

    def overlap_grads(self) -> GradientSum | None:
        """One rank, one backward pass per counted microbatch: the step's reduce may start
        during the last one (recover.runtime.overlap)."""
        return self.grads if self.grads.hookable else None

    # ---- commit -------------------------------------------------------------------------------
    def apply_commit(
        self,
        step: int,
        flat_sum: torch.Tensor,
        *,
        count: int | None = None,
        finite: bool | None = None,
    ) -> CommitStats:
        """Apply the update of `step` from the sum over all M microbatches (flat layout).

        `count` is the number of microbatches in the sum: M always, except in the `shrink`
        baseline, whose global batch shrinks after a failure. `finite`: whether every value of
        the sum is finite (None: check it here). A non-finite step is skipped: no update, and
        `stop_if_diverging` ends the run after `max_nonfinite` of them in a row. So is a step
        whose update made any parameter or optimizer state non-finite: it is undone.
        """
        M = self.cfg.microbatches if count is None else count
        loss = self._committed_loss_sum(flat_sum) / M
        if finite is None:  # one rank alone; the step machine agrees it over a replica's ranks
            finite = all_finite([flat_sum])
        lr = compute_lr(step, self.cfg)
        if not finite:
            # Never applied: a NaN or infinity in the update would poison every parameter of
            # every replica at once. The step counts (the schedule moves on); the state does not.
            self.grads.clear()
            self.consecutive_skips += 1
            return CommitStats(
                step=step, loss=loss, lr=lr, grad_norm=math.nan, skipped="non-finite"
            )
        self.grads.load(flat_sum, divide_by=M)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = self._clip_gradients(clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.phase_hook("optimizer", step, None)
        self.update_guard.save()
        self.optimizer.step()
        self.grads.clear()
        if not self._all_ranks(self.update_guard.finite()):
            # A finite gradient made a non-finite state (an overflow inside the optimizer): the
            # update is undone on every rank, and the step is skipped like a non-finite sum.
            self.update_guard.restore()
            self.consecutive_skips += 1
            return CommitStats(
                step=step, loss=loss, lr=lr, grad_norm=grad_norm, skipped="non-finite update"
            )
        self.consecutive_skips = 0
        return CommitStats(step=step, loss=loss, lr=lr, grad_norm=grad_norm)

    def _all_ranks(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank of the replica (one rank here)."""
        return ok

    def _committed_loss_sum(self, flat_sum: torch.Tensor) -> float:
        return float(flat_sum[-1])

    def stop_if_diverging(self) -> None:
        """NonFiniteError after `max_nonfinite` consecutive skipped steps (0: never)."""
        limit = self.cfg.max_nonfinite
        if limit and self.consecutive_skips >= limit:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive steps had a non-finite gradient, loss or "
                "update (skipped, never applied); the parameters are those of the last finite step. "
                "Lower --lr or enable --grad-clip, then resume"
            )

    def _clip_gradients(self, clip: float) -> float:
        """Clip the averaged gradient to global norm `clip`; return the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=False))

    # ---- evaluation and state -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the run's fixed validation batches."""
        if self._eval_set is None:
            self._eval_set = validation_batches(
                self.dataset,
                microbatch_size=self.cfg.microbatch_size,
                seq_len=self.cfg.seq_len,
                max_batches=self.cfg.eval_batches,
            )
        self.model.eval()
        losses = []
        for x, y in self._eval_set:
            with self.autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            losses.append(float(loss))
        self.model.train()
        return sum(losses) / len(losses)

    def state_dict(self) -> dict:
        """The committed state in the layout-free form every trainer saves and loads: the whole
        model's state dict, and the optimizer's state keyed by parameter name (not by position),
        so that a checkpoint of any layout resumes in any other (`layout` records which saved
        it, for people; nothing checks it)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FULL_STATE),
            "layout": {},
        }

    def load_state_dict(self, state: dict) -> None:
        check_layout_free(state, ReplicaLayout())
        self.model.load_state_dict(state["model"])
        if is_layout_free(state):
            set_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], options=FULL_STATE
            )
        else:  # an older one-rank checkpoint: the optimizer's own form
            self.optimizer.load_state_dict(state["optimizer"])

    def checkpoint_state(self) -> dict:
        """This rank's part of the committed state, as a DCP checkpoint saves it (every layout
        saves its own shards, keyed by parameter name: any layout loads it)."""
        return dcp_state(self.model, self.optimizer, aliases=CHECKPOINT_ALIASES)

    def load_checkpoint(self, point: ResumePoint) -> None:
        """Load a checkpoint saved by any layout (each rank reads its own part), or a file of
        the older single-file form."""
        if point.legacy_state is not None:
            self.load_state_dict(point.legacy_state)
            return
        load_dcp_state(
            point.path, self.model, self.optimizer, aliases=CHECKPOINT_ALIASES,
            process_group=self.checkpoint_group,
        )  # fmt: skip

    def transfer_state_dict(self) -> dict:
        """What the live state transfer sends to a joiner: this rank's committed state, the
        optimizer's in torch's own form (by position). The joiner is the same model built by the
        same code (its fingerprint was checked at registration), so positions agree; the
        layout-free form by name is for checkpoints, which other layouts load."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_transfer_state(self, state: dict) -> None:
        """Load a live replica's `transfer_state_dict()`. The received tensors are this process's
        own fresh buffers: the optimizer adopts them as its state (same dtype and device, so
        torch's load makes no copy). The checkpoint path's helper would first create the state
        by a zero step over every parameter and copy into it: on gpt2-124m, 3.0-6.0 s against
        0.05 s, and 2.0 s of a 3.1 s transfer in `recover bench rejoin`."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def flat_parameters(self) -> torch.Tensor:
        """This rank's parameter values, flat (the local shards in a sharded replica)."""
        return self.grads.flat_parameters()

    def check_finite_model(self) -> None:
        """NonFiniteError unless the model and optimizer state are finite on every rank: a
        non-finite model is never written (the guard should have made this impossible)."""
        if not self._all_ranks(self.update_guard.finite()):
            raise NonFiniteError("the model holds a value that is not finite: it is not written")

    def save_model(self, path: str | None) -> None:
        """Write the whole model as safetensors to `path` (a collective in a sharded replica,
        whose other ranks pass None: they take part in gathering it, and write nothing)."""
        from safetensors.torch import save_model

        self.check_finite_model()
        if path is not None:
            save_model(self.model, path)
