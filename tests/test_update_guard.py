"""The guard guards the state, not a proxy: an update that makes any parameter or optimizer state
non-finite from a finite gradient is undone, bit for bit, and nothing non-finite is checkpointed
or exported.

The overflows are made on purpose, so that no test depends on where a CPU's kernels first
overflow: a gradient of 1e30 is finite in fp32, its square is not (even times 1 - beta2 first),
so AdamW's second moment overflows whatever the kernel; a learning rate times weight decay of 1e40 makes the decayed
parameters overflow. Without the guard both commit a non-finite state.
"""

from __future__ import annotations

import math

import pytest
import torch

from recover.runtime.update_guard import UpdateGuard, all_finite

pytestmark = pytest.mark.unit


def _model_and_adamw(**kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **kw)
    return model, optimizer


def _state(model, optimizer) -> dict:
    """Every value the update can change, copied."""
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, s in enumerate(optimizer.state.values()):
        for k, v in s.items():
            out[f"s.{i}.{k}"] = v.clone() if torch.is_tensor(v) else v
    return out


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _set_grads(model, value: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def test_all_finite_sees_nan_and_infinity_anywhere():
    assert all_finite([torch.ones(5), torch.zeros(0), torch.arange(3)])
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.ones(1000)
        t[777] = bad
        assert not all_finite([torch.ones(2), t]), bad
    assert not all_finite([torch.tensor([1.0, math.nan], dtype=torch.bfloat16)])
    # An infinity of each sign: their sum is NaN, not finite either.
    assert not all_finite([torch.tensor([math.inf, -math.inf, 1.0])])


def test_all_finite_reads_values_again_where_only_their_sum_overflows():
    """Finite values whose sum overflows (3e38 x 10 in fp32; 3e38 is near fp32's largest) are
    finite: the sum only decides where it is finite."""
    big = torch.full((10,), 3e38)
    assert not bool(torch.isfinite(big.sum()))
    assert all_finite([torch.ones(3), big])
    big[4] = math.inf
    assert not all_finite([torch.ones(3), big])


@pytest.mark.parametrize("first_step", [True, False])
def test_an_overflowing_second_moment_is_undone_bit_for_bit(first_step):
    """A gradient of 1e30 is finite; AdamW's exp_avg_sq = (1 - beta2) * g^2 is not (fp32),
    in whatever order a kernel multiplies the three."""
    model, optimizer = _model_and_adamw(lr=1e-3)
    guard = UpdateGuard(optimizer)
    if not first_step:  # the optimizer's state exists already: it must be copied back
        _set_grads(model, 0.5)
        guard.save()
        optimizer.step()
        assert guard.finite()
    before = _state(model, optimizer)
    _set_grads(model, 1e30)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())  # the gradient passes
    guard.save()
    optimizer.step()
    assert not guard.finite()  # the state it made does not
    guard.restore()
    assert guard.finite()
    assert _equal(_state(model, optimizer), before)
    # The restored optimizer goes on as if the bad step had never been taken.
    _set_grads(model, 0.25)
    optimizer.step()
    twin, twin_opt = _model_and_adamw(lr=1e-3)
    if not first_step:
        _set_grads(twin, 0.5)
        twin_opt.step()
    _set_grads(twin, 0.25)
    twin_opt.step()
    assert _equal(_state(model, optimizer), _state(twin, twin_opt))


def test_parameters_that_overflow_under_weight_decay_are_undone():
    """A finite gradient, and an update that grows the parameters past fp32's range."""
    model, optimizer = _model_and_adamw(lr=1e20, weight_decay=1e20)
    guard = UpdateGuard(optimizer)
    _set_grads(model, 0.5)
    before = _state(model, optimizer)
    guard.save()
    optimizer.step()
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert not guard.finite()
    guard.restore()
    assert _equal(_state(model, optimizer), before)


def test_the_trainer_skips_an_update_that_is_not_finite(tiny_dataset):
    """ReplicaTrainer.apply_commit with a finite sum whose AdamW update overflows: the step is
    recorded as skipped ("non-finite update"), the state is the one before it, and after
    max_nonfinite of them in a row the run stops with the last finite state."""
    from recover.data.addressing import TokenDataset
    from recover.training.config import TrainConfig
    from recover.training.trainer import NonFiniteError, ReplicaTrainer

    torch.set_num_threads(1)
    cfg = TrainConfig(preset="tiny", seq_len=16, microbatch_size=2, microbatches=2, grad_clip=0.0)
    trainer = ReplicaTrainer(cfg, TokenDataset.open(tiny_dataset))
    trainer.compute_microbatches(0, range(2))
    stats = trainer.apply_commit(0, trainer.snapshot())
    assert not stats.skipped and trainer.update_guard.finite()
    before = _state(trainer.model, trainer.optimizer)
    huge = torch.full((trainer.numel + 1,), 1e30)  # the gradient values, then the loss sum
    huge[-1] = 4.0
    for step in (1, 2, 3):
        stats = trainer.apply_commit(step, huge.clone())
        assert stats.skipped == "non-finite update" and math.isfinite(stats.loss)
        assert _equal(_state(trainer.model, trainer.optimizer), before)
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        trainer.stop_if_diverging()
    trainer.check_finite_model()  # the model it would write is finite


def test_a_checkpoint_of_a_non_finite_state_is_refused(tmp_path):
    from recover.checkpoint.folders import CheckpointError
    from recover.checkpoint.state import CheckpointWriter

    model, optimizer = _model_and_adamw(lr=1e-3)
    writer = CheckpointWriter(tmp_path / "ckpt", keep=2)
    state = {"model": {n: p.detach().clone() for n, p in model.named_parameters()}}
    writer.save(1, state, {}, block=True)
    state["model"]["0.weight"][1, 2] = math.nan
    with pytest.raises(CheckpointError, match="not finite"):
        writer.save(2, state, {}, block=True)
    writer.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001"]
