"""Addressing: microbatch id ``(step, j)`` -> its tokens, as a pure function of ``(seed, step, j)``.

Job: open a prepared dataset read-only and answer "which tokens does microbatch (step, j) hold?"
and "which seed drives its randomness (dropout)?", the same way in every process.

The rule (docs/design.md, invariant 2 "same samples"):

* A sample is a window of ``seq_len + 1`` consecutive tokens inside one shard; windows start at
  multiples of ``seq_len`` (so consecutive windows share one token: the last target of one is the
  first input of the next). A shard of n tokens has ``(n - 1) // seq_len`` windows; the windows of
  the train split are numbered ``0..W-1`` shard after shard.
* Row b of microbatch (step, j) is the global sample ``g = (step * M + j) * B + b``
  (M microbatches per step, B rows per microbatch); it lies in pass ``p = g // W`` at position
  ``q = g % W`` and reads window ``permutation(seed, p)[q]``, where ``permutation(seed, p)`` is
  ``numpy.random.Generator(PCG64(SeedSequence((seed, p)))).permutation(W)``.
  So each pass reads every train window exactly once, in an order fixed by ``(seed, p)``.
* ``microbatch_seed(seed, step, j)`` is a 63-bit seed hashed from ``(seed, step, j)``.

Invariants: nothing here reads a rank, a replica, a clock, the environment or a global RNG; the
answer depends only on the dataset content and the arguments, never on call order. The dataset is
opened read-only (memmaps), so any number of processes can share it.

Costs and limits: a pass permutation costs 8 bytes per window and O(W) time to build; each
TokenDataset caches the last few (per object, no module state). For W in the billions a
closed-form permutation (e.g. a Feistel network over range(W)) would be needed instead.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recover.checks import is_int
from recover.data.corpus import DataError
from recover.data.folder import META_FILE, READABLE_FORMAT_VERSIONS, SPLITS

_PERMUTATION_CACHE_SIZE = 4
_ALLOWED_DTYPES = ("uint8", "uint16", "uint32")


def _require_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def compute_pass_permutation(seed: int, pass_index: int, num_windows: int) -> np.ndarray:
    """Pure: the order in which pass ``pass_index`` reads the windows ``0..num_windows-1``."""
    seed = _require_int("seed", seed, 0)
    pass_index = _require_int("pass_index", pass_index, 0)
    num_windows = _require_int("num_windows", num_windows, 1)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, pass_index))))
    return rng.permutation(num_windows)


def microbatch_seed(seed: int, step: int, j: int) -> int:
    """Pure: a 63-bit seed for the randomness (dropout) inside microbatch ``(step, j)``."""
    seed = _require_int("seed", seed, 0)
    step = _require_int("step", step, 0)
    j = _require_int("j", j, 0)
    h = hashlib.sha256(b"recover.microbatch_seed\0")
    for v in (seed, step, j):
        h.update(v.to_bytes(16, "little"))
    return int.from_bytes(h.digest()[:8], "little") >> 1


def _validate_meta(meta: Any, meta_path: Path) -> None:
    def bad(why: str) -> DataError:
        return DataError(f"{meta_path} is not a valid dataset meta: {why}")

    if not isinstance(meta, dict):
        raise bad("not a JSON object")
    if meta.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise bad(
            f"format_version {meta.get('format_version')!r}, expected one of "
            f"{READABLE_FORMAT_VERSIONS}"
        )
    if meta.get("dtype") not in _ALLOWED_DTYPES:
        raise bad(f"dtype {meta.get('dtype')!r} not one of {_ALLOWED_DTYPES}")
    vocab = meta.get("vocab_size")
    if not is_int(vocab) or vocab < 2:
        raise bad(f"vocab_size {vocab!r}")
    if not isinstance(meta.get("content_hash"), str):
        raise bad("no content_hash")
    shards = meta.get("shards")
    if not isinstance(shards, dict):
        raise bad("no shards")
    for split in SPLITS:
        entries = shards.get(split)
        if not isinstance(entries, list) or not entries:
            raise bad(f"no {split} shards")
        for entry in entries:
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("file"), str)
                or "/" in entry["file"]
                or not isinstance(entry.get("tokens"), int)
                or entry["tokens"] < 1
                or not isinstance(entry.get("offset", 0), int)
                or entry.get("offset", 0) < 0
            ):
                raise bad(f"bad {split} shard entry {entry!r}")


class TokenDataset:
    """A prepared dataset, opened read-only: meta plus one memmap per shard."""

    def __init__(self, path: Path, meta: dict[str, Any], shards: dict[str, list[np.ndarray]]):
        self.path = path
        self.meta = meta
        self._shards = shards
        self._window_offsets: dict[tuple[str, int], np.ndarray] = {}
        self._permutations: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()

    @classmethod
    def open(cls, path: Path | str) -> TokenDataset:
        """Open a dataset folder; DataError naming the file on a missing or corrupt meta/shard."""
        path = Path(path)
        meta_path = path / META_FILE
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise DataError(f"{meta_path} is missing; run `recover prepare` first") from exc
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read {meta_path}: {exc}") from exc
        _validate_meta(meta, meta_path)
        dtype = np.dtype(meta["dtype"])
        shards: dict[str, list[np.ndarray]] = {}
        for split in SPLITS:
            shards[split] = []
            for entry in meta["shards"][split]:
                shard_path = path / entry["file"]
                try:
                    size = shard_path.stat().st_size
                except OSError as exc:
                    raise DataError(f"cannot read shard {shard_path}: {exc}") from exc
                # A shard is a whole file, or (an adopted token file) a range of one.
                offset = entry.get("offset")
                end = entry["tokens"] + (offset or 0)
                if size != end * dtype.itemsize and (offset is None or size < end * dtype.itemsize):
                    raise DataError(
                        f"shard {shard_path} holds {size} bytes, meta says "
                        f"{end} tokens of {dtype.name}"
                    )
                shards[split].append(
                    np.memmap(
                        shard_path,
                        dtype=dtype,
                        mode="r",
                        offset=(offset or 0) * dtype.itemsize,
                        shape=(entry["tokens"],),
                    )
                )
        return cls(path, meta, shards)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def content_hash(self) -> str:
        return str(self.meta["content_hash"])

    @property
    def train_tokens(self) -> int:
        return sum(int(s.size) for s in self._shards["train"])

    @property
    def val_tokens(self) -> int:
        return sum(int(s.size) for s in self._shards["val"])

    def shards(self, split: str) -> list[np.ndarray]:
        """The read-only token arrays of ``split`` ("train" or "val"), in order."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return list(self._shards[split])

    def _offsets(self, split: str, seq_len: int) -> np.ndarray:
        """Cumulative window counts: shard i holds windows offsets[i]..offsets[i+1]-1."""
        seq_len = _require_int("seq_len", seq_len, 1)
        key = (split, seq_len)
        if key not in self._window_offsets:
            counts = [(int(s.size) - 1) // seq_len for s in self.shards(split)]
            self._window_offsets[key] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return self._window_offsets[key]

    def num_windows(self, split: str, seq_len: int) -> int:
        """How many windows of ``seq_len + 1`` tokens ``split`` holds; ValueError when none."""
        total = int(self._offsets(split, seq_len)[-1])
        if total == 0:
            largest = max(int(s.size) for s in self._shards[split])
            raise ValueError(
                f"seq_len={seq_len} needs shards of at least {seq_len + 1} tokens; the largest "
                f"{split} shard of {self.path} holds {largest} (use seq_len <= {largest - 1})"
            )
        return total

    def window(self, split: str, window_id: int, seq_len: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of window ``window_id`` of ``split`` (a read-only view)."""
        offsets = self._offsets(split, seq_len)
        if not 0 <= window_id < offsets[-1]:
            raise ValueError(f"window_id must be in [0, {offsets[-1]}), got {window_id}")
        shard = int(np.searchsorted(offsets, window_id, side="right")) - 1
        start = (int(window_id) - int(offsets[shard])) * seq_len
        return self._shards[split][shard][start : start + seq_len + 1]

    def pass_permutation(self, seed: int, pass_index: int, seq_len: int) -> np.ndarray:
        """compute_pass_permutation over the train windows, cached per object (read-only)."""
        key = (seed, pass_index, seq_len)
        perm = self._permutations.get(key)
        if perm is None:
            perm = compute_pass_permutation(seed, pass_index, self.num_windows("train", seq_len))
            perm.setflags(write=False)
            self._permutations[key] = perm
            while len(self._permutations) > _PERMUTATION_CACHE_SIZE:
                self._permutations.popitem(last=False)
        else:
            self._permutations.move_to_end(key)
        return perm

    def microbatch_window_ids(
        self,
        *,
        seed: int,
        step: int,
        j: int,
        microbatches: int,
        microbatch_size: int,
        seq_len: int,
    ) -> np.ndarray:
        """The train window id of each row of microbatch ``(step, j)`` (see the module rule)."""
        seed = _require_int("seed", seed, 0)
        step = _require_int("step", step, 0)
        microbatches = _require_int("microbatches", microbatches, 1)
        j = _require_int("j", j, 0)
        if j >= microbatches:
            raise ValueError(f"j must be < microbatches={microbatches}, got {j}")
        microbatch_size = _require_int("microbatch_size", microbatch_size, 1)
        num = self.num_windows("train", seq_len)
        first = (step * microbatches + j) * microbatch_size  # Python int: no overflow
        ids = np.empty(microbatch_size, dtype=np.int64)
        for b in range(microbatch_size):
            pass_index, position = divmod(first + b, num)
            ids[b] = self.pass_permutation(seed, pass_index, seq_len)[position]
        return ids


def _windows_to_xy(
    ds: TokenDataset, split: str, window_ids: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.empty((len(window_ids), seq_len + 1), dtype=np.int64)  # (B, T+1)
    for b, w in enumerate(window_ids):
        rows[b] = ds.window(split, int(w), seq_len)
    tokens = torch.from_numpy(rows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T), (B, T)


def microbatch_tokens(
    ds: TokenDataset,
    *,
    seed: int,
    step: int,
    j: int,
    microbatches: int,
    microbatch_size: int,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: inputs x and targets y (int64, shape (microbatch_size, seq_len)) of ``(step, j)``.

    ``y`` is ``x`` shifted left by one token. Depends only on the dataset and the arguments.
    """
    ids = ds.microbatch_window_ids(
        seed=seed,
        step=step,
        j=j,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        seq_len=seq_len,
    )
    return _windows_to_xy(ds, "train", ids, seq_len)


def validation_batches(
    ds: TokenDataset, *, microbatch_size: int, seq_len: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches: windows evenly spaced over the validation split.

    Takes ``n = min(max_batches * microbatch_size, W_val)`` windows ``(i * W_val) // n`` in order
    and cuts them into batches of ``microbatch_size`` rows (the last may be shorter when W_val is
    small). The same on every call and in every process.
    """
    microbatch_size = _require_int("microbatch_size", microbatch_size, 1)
    max_batches = _require_int("max_batches", max_batches, 1)
    total = ds.num_windows("val", seq_len)
    n = min(max_batches * microbatch_size, total)
    ids = (np.arange(n, dtype=np.int64) * total) // n
    return [
        _windows_to_xy(ds, "val", ids[start : start + microbatch_size], seq_len)
        for start in range(0, n, microbatch_size)
    ]
