"""prepare: deterministic, atomic, idempotent dataset folders, and clear errors on bad input."""

from __future__ import annotations

import argparse
import json
import os
import random
import string
from pathlib import Path

import numpy as np
import pytest

from recover.data import (
    DataError,
    Document,
    assign_splits,
    dtype_for_vocab,
    ensure_dataset,
    load_tokenizer,
    prepare_dataset,
)
from recover.data import shards as shards_module
from recover.data.cli import add_prepare_parser, run_prepare
from recover.data.corpus import compute_content_hash
from recover.data.prepare import read_documents

pytestmark = pytest.mark.timeout(30)


def write_corpus(root: Path, n_docs: int = 12, size: int = 400, seed: int = 0) -> Path:
    """n_docs unique text files (some in a subfolder) plus hidden ones that must be ignored."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " \n.,;:()é"
    root.mkdir(parents=True)
    (root / "sub").mkdir()
    for i in range(n_docs):
        folder = root / "sub" if i % 3 == 0 else root
        text = f"doc {i}\n" + "".join(rng.choice(alphabet) for _ in range(size))
        (folder / f"doc_{i:02d}.txt").write_text(text, encoding="utf-8")
    (root / ".hidden.txt").write_bytes(b"\x00binary but hidden")
    (root / ".git").mkdir()
    (root / ".git" / "x").write_bytes(b"\xff\xfe")
    return root


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_byte_dataset_is_byte_identical_across_runs_and_meta_is_complete(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    a = prepare_dataset(tmp_path / "a" / "ds", source=src, shard_tokens=1000, show_progress=False)
    b = prepare_dataset(tmp_path / "b" / "ds", source=src, shard_tokens=1000, show_progress=False)
    assert tree_bytes(a) == tree_bytes(b)

    meta = json.loads((a / "meta.json").read_text())
    assert meta["format_version"] == 2
    assert meta["source"] == str(src)
    assert meta["tokenizer"]["kind"] == "byte" and meta["vocab_size"] == 256
    assert meta["dtype"] == "uint8"
    documents = read_documents(a)
    paths = [d["path"] for d in documents]
    assert paths == sorted(paths) and len(paths) == 12  # hidden files and folders skipped
    assert not any(p.startswith(".") for p in paths)
    assert meta["train"]["documents"] + meta["val"]["documents"] == 12
    assert meta["train"]["documents"] > 0 and meta["val"]["documents"] > 0
    assert len(meta["shards"]["train"]) > 1  # small shard_tokens forces several shards

    # Shards are exactly each split's documents, in order, each followed by byte 0.
    docs = [Document(p, (src / p).read_bytes()) for p in paths]
    assert meta["content_hash"] == compute_content_hash(docs)
    for split in ("train", "val"):
        expected = b"".join(
            d.data + b"\x00" for d, e in zip(docs, documents, strict=True) if e["split"] == split
        )
        got = b"".join((a / s["file"]).read_bytes() for s in meta["shards"][split])
        assert got == expected
        assert meta[split]["tokens"] == len(expected)
        assert [s["tokens"] for s in meta["shards"][split]] == [
            (a / s["file"]).stat().st_size for s in meta["shards"][split]
        ]
        assert all(s["tokens"] <= 1000 for s in meta["shards"][split])
    assert meta["tokens_hash"].startswith("sha256:")


def test_bpe_dataset_is_deterministic_and_roundtrips(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src", n_docs=10, size=600)
    kw = dict(source=src, tokenizer="bpe", vocab_size=300, show_progress=False)
    a = prepare_dataset(tmp_path / "a", **kw)
    b = prepare_dataset(tmp_path / "b", **kw)
    assert tree_bytes(a) == tree_bytes(b)
    assert (a / "tokenizer.json").is_file()
    meta = json.loads((a / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["requested_vocab_size"] == 300
    assert 257 <= meta["vocab_size"] <= 300
    assert meta["dtype"] == "uint16"

    tok = load_tokenizer(a)
    assert tok.vocab_size == meta["vocab_size"] and tok.eod_id == 0
    text = (src / "doc_01.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned
    # Literal separator text in a document never becomes the separator id.
    assert tok.eod_id not in tok.encode("a <|endoftext|> b")
    # The train shard holds the documents' ids joined by the separator.
    train = np.concatenate(
        [np.fromfile(a / s["file"], dtype=np.uint16) for s in meta["shards"]["train"]]
    )
    first_train = next(d for d in read_documents(a) if d["split"] == "train")
    first_ids = tok.encode((src / first_train["path"]).read_text(encoding="utf-8"))
    assert train[: len(first_ids)].tolist() == first_ids and train[len(first_ids)] == 0


@pytest.mark.parametrize(
    ("vocab", "dtype"),
    [(256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32)],
)
def test_dtype_by_vocab_size(vocab: int, dtype: type) -> None:
    assert dtype_for_vocab(vocab) == np.dtype(dtype)


def test_bad_settings_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        prepare_dataset(tmp_path / "x", tokenizer="bpe", vocab_size=256, show_progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        prepare_dataset(tmp_path / "x", tokenizer="wordpiece", show_progress=False)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_dataset(tmp_path / "x", val_fraction=1.0, show_progress=False)
    assert not (tmp_path / "x").exists()


def _bad_missing(root: Path) -> tuple[Path, Path]:
    return root / "nope", root / "nope"


def _bad_empty_folder(root: Path) -> tuple[Path, Path]:
    (root / "src").mkdir()
    return root / "src", root / "src"


def _bad_all_empty(root: Path) -> tuple[Path, Path]:
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_bytes(b"")
    (root / "src" / "b.txt").write_bytes(b"")
    return root / "src", root / "src"


def _bad_nul(root: Path) -> tuple[Path, Path]:
    src = write_corpus(root / "src", n_docs=3)
    (src / "bin.dat").write_bytes(b"abc\x00def")
    return src, src / "bin.dat"


def _bad_utf8(root: Path) -> tuple[Path, Path]:
    src = write_corpus(root / "src", n_docs=3)
    (src / "latin1.txt").write_bytes("café".encode("latin-1"))
    return src, src / "latin1.txt"


def _bad_dangling_link(root: Path) -> tuple[Path, Path]:
    src = write_corpus(root / "src", n_docs=3)
    (src / "link.txt").symlink_to(root / "gone.txt")
    return src, src / "link.txt"


def _bad_fifo(root: Path) -> tuple[Path, Path]:
    src = write_corpus(root / "src", n_docs=3)
    os.mkfifo(src / "pipe")
    return src, src / "pipe"


def _bad_unreadable(root: Path) -> tuple[Path, Path]:
    if os.geteuid() == 0:
        pytest.skip("root can read a chmod 000 file; the dangling-link case covers read errors")
    src = write_corpus(root / "src", n_docs=3)
    (src / "secret.txt").write_text("hidden")
    (src / "secret.txt").chmod(0)
    return src, src / "secret.txt"


@pytest.mark.parametrize(
    "make_bad",
    [
        _bad_missing,
        _bad_empty_folder,
        _bad_all_empty,
        _bad_nul,
        _bad_utf8,
        _bad_dangling_link,
        _bad_fifo,
        _bad_unreadable,
    ],
)
def test_bad_source_is_a_data_error_naming_the_path_and_leaves_nothing(
    tmp_path: Path, make_bad
) -> None:
    source, culprit = make_bad(tmp_path)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(DataError) as info:
        prepare_dataset(out_parent / "ds", source=source, show_progress=False)
    assert str(culprit) in str(info.value)
    assert list(out_parent.iterdir()) == []


def test_failure_while_writing_removes_the_temporary_folder(tmp_path, monkeypatch) -> None:
    src = write_corpus(tmp_path / "src")
    real_open = shards_module._open_shard
    calls = []

    def failing_open(path: Path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_open(path)

    monkeypatch.setattr(shards_module, "_open_shard", failing_open)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(OSError, match="No space"):
        prepare_dataset(out_parent / "ds", source=src, shard_tokens=500, show_progress=False)
    assert len(calls) == 2  # it did start writing into a temporary folder
    assert list(out_parent.iterdir()) == []


def test_a_killed_prepares_temporary_folder_is_removed_by_the_next_prepare(tmp_path) -> None:
    """A prepare SIGKILLed while it writes cannot remove its temporary folder; the next prepare
    of the same folder on this host removes it (its process is gone), and publishes."""
    import signal
    import subprocess
    import sys

    src = write_corpus(tmp_path / "src")
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    # A prepare's first step of writing (its temporary folder made, a file in it), then killed.
    code = (
        "import sys, time; from pathlib import Path; "
        "from recover.data.folder import make_temporary_folder; "
        "t = make_temporary_folder(Path(sys.argv[1])); (t / 'part').write_bytes(b'x'); "
        "print(t, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(out_parent / "ds")], stdout=subprocess.PIPE, text=True
    )
    try:
        left = Path(child.stdout.readline().strip())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert left.is_dir() and left.parent == out_parent
    # Another live prepare's temporary folder (this process's) is not touched.
    from recover.data.folder import make_temporary_folder

    mine = make_temporary_folder(out_parent / "ds")
    assert not left.exists(), "the killed prepare's temporary folder was left"
    assert mine.is_dir()
    mine.rmdir()
    prepare_dataset(out_parent / "ds", source=src, shard_tokens=500, show_progress=False)
    assert [p.name for p in out_parent.iterdir()] == ["ds"]


def test_only_a_bpe_prepare_shows_a_training_bar(tmp_path, monkeypatch) -> None:
    """The progress bars a prepare shows: a byte tokenizer trains nothing, so no `training bpe`
    bar (it showed one that never moved)."""
    from recover.data import prepare as prepare_module

    shown = []

    def task(self, description, total):
        shown.append(description)
        return lambda n=1: None

    monkeypatch.setattr(prepare_module._Progress, "task", task)
    src = write_corpus(tmp_path / "src")
    prepare_dataset(tmp_path / "byte", source=src, show_progress=False)
    assert "training bpe" not in shown and "tokenizing" in shown, shown
    shown.clear()
    prepare_dataset(tmp_path / "bpe", source=src, tokenizer="bpe", vocab_size=300,
                    show_progress=False)  # fmt: skip
    assert "training bpe" in shown, shown


def test_existing_output_with_other_content_is_refused_untouched(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=str(other)):
        prepare_dataset(other, source=src, show_progress=False)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(DataError, match=str(a_file)):
        prepare_dataset(a_file, source=src, show_progress=False)
    assert a_file.read_text() == "x"

    # Another dataset (other settings, or other content) in the way is refused too.
    ds = prepare_dataset(tmp_path / "ds", source=src, show_progress=False)
    before = tree_bytes(ds)
    with pytest.raises(DataError, match=str(ds)):
        prepare_dataset(ds, source=src, val_fraction=0.5, show_progress=False)
    (src / "doc_01.txt").write_text("changed", encoding="utf-8")
    with pytest.raises(DataError, match=str(ds)):
        prepare_dataset(ds, source=src, show_progress=False)
    # A complete dataset with a stray extra file is not "this dataset" either.
    (src / "doc_01.txt").unlink()
    ds2 = prepare_dataset(tmp_path / "ds2", source=src, show_progress=False)
    (ds2 / "extra").write_text("?")
    with pytest.raises(DataError, match=str(ds2)):
        prepare_dataset(ds2, source=src, show_progress=False)
    assert tree_bytes(ds) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "ds2", "file", "other", "src"]


def test_reprepare_is_idempotent_and_does_not_rewrite(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    out = tmp_path / "ds"
    out.mkdir()  # an empty folder is fine
    first = prepare_dataset(out, source=src, show_progress=False)
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.iterdir()}
    again = prepare_dataset(out, source=src, show_progress=False)
    assert again == first
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in again.iterdir()} == stamps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "src"]


def test_single_text_file_is_split_into_line_chunks(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text("".join(f"line {i} of the book\n" for i in range(8000)), encoding="utf-8")
    ds = prepare_dataset(tmp_path / "ds", source=book, show_progress=False)
    meta = json.loads((ds / "meta.json").read_text())
    assert meta["source"] == str(book)
    assert meta["train"]["documents"] > 0 and meta["val"]["documents"] > 0
    assert meta["train"]["tokens"] + meta["val"]["tokens"] == book.stat().st_size + len(
        read_documents(ds)
    )

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("one short line\n")
    with pytest.raises(DataError, match="at least 2 documents"):
        prepare_dataset(tmp_path / "ds_tiny", source=tiny, show_progress=False)
    assert not (tmp_path / "ds_tiny").exists()


def test_assign_splits_is_pure_and_never_leaves_a_split_empty() -> None:
    paths = [f"f{i}.txt" for i in range(50)]
    splits = assign_splits(paths, 0.2)
    assert splits == assign_splits(list(paths), 0.2)
    assert 0 < splits.count("val") < 50
    # A document's split depends on its own path, not on which other documents exist.
    sub = assign_splits(paths[:25], 0.2)
    if "val" in splits[:25] and "train" in splits[:25]:
        assert sub == splits[:25]
    for fraction in (1e-9, 1 - 1e-9):
        two = assign_splits(["a", "b"], fraction)
        assert sorted(two) == ["train", "val"]


def test_ensure_dataset_on_the_python_stdlib_is_idempotent(tmp_path: Path) -> None:
    ds = ensure_dataset(tmp_path, show_progress=False)
    assert ds == tmp_path / "stdlib-byte"
    meta = json.loads((ds / "meta.json").read_text())
    assert meta["source"] == "python-stdlib" and meta["python_version"]
    paths = [d["path"] for d in read_documents(ds)]
    assert len(paths) > 100 and paths == sorted(paths)
    assert all(p.endswith(".py") for p in paths)
    excluded = {"test", "tests", "idlelib", "site-packages"}
    assert not any(excluded & set(p.split("/")) for p in paths)
    assert "os.py" in paths
    assert meta["train"]["tokens"] > 1_000_000
    stamps = {p.name: p.stat().st_mtime_ns for p in ds.iterdir()}
    assert ensure_dataset(tmp_path, show_progress=False) == ds
    assert {p.name: p.stat().st_mtime_ns for p in ds.iterdir()} == stamps


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="recover")
    add_prepare_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_prepare_summary_and_errors(tmp_path: Path, capsys) -> None:
    src = write_corpus(tmp_path / "src")
    out = tmp_path / "ds"
    args = _parse(["prepare", "--source", str(src), "--out", str(out), "--no-progress"])
    assert args.func is run_prepare
    assert run_prepare(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    printed = capsys.readouterr().out
    assert str(out) in printed and meta["content_hash"] in printed

    bad = _parse(["prepare", "--tokenizer", "bpe", "--out", str(tmp_path / "x"), "--no-progress"])
    assert run_prepare(bad) == 2
    assert "--vocab-size" in capsys.readouterr().err
    bad = _parse(["prepare", "--tokenizer", "chars", "--no-progress"])
    assert run_prepare(bad) == 2
    err = capsys.readouterr().err
    assert "--tokenizer" in err and "byte" in err and "bpe" in err

    missing = tmp_path / "missing"
    args = _parse(["prepare", "--source", str(missing), "--out", str(tmp_path / "y")])
    assert run_prepare(args) == 2
    assert capsys.readouterr().err.startswith(f"error: source {missing}")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_default_dataset_names_keep_sources_of_two_formats_apart() -> None:
    """`docs.jsonl` and `docs.parquet` prepared with one tokenizer default to folders of their
    own (both were `docs-byte`, and the second prepare was refused)."""
    from recover.data.prepare import default_dataset_name

    assert default_dataset_name("data/docs.jsonl") == "docs-jsonl-byte"
    assert default_dataset_name("data/docs.parquet", "bpe", 4096) == "docs-parquet-bpe4096"
    assert default_dataset_name("data/corpus") == "corpus-byte"  # a folder
    assert default_dataset_name() == "stdlib-byte"
