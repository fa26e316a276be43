"""The run folder and what happens after every commit (log, evaluate, checkpoint).

Job: own `--out DIR`: refuse a folder that holds another run, write `config.json`, check on
`--resume` that the folder's run is the one asked for, and after each committed step write the
metrics record, print the human line, evaluate and checkpoint at their cadence, and at the end save
the final model and print the summary. Both the single-replica loop and the replicas of a
multi-replica run use this one `RunRecorder`.

Filling a gap: every replica keeps the step records of its last commits, written or not. When the
coordinator names this replica the writer of a commit whose previous writer died or left before
its records were known written (`fill_gaps`), it writes the step records that the run folder
lacks, and the evaluation and checkpoint due at the step before, from the committed state it still
holds (the new commit is applied after). A checkpoint or evaluation due at an older step (two
writers lost in a row) cannot be made any more: the next due one is.

It must not decide anything about the trajectory: it only records and persists committed state.

Size: one owner of the run folder's writes (records, lines, evaluations, checkpoints, the gap
filling after a lost writer, the summary), so that "who writes what, when" reads in one place.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from recover.checkpoint.folders import (
    CheckpointError,
    ResumePoint,
    checkpoint_path,
    find_resume_point,
    remove_stale_tmp,
)
from recover.checkpoint.state import CheckpointWriter, SavedCheckpoint
from recover.dashboards import RecordMirror, TensorBoardBackend, WandbBackend
from recover.record import MetricsWriter, read_metrics
from recover.training.config import RunPaths, TrainConfig
from recover.training.console import format_duration, format_rate, format_step_line
from recover.training.flops import achieved_flop_per_s, device_peak_tflops, format_flops, mfu
from recover.training.model import training_flops_per_token
from recover.training.trainer import CHECKPOINT_ALIASES, CommitStats, ReplicaTrainer

log = logging.getLogger(__name__)


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
    console: TextIO | None = None  # None: no lines (--quiet); else logged at INFO
    start_step: int = 0
    # Whether this replica is the writer (docs/design.md): only the writer writes step and eval
    # records, checkpoints and the final model (the replica the coordinator names at each commit;
    # the lowest live one). Events are written by every replica.
    is_writer: bool = True
    # Whether this rank leads its replica (its first rank). The other ranks of a writer replica
    # take part in what the writer does (evaluation, gathering the state to save and the final
    # model are collectives inside the replica) but only the leading rank writes records and files.
    leads: bool = True
    replica: int | None = None  # a replica of a multi-replica run: named in its step records
    peak_tflops: float = 0.0  # --peak-tflops (0: from the GPU's name where known)
    devices_per_replica: int = 1  # its ranks, one device each: the MFU's denominator
    tensorboard: str = ""  # --tensorboard DIR: the writer mirrors the record there
    wandb: str = ""  # --wandb PROJECT: and to a W&B run
    _ckpt: CheckpointWriter = field(init=False)
    _recent: dict[int, dict] = field(init=False, default_factory=dict)  # step -> its record
    _t_start: float = field(init=False)
    _t_last: float = field(init=False)
    _tokens: int = field(init=False, default=0)
    _last_eval: float | None = field(init=False, default=None)
    _sinks: list[RecordMirror] = field(init=False, default_factory=list)
    _devices: int = field(init=False, default=1)  # devices of the last commit

    def __post_init__(self) -> None:
        # FLOPs of the whole model (whatever part this rank holds), and the peak of one device.
        trainer = self.trainer
        self._flops_per_token = training_flops_per_token(trainer.model_config, trainer.model_values)
        self._peak = device_peak_tflops(str(trainer.device), self.peak_tflops)
        if self.leads:  # the dashboards: mirrors of the record, held by the writer's leader
            if self.tensorboard:
                self._mirror(TensorBoardBackend(Path(self.tensorboard)))
            if self.wandb:
                config = json.loads(self.cfg.to_json())
                self._mirror(WandbBackend(self.wandb, self.paths.out, config=config))
        self._ckpt = CheckpointWriter(
            self.paths.checkpoints,
            keep=self.cfg.keep_ckpts,
            on_saved=self._on_saved,
            fence=self.writer.allowed,  # an evicted incarnation publishes no checkpoint
            process_group=trainer.checkpoint_group,  # every rank of the replica writes its part
        )
        if self.leads:  # a writer of this host killed mid-save left its temporary file
            for stale in remove_stale_tmp(self.paths.checkpoints):
                self.event("checkpoint_tmp_removed", path=str(stale))
        self._t_start = self._t_last = time.perf_counter()
        self._t_wall_start = time.time()  # records older than this are another run's
        self.last_committed = self.start_step - 1

    @property
    def writes_records(self) -> bool:
        """This process writes the run's records: the writer replica's leading rank."""
        return self.is_writer and self.leads

    def say(self, line: str) -> None:
        """A line for people (the step line, a recovery, the summary): logged at INFO by the
        process that writes the records; none with --quiet (no console)."""
        if self.console is not None and self.writes_records:
            log.info(line)

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
            extra["skipped"] = stats.skipped
            what = (
                "the update it made is not finite (undone)"
                if stats.skipped == "non-finite update"
                else "its summed gradient or loss is not finite (not applied)"
            )
            self.say(
                f"step {stats.step} skipped: {what}; {self.trainer.consecutive_skips} in a row"
            )
        flop_per_s = achieved_flop_per_s(self._flops_per_token, tokens, step_s)
        devices = self._devices = extra.get("replicas", 1) * self.devices_per_replica
        utilisation = mfu(flop_per_s, self._peak, devices)
        record = dict(
            step=stats.step,
            loss=_finite_or_none(stats.loss),  # (null for a step skipped as non-finite)
            lr=stats.lr,
            grad_norm=_finite_or_none(stats.grad_norm),
            tokens=tokens,
            microbatches=microbatches,
            step_s=round(step_s, 6),
            wall_s=round(elapsed, 6),
            tflop_per_s=_significant(flop_per_s / 1e12),
            **_present("mfu", utilisation),
            **extra,
        )
        # Kept by every replica: the writer of a later commit may have to write it (fill_gaps).
        self._recent[stats.step] = record
        for old in [k for k in self._recent if k <= stats.step - _RECENT_KEPT]:
            del self._recent[old]
        if self.writes_records and self._write_step(record):  # (nothing when fenced)
            self.say(
                format_step_line(
                    step=stats.step,
                    steps=cfg.steps,
                    loss=stats.loss,
                    lr=stats.lr,
                    tok_per_s=tokens / step_s if step_s > 0 else 0.0,
                    step_s=step_s,
                    eta_s=eta,
                    flop_per_s=flop_per_s,
                    mfu=utilisation,
                )
            )
            for sink in self._sinks:
                sink.follow()
        eval_due, ckpt_due = self._due(stats.step)
        if eval_due:
            self.evaluate(stats.step)
        if ckpt_due:
            self.checkpoint(stats.step + 1)

    def _due(self, step: int) -> tuple[bool, bool]:
        """Whether an evaluation, and a checkpoint, fall due after committed step `step`."""
        cfg, next_step = self.cfg, step + 1
        last = next_step == cfg.steps
        eval_due = bool(cfg.eval_every) and (next_step % cfg.eval_every == 0 or last)
        return eval_due, bool(cfg.ckpt_every) and next_step % cfg.ckpt_every == 0 and not last

    def _mirror(self, backend) -> None:
        self._sinks.append(RecordMirror(self.writer.path, replica=self.replica, backend=backend))

    def close_sinks(self) -> None:
        """Close the dashboards' mirrors, if any (TensorBoard's event files are flushed at every
        step; W&B's client is given what was queued, and time to finish)."""
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def _write_step(self, record: dict) -> bool:
        writer = {} if self.replica is None else {"writer": self.replica}
        return self.writer.step(**record, **writer) is not None

    def fill_gaps(self, first: int, upto: int) -> None:
        """This replica writes the records of the commit of step `upto`, and the coordinator says
        the records from step `first` on may be missing (their writer died or left before they
        were known written). Called before the update of `upto` is applied: the state is still
        the committed state after `upto - 1`. Writes the missing step records it kept, and the
        evaluation and checkpoint due after `upto - 1` when the run folder lacks them. Every rank
        of the replica calls it (evaluating and saving are collectives inside a replica) and reads
        the same run folder, so they agree on what is missing."""
        if not self.is_writer or first >= upto:
            return
        steps, evals = set(), set()
        for rec in read_metrics(self.writer.path):
            if rec.get("t_wall", 0) < self._t_wall_start:
                continue  # another run's (a resumed run re-commits the steps after its checkpoint)
            if rec.get("kind") == "step":
                steps.add(int(rec["step"]))
            elif rec.get("kind") == "eval":
                evals.add(int(rec["step"]))
        filled = [s for s in range(first, upto) if s not in steps and s in self._recent]
        if self.leads:
            for s in filled:
                self._write_step(self._recent[s])
        before = upto - 1
        eval_due, ckpt_due = self._due(before)
        evaluated = eval_due and before not in evals
        if evaluated:
            self.evaluate(before)
        saved = ckpt_due and not checkpoint_path(self.paths.checkpoints, upto).exists()
        if saved:
            self.checkpoint(upto)
        if self.leads and (filled or evaluated or saved):
            self.event(
                "records_filled", replica=self.replica, steps=filled,
                eval=before if evaluated else None, checkpoint=upto if saved else None,
            )  # fmt: skip
            self.say(
                f"recorded what the writer of step {first} left unwritten: "
                + ", ".join(
                    [f"step {s}" for s in filled]
                    + (["its evaluation"] if evaluated else [])
                    + ([f"the checkpoint after step {before}"] if saved else [])
                )
            )

    def evaluate(self, step: int) -> float | None:
        if not self.is_writer:  # the parameters are identical everywhere: one evaluation is enough
            return None
        loss = self.trainer.evaluate()
        self._last_eval = loss
        if self.leads:
            self.writer.eval(step=step, val_loss=loss)
        self.say(f"eval step {step} | val loss {loss:.4f}")
        return loss

    def checkpoint(self, next_step: int, *, block: bool = False) -> Path | None:
        """Save the committed state; only the writer replica writes, each of its ranks its own
        part (a collective inside the replica). An evicted incarnation saves nothing."""
        if not self.is_writer:
            return None
        trainer = self.trainer
        intra = getattr(trainer, "intra", None)
        meta = {
            "train": self.cfg.to_dict(),
            "data_hash": self.data_hash,
            # Who saved it, for people: any layout loads it.
            "layout": intra.layout.dims if intra is not None else {},
            "model": {k: getattr(trainer.model_config, k) for k in _MODEL_SHAPE},
        }
        # `checkpoint_saved` is written by _on_saved once the folder is durable, not here.
        return self._ckpt.save(
            next_step, trainer.checkpoint_state(), meta, aliases=CHECKPOINT_ALIASES, block=block
        )

    def wait_saves(self) -> None:
        """Block until the checkpoint in flight, if any, is durable (and announced)."""
        self._ckpt.wait()

    def settle(self) -> None:
        """Wait for the save in flight, if any, without raising its error: an incarnation that
        is leaving because it was evicted lets its save thread remove its temporary file."""
        try:
            self._ckpt.wait()
        except CheckpointError:
            pass

    def _on_saved(self, saved: SavedCheckpoint) -> None:
        """On the checkpoint thread, after fsync and rename: the file is on disk."""
        self.event(
            "checkpoint_saved",
            **({} if self.replica is None else {"replica": self.replica}),
            step=saved.step,
            path=str(saved.path),
            bytes=saved.bytes,
            seconds=round(saved.seconds, 6),
            stall_s=round(saved.stall_s, 6),
        )

    def finish(self, *, unigram_loss: float | None = None, extra: dict | None = None) -> dict:
        """Save the final model, write the summary record, print the summary."""
        self._ckpt.close()
        elapsed = time.perf_counter() - self._t_start
        flop_per_s = achieved_flop_per_s(self._flops_per_token, self._tokens, elapsed)
        summary = {
            "steps": self.cfg.steps,
            "steps_this_run": self.cfg.steps - self.start_step,
            "tokens_this_run": self._tokens,
            "wall_s": round(elapsed, 3),
            "tflop_per_s": _significant(flop_per_s / 1e12),
            "peak_tflops": self._peak,  # (of one device; null: unknown, no MFU)
            # (over the devices of the last commit: replicas x ranks)
            **_present("mfu", mfu(flop_per_s, self._peak, self._devices)),
            "final_val_loss": self._last_eval,
            "unigram_loss": unigram_loss,
            "out": str(self.paths.out),
            **(extra or {}),
        }
        # Nothing from an evicted incarnation, not even the temporary file (every rank of the
        # replica still takes part in gathering the model).
        publish = self.writes_records and self.writer.allowed()
        if self.is_writer:
            self.paths.final_model.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.paths.final_model.with_name("model.safetensors.tmp")
            self.trainer.save_model(str(tmp) if publish else None)
        if publish:
            os.replace(tmp, self.paths.final_model)
            self.writer.write("summary", **summary)
            self.say(self.format_summary(summary))
            for sink in self._sinks:
                sink.follow(final=True)
        self.close_sinks()
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
        if s.get("tflop_per_s") is not None:
            compute = f"{format_flops(s['tflop_per_s'] * 1e12)} achieved"
            if s.get("mfu") is not None:
                compute += f", MFU {100 * s['mfu']:.1f}% of {s['peak_tflops']:g} TFLOP/s per device"
            else:
                compute += ", MFU n/a (no known peak: --peak-tflops)"
            lines.append(f"  compute        {compute}")
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


# The model's shape, recorded in each checkpoint's metadata (the run's config.json has it too).
_MODEL_SHAPE = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")

# Commits whose step records every replica keeps (the gap a run of dead writers can leave).
_RECENT_KEPT = 64


def _present(name: str, value: float | None) -> dict:
    """{name: value rounded} when there is a value, else nothing (a field left out)."""
    return {} if value is None else {name: _significant(value)}


def _significant(x: float) -> float:
    """`x` to 6 significant digits (a CPU run's TFLOP/s is a small number)."""
    return float(f"{x:.6g}")


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
    """Validate a checkpoint's metadata against the run; return the next step to run."""
    if state.get("data_hash") != data_hash:
        raise CheckpointError(f"checkpoint in {path} was trained on another dataset")
    step = int(state["step"])
    if not 0 <= step <= cfg.steps:
        raise CheckpointError(f"checkpoint in {path} is at step {step}, beyond --steps {cfg.steps}")
    return step
