"""The ``recover prepare`` subcommand: flags, validation, and a short summary.

Job: parse and check the flags (messages name the flag and the allowed values), call
``prepare_dataset`` and print where the dataset is and what it holds. Exit codes: 0 on success,
2 on a bad flag or a DataError (printed as ``error: <message>`` on stderr). No other logic here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recover.data.corpus import DataError
from recover.data.prepare import META_FILE, default_dataset_name, prepare_dataset
from recover.data.tokenizer import MIN_BPE_VOCAB, TOKENIZER_KINDS

DEFAULT_DATA_ROOT = Path("data")


def add_prepare_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``prepare`` subcommand (its handler is set as ``args.func = run_prepare``)."""
    p = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus into a dataset folder (default: the python stdlib, byte tokens)",
        description="Tokenize a corpus into token shards plus meta.json. Idempotent: an existing "
        "identical dataset is reused; anything else at --out is an error.",
    )
    p.add_argument(
        "--source",
        type=Path,
        default=None,
        help="a text file or a folder of text files (default: the python standard library)",
    )
    p.add_argument("--tokenizer", default="byte", help="byte (default) or bpe")
    p.add_argument(
        "--vocab-size", type=int, default=None, help=f"bpe vocabulary size, >= {MIN_BPE_VOCAB}"
    )
    p.add_argument(
        "--val-fraction", type=float, default=0.05, help="share of documents for validation"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="dataset folder (default: data/stdlib-byte, data/stdlib-bpe<N>, data/<source>-...)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_prepare)


def _check_flags(args: argparse.Namespace) -> str | None:
    """A message naming the bad flag and the allowed values, or None."""
    if args.tokenizer not in TOKENIZER_KINDS:
        return f"--tokenizer must be one of {', '.join(TOKENIZER_KINDS)}, got {args.tokenizer!r}"
    if args.tokenizer == "byte" and args.vocab_size not in (None, 256):
        return "--vocab-size applies only to --tokenizer bpe (byte has 256)"
    if args.tokenizer == "bpe" and (args.vocab_size is None or args.vocab_size < MIN_BPE_VOCAB):
        return f"--vocab-size must be an integer >= {MIN_BPE_VOCAB} with --tokenizer bpe"
    if not 0.0 < args.val_fraction < 1.0:
        return f"--val-fraction must be in (0, 1), got {args.val_fraction}"
    return None


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``recover prepare``; returns the process exit code."""
    problem = _check_flags(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = args.out
    if out is None:
        out = DEFAULT_DATA_ROOT / default_dataset_name(args.source, args.tokenizer, args.vocab_size)
    try:
        path = prepare_dataset(
            out,
            source=args.source,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            show_progress=not args.no_progress,
        )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    tok = meta["tokenizer"]
    print(f"dataset   {path}")
    print(f"source    {meta['source']}  ({tok['kind']} tokens, vocab {tok['vocab_size']})")
    print(f"train     {meta['train']['tokens']:,} tokens  {meta['train']['documents']} documents")
    print(f"val       {meta['val']['tokens']:,} tokens  {meta['val']['documents']} documents")
    print(f"skipped   {meta['skipped_count']} files")
    print(f"content   {meta['content_hash']}")
    return 0
