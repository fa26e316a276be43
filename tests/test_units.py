"""Fast unit tests: model shapes, config validation, the LR schedule, checkpoints, metrics."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import child_env
from recover.checkpoint.folders import list_checkpoints
from recover.checkpoint.state import CheckpointWriter, read_checkpoint
from recover.record import MetricsWriter, committed_steps
from recover.training.config import TrainConfig, compute_lr
from recover.training.console import format_step_line
from recover.training.model import GPT, PRESETS, GPTConfig, build_config


def test_gpt_shapes_and_loss_near_uniform_at_init():
    torch.manual_seed(0)
    model = GPT(build_config("tiny", vocab_size=256, block_size=16))
    x = torch.randint(0, 256, (3, 16))
    y = torch.randint(0, 256, (3, 16))
    logits, loss = model(x, y)
    assert logits.shape == (3, 16, 256)
    assert abs(float(loss.detach()) - math.log(256)) < 0.2  # small init: close to uniform


def test_gpt_rejects_too_long_sequences_and_bad_configs():
    model = GPT(build_config("tiny", vocab_size=256, block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="unknown preset"):
        build_config("nope", vocab_size=256, block_size=8)


def test_presets_include_the_promised_sizes():
    assert {"tiny", "small", "gpt2-124m"} <= set(PRESETS)
    cfg = build_config("gpt2-124m", vocab_size=50304, block_size=1024)
    n = sum(p.numel() for p in GPT(cfg).parameters())
    assert 120e6 < n < 130e6


def test_train_config_validation_names_the_flag():
    with pytest.raises(ValueError, match="--microbatches"):
        TrainConfig(microbatches=0)
    with pytest.raises(ValueError, match="--min-lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="--preset"):
        TrainConfig(preset="x")


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [compute_lr(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[-1] >= 0.1 and compute_lr(100, cfg) == pytest.approx(0.1)


def test_checkpoint_save_copies_state_before_training_goes_on(tmp_path):
    # (Atomic publish, verification and pruning: tests/test_checkpoint.py.)
    w = torch.zeros(1000)
    writer = CheckpointWriter(tmp_path, keep=1)
    writer.save(1, {"model": {"w": w}}, {"note": "copy"})
    w.add_(5.0)  # training mutates parameters while the write is in flight
    writer.close()
    saved = read_checkpoint(list_checkpoints(tmp_path)[0][1])
    assert torch.equal(saved["model"]["w"], torch.zeros(1000))
    assert saved["meta"]["step"] == 1 and saved["meta"]["note"] == "copy"


def test_metrics_last_record_of_a_step_wins_and_torn_lines_are_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    w.step(step=0, loss=2.0)
    w.step(step=1, loss=1.5)
    w.event("resumed", step=1)
    w.step(step=1, loss=1.4)
    w.close()
    with open(path, "a") as f:
        f.write('{"kind": "step", "step": 2, "lo')  # a writer killed mid-line
    steps = committed_steps(path)
    assert sorted(steps) == [0, 1] and steps[1]["loss"] == 1.4


def test_step_line_has_the_promised_fields():
    line = format_step_line(
        step=4, steps=10, loss=2.5, lr=1e-3, tok_per_s=12345, step_s=0.2, eta_s=65
    )
    assert line.startswith("step  4/10")  # the step's index, as in the record
    assert "loss 2.5000" in line and "tok/s" in line
    assert "200 ms" in line and "eta 1m05s" in line


_GUARD_SCRIPT = """
import sys, time
from recover.runtime.stall import StallGuard
mode = sys.argv[1]
guard = StallGuard(0 if mode == "off" else 0.3, replica=4, rank=1)
if mode == "idle":  # not busy: never watched
    time.sleep(1.0)
elif mode == "ticking":  # busy, making progress
    with guard.busy("computing"):
        for _ in range(20):
            time.sleep(0.05)
            guard.tick()
elif mode == "off":  # --stall-timeout 0: busy and stuck, but nothing watches
    with guard.busy("computing"):
        time.sleep(1.0)
else:  # busy, stuck
    def stuck_in_a_kernel():
        time.sleep(5)
    with guard.busy("computing"):
        stuck_in_a_kernel()
print("finished")
"""


@pytest.mark.process  # a real process that the guard ends
@pytest.mark.parametrize("mode, code", [("idle", 0), ("ticking", 0), ("off", 0), ("stuck", 8)])
def test_stall_guard_ends_only_a_process_busy_without_progress(mode, code):
    r = subprocess.run(
        [sys.executable, "-c", _GUARD_SCRIPT, mode],
        capture_output=True, text=True, timeout=20, env=child_env(),
    )  # fmt: skip
    assert r.returncode == code, r.stderr
    if code:
        assert "replica 4 rank 1: no progress for" in r.stderr and "while computing" in r.stderr
        assert "finished" not in r.stdout
        # Every thread's stack was dumped before the end: the stuck main thread's, where it sleeps
        # in the script, and the guard's own.
        assert "the stacks of all threads" in r.stderr
        dump = r.stderr.split("the stacks of all threads", 1)[1]
        assert "in stuck_in_a_kernel" in dump and "in _stalled" in dump
    else:
        assert "the stacks of all threads" not in r.stderr
        assert "finished" in r.stdout


def test_stall_timeout_is_checked():
    from recover.runtime.stall import check_stall

    check_stall(0)
    check_stall(2.5)
    for bad in (-1, "10", True):
        with pytest.raises(ValueError, match="--stall-timeout must be >= 0"):
            check_stall(bad)


def test_the_join_fingerprint_covers_every_setting_of_the_update(tiny_dataset):
    """A replica whose training settings differ in anything that changes the committed update
    (optimizer, schedule, clip, dropout, precision, batch, seed...) or whose mode differs is
    refused; the record-only settings (eval and checkpoint cadence) may differ."""
    from dataclasses import fields, replace

    from recover.data.addressing import TokenDataset
    from recover.runtime.spec import ReplicaSpec
    from recover.training.config import TrainConfig
    from recover.training.worker import fingerprint

    data = TokenDataset.open(tiny_dataset)
    base = TrainConfig()
    ref = fingerprint(base, data)
    changed = {
        "preset": "small", "precision": "bf16", "steps": 301, "microbatches": 9,
        "microbatch_size": 9, "seq_len": 64, "seed": 1, "warmup_steps": 31, "eval_every": 101,
        "eval_batches": 9, "ckpt_every": 101, "keep_ckpts": 3, "beta1": 0.8, "beta2": 0.9,
        "dropout": 0.1, "init_from": "runs/other",
    }  # fmt: skip
    for f in fields(TrainConfig):
        value = changed.get(f.name, getattr(base, f.name) * 2)  # lr, min_lr, weight_decay, clip
        other = fingerprint(replace(base, **{f.name: value}), data)
        record_only = f.name in ("eval_every", "eval_batches", "ckpt_every", "keep_ckpts")
        assert (other == ref) == record_only, f.name
    assert fingerprint(base, data, ReplicaSpec(mode="shrink")) != ref
    assert fingerprint(base, data, ReplicaSpec(reduce_bucket_mb=4)) != ref


def test_a_joiner_trainer_adopts_the_transferred_state_without_copying_it(tiny_dataset):
    """The built-in trainer's transfer: a fresh trainer (a joiner's) loads a trained one's
    transfer_state_dict() through the transfer's own byte form; its optimizer then holds the
    received buffers themselves (no copy, no state created by a zero step first), and one more
    step of both gives the same bits."""
    from recover.data.addressing import TokenDataset
    from recover.runtime.transfer import _unflatten, describe_state
    from recover.training.config import TrainConfig
    from recover.training.trainer import ReplicaTrainer

    cfg = TrainConfig(preset="tiny", seq_len=32, microbatch_size=2, microbatches=2, steps=4)
    data = TokenDataset.open(tiny_dataset)
    live, joiner = ReplicaTrainer(cfg, data), ReplicaTrainer(cfg, data)

    def step(trainer, k):
        trainer.grads.clear()
        trainer.compute_microbatches(k, [0, 1])
        trainer.apply_commit(k, trainer.snapshot())

    step(live, 0)
    header, parts = describe_state(live, torch.device("cpu"))
    received = [p.clone() for p in parts]  # the joiner's fresh receive buffers
    meta = json.loads(header)
    steps = []  # optimizer steps taken by the load (torch's state-dict helper takes a zero step)
    hook = joiner.optimizer.register_step_pre_hook(lambda *args: steps.append(1))
    joiner.load_transfer_state(_unflatten(meta["structure"], received))
    hook.remove()
    assert steps == []
    pointers = {b.data_ptr() for b in received}
    held = [t for s in joiner.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert held and all(t.data_ptr() in pointers for t in held)
    step(live, 1)
    step(joiner, 1)
    assert all(torch.equal(a, b) for a, b in zip(live.params, joiner.params, strict=True))
