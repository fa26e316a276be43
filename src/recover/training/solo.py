"""Training with one replica: the failure-free step of docs/design.md with nobody to reduce with.

Job: open the run folder, build the replica's trainer, resume from the newest checkpoint when
asked, and run steps `start..steps-1`: compute microbatch ids 0..M-1, take the snapshot, commit
from it. With R replicas the same step goes through the coordinator and the fault-tolerant
all-reduce (see `recover.training.worker`); the trajectory is the same.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from recover.checkpoint.folders import (
    MARKER,
    CheckpointError,
    ResumePoint,
    find_resume_point,
    verify_checkpoint,
)
from recover.checkpoint.state import load_dcp_state
from recover.data.addressing import TokenDataset
from recover.record import MetricsWriter
from recover.training.config import RunPaths, TrainConfig
from recover.training.recorder import (
    RunRecorder,
    check_resume_state,
    load_resume_state,
    unigram_loss,
)
from recover.training.runfolder import open_run_folder, read_dataset_info
from recover.training.trainer import (
    CHECKPOINT_ALIASES,
    NonFiniteError,
    ReplicaTrainer,
    pick_device,
)

log = logging.getLogger(__name__)


def announce_resume(
    point: ResumePoint | None,
    start: int,
    *,
    emit: Callable[..., object],
    console: TextIO | None,
) -> None:
    """Say where a resumed run starts: a `resumed` event (and one `checkpoint_corrupt` event per
    corrupt newer checkpoint it skipped) and a console line. A skipped checkpoint is also a loud
    warning on stderr: steps after the older checkpoint are recomputed (same trajectory)."""
    skipped = point.skipped if point is not None else ()
    for path, why in skipped:
        emit("checkpoint_corrupt", path=str(path), error=why)
        log.warning(f"WARNING: {why}; skipping it and resuming from the older {point.path}")
    emit(
        "resumed",
        step=start,
        path=str(point.path) if point is not None else None,
        skipped=[str(p) for p, _ in skipped],
    )
    if console is not None:
        where = f"from {point.path}" if point is not None else "(no checkpoint: from the start)"
        log.info(f"resuming at step {start} {where}")


def build_trainer_for_run(
    cfg: TrainConfig,
    *,
    paths: RunPaths,
    dataset: TokenDataset,
    resume: bool,
    intra=None,
    device: str = "cpu",
    emit: Callable[..., object] | None = None,
    console: TextIO | None = sys.stdout,
) -> tuple[ReplicaTrainer, int]:
    """The trainer, loaded from the newest valid checkpoint when resuming; and the next step to
    run. With `intra` (a recover.runtime.links.IntraReplica), the model is split over the replica's ranks
    as its layout `intra.layout` says.

    Resuming is announced (announce_resume) by the first rank of the replica: through `emit`
    (an event writer), or when none is given, through a writer of the run's metrics.jsonl opened
    for it; and on `console`."""
    if intra is None:
        trainer = ReplicaTrainer(cfg, dataset, device=device)
    else:
        from recover.training.parallel import trainer_class

        trainer = trainer_class(intra.layout)(cfg, dataset, intra=intra, device=device)
    emit = emit or _event_once(paths)
    start = 0
    point = None
    if resume:
        point = load_resume_state(paths)
        if point is not None:
            start = check_resume_state(
                point.meta, cfg=cfg, data_hash=dataset.content_hash, path=point.path
            )
            try:
                trainer.load_checkpoint(point)
            except ValueError as e:  # an older single-file checkpoint of another layout
                raise CheckpointError(f"{point.path}: {e}") from None
        if intra is None or intra.rank == 0:
            announce_resume(point, start, emit=emit, console=console)
    if point is None and cfg.init_from:  # a fresh start (a resumed run's own state wins)
        source = init_checkpoint(Path(cfg.init_from))
        load_dcp_state(
            source, trainer.model, None, aliases=CHECKPOINT_ALIASES,
            process_group=trainer.checkpoint_group,
        )  # fmt: skip
        if intra is None or intra.rank == 0:
            emit("initialized_from", path=str(source))
            if console is not None:
                log.info(f"model initialized from {source} (the optimizer starts fresh, at step 1)")
    return trainer, start


def init_checkpoint(path: Path) -> Path:
    """The checkpoint folder that --init-from names: `path` itself (a step_N folder), or the
    newest valid one of a run folder or of a checkpoints folder. CheckpointError naming the
    path when there is none."""
    if (path / MARKER).exists():
        verify_checkpoint(path)
        return path
    for folder in (path / "checkpoints", path):
        if folder.is_dir():
            point = find_resume_point(folder)
            if point is not None and point.legacy_state is None:
                return point.path
    raise CheckpointError(
        f"--init-from {path}: no checkpoint there (a step_N folder, a run folder or its "
        "checkpoints folder)"
    )


def _event_once(paths: RunPaths) -> Callable[..., object]:
    """An event writer for a caller that holds none: each event through a writer of the run's
    metrics.jsonl opened for it."""

    def emit(name: str, **fields) -> None:
        writer = MetricsWriter(paths.metrics)
        try:
            writer.event(name, **fields)
        finally:
            writer.close()

    return emit


def train_single(
    cfg: TrainConfig,
    *,
    out: Path,
    data_path: Path,
    resume: bool = False,
    console: TextIO | None = sys.stdout,
    device: str = "cpu",
    peak_tflops: float = 0.0,
    tensorboard: str = "",
    wandb: str = "",
) -> dict:
    """Train one replica; return the run summary. Raises RunFolderError / CheckpointError.
    `peak_tflops`, `tensorboard` and `wandb`: the replica spec's (--peak-tflops, --tensorboard,
    --wandb)."""
    dataset = TokenDataset.open(data_path)
    paths = RunPaths(out=out)
    info = read_dataset_info(data_path)
    device = pick_device(device)  # before the run folder: a bad --device leaves nothing behind
    open_run_folder(paths, cfg, data_info=info, resume=resume, launch={"replicas": 1})
    writer = MetricsWriter(paths.metrics)
    try:
        trainer, start = build_trainer_for_run(
            cfg, paths=paths, dataset=dataset, resume=resume, device=device,
            emit=writer.event, console=console,
        )  # fmt: skip
    except BaseException:
        writer.close()
        raise
    recorder = RunRecorder(
        cfg=cfg,
        paths=paths,
        trainer=trainer,
        data_hash=dataset.content_hash,
        writer=writer,
        console=console,
        start_step=start,
        peak_tflops=peak_tflops,
        tensorboard=tensorboard,
        wandb=wandb,
    )
    if console is not None:
        n = trainer.model.num_params()
        log.info(
            f"training {cfg.preset} ({n / 1e6:.2f}M parameters) for {cfg.steps} steps of "
            f"{cfg.microbatches} x {cfg.microbatch_size} x {cfg.seq_len} tokens; run folder {out}"
        )
    all_ids = range(cfg.microbatches)
    try:
        for step in range(start, cfg.steps):
            trainer.compute_microbatches(step, all_ids)
            snapshot = trainer.snapshot()
            stats = trainer.apply_commit(step, snapshot)
            recorder.on_commit(stats, microbatches=cfg.microbatches)
            try:
                trainer.stop_if_diverging()
            except NonFiniteError:  # the parameters are those of the last finite step: keep them
                recorder.checkpoint(step + 1, block=True)
                raise
        summary = recorder.finish(
            unigram_loss=unigram_loss(
                dataset.shards("train"), dataset.shards("val"), dataset.vocab_size
            )
        )
    finally:
        writer.close()
    return summary


__all__ = ["train_single", "CheckpointError"]
