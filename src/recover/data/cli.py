"""The ``recover prepare`` subcommand: flags, validation, and a short summary.

Job: parse and check the flags (messages name the flag and the allowed values), call ``prepare``
(or ``adopt_token_files`` for ``--from-bin``) and print where the dataset is, what it holds and
how long it took. Exit codes: 0 on success, 2 on a bad flag or a DataError (printed as
``error: <message>`` on stderr). No other logic here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recover.data.corpus import DEFAULT_TEXT_FIELD, SOURCE_FORMATS, DataError
from recover.data.folder import META_FILE
from recover.data.prepare import (
    PrepareConfig,
    default_dataset_name,
    prepare,
    resolve_tokenizer,
)
from recover.data.tokenizer import EOD_TOKEN, MIN_BPE_VOCAB

DEFAULT_DATA_ROOT = Path("data")


def add_prepare_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``prepare`` subcommand (its handler is set as ``args.func = run_prepare``)."""
    p = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus into a dataset folder (default: the python stdlib, byte tokens)",
        description="Tokenize a corpus into token shards plus meta.json, streaming (bounded "
        "memory), or adopt a nanoGPT token file with --from-bin. Idempotent: an existing "
        "identical dataset is reused; anything else at --out is an error. Format: docs/data.md.",
    )
    p.add_argument(
        "--source",
        type=Path,
        default=None,
        help="a text file, a folder of text files, a .jsonl or .parquet file (or a folder of "
        "them), or a folder saved by datasets' save_to_disk (default: the python standard library)",
    )
    p.add_argument(
        "--format",
        default="auto",
        help=f"the source's format: {', '.join(SOURCE_FORMATS)} (default auto: by file name)",
    )
    p.add_argument(
        "--text-field",
        default=DEFAULT_TEXT_FIELD,
        help="jsonl/parquet/hf-disk: the field holding a document's text (default: text)",
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default), bpe (trained here; needs --vocab-size), or PATH/tokenizer.json "
        "(a Hugging Face tokenizers file you already have; copied into the dataset)",
    )
    p.add_argument(
        "--eod-token",
        default=EOD_TOKEN,
        help=f"with a tokenizer.json: the token between documents (default {EOD_TOKEN})",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"bpe vocabulary size, >= {MIN_BPE_VOCAB}; with --from-bin, the file's vocabulary",
    )
    p.add_argument(
        "--val-fraction", type=float, default=0.05, help="share of documents for validation"
    )
    p.add_argument(
        "--from-bin",
        type=Path,
        default=None,
        help="adopt a nanoGPT-style token file (train.bin) without copying it; needs --vocab-size",
    )
    p.add_argument(
        "--val-bin",
        type=Path,
        default=None,
        help="with --from-bin: its validation file (default: the last --val-fraction of train.bin)",
    )
    p.add_argument("--dtype", default="uint16", help="with --from-bin: uint16 (default) or uint32")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="dataset folder (default: data/stdlib-byte, data/stdlib-bpe<N>, data/<folder>-byte "
        "for a folder, data/<name>-<format>-byte for a file, e.g. data/docs-jsonl-byte)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_prepare)


def _check_flags(args: argparse.Namespace) -> str | None:
    """A message naming the bad flag and the allowed values, or None."""
    if not 0.0 < args.val_fraction < 1.0:
        return f"--val-fraction must be in (0, 1), got {args.val_fraction}"
    if args.from_bin is not None:
        if args.source is not None:
            return "--from-bin and --source are exclusive"
        if args.vocab_size is None:
            return "--from-bin needs --vocab-size (the file's vocabulary size)"
        if args.dtype not in ("uint16", "uint32"):
            return f"--dtype must be uint16 or uint32, got {args.dtype!r}"
        return None
    if args.val_bin is not None:
        return "--val-bin applies only with --from-bin"
    if args.format not in SOURCE_FORMATS:
        return f"--format must be one of {', '.join(SOURCE_FORMATS)}, got {args.format!r}"
    kind, _ = resolve_tokenizer(args.tokenizer)
    if kind not in ("byte", "bpe", "hf"):
        return f"--tokenizer must be byte, bpe or PATH/tokenizer.json, got {args.tokenizer!r}"
    if kind == "byte" and args.vocab_size not in (None, 256):
        return "--vocab-size applies only to --tokenizer bpe (byte has 256)"
    if kind == "hf" and args.vocab_size is not None:
        return "--vocab-size applies only to --tokenizer bpe (a tokenizer.json has its own)"
    if kind == "bpe" and (args.vocab_size is None or args.vocab_size < MIN_BPE_VOCAB):
        return f"--vocab-size must be an integer >= {MIN_BPE_VOCAB} with --tokenizer bpe"
    return None


def _run(args: argparse.Namespace, show_progress: bool):
    if args.from_bin is not None:
        from recover.data.adopt import adopt_token_files

        out = args.out or DEFAULT_DATA_ROOT / f"{args.from_bin.stem}-bin"
        return adopt_token_files(
            out,
            train_bin=args.from_bin,
            vocab_size=args.vocab_size,
            val_bin=args.val_bin,
            dtype=args.dtype,
            val_fraction=args.val_fraction,
        )
    kind, tokenizer_file = resolve_tokenizer(args.tokenizer)
    config = PrepareConfig(
        source=args.source,
        tokenizer=kind,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        tokenizer_file=tokenizer_file,
        eod_token=args.eod_token,
        format=args.format,
        text_field=args.text_field,
    )
    out = args.out
    if out is None:
        out = DEFAULT_DATA_ROOT / default_dataset_name(args.source, args.tokenizer, args.vocab_size)
    return prepare(out, config, show_progress=show_progress)


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``recover prepare``; returns the process exit code."""
    problem = _check_flags(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        result = _run(args, show_progress=not args.no_progress)
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = json.loads((result.path / META_FILE).read_text(encoding="utf-8"))
    tok = meta["tokenizer"]
    docs = {s: meta[s]["documents"] for s in ("train", "val")}
    print(f"dataset   {result.path}")
    kind = "token ids as given, no tokenizer" if tok["kind"] == "none" else f"{tok['kind']} tokens"
    print(f"source    {meta['source']}  ({kind}, vocab {tok['vocab_size']})")
    for split in ("train", "val"):
        what = "" if docs[split] is None else f"  {docs[split]} documents"
        print(f"{split:<9} {meta[split]['tokens']:,} tokens{what}")
    print(f"skipped   {meta['skipped_count']} files")
    print(f"content   {meta['content_hash']}")
    print(result.summary())
    return 0
