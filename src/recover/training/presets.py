"""Model presets and the model's config: the GPT shapes by name, torch-free, so that launchers
can validate flags and record a run's model shape cheaply (recover.training.model builds the model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Shapes of the presets; vocab_size and block_size come from the dataset and --seq-len.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128),
    "medium": dict(n_layer=6, n_head=6, n_embd=384),
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-1b": dict(n_layer=24, n_head=16, n_embd=2048),
}


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256  # from the dataset's tokenizer (256 for the byte tokenizer)
    block_size: int = 128  # longest sequence the position table covers
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64  # model width; must be divisible by n_head
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm; off is a little faster and no worse

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


def build_config(
    preset: str, *, vocab_size: int, block_size: int, dropout: float = 0.0
) -> GPTConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    return GPTConfig(
        vocab_size=vocab_size, block_size=block_size, dropout=dropout, **PRESETS[preset]
    )
