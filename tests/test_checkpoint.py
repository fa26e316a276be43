"""DCP checkpoints in one process: the library's save and restore, the reader, and the failure cases.

A script's own model, optimizer and scheduler saved with `recover.checkpoint.Checkpointer` while
training goes on (the save must hold the state of the step it was asked for, not a later one),
restored into fresh objects, and trained on: bit for bit the uninterrupted run. The reader returns
plain state dicts. A truncated or altered shard, a folder without its marker, a model of another
shape and a fenced writer each end as docs/checkpoints.md says.
"""

from __future__ import annotations

import json

import pytest
import torch

import recover.checkpoint as ckpt
from recover.training.checkpoint import MARKER, CheckpointError, checkpoint_path, list_checkpoints

# A one-rank save or load runs without a process group on purpose (DCP warns that it does).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)  # the batch of a step: a pure function of it
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_script_saves_while_it_trains_and_resumes_on_the_same_trajectory(tmp_path):
    model, optimizer, scheduler = build()
    for step in range(6):
        train_step(model, optimizer, scheduler, step)
    expected = flat(model)

    model, optimizer, scheduler = build()
    saver = ckpt.Checkpointer(tmp_path, keep=2)
    for step in range(3):
        train_step(model, optimizer, scheduler, step)
    at_3 = flat(model)
    saver.save(3, model, optimizer, extra={"scheduler": scheduler}, meta={"note": "mine"})
    train_step(model, optimizer, scheduler, 3)  # while the save is (maybe) still writing
    saver.close()

    model, optimizer, scheduler = build(seed=1)  # other initial values: all must come back
    restorer = ckpt.Checkpointer(tmp_path)
    start = restorer.restore(model, optimizer, extra={"scheduler": scheduler})
    assert start == 3 and torch.equal(flat(model), at_3)
    assert scheduler.last_epoch == 3 and optimizer.param_groups[0]["lr"] == 1e-2 * 0.5
    for step in range(start, 6):
        train_step(model, optimizer, scheduler, step)
    assert torch.equal(flat(model), expected)  # moments, step counts and schedule restored


def test_the_reader_returns_plain_state_dicts(tmp_path):
    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler, 0)
    path = ckpt.save(tmp_path, 1, model, optimizer, extra={"scheduler": scheduler}, meta={"a": 1})
    assert path == checkpoint_path(tmp_path, 1) and (path / MARKER).is_file()
    state = ckpt.load(path)
    assert state["meta"] == {"step": 1, "a": 1}
    assert set(state["model"]) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(state["model"][name], value)
    exp_avg = state["optimizer"]["state"]["0.weight"]["exp_avg"]
    assert torch.equal(exp_avg, optimizer.state[model[0].weight]["exp_avg"])
    assert state["optimizer"]["param_groups"]["2.bias"]["lr"] == optimizer.param_groups[0]["lr"]
    assert state["extra"]["scheduler"]["last_epoch"] == 1
    assert ckpt.latest(tmp_path)["meta"]["step"] == 1


def test_keep_removes_the_oldest_and_a_corrupt_newest_is_skipped(tmp_path, caplog):
    model, optimizer, scheduler = build()
    saver = ckpt.Checkpointer(tmp_path, keep=2)
    for step in range(4):
        train_step(model, optimizer, scheduler, step)
        saver.save(step + 1, model, optimizer, block=True)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    (shard,) = checkpoint_path(tmp_path, 4).glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    fresh, fresh_opt, _ = build(seed=1)
    assert saver.restore(fresh, fresh_opt) == 3
    assert "has" in caplog.text and "bytes" in caplog.text and "step_00000004" in caplog.text
    with pytest.raises(CheckpointError, match="checksum"):
        (shard,) = checkpoint_path(tmp_path, 3).glob("*.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
        ckpt.load(checkpoint_path(tmp_path, 3))
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        saver.restore(fresh, fresh_opt)  # both corrupt: never a silent fresh start
    saver.close()


def test_a_folder_without_its_marker_is_no_checkpoint(tmp_path):
    model, optimizer, _ = build()
    path = ckpt.save(tmp_path, 2, model, optimizer)
    (path / MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.load(path)


def test_a_checkpoint_of_another_model_shape_is_refused_by_name(tmp_path):
    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler, 0)
    ckpt.save(tmp_path, 1, model, optimizer)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    with pytest.raises(CheckpointError, match=r"0\.weight of shape \(16, 8\).*\(32, 8\)"):
        ckpt.Checkpointer(tmp_path).restore(wider, torch.optim.AdamW(wider.parameters()))


@pytest.mark.parametrize("refuse_at", ["start", "publish"])
def test_a_fenced_writer_publishes_nothing(tmp_path, refuse_at):
    asked = []

    def fence() -> bool:  # the first question is before the save, the second before the rename
        asked.append(len(asked))
        return refuse_at == "publish" and len(asked) == 1

    saved = []
    model, optimizer, _ = build()
    saver = ckpt.Checkpointer(tmp_path, fence=fence, on_saved=saved.append)
    result = saver.save(1, model, optimizer, block=True)
    saver.close()
    assert list(tmp_path.iterdir()) == [] and saved == []  # no folder, no temporary, no event
    assert (result is None) == (refuse_at == "start")
    assert len(asked) == (1 if refuse_at == "start" else 2)


def test_the_marker_lists_every_file_with_its_size(tmp_path):
    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler, 0)
    path = ckpt.save(tmp_path, 1, model, optimizer)
    marker = json.loads((path / MARKER).read_text())
    assert marker["format"] == "recover-dcp/1" and marker["step"] == 1
    on_disk = {f.name: f.stat().st_size for f in path.iterdir() if f.name != MARKER}
    assert {n: f["bytes"] for n, f in marker["files"].items()} == on_disk
    assert ".metadata" in on_disk and any(n.endswith(".distcp") for n in on_disk)
