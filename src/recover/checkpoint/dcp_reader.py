"""Reading a DCP checkpoint's tensors straight into their places: DCP's file reader less its temporaries.

Job: `InPlaceReader`, a `torch.distributed.checkpoint.FileSystemReader` for the checkpoints of
`recover.checkpoint.state`. DCP's own reader torch.loads every saved tensor chunk into a new
tensor and then copies it into its destination. This one reads a chunk that a contiguous CPU
destination of its dtype receives whole with one `readinto` on the destination's bytes: no
temporary tensor, no copy. That is every tensor of a resume in the layout that saved it, and,
when resharding, every saved chunk that lands whole in a contiguous part of its destination (a
dim-0 shard loaded by fewer ranks). Every other read (the part of a saved chunk that resharding
cuts out, a destination that is not contiguous or not on the CPU, another dtype, an object)
takes DCP's own path, unchanged.

Where the bytes are: DCP's FileSystemWriter stores each tensor chunk as a torch.save archive (a
zip whose records are stored, not compressed) at the (offset, length) its metadata gives in its
rank's file. `torch.load(..., map_location="meta")` of that slice reads the archive's directory
and its small pickle, never the data: it gives the saved tensor's dtype, shape and strides and,
on its storage, where the data record starts (`_checkpoint_offset`, which torch sets on loads to
the meta device). A chunk is read in place only when that record holds exactly the tensor,
densely, in this machine's byte order; torch's private `PyTorchFileReader` tells the byte order.
If a torch release drops either private name, every chunk takes DCP's path (slower, more memory,
never wrong), and the test that counts the chunks read in place fails.

Invariants:
- The state it leaves is bit for bit the state DCP's reader leaves (tests/test_checkpoint.py:
  several dtypes, saved and destination strides, a resharded read that cuts saved chunks).
- A file shorter than the records its checkpoint's metadata places in it (truncated), or a
  record that cannot be parsed, raises `UnreadableRecord` naming the file and the tensor; the
  caller adds the checkpoint's path. (A resume verifies every file's size and CRC-32 first.)
- It writes only into the destinations DCP's planner resolves, and reads only the records DCP's
  reader would.

Costs: per chunk read in place, two parses of its archive's directory and pickle (a few reads
of some hundred bytes) and one read of its bytes into place. On gpt2-124m (1.49 GB of parameters
and AdamW moments, benchmarks/checkpoint_format.py, medians of 3 side by side, load 5-12) a
resume's peak host memory is 1.03x the state with this reader and 1.23x with DCP's (whose
temporaries for the 154 MB embedding come on top of the whole state); the resume takes 0.83 of
the time (8.8 s vs 10.6 s).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future


class UnreadableRecord(ValueError):
    """A record of a checkpoint file cannot be read: the file is truncated or altered."""


class InPlaceReader(dcp.FileSystemReader):
    """DCP's FileSystemReader that reads a tensor chunk a contiguous CPU destination of its dtype
    receives whole straight into it (the module docstring says when). `in_place` and `by_dcp`
    count the chunks and objects each way read."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.in_place = 0
        self.by_dcp = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            rest = self._read_file(name, items, planner)
            if not rest:
                continue
            self.by_dcp += len(rest)
            try:
                super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
            except Exception as e:  # DCP's path does not say which file failed
                raise UnreadableRecord(f"{name}: {type(e).__name__}: {e}") from e
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Read the chunks of the file `name` that go in place; return the other items."""
        rest = []
        with open(Path(self.path) / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for item in items:
                info = self.storage_data[item.storage_index]
                fqn = item.storage_index.fqn
                end = info.offset + info.length
                if end > size:
                    raise UnreadableRecord(
                        f"{name} has {size} bytes, but the record of {fqn} ends at byte {end} "
                        "(truncated)"
                    )
                if item.type != LoadItemType.TENSOR or info.transform_descriptors:
                    rest.append(item)
                    continue
                target = planner.resolve_tensor(item).detach()
                start = self._data_offset(f, info, item, target, name)
                if start is None:
                    rest.append(item)
                    continue
                _read_exactly(f, start, target, f"{name} ends inside the data of {fqn}")
                planner.commit_tensor(item, target)
                self.in_place += 1
        return rest

    def _data_offset(self, f, info, item: ReadItem, target: torch.Tensor, name: str) -> int | None:
        """Where in the file the saved chunk's bytes start, if `item` reads it whole into
        `target` (dense, same dtype and byte order); None otherwise."""
        if (
            type(target) is not torch.Tensor
            or target.device.type != "cpu"
            or target.layout != torch.strided
            or not target.is_contiguous()
            or target.is_conj()
            or target.is_neg()
            or any(item.storage_offsets)
        ):
            return None
        view = self._slice_file(f, info)
        try:
            archive = torch._C.PyTorchFileReader(view)
            order = archive.get_record("byteorder") if archive.has_record("byteorder") else None
            view.seek(0)
            saved = torch.load(view, map_location="meta", weights_only=True)
        except Exception as e:
            raise UnreadableRecord(
                f"{name}: the record of {item.storage_index.fqn} at byte {info.offset} cannot be "
                f"parsed (altered?): {e}"
            ) from e
        if type(saved) is not torch.Tensor:
            return None
        offset = getattr(saved.untyped_storage(), "_checkpoint_offset", None)
        nbytes = target.numel() * target.element_size()
        if (
            offset is None
            or order not in (None, sys.byteorder.encode())  # none written: little, as torch reads
            or (order is None and sys.byteorder != "little")
            or saved.dtype != target.dtype
            or tuple(saved.shape) != tuple(item.lengths)
            or tuple(saved.shape) != tuple(target.shape)
            or not saved.is_contiguous()
            or saved.storage_offset() != 0
            or saved.untyped_storage().nbytes() != nbytes
            or offset + nbytes > info.length
        ):
            return None
        return info.offset + offset


def _read_exactly(f, start: int, target: torch.Tensor, short: str) -> None:
    """Read `target`'s bytes from `f` at `start` into its memory."""
    nbytes = target.numel() * target.element_size()
    if nbytes == 0:
        return
    view = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
    f.seek(start)
    done = 0
    while done < nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise UnreadableRecord(f"{short} (truncated)")
        done += n
