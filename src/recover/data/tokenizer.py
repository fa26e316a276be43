"""Tokenizers: ``byte`` (UTF-8 bytes, vocab 256), ``bpe`` (trained here) and ``hf`` (the user's file).

Job: a small common interface, ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size`` and ``eod_id`` (the end-of-document separator), plus training, saving and loading.

Invariants:

* ``byte``: id = byte value; the separator is byte 0, which never occurs in a corpus document
  (the corpus rejects or skips text with NUL bytes), so it cannot be confused with text.
* ``bpe``: HF ``tokenizers`` byte-level BPE whose id 0 is the special ``<|endoftext|>`` separator.
  ``encode`` never produces the separator from text (``encode_special_tokens``), so a document
  that literally contains "<|endoftext|>" cannot fake a document boundary. Training is
  deterministic: the same texts and vocab size give the same ``tokenizer.json`` and the same ids
  (checked by the tests, not promised by HF in general; keep it tested when upgrading).
* ``hf``: a ``tokenizer.json`` of HF ``tokenizers`` that the user brings (any model: BPE,
  WordPiece, Unigram). The separator is its ``eod_token`` (default ``<|endoftext|>``), which must
  be in its vocabulary; ``encode`` never produces it (nor any other special token) from text, and
  adds no special tokens of its own (no BOS/EOS from the post-processor).

Costs and limits: BPE training reads all texts into the HF trainer (multi-threaded, seconds for
the ~11 MB stdlib corpus). The trained vocabulary can be smaller than requested when the corpus
runs out of pairs seen at least twice; ``vocab_size`` is always the real size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from recover.checks import is_int
from recover.data.corpus import DataError

TOKENIZER_KINDS = ("byte", "bpe", "hf")
BPE_FILE = "tokenizer.json"
EOD_TOKEN = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # the special separator plus the 256 byte symbols


class ByteTokenizer:
    """Token id = UTF-8 byte value; vocab 256; byte 0 is the end-of-document separator."""

    kind = "byte"
    vocab_size = 256
    eod_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, out_dir: Path) -> None:
        """Nothing to save: the byte tokenizer has no state."""


class JsonTokenizer:
    """A tokenizer of HF ``tokenizers`` (a ``tokenizer.json``) whose ``eod_token`` is the separator."""

    kind = "hf"

    def __init__(self, hf: HFTokenizer, eod_token: str = EOD_TOKEN) -> None:
        eod = hf.token_to_id(eod_token)
        if eod is None:
            raise DataError(
                f"the tokenizer has no {eod_token!r} token to separate documents; "
                "name one of its tokens with --eod-token"
            )
        hf.encode_special_tokens = True  # text never maps to the separator; not serialized
        self._hf = hf
        self.eod_token = eod_token
        self.eod_id: int = eod
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self._hf.to_str()

    def save(self, out_dir: Path) -> None:
        (Path(out_dir) / BPE_FILE).write_text(self._hf.to_str(), encoding="utf-8")


class BpeTokenizer(JsonTokenizer):
    """A byte-level BPE trained here (``train_bpe``); id 0 is ``<|endoftext|>``."""

    kind = "bpe"

    def __init__(self, hf: HFTokenizer) -> None:
        super().__init__(hf, EOD_TOKEN)


def load_tokenizer_file(path: Path | str, *, eod_token: str = EOD_TOKEN) -> JsonTokenizer:
    """A user's ``tokenizer.json``; DataError naming the file when it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist or is not a file")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:  # HF raises a bare Exception for bad files
        raise DataError(f"cannot load the tokenizer {path}: {exc}") from exc
    try:
        return JsonTokenizer(hf, eod_token)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from exc


Tokenizer = ByteTokenizer | JsonTokenizer


def validate_vocab_size(kind: str, vocab_size: int | None) -> None:
    """ValueError naming ``tokenizer``/``vocab_size`` for an impossible combination."""
    if kind not in TOKENIZER_KINDS:
        raise ValueError(
            f"tokenizer must be byte, bpe or the path of a tokenizer.json, got {kind!r}"
        )
    if kind == "byte":
        if vocab_size not in (None, 256):
            raise ValueError(f"vocab_size applies only to the bpe tokenizer, got {vocab_size}")
        return
    if kind == "hf":
        if vocab_size is not None:
            raise ValueError("vocab_size applies only to the bpe tokenizer (a file has its own)")
        return
    if vocab_size is None or not is_int(vocab_size):
        raise ValueError(
            f"vocab_size must be an int >= {MIN_BPE_VOCAB} for bpe, got {vocab_size!r}"
        )
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_BPE_VOCAB} for bpe, got {vocab_size}")


def train_bpe(texts: Iterable[str], *, vocab_size: int) -> BpeTokenizer:
    """Train a byte-level BPE on ``texts`` (in the given order); deterministic for equal input."""
    validate_vocab_size("bpe", vocab_size)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],  # first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return BpeTokenizer(hf)


def build_tokenizer(kind: str) -> ByteTokenizer:
    """The untrained tokenizer of ``kind`` (only ``byte`` exists without training)."""
    if kind != "byte":
        raise ValueError(f"tokenizer {kind!r} must be trained or loaded, not built")
    return ByteTokenizer()


def load_tokenizer(dataset_dir: Path | str) -> Tokenizer:
    """The tokenizer of a prepared dataset folder (reads its meta.json and tokenizer.json)."""
    dataset_dir = Path(dataset_dir)
    meta_path = dataset_dir / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        kind = meta["tokenizer"]["kind"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"cannot read the tokenizer kind from {meta_path}: {exc}") from exc
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        path = dataset_dir / BPE_FILE
        try:
            return BpeTokenizer(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # HF raises a bare Exception for missing or bad files
            raise DataError(f"cannot load the BPE tokenizer {path}: {exc}") from exc
    if kind == "hf":
        eod_token = meta["tokenizer"].get("eod_token") or EOD_TOKEN
        return load_tokenizer_file(dataset_dir / BPE_FILE, eod_token=eod_token)
    raise DataError(f"{meta_path} names an unknown tokenizer kind {kind!r}")
