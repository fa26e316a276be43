"""ReCoVer: resilient LLM pre-training for PyTorch.

Training runs as R data-parallel replicas. When a replica dies or hangs, the survivors finish the
same step, on the very same microbatches, without a restart. See docs/design.md.

The public API for your own training loop (docs/api.md):

- `Replica`: joins the job a launcher (`recover run`) started, hands out each step's microbatch
  ids (or, for a replica cut into pipeline stages, each attempt's share at once as a
  `PipelinePart` for a schedule), and returns the committed mean gradient in `.grad`;
- `TokenWindows`: microbatch `(step, j)` as a pure function of `(seed, step, j)` over a token file;
- `seed_generators(seed)`: the randomness of a microbatch (dropout) from its own seed, cheaply;
- `UsageError`, `QuorumLost`, `NonFinite`, `CoordinatorLost`, `AddressError`: what the API
  raises.

They are imported on first use, so that `import recover.coordinator...` (which needs no torch)
stays fast.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Replica": "recover.runtime.api",
    "UsageError": "recover.runtime.api",
    "QuorumLost": "recover.runtime.api",
    "NonFinite": "recover.runtime.api",
    "CoordinatorLost": "recover.runtime.api",
    "PipelinePart": "recover.runtime.pipeline",
    "AddressError": "recover.addresses",
    "TokenWindows": "recover.data.windows",
    "write_token_file": "recover.data.windows",
    "seed_generators": "recover.data.windows",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'recover' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
