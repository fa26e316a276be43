"""Addressing: the tokens and the seed of microbatch (step, j) are pure functions of (seed, step, j)."""

from __future__ import annotations

import json
import random
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recover.data import (
    DataError,
    TokenDataset,
    compute_pass_permutation,
    microbatch_seed,
    microbatch_tokens,
    prepare_dataset,
    validation_batches,
)
from recover.data.prepare import read_documents

pytestmark = pytest.mark.timeout(30)

SEQ = 16
SIZES = dict(microbatches=3, microbatch_size=5, seq_len=SEQ)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    """~20 unique random documents, sharded small so windows span many shards."""
    root = tmp_path_factory.mktemp("addressing")
    src = root / "src"
    src.mkdir()
    rng = random.Random(7)
    for i in range(20):
        text = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(500))
        (src / f"d{i:02d}.txt").write_text(text, encoding="ascii")
    return prepare_dataset(
        root / "ds", source=src, val_fraction=0.2, shard_tokens=997, show_progress=False
    )


def all_train_windows(ds: TokenDataset) -> list[bytes]:
    out = []
    for shard in ds.shards("train"):
        for w in range((shard.size - 1) // SEQ):
            out.append(bytes(shard[w * SEQ : w * SEQ + SEQ + 1]))
    return out


def rows(x: torch.Tensor, y: torch.Tensor) -> list[bytes]:
    full = torch.cat([x, y[:, -1:]], dim=1)
    return [bytes(r.tolist()) for r in full]


def test_shapes_dtype_and_shift(dataset_dir: Path) -> None:
    ds = TokenDataset.open(dataset_dir)
    x, y = microbatch_tokens(ds, seed=1, step=4, j=2, **SIZES)
    assert x.shape == y.shape == (5, SEQ)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    windows = set(all_train_windows(ds))
    assert all(r in windows for r in rows(x, y))  # each row is one train window


def test_microbatch_is_pure_whatever_the_call_order_or_object(dataset_dir: Path) -> None:
    ids = [(0, 0), (0, 2), (7, 1), (250, 0), (10**6, 2)]  # far steps wrap into later passes
    ds = TokenDataset.open(dataset_dir)
    forward = {i: microbatch_tokens(ds, seed=3, step=i[0], j=i[1], **SIZES) for i in ids}
    again = {i: microbatch_tokens(ds, seed=3, step=i[0], j=i[1], **SIZES) for i in ids}
    fresh = TokenDataset.open(dataset_dir)
    backward = {
        i: microbatch_tokens(fresh, seed=3, step=i[0], j=i[1], **SIZES) for i in reversed(ids)
    }
    for i in ids:
        for other in (again, backward):
            assert torch.equal(forward[i][0], other[i][0])
            assert torch.equal(forward[i][1], other[i][1])
    # Different ids of one step are different samples.
    assert not torch.equal(forward[(0, 0)][0], forward[(0, 2)][0])


_CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
from recover.data import TokenDataset, microbatch_seed, microbatch_tokens
ds = TokenDataset.open(sys.argv[1])
out = {}
for step, j in [(5, 1), (0, 0), (123, 2)]:
    x, y = microbatch_tokens(ds, seed=9, step=step, j=j, microbatches=3, microbatch_size=5,
                             seq_len=16)
    out[f"{step},{j}"] = {"x": x.tolist(), "y": y.tolist(), "seed": microbatch_seed(9, step, j)}
print(json.dumps(out))
"""


@pytest.mark.process
def test_microbatch_is_identical_in_another_process(dataset_dir: Path) -> None:
    # subprocess.run kills and reaps the child if it overruns its timeout.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dataset_dir)],
        capture_output=True,
        text=True,
        timeout=25,
        check=True,
    )
    child = json.loads(done.stdout)
    ds = TokenDataset.open(dataset_dir)
    for key, got in child.items():
        step, j = (int(v) for v in key.split(","))
        x, y = microbatch_tokens(ds, seed=9, step=step, j=j, **SIZES)
        assert got["x"] == x.tolist() and got["y"] == y.tolist()
        assert got["seed"] == microbatch_seed(9, step, j)


def _first_samples(ds: TokenDataset, seed: int, count: int) -> tuple[list[int], list[bytes]]:
    """Window ids and tokens of global samples 0..count-1, walking (step, j) in order."""
    m, b = SIZES["microbatches"], SIZES["microbatch_size"]
    ids: list[int] = []
    toks: list[bytes] = []
    step = 0
    while len(ids) < count:
        for j in range(m):
            ids.extend(
                ds.microbatch_window_ids(
                    seed=seed, step=step, j=j, microbatches=m, microbatch_size=b, seq_len=SEQ
                ).tolist()
            )
            toks.extend(rows(*microbatch_tokens(ds, seed=seed, step=step, j=j, **SIZES)))
        step += 1
    return ids[:count], toks[:count]


def test_each_pass_reads_every_train_window_exactly_once(dataset_dir: Path) -> None:
    ds = TokenDataset.open(dataset_dir)
    windows = all_train_windows(ds)
    n = ds.num_windows("train", SEQ)
    assert n == len(windows) and n > 100
    assert len(set(windows)) == n  # precondition: window contents identify windows
    ids, toks = _first_samples(ds, seed=5, count=2 * n)
    assert sorted(ids[:n]) == list(range(n))
    assert sorted(ids[n:]) == list(range(n))
    assert sorted(toks[:n]) == sorted(windows)  # the tokens really are those windows
    assert sorted(toks[n:]) == sorted(windows)
    assert ids[:n] != ids[n:]  # the next pass has its own order
    assert ids[:n] != list(range(n))  # and the order is shuffled


def test_different_seeds_give_different_orders(dataset_dir: Path) -> None:
    ds = TokenDataset.open(dataset_dir)
    n = ds.num_windows("train", SEQ)
    a, _ = _first_samples(ds, seed=0, count=30)
    b, _ = _first_samples(ds, seed=1, count=30)
    assert a != b
    assert not np.array_equal(compute_pass_permutation(0, 0, n), compute_pass_permutation(1, 0, n))
    assert np.array_equal(compute_pass_permutation(4, 2, n), compute_pass_permutation(4, 2, n))


def test_train_and_validation_are_disjoint(dataset_dir: Path) -> None:
    ds = TokenDataset.open(dataset_dir)
    docs = read_documents(dataset_dir)
    val_docs = {d["path"] for d in docs if d["split"] == "val"}
    train_docs = {d["path"] for d in docs if d["split"] == "train"}
    assert val_docs and train_docs and not (val_docs & train_docs)
    train = b"".join(bytes(s) for s in ds.shards("train"))
    val = b"".join(bytes(s) for s in ds.shards("val"))
    src = Path(ds.meta["source"])
    for path in val_docs:
        text = (src / path).read_bytes()
        assert text in val and text[:40] not in train
    for path in train_docs:
        assert (src / path).read_bytes()[:40] not in val
    # Validation batches come from validation text only.
    for x, y in validation_batches(ds, microbatch_size=4, seq_len=SEQ, max_batches=3):
        for r in rows(x, y):
            assert r in val and r not in train


def test_validation_batches_are_fixed(dataset_dir: Path) -> None:
    ds = TokenDataset.open(dataset_dir)
    first = validation_batches(ds, microbatch_size=4, seq_len=SEQ, max_batches=3)
    second = validation_batches(
        TokenDataset.open(dataset_dir), microbatch_size=4, seq_len=SEQ, max_batches=3
    )
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert x1.shape == (4, SEQ) and torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert len({r for x, y in first for r in rows(x, y)}) == 12  # distinct windows
    huge = validation_batches(ds, microbatch_size=4, seq_len=SEQ, max_batches=10**6)
    assert sum(len(x) for x, _ in huge) == ds.num_windows("val", SEQ)


def test_microbatch_seed_is_pure_and_spread() -> None:
    assert microbatch_seed(1, 2, 3) == microbatch_seed(1, 2, 3)
    seeds = [microbatch_seed(s, t, j) for s in range(4) for t in range(50) for j in range(8)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= v < 2**63 for v in seeds)
    assert max(seeds) > 2**62  # uses the high bits
    bits = np.array([[(v >> k) & 1 for k in range(63)] for v in seeds])
    assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 0.1)  # every bit flips about half the time
    # Each argument matters on its own (no (seed, step, j) -> sum-like collisions).
    assert len({microbatch_seed(1, 2, 3), microbatch_seed(2, 1, 3), microbatch_seed(3, 2, 1)}) == 3


def test_seed_generators_draws_what_torch_manual_seed_draws_and_refuses_bad_seeds() -> None:
    from recover.data.windows import seed_generators

    for seed in (0, 7, microbatch_seed(1, 2, 3), (1 << 64) - 1):
        torch.manual_seed(seed)
        want = (torch.rand(5), torch.nn.functional.dropout(torch.ones(64), 0.5))
        torch.manual_seed((seed + 1) % (1 << 64))  # another state in between
        seed_generators(seed)
        got = (torch.rand(5), torch.nn.functional.dropout(torch.ones(64), 0.5))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), seed
    for bad in (-1, 1 << 64, 1.5, True, "3"):
        with pytest.raises(ValueError, match="seed must be an int"):
            seed_generators(bad)  # type: ignore[arg-type]


def test_errors_are_clear(dataset_dir: Path, tmp_path: Path) -> None:
    ds = TokenDataset.open(dataset_dir)
    with pytest.raises(ValueError, match="seq_len"):
        microbatch_tokens(ds, seed=0, step=0, j=0, microbatches=1, microbatch_size=1, seq_len=5000)
    with pytest.raises(ValueError, match="seq_len"):
        validation_batches(ds, microbatch_size=1, seq_len=5000, max_batches=1)
    with pytest.raises(ValueError, match="j must be"):
        microbatch_tokens(ds, seed=0, step=0, j=3, **SIZES)
    with pytest.raises(ValueError, match="seed"):
        microbatch_tokens(ds, seed=-1, step=0, j=0, **SIZES)

    with pytest.raises(DataError, match="meta.json"):
        TokenDataset.open(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="meta.json"):
        TokenDataset.open(tmp_path)
    meta = dict(ds.meta, format_version=99)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="format_version"):
        TokenDataset.open(tmp_path)
    # A truncated shard is caught at open time.
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in dataset_dir.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    shard = broken / ds.meta["shards"]["train"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(DataError, match=str(shard)):
        TokenDataset.open(broken)


def test_dataset_properties(dataset_dir: Path) -> None:
    ds = TokenDataset.open(dataset_dir)
    assert ds.vocab_size == 256
    assert ds.content_hash == ds.meta["content_hash"]
    assert ds.train_tokens == ds.meta["train"]["tokens"]
    assert ds.val_tokens == ds.meta["val"]["tokens"]
