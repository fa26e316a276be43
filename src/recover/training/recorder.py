"""The run folder and what happens after every commit (log, evaluate, checkpoint).

Job: own `--out DIR`: refuse a folder that holds another run, write `config.json`, check on
`--resume` that the folder's run is the one asked for, and after each committed step write the
metrics record, print the human line, evaluate and checkpoint at their cadence, and at the end save
the final model and print the summary. Both the single-replica loop and the replicas of a
multi-replica run use this one `RunRecorder`.

It must not decide anything about the trajectory: it only records and persists committed state.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from recover.record import MetricsWriter
from recover.training.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    ResumePoint,
    SavedCheckpoint,
    find_resume_point,
    remove_stale_tmp,
)
from recover.training.config import RunPaths, TrainConfig
from recover.training.console import format_duration, format_rate, format_step_line
from recover.training.trainer import CommitStats, ReplicaTrainer


def load_resume_state(paths: RunPaths) -> ResumePoint | None:
    """The newest valid checkpoint of the run, or None when it has none. Corrupt newer ones are
    listed in `skipped`; when every checkpoint is corrupt this raises CheckpointError."""
    return find_resume_point(paths.checkpoints)


@dataclass
class RunRecorder:
    """Records committed steps: metrics, terminal line, evaluation, checkpoints, summary."""

    cfg: TrainConfig
    paths: RunPaths
    trainer: ReplicaTrainer
    data_hash: str
    writer: MetricsWriter
    console: TextIO | None = None
    start_step: int = 0
    # The pen: only the replica holding it writes step and eval records, checkpoints and the final
    # model (the lowest live replica of a multi-replica run). Events are written by every replica.
    holds_pen: bool = True
    # False on the other ranks of a replica of several ranks: they hold the pen with their
    # replica (evaluation, gathering the state to save and the final model are collectives
    # inside it) but only its first rank writes records and files.
    writes: bool = True
    _ckpt: CheckpointWriter = field(init=False)
    _t_start: float = field(init=False)
    _t_last: float = field(init=False)
    _tokens: int = field(init=False, default=0)
    _last_eval: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._ckpt = CheckpointWriter(
            self.paths.checkpoints, keep=self.cfg.keep_ckpts, on_saved=self._on_saved
        )
        if self.writes:  # a writer of this host killed mid-save left its temporary file
            for stale in remove_stale_tmp(self.paths.checkpoints):
                self.event("checkpoint_tmp_removed", path=str(stale))
        self._t_start = self._t_last = time.perf_counter()
        self.last_committed = self.start_step - 1

    @property
    def pen_writes(self) -> bool:
        return self.holds_pen and self.writes

    def say(self, line: str) -> None:
        if self.console is not None and self.pen_writes:
            print(line, file=self.console, flush=True)

    def event(self, name: str, **fields) -> None:
        self.writer.event(name, **fields)

    def on_commit(self, stats: CommitStats, *, microbatches: int, **extra) -> None:
        """Called once per committed step, after the optimizer step."""
        self.last_committed = stats.step
        now = time.perf_counter()
        step_s = now - self._t_last
        self._t_last = now
        cfg = self.cfg
        tokens = microbatches * cfg.microbatch_size * cfg.seq_len
        self._tokens += tokens
        done = stats.step + 1 - self.start_step
        elapsed = now - self._t_start
        eta = elapsed / max(1, done) * (cfg.steps - stats.step - 1)
        if stats.skipped:
            extra["skipped"] = "non-finite"
            self.say(
                f"step {stats.step + 1} skipped: its summed gradient or loss is not finite "
                f"(not applied; {self.trainer.consecutive_skips} in a row)"
            )
        if self.pen_writes:
            self.writer.step(
                step=stats.step,
                loss=_finite_or_none(stats.loss),  # (null for a step skipped as non-finite)
                lr=stats.lr,
                grad_norm=_finite_or_none(stats.grad_norm),
                tokens=tokens,
                microbatches=microbatches,
                step_s=round(step_s, 6),
                wall_s=round(elapsed, 6),
                **extra,
            )
            self.say(
                format_step_line(
                    step=stats.step,
                    steps=cfg.steps,
                    loss=stats.loss,
                    lr=stats.lr,
                    tok_per_s=tokens / step_s if step_s > 0 else 0.0,
                    step_s=step_s,
                    eta_s=eta,
                )
            )
        next_step = stats.step + 1
        last = next_step == cfg.steps
        if cfg.eval_every and (next_step % cfg.eval_every == 0 or last):
            self.evaluate(stats.step)
        if cfg.ckpt_every and next_step % cfg.ckpt_every == 0 and not last:
            self.checkpoint(next_step)

    def evaluate(self, step: int) -> float | None:
        if not self.holds_pen:  # the parameters are identical everywhere: one evaluation is enough
            return None
        loss = self.trainer.evaluate()
        self._last_eval = loss
        if self.writes:
            self.writer.eval(step=step, val_loss=loss)
        self.say(f"eval step {step + 1} | val loss {loss:.4f}")
        return loss

    def checkpoint(self, next_step: int, *, block: bool = False) -> Path | None:
        """Save the committed state; only the replica holding the pen writes to disk."""
        if not self.holds_pen:
            return None
        state = {
            "step": next_step,
            "train": self.cfg.to_dict(),
            "data_hash": self.data_hash,
            **self.trainer.state_dict(),
        }
        if not self.writes:
            return None
        # `checkpoint_saved` is written by _on_saved once the file is durable, not here.
        return self._ckpt.save(next_step, state, block=block)

    def _on_saved(self, saved: SavedCheckpoint) -> None:
        """On the checkpoint thread, after fsync and rename: the file is on disk."""
        self.event(
            "checkpoint_saved",
            step=saved.step,
            path=str(saved.path),
            bytes=saved.bytes,
            seconds=round(saved.seconds, 6),
        )

    def finish(self, *, unigram_loss: float | None = None, extra: dict | None = None) -> dict:
        """Save the final model, write the summary record, print the summary."""
        self._ckpt.close()
        elapsed = time.perf_counter() - self._t_start
        summary = {
            "steps": self.cfg.steps,
            "steps_this_run": self.cfg.steps - self.start_step,
            "tokens_this_run": self._tokens,
            "wall_s": round(elapsed, 3),
            "final_val_loss": self._last_eval,
            "unigram_loss": unigram_loss,
            "out": str(self.paths.out),
            **(extra or {}),
        }
        if self.holds_pen:
            self.paths.final_model.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.paths.final_model.with_name("model.safetensors.tmp")
            self.trainer.save_model(str(tmp) if self.writes else None)
        if self.pen_writes:
            os.replace(tmp, self.paths.final_model)
            self.writer.write("summary", **summary)
            self.say(self.format_summary(summary))
        return summary

    @staticmethod
    def format_summary(s: dict) -> str:
        lines = [
            "",
            "summary",
            f"  steps          {s['steps']} ({s['steps_this_run']} in this run)",
            f"  tokens         {s['tokens_this_run']:,} in {format_duration(s['wall_s'])} "
            f"({format_rate(s['tokens_this_run'] / max(s['wall_s'], 1e-9))} tok/s)",
        ]
        if s.get("final_val_loss") is not None:
            lines.append(f"  val loss       {s['final_val_loss']:.4f}")
        if s.get("unigram_loss") is not None:
            lines.append(
                f"  unigram loss   {s['unigram_loss']:.4f} (predicting the token distribution)"
            )
        for key, label in (
            ("failures_survived", "failures"),
            ("microbatches_recomputed", "recomputed"),
            ("recovery_s", "recovering"),
        ):
            if key in s:
                lines.append(f"  {label:<14} {s[key]}")
        lines.append(f"  run folder     {s['out']}")
        return "\n".join(lines)


def _finite_or_none(x: float) -> float | None:
    """JSON has no NaN or infinity: a non-finite figure is recorded as null."""
    return x if math.isfinite(x) else None


def unigram_loss(
    train_shards: list[np.ndarray], val_shards: list[np.ndarray], vocab_size: int
) -> float:
    """Cross-entropy (nats) of the validation tokens under the train split's token frequencies:
    the loss of a model that only knows the token distribution (add-one smoothed)."""
    counts = np.ones(vocab_size, dtype=np.float64)
    for shard in train_shards:
        counts += np.bincount(np.asarray(shard), minlength=vocab_size)
    logp = np.log(counts / counts.sum())
    val_counts = np.zeros(vocab_size, dtype=np.float64)
    for shard in val_shards:
        val_counts += np.bincount(np.asarray(shard), minlength=vocab_size)
    return float(-(val_counts * logp).sum() / val_counts.sum())


def check_resume_state(state: dict, *, cfg: TrainConfig, data_hash: str, path: Path) -> int:
    """Validate a loaded checkpoint against the run; return the next step to run."""
    if state.get("data_hash") != data_hash:
        raise CheckpointError(f"checkpoint in {path} was trained on another dataset")
    step = int(state["step"])
    if not 0 <= step <= cfg.steps:
        raise CheckpointError(f"checkpoint in {path} is at step {step}, beyond --steps {cfg.steps}")
    return step
