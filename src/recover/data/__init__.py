"""Data: corpus, tokenizers, dataset preparation and pure microbatch addressing.

The public surface for the rest of recover: ``ensure_dataset``/``prepare_dataset`` make a token
dataset folder, ``TokenDataset.open`` reads it, and ``microbatch_tokens(ds, seed=, step=, j=, ...)``
and ``microbatch_seed(seed, step, j)`` give the tokens and the RNG seed of a microbatch id as pure
functions (no rank, no replica, no global state).
"""

from recover.data.addressing import (
    TokenDataset,
    compute_pass_permutation,
    microbatch_seed,
    microbatch_tokens,
    validation_batches,
)
from recover.data.corpus import (
    STDLIB_SOURCE,
    Corpus,
    DataError,
    Document,
    list_corpus_files,
    load_corpus,
    read_corpus,
)
from recover.data.prepare import (
    DEFAULT_DATASET_NAME,
    DEFAULT_SHARD_TOKENS,
    PrepareConfig,
    assign_splits,
    default_dataset_name,
    dtype_for_vocab,
    ensure_dataset,
    prepare_dataset,
)
from recover.data.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "DEFAULT_DATASET_NAME",
    "DEFAULT_SHARD_TOKENS",
    "STDLIB_SOURCE",
    "BpeTokenizer",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "Document",
    "PrepareConfig",
    "TokenDataset",
    "Tokenizer",
    "assign_splits",
    "compute_pass_permutation",
    "default_dataset_name",
    "dtype_for_vocab",
    "ensure_dataset",
    "list_corpus_files",
    "load_corpus",
    "load_tokenizer",
    "microbatch_seed",
    "microbatch_tokens",
    "prepare_dataset",
    "read_corpus",
    "train_bpe",
    "validation_batches",
]
