"""Training with one replica: the failure-free step of DESIGN.md with nobody to reduce with.

Job: open the run folder, build the replica's trainer, resume from the newest checkpoint when
asked, and run steps `start..steps-1`: compute microbatch ids 0..M-1, take the snapshot, commit
from it. With R replicas the same step goes through the coordinator and the fault-tolerant
all-reduce (see `recover.worker`); the trajectory is the same.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from recover.checkpoint import CheckpointError
from recover.config import RunPaths, TrainConfig
from recover.data.addressing import TokenDataset
from recover.metrics import MetricsWriter
from recover.run import RunRecorder, check_resume_state, load_resume_state, unigram_loss
from recover.runfolder import open_run_folder, read_dataset_info
from recover.trainer import ReplicaTrainer, pick_device


def build_trainer_for_run(
    cfg: TrainConfig,
    *,
    paths: RunPaths,
    dataset: TokenDataset,
    resume: bool,
    intra=None,
    device: str = "cpu",
) -> tuple[ReplicaTrainer, int]:
    """The trainer, loaded from the newest checkpoint when resuming; and the next step to run.
    With `intra` (a recover.intra.IntraReplica), the model is split over the replica's ranks
    as its layout `intra.dims` says."""
    if intra is None:
        trainer = ReplicaTrainer(cfg, dataset, device=device)
    else:
        from recover.parallel import trainer_class

        trainer = trainer_class(intra.dims)(cfg, dataset, intra=intra, device=device)
    start = 0
    if resume:
        state = load_resume_state(paths)
        if state is not None:
            start = check_resume_state(
                state, cfg=cfg, data_hash=dataset.content_hash, path=paths.checkpoints
            )
            try:
                trainer.load_state_dict(state)
            except ValueError as e:  # a checkpoint of another layout
                raise CheckpointError(f"{paths.checkpoints}: {e}") from None
    return trainer, start


def train_single(
    cfg: TrainConfig,
    *,
    out: Path,
    data_path: Path,
    resume: bool = False,
    console: TextIO | None = sys.stdout,
    device: str = "cpu",
) -> dict:
    """Train one replica; return the run summary. Raises RunFolderError / CheckpointError."""
    dataset = TokenDataset.open(data_path)
    paths = RunPaths(out=out)
    info = read_dataset_info(data_path)
    device = pick_device(device)  # before the run folder: a bad --device leaves nothing behind
    open_run_folder(paths, cfg, data_info=info, resume=resume, launch={"replicas": 1})
    trainer, start = build_trainer_for_run(
        cfg, paths=paths, dataset=dataset, resume=resume, device=device
    )
    writer = MetricsWriter(paths.metrics)
    recorder = RunRecorder(
        cfg=cfg,
        paths=paths,
        trainer=trainer,
        data_hash=dataset.content_hash,
        writer=writer,
        console=console,
        start_step=start,
    )
    if console is not None:
        n = trainer.model.num_params()
        print(
            f"training {cfg.preset} ({n / 1e6:.2f}M parameters) for {cfg.steps} steps of "
            f"{cfg.microbatches} x {cfg.microbatch_size} x {cfg.seq_len} tokens; run folder {out}",
            file=console,
            flush=True,
        )
    if resume:
        recorder.event("resumed", step=start)
        if console is not None:
            print(f"resuming at step {start + 1}", file=console, flush=True)
    all_ids = range(cfg.microbatches)
    try:
        for step in range(start, cfg.steps):
            trainer.compute_microbatches(step, all_ids)
            snapshot = trainer.snapshot()
            stats = trainer.apply_commit(step, snapshot)
            recorder.on_commit(stats, microbatches=cfg.microbatches)
        summary = recorder.finish(
            unigram_loss=unigram_loss(
                dataset.shards("train"), dataset.shards("val"), dataset.vocab_size
            )
        )
    finally:
        writer.close()
    return summary


__all__ = ["train_single", "CheckpointError"]
