"""Data in the formats people have: JSONL, parquet, a saved datasets folder, their own
tokenizer.json, and a nanoGPT token file adopted without a copy; each gives the expected tokens."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_TRAIN_FLAGS, cli_here, run_cli
from recover.data import DataError, TokenDataset, load_tokenizer, prepare_dataset
from recover.data import corpus as corpus_module
from recover.data.adopt import adopt_token_files
from recover.data.cli import add_prepare_parser, run_prepare
from recover.data.prepare import read_documents

pytestmark = pytest.mark.timeout(60)

TEXTS = [f"record {i}: " + "the replica commits the step. " * (i % 5 + 1) for i in range(30)]


def split_streams(ds: Path) -> dict[str, np.ndarray]:
    meta = json.loads((ds / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    return {
        split: np.concatenate([np.fromfile(ds / s["file"], dtype=dtype) for s in shards])
        for split, shards in meta["shards"].items()
    }


def expected_streams(ds: Path, text_of: dict[str, str], encode, eod: int) -> dict[str, list[int]]:
    """Each split: its documents' tokens, in order, each followed by the separator."""
    out: dict[str, list[int]] = {"train": [], "val": []}
    for doc in read_documents(ds):
        ids = encode(text_of[doc["path"]])
        assert doc["tokens"] == len(ids)
        out[doc["split"]] += [*ids, eod]
    return out


def assert_tokens(ds: Path, text_of: dict[str, str], encode=None, eod: int = 0) -> None:
    encode = encode or (lambda t: list(t.encode("utf-8")))
    got = split_streams(ds)
    want = expected_streams(ds, text_of, encode, eod)
    assert sorted(text_of) == sorted(d["path"] for d in read_documents(ds))  # none lost
    for split in ("train", "val"):
        assert want[split] and got[split].tolist() == want[split]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> dict[str, str]:
    lines = [json.dumps({field: t, "id": i}) for i, t in enumerate(texts)]
    lines.insert(3, "")  # a blank line is no document
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    text_of, lineno = {}, 0
    for line in lines:
        lineno += 1
        if line:
            text_of[f"{path.name}#L{lineno}"] = json.loads(line)[field]
    return text_of


def test_jsonl_records_are_documents_with_the_chosen_field(tmp_path: Path) -> None:
    text_of = write_jsonl(tmp_path / "a.jsonl", TEXTS[:20], field="body")
    ds = prepare_dataset(
        tmp_path / "ds", source=tmp_path / "a.jsonl", text_field="body", show_progress=False
    )
    meta = json.loads((ds / "meta.json").read_text())
    assert meta["source_format"] == "jsonl" and meta["settings"]["text_field"] == "body"
    assert meta["train"]["documents"] + meta["val"]["documents"] == 20
    assert_tokens(ds, text_of)

    # A folder of .jsonl files: files in name order, records in line order.
    folder = tmp_path / "shards"
    folder.mkdir()
    both = write_jsonl(folder / "b.jsonl", TEXTS[:15]) | write_jsonl(folder / "a.jsonl", TEXTS[15:])
    ds2 = prepare_dataset(tmp_path / "ds2", source=folder, show_progress=False)
    assert_tokens(ds2, {f"{k}": v for k, v in both.items()})
    assert [d["path"] for d in read_documents(ds2)][0].startswith("a.jsonl#")

    with pytest.raises(DataError, match=r"a\.jsonl line 1: no field 'text'.*--text-field"):
        prepare_dataset(tmp_path / "x", source=tmp_path / "a.jsonl", show_progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": null}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: field 'text' is null"):
        prepare_dataset(tmp_path / "x", source=tmp_path / "bad.jsonl", show_progress=False)
    assert not (tmp_path / "x").exists()


def test_parquet_and_a_saved_datasets_folder_give_the_same_documents(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(TEXTS))), "content": TEXTS})
    pq.write_table(table, tmp_path / "corpus.parquet", row_group_size=7)
    ds = prepare_dataset(
        tmp_path / "pq", source=tmp_path / "corpus.parquet", text_field="content",
        show_progress=False,
    )  # fmt: skip
    assert json.loads((ds / "meta.json").read_text())["source_format"] == "parquet"
    assert_tokens(ds, {f"corpus.parquet#{i}": t for i, t in enumerate(TEXTS)})

    # The layout `datasets.Dataset.save_to_disk` writes: Arrow stream files named in state.json.
    saved = tmp_path / "saved"
    saved.mkdir()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (table.slice(0, 12), table.slice(12)), strict=True):
        with pa.OSFile(str(saved / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for batch in part.to_batches(max_chunksize=5):
                w.write_batch(batch)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (saved / "dataset_info.json").write_text("{}")
    hf = prepare_dataset(tmp_path / "hf", source=saved, text_field="content", show_progress=False)
    assert json.loads((hf / "meta.json").read_text())["source_format"] == "hf-disk"
    text_of = {f"{names[0]}#{i}": t for i, t in enumerate(TEXTS[:12])}
    text_of |= {f"{names[1]}#{i}": t for i, t in enumerate(TEXTS[12:])}
    assert_tokens(hf, text_of)

    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match="DatasetDict"):
        prepare_dataset(tmp_path / "x", source=tmp_path / "dict", show_progress=False)
    with pytest.raises(DataError, match="no column 'text'.*content"):
        prepare_dataset(tmp_path / "x", source=tmp_path / "corpus.parquet", show_progress=False)


def test_parquet_without_pyarrow_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(DataError, match=r"recover\[parquet\]"):
        prepare_dataset(tmp_path / "x", source=tmp_path / "c.parquet", show_progress=False)


def make_tokenizer_json(path: Path, texts: list[str], eod: str = "</s>") -> Path:
    """A user's own tokenizer: a small BPE with another separator, trained here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<pad>", eod], show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return path


def test_a_given_tokenizer_json_is_used_recorded_and_copied(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    (tmp_path / "mine").mkdir()
    tok_path = make_tokenizer_json(tmp_path / "mine" / "tokenizer.json", TEXTS)
    text_of = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    kw = dict(
        source=tmp_path / "c.jsonl", tokenizer=tok_path, eod_token="</s>", show_progress=False
    )
    a = prepare_dataset(tmp_path / "a", **kw)
    b = prepare_dataset(tmp_path / "b", **kw)
    assert {p.name: p.read_bytes() for p in a.iterdir()} == {
        p.name: p.read_bytes() for p in b.iterdir()
    }  # deterministic, byte for byte
    meta = json.loads((a / "meta.json").read_text())
    user = Tokenizer.from_file(str(tok_path))
    eod = user.token_to_id("</s>")
    assert meta["tokenizer"]["kind"] == "hf" and meta["tokenizer"]["eod_id"] == eod
    assert meta["tokenizer"]["origin"] == str(tok_path)
    assert meta["vocab_size"] == user.get_vocab_size() and meta["dtype"] == "uint8"
    assert (a / "tokenizer.json").read_bytes() == tok_path.read_bytes()  # self-contained
    assert_tokens(a, text_of, lambda t: user.encode(t, add_special_tokens=False).ids, eod)
    assert load_tokenizer(a).encode(TEXTS[0]) == user.encode(TEXTS[0]).ids

    # Another tokenizer file is another dataset; a missing separator names the flag.
    with pytest.raises(DataError, match="--eod-token"):
        prepare_dataset(tmp_path / "x", **{**kw, "eod_token": "<|endoftext|>"})
    other = make_tokenizer_json(tmp_path / "other.json", TEXTS[:10])
    with pytest.raises(DataError, match="another dataset"):
        prepare_dataset(a, **{**kw, "tokenizer": other})


def test_streamed_text_file_chunks_equal_the_whole_file_cut(tmp_path: Path, monkeypatch) -> None:
    lines = [("x" * (i * 37 % 900)) + "\n" for i in range(3000)] + ["tail without newline"]
    data = "".join(lines).encode()
    path = tmp_path / "book.txt"
    path.write_bytes(data)
    monkeypatch.setattr(corpus_module, "_READ_BLOCK", 4096)  # many reads per chunk
    with open(path, "rb") as f:
        streamed = list(corpus_module._stream_line_chunks(f, 5000))
    whole = [d.data for d in corpus_module._chunk_at_lines("b", data, 5000)]
    assert streamed == whole and len(whole) > 50


def write_bin(path: Path, n: int, vocab: int, seed: int = 0) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)
    tokens.tofile(path)
    return tokens


def test_from_bin_adopts_without_copying_and_hashes_the_content(tmp_path: Path) -> None:
    train = write_bin(tmp_path / "train.bin", 5000, 300)
    val = write_bin(tmp_path / "val.bin", 800, 300, seed=1)
    result = adopt_token_files(
        tmp_path / "ds", train_bin=tmp_path / "train.bin", val_bin=tmp_path / "val.bin",
        vocab_size=300,
    )  # fmt: skip
    ds = result.path
    meta = json.loads((ds / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
    for name in ("train.bin", "val.bin"):  # a link, not a copy
        assert os.path.samefile(ds / name, tmp_path / name)
        assert meta["adopted"][name]["link"] in ("hardlink", "symlink")
    opened = TokenDataset.open(ds)
    assert np.array_equal(opened.shards("train")[0], train)
    assert np.array_equal(opened.shards("val")[0], val)
    # Idempotent; other content is another dataset (the hash covers the bytes).
    assert adopt_token_files(
        ds, train_bin=tmp_path / "train.bin", val_bin=tmp_path / "val.bin", vocab_size=300
    ).reused
    write_bin(tmp_path / "train2.bin", 5000, 300, seed=2)
    with pytest.raises(DataError, match="another dataset"):
        adopt_token_files(
            ds, train_bin=tmp_path / "train2.bin", val_bin=tmp_path / "val.bin", vocab_size=300
        )
    with pytest.raises(DataError, match=">= --vocab-size 200"):
        adopt_token_files(tmp_path / "x", train_bin=tmp_path / "train.bin", vocab_size=200)
    assert not (tmp_path / "x").exists()

    # Without --val-bin, the tail of train.bin is validation: two ranges of one file.
    tail = adopt_token_files(
        tmp_path / "tail", train_bin=tmp_path / "train.bin", vocab_size=300, val_fraction=0.1
    ).path
    opened = TokenDataset.open(tail)
    assert np.array_equal(opened.shards("train")[0], train[:4500])
    assert np.array_equal(opened.shards("val")[0], train[4500:])
    assert sorted(p.name for p in tail.iterdir()) == ["meta.json", "train.bin"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="recover")
    add_prepare_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.mark.inprocess  # a 1-replica run, like tests/test_train_single.py
def test_cli_from_bin_then_train_reads_it(tmp_path: Path, capsys) -> None:
    write_bin(tmp_path / "train.bin", 20000, 256)
    write_bin(tmp_path / "val.bin", 3000, 256, seed=1)
    ds = tmp_path / "ds"
    args = _parse(
        ["prepare", "--from-bin", str(tmp_path / "train.bin"), "--val-bin",
         str(tmp_path / "val.bin"), "--vocab-size", "256", "--out", str(ds)]
    )  # fmt: skip
    assert run_prepare(args) == 0
    printed = capsys.readouterr().out
    assert "20,000 tokens" in printed and "adopted" in printed and "shards" in printed
    # Adopted token ids have no documents and no tokenizer: said so, not "0 documents", "none".
    assert "documents" not in printed and "none tokens" not in printed, printed
    assert "token ids as given, no tokenizer" in printed, printed
    assert run_prepare(_parse(["prepare", "--from-bin", str(tmp_path / "train.bin")])) == 2
    assert "--vocab-size" in capsys.readouterr().err

    run = tmp_path / "run"
    r = run_cli(["train", *TINY_TRAIN_FLAGS, "--data", str(ds), "--out", str(run), "--steps", "3"])
    assert r.returncode == 0, r.stdout + r.stderr
    config = json.loads((run / "config.json").read_text())
    meta = json.loads((ds / "meta.json").read_text())
    assert config["data"]["content_hash"] == meta["content_hash"]
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for s in steps if s.get("kind") == "step") == 3
    # Adopted token ids have no tokenizer: sampling says to name one, and works with it.
    r = cli_here(["sample", str(run), "--prompt", "ab", "--tokens", "4"])
    assert r.returncode == 2 and "--tokenizer" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli_here(["sample", str(run), "--prompt", "ab", "--tokens", "4", "--tokenizer", "byte"])
    assert r.returncode == 0 and r.stdout.startswith("ab"), r.stdout + r.stderr
    # Exported, its folder says it has no tokenizer (it claimed bytes), or holds the one given.
    pytest.importorskip("transformers", reason="transformers is not installed")
    r = cli_here(["export", str(run), "--out", str(tmp_path / "hf")])
    assert r.returncode == 0, r.stderr
    assert (
        "Tokenizer: none. The run's data was adopted" in (tmp_path / "hf" / "README.md").read_text()
    )
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    r = cli_here(["export", str(run), "--out", str(tmp_path / "hf-byte"), "--tokenizer", "byte"])
    assert r.returncode == 0, r.stderr
    assert "Tokenizer: bytes" in (tmp_path / "hf-byte" / "README.md").read_text()
    mine = make_tokenizer_json(tmp_path / "mine.json", TEXTS)  # a small vocabulary: it fits
    r = cli_here(["export", str(run), "--out", str(tmp_path / "hf-mine"), "--tokenizer", str(mine)])
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf-mine" / "tokenizer.json").read_bytes() == mine.read_bytes()
    r = cli_here(["export", str(run), "--out", str(tmp_path / "x"), "--tokenizer", str(run)])
    assert r.returncode == 2 and "is not a tokenizer.json" in r.stderr, r.stderr


def test_cli_summary_line_counts_documents_tokens_and_shards(tmp_path: Path, capsys) -> None:
    write_jsonl(tmp_path / "c.jsonl", TEXTS)
    out = tmp_path / "ds"
    args = _parse(["prepare", "--source", str(tmp_path / "c.jsonl"), "--out", str(out)])
    assert run_prepare(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("prepared  30 documents")
    assert f"{tokens:,} tokens in 2 shards" in summary and "tokens/s" in summary
    assert run_prepare(args) == 0  # again: reused, nothing written
    assert capsys.readouterr().out.splitlines()[-1].startswith("reused")
