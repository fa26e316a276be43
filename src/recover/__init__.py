"""ReCoVer: resilient LLM pre-training for PyTorch.

Training runs as R data-parallel replicas. When a replica dies or hangs, the survivors finish the
same step, on the very same microbatches, without a restart. See docs/design.md.
"""

__version__ = "0.1.0"
