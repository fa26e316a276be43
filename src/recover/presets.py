"""Model presets: the GPT shapes by name (torch-free, so launchers can validate flags cheaply)."""

# Shapes of the presets; vocab_size and block_size come from the dataset and --seq-len.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128),
    "medium": dict(n_layer=6, n_head=6, n_embd=384),
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-1b": dict(n_layer=24, n_head=16, n_embd=2048),
}
