"""recover train's updates applied while the vote completes (training.worker.EarlyUpdates), on a
real trainer: undone bit for bit by a redo, and set aside while a lost writer's checkpoint is
written. The step machine's side (when it applies and undoes) is in test_step_machine.py.

Not in test_update_guard.py on purpose: that file is run again under every CPU kernel set
(test_cpu_kernels.py), and these compare two runs of the same kernels in one process.
"""

from __future__ import annotations

import torch
from test_update_guard import _equal, _state


def test_an_update_applied_during_the_vote_is_undone_bit_for_bit(tiny_dataset):
    """recover train's replicas apply each update while the vote completes (worker.EarlyUpdates)
    and undo it when the outcome is a redo: the parameters, the AdamW state, the skip count and
    the local gradient sum are what they were, so the redo's commit gives the same bits as a
    trainer that never applied early."""
    from recover.data.addressing import TokenDataset
    from recover.runtime.stall import StallGuard
    from recover.training.config import TrainConfig
    from recover.training.trainer import ReplicaTrainer
    from recover.training.worker import EarlyUpdates

    torch.set_num_threads(1)
    cfg = TrainConfig(preset="tiny", seq_len=16, microbatch_size=2, microbatches=3)
    data = TokenDataset.open(tiny_dataset)
    early_one, plain = ReplicaTrainer(cfg, data), ReplicaTrainer(cfg, data)
    early = EarlyUpdates(early_one, StallGuard(0, replica=0), steps=100)
    for trainer in (early_one, plain):  # one committed step, so that AdamW has state
        trainer.compute_microbatches(0, range(3))
        trainer.apply_commit(0, trainer.snapshot())
    for trainer in (early_one, plain):
        trainer.compute_microbatches(1, range(2))  # the attempt's ids; id 2 comes in the redo
    before = _state(early_one.model, early_one.optimizer)
    local = early_one.snapshot()
    undo = early(1, early_one.snapshot(), 3, True)  # the vote's update, then a redo
    assert not _equal(_state(early_one.model, early_one.optimizer), before)
    undo()
    assert _equal(_state(early_one.model, early_one.optimizer), before)
    assert torch.equal(early_one.snapshot(), local) and early_one.consecutive_skips == 0
    for trainer in (early_one, plain):  # the redo: id 2 on top of the kept sum, then the commit
        trainer.compute_microbatches(1, [2])
    undo = early(1, early_one.snapshot(), 3, True)
    stats, _ = early.take(1)
    plain_stats = plain.apply_commit(1, plain.snapshot())
    assert stats.loss == plain_stats.loss
    assert _equal(
        _state(early_one.model, early_one.optimizer), _state(plain.model, plain.optimizer)
    )


def test_a_lost_writers_checkpoint_is_written_from_the_state_before_the_update(tiny_dataset):
    """A writer that must fill in a lost writer's checkpoint (recorder.fill_gaps) after its own
    update was applied during the vote sets that update aside while it writes
    (EarlyUpdates.before): inside the block the model and optimizer are the committed state
    before the update, after it the updated state again."""
    from recover.data.addressing import TokenDataset
    from recover.runtime.stall import StallGuard
    from recover.training.config import TrainConfig
    from recover.training.trainer import ReplicaTrainer
    from recover.training.worker import EarlyUpdates

    torch.set_num_threads(1)
    cfg = TrainConfig(preset="tiny", seq_len=16, microbatch_size=2, microbatches=2)
    trainer = ReplicaTrainer(cfg, TokenDataset.open(tiny_dataset))
    early = EarlyUpdates(trainer, StallGuard(0, replica=0), steps=100)
    for step in (0, 1):
        trainer.compute_microbatches(step, range(2))
        committed = _state(trainer.model, trainer.optimizer)
        early(step, trainer.snapshot(), 2, True)
        updated = _state(trainer.model, trainer.optimizer)
        assert not _equal(updated, committed)
        with early.before(step):
            assert _equal(_state(trainer.model, trainer.optimizer), committed)
        assert _equal(_state(trainer.model, trainer.optimizer), updated)
        early.take(step)
