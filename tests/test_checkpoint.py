"""DCP checkpoints in one process: the library's save and restore, the reader, and the failure cases.

A script's own model, optimizer and scheduler saved with `recover.checkpoint.Checkpointer` while
training goes on (the save must hold the state of the step it was asked for, not a later one),
restored into fresh objects, and trained on: bit for bit the uninterrupted run. The reader returns
plain state dicts. A truncated or altered shard, a folder without its marker, a model of another
shape and a fenced writer each end as docs/checkpoints.md says.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import recover.checkpoint as ckpt
from recover.checkpoint.folders import MARKER, CheckpointError, checkpoint_path, list_checkpoints

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


def test_an_edited_marker_is_refused_and_the_resume_takes_the_older_checkpoint(tmp_path, caplog):
    """The marker's step is not trusted: a marker edited by hand (step 4 -> 2, so that a resume
    would silently start off the trajectory) fails its own checksum, and one whose checksum was
    recomputed too still names another step than its folder. Either way the newest valid
    checkpoint is the older one."""
    from recover.checkpoint.folders import _marker_crc32

    model, optimizer, scheduler = build()
    saver = ckpt.Checkpointer(tmp_path, keep=3)
    for step in range(4):
        train_step(model, optimizer, scheduler, step)
        if step in (2, 3):
            saver.save(step + 1, model, optimizer, block=True)
    saver.close()
    marker_path = checkpoint_path(tmp_path, 4) / MARKER
    marker = json.loads(marker_path.read_text())
    assert marker["step"] == 4 and marker["marker_crc32"] == _marker_crc32(marker)
    marker["step"] = 2
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="does not match its own checksum"):
        ckpt.load(checkpoint_path(tmp_path, 4))
    marker["marker_crc32"] = _marker_crc32(marker)  # a careful edit: the checksum recomputed
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="says step 2, its folder is named after step 4"):
        ckpt.load(checkpoint_path(tmp_path, 4))
    fresh, fresh_opt, _ = build(seed=1)
    assert ckpt.Checkpointer(tmp_path).restore(fresh, fresh_opt) == 3
    assert "step_00000004" in caplog.text


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


# ---- the in-place reader against DCP's own ----------------------------------------------------
class Chunks(torch.Tensor):
    """A tensor that DCP saves and loads as the chunks `bounds` cut along `dim`, as the ranks of a
    sharded layout would: a save in one layout and a load in another, in one process."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, dim: int, bounds: tuple[int, ...]):
        t = torch.Tensor._make_subclass(cls, data)
        t.cut, t.bounds = dim, bounds
        return t

    def _part(self, start: int) -> torch.Tensor:
        end = self.bounds[self.bounds.index(start) + 1]
        return self.as_subclass(torch.Tensor).narrow(self.cut, start, end - start)

    def _chunks(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        for start in self.bounds[:-1]:
            part = self._part(start)
            offsets = [0] * self.dim()
            offsets[self.cut] = start
            yield part, ChunkStorageMetadata(torch.Size(offsets), part.shape)

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(part),
                    size=self.shape,
                ),
            )  # fmt: skip
            for part, chunk in self._chunks()
        ]

    def __create_chunk_list__(self):
        return [chunk for _, chunk in self._chunks()]

    def __get_tensor_shard__(self, index):
        return self._part(index.offset[self.cut])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor).reshape(-1).contiguous().view(torch.uint8)


def test_the_in_place_reader_leaves_the_state_dcp_reader_leaves(tmp_path):
    import torch.distributed.checkpoint as dcp

    from recover.checkpoint.dcp_reader import InPlaceReader

    g = torch.Generator().manual_seed(0)
    saved = {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(6, 3, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-9, 9, (11,), generator=g),
        "flag": torch.tensor([True, False, True]),
        "step": torch.tensor(7.0),  # 0-dim, like AdamW's step
        "saved_t": torch.randn(4, 6, generator=g).t(),  # saved with transposed strides
        "dest_t": torch.randn(3, 5, generator=g),  # loaded into a transposed destination
        "groups": {"lr": 0.1, "betas": (0.9, 0.95)},  # objects
        "rows": Chunks(torch.randn(10, 4, generator=g), 0, (0, 3, 10)),  # 2 saved chunks
        "cols": Chunks(torch.randn(4, 10, generator=g), 1, (0, 6, 10)),
    }
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)

    def fresh(layout: str) -> dict:  # every byte a sentinel: a byte not read shows
        rows, cols = torch.full((10, 4), -1.0), torch.full((4, 10), -1.0)
        return {
            "f32": torch.full((5, 7), -1.0),
            "bf16": torch.full((6, 3), -1.0, dtype=torch.bfloat16),
            "i64": torch.full((11,), -1),
            "flag": torch.zeros(3, dtype=torch.bool),
            "step": torch.tensor(-1.0),
            "saved_t": torch.full((6, 4), -1.0),
            "dest_t": torch.full((5, 3), -1.0).t(),
            "groups": {"lr": None, "betas": None},
            # "whole": one rank holds each tensor; "resharded": chunks cut elsewhere than saved
            "rows": rows if layout == "whole" else Chunks(rows, 0, (0, 5, 10)),
            "cols": cols if layout == "whole" else Chunks(cols, 1, (0, 2, 10)),
        }

    expected_in_place = {
        # f32, bf16, i64, flag, step, and both saved chunks of rows, each whole in a row range
        "whole": 7,
        # rows' first saved chunk [0, 3) lies whole in the new chunk [0, 5); [3, 10) is cut
        "resharded": 6,
    }
    for layout, count in expected_in_place.items():
        by_dcp, in_place = fresh(layout), fresh(layout)
        dcp.load(by_dcp, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
        reader = InPlaceReader(tmp_path)
        dcp.load(in_place, storage_reader=reader, no_dist=True)
        assert reader.in_place == count, layout
        assert reader.by_dcp > 0  # the rest went through DCP's path, compared below too
        assert in_place["groups"] == by_dcp["groups"] == saved["groups"]
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(_bits(by_dcp[key]), _bits(value)), (layout, key)
                assert torch.equal(_bits(in_place[key]), _bits(value)), (layout, key)


def test_a_resume_read_in_place_equals_one_read_by_dcp(tmp_path):
    from recover.checkpoint.state import load_dcp_state

    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler, 0)
    path = ckpt.save(tmp_path, 1, model, optimizer)
    states = []
    for in_place in (True, False):
        fresh, fresh_opt, _ = build(seed=1)
        load_dcp_state(path, fresh, fresh_opt, in_place=in_place)
        states.append((fresh.state_dict(), fresh_opt.state_dict()))
    (m1, o1), (m2, o2) = states
    assert all(torch.equal(_bits(m1[k]), _bits(m2[k])) for k in model.state_dict())
    assert all(torch.equal(_bits(m1[k]), _bits(v)) for k, v in model.state_dict().items())
    assert o1["param_groups"] == o2["param_groups"] == optimizer.state_dict()["param_groups"]
    for i, moments in optimizer.state_dict()["state"].items():
        for name, value in moments.items():
            assert torch.equal(_bits(o1["state"][i][name]), _bits(value)), (i, name)
            assert torch.equal(_bits(o2["state"][i][name]), _bits(value)), (i, name)


def test_a_truncated_or_altered_file_is_named_when_read_unverified(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from recover.checkpoint.state import load_dcp_state

    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler, 0)
    path = ckpt.save(tmp_path, 1, model, optimizer)
    (shard,) = path.glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # load_dcp_state trusts its caller to have verified: read on
    fresh, fresh_opt, _ = build(seed=1)
    with pytest.raises(
        CheckpointError, match=rf"{re.escape(str(path))} is corrupt: {shard.name} has"
    ):
        load_dcp_state(path, fresh, fresh_opt)

    storage = FileSystemReader(path).read_metadata().storage_data
    record = next(v for k, v in storage.items() if k.fqn == "model.0.weight")
    altered = bytearray(data)
    altered[record.offset : record.offset + 4] = b"\0\0\0\0"  # the record's zip header
    shard.write_bytes(bytes(altered))
    with pytest.raises(
        CheckpointError, match=rf"corrupt: {shard.name}: the record of model\.0\.weight"
    ):
        load_dcp_state(path, fresh, fresh_opt)


def test_hyperparameters_are_saved_once_and_checkpoints_of_the_older_form_still_load(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from recover.checkpoint.state import _FLAT, CheckpointWriter, dcp_state

    def two_groups(seed: int, lrs: tuple[float, float]):
        model, _, _ = build(seed)
        groups = [
            {"params": model[0].parameters()},
            {"params": model[2].parameters(), "lr": lrs[1]},
        ]
        optimizer = torch.optim.AdamW(groups, lr=lrs[0], foreach=False)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)

    model, optimizer, scheduler = two_groups(0, (1e-2, 0.5))
    train_step(model, optimizer, scheduler, 0)
    new = ckpt.save(tmp_path / "new", 1, model, optimizer)
    keys = FileSystemReader(new).read_metadata().state_dict_metadata
    (groups,) = [k for k in keys if "param_groups" in k]  # one object for all parameters
    assert groups.startswith("optimizer.param_groups@")
    # The older form: every setting of every parameter an object of its own.
    older = dcp_state(model, optimizer)
    older["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_FLAT)
    writer = CheckpointWriter(tmp_path / "old", keep=1)
    old = writer.save(1, older, {}, block=True)
    writer.close()
    keys = FileSystemReader(old).read_metadata().state_dict_metadata
    assert sum(k.startswith("optimizer.param_groups.") for k in keys) >= 4 * 11

    want = optimizer.state_dict()
    for path in (new, old):
        fresh, fresh_opt, _ = two_groups(1, (0.3, 0.7))
        assert ckpt.Checkpointer(path.parent).restore(fresh, fresh_opt) == 1
        got = fresh_opt.state_dict()
        assert got["param_groups"] == want["param_groups"], path.parent.name
        assert all(
            torch.equal(got["state"][i]["exp_avg"], s["exp_avg"]) for i, s in want["state"].items()
        )
        groups = ckpt.load(path)["optimizer"]["param_groups"]
        assert groups["0.weight"]["lr"] == 1e-2 and groups["2.bias"]["lr"] == 0.5
