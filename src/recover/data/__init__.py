"""Data: corpus, tokenizers, dataset preparation and pure microbatch addressing.

The public surface for the rest of recover: ``ensure_dataset``/``prepare_dataset`` make a token
dataset folder, ``TokenDataset.open`` reads it, and ``microbatch_tokens(ds, seed=, step=, j=, ...)``
and ``microbatch_seed(seed, step, j)`` give the tokens and the RNG seed of a microbatch id as pure
functions (no rank, no replica, no global state).

Names are imported on first use, so a process that only prepares or validates data (the launcher)
does not pay for importing torch, which the addressing module needs.
"""

from importlib import import_module

_WHERE = {
    "TokenDataset": "addressing",
    "compute_pass_permutation": "addressing",
    "microbatch_seed": "addressing",
    "microbatch_tokens": "addressing",
    "validation_batches": "addressing",
    "STDLIB_SOURCE": "corpus",
    "Corpus": "corpus",
    "DataError": "corpus",
    "Document": "corpus",
    "list_corpus_files": "corpus",
    "load_corpus": "corpus",
    "read_corpus": "corpus",
    "DEFAULT_DATASET_NAME": "prepare",
    "DEFAULT_SHARD_TOKENS": "prepare",
    "PrepareConfig": "prepare",
    "assign_splits": "prepare",
    "default_dataset_name": "prepare",
    "dtype_for_vocab": "prepare",
    "ensure_dataset": "prepare",
    "prepare_dataset": "prepare",
    "BpeTokenizer": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_bpe": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'recover.data' has no attribute {name!r}")
    value = getattr(import_module(f"recover.data.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
