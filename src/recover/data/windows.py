"""Token windows for any training script: microbatch ``(step, j)`` as a pure function.

Job: the data half of the contract a script keeps when it uses ReCoVer (docs/api.md): the tokens of
microbatch ``(step, j)`` depend only on ``(seed, step, j)``, never on which replica computes it or
when. `TokenWindows` gives that over a nanoGPT-style flat token file (``.bin``: uint16 or uint32
tokens, no header) or over a dataset folder made by ``recover prepare``, with the addressing rule
of `recover.data.addressing` (windows of ``seq_len + 1`` tokens, each pass a fresh permutation
fixed by ``(seed, pass)``).

Costs: the file is memory-mapped read-only (any number of processes share it); one pass
permutation costs 8 bytes per window. `content_hash` reads the whole file once (on first use).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from recover.checks import is_int
from recover.data.addressing import TokenDataset, microbatch_tokens
from recover.data.folder import META_FILE

_DTYPES = ("uint16", "uint32")


class TokenWindows:
    """Microbatches of windows over a token file, addressed by ``(step, j)``."""

    def __init__(
        self,
        path: str | Path,
        *,
        seq_len: int,
        microbatch_size: int,
        microbatches: int,
        seed: int = 0,
        dtype: str = "uint16",
    ) -> None:
        self.path = Path(path)
        for name, value in (
            ("seq_len", seq_len),
            ("microbatch_size", microbatch_size),
            ("microbatches", microbatches),
        ):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not is_int(seed) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seq_len, self.microbatch_size, self.microbatches = (
            seq_len,
            microbatch_size,
            microbatches,
        )
        self.seed = seed
        self._hash: str | None = None
        if (self.path / META_FILE).exists():  # a folder made by `recover prepare`
            self.dataset = TokenDataset.open(self.path)
            self._hash = self.dataset.content_hash
        elif self.path.is_file():
            if dtype not in _DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
            tokens = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
            meta = {"vocab_size": None, "content_hash": None}
            self.dataset = TokenDataset(self.path, meta, {"train": [tokens], "val": []})
        else:
            raise FileNotFoundError(
                f"{self.path}: neither a token file nor a dataset folder (with {META_FILE})"
            )
        self.dataset.num_windows("train", seq_len)  # ValueError now if the file is too short

    def batch(self, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of microbatch ``(step, j)``: int64, shape (microbatch_size,
        seq_len) each; targets are the inputs shifted left by one token."""
        return microbatch_tokens(
            self.dataset,
            seed=self.seed,
            step=step,
            j=j,
            microbatches=self.microbatches,
            microbatch_size=self.microbatch_size,
            seq_len=self.seq_len,
        )

    @property
    def content_hash(self) -> str:
        """sha256 of the token file (16 hex), for the fingerprint every replica must share."""
        if self._hash is None:
            digest = hashlib.sha256()
            with self.path.open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            self._hash = digest.hexdigest()[:16]
        return self._hash


def seed_generators(seed: int) -> None:
    """Seed the generators the randomness of a computation draws from (dropout and the like):
    the CPU's, and every CUDA device's where CUDA is initialized. For a microbatch's forward
    pass (the contract: its randomness a pure function of `(step, j)`) this is what
    `torch.manual_seed` does, without that call's cost where an accelerator backend is not
    initialized (every CPU-only machine): it then formats the caller's whole stack to queue the
    backend's seeding for later, 0.1 ms a call at the top of a script and 0.27 ms thirty frames
    deeper (2-core EPYC, torch 2.13), against 1-3 µs here. `seed`: an int in [0, 2**64)."""
    if not is_int(seed) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # (a model on CUDA has initialized it)
        torch.cuda.manual_seed_all(seed)


def write_token_file(path: str | Path, tokens: np.ndarray) -> Path:
    """Write a nanoGPT-style flat token file (the array's own dtype, no header)."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.dtype.name not in _DTYPES:
        raise ValueError(f"tokens must be uint16 or uint32, got {tokens.dtype}")
    tmp = path.with_name(path.name + ".tmp")
    tokens.tofile(tmp)
    tmp.replace(path)
    return path


__all__ = ["TokenWindows", "seed_generators", "write_token_file"]
