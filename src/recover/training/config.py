"""The resolved configuration of a training run.

Job: one keyword-only dataclass per concern, each validated once at start-up with a ValueError that
names the flag and the allowed values. The CLI reads flags (and the environment, once) and builds
these; everything below the CLI receives them as arguments and never reads `os.environ`.

`TrainConfig` is what decides the trajectory: two runs with equal `trajectory_fields()` compute the
same committed steps on the same microbatches, whatever the number of replicas or the failures.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from recover.training.presets import PRESETS

TRAIN_CONFIG_ENV = "RECOVER_TRAIN_CONFIG"  # how a launcher hands its workers the TrainConfig
PRECISIONS = ("fp32", "bf16")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    preset: str = "tiny"
    steps: int = 300  # optimizer steps in the run
    microbatches: int = 8  # M: microbatches summed per step, fixed for the run
    microbatch_size: int = 8  # B: sequences per microbatch
    seq_len: int = 128  # T: tokens per sequence
    seed: int = 1337  # decides init, sample order and dropout: (seed, step, j) -> microbatch
    lr: float = 3e-3  # peak learning rate (after warmup)
    min_lr: float = 3e-4  # end of the cosine decay
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables
    dropout: float = 0.0
    precision: str = "fp32"  # fp32, or bf16: forward under bf16 autocast, fp32 gradients and state
    eval_every: int = 100  # validation loss every N steps (and at the end); 0 disables
    eval_batches: int = 8  # validation microbatches per evaluation
    ckpt_every: int = 100  # checkpoint every N steps; 0 disables periodic checkpoints
    keep_ckpts: int = 2  # keep the last K checkpoints
    max_nonfinite: int = 3  # stop after N consecutive steps skipped as non-finite (0: never)
    # A new run whose model starts from another run's checkpoint (its weights only; the optimizer
    # and schedule start fresh at step 0): a checkpoint folder, or a run folder (its newest).
    init_from: str = ""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(
                f"--preset: unknown preset {self.preset!r}; allowed: {', '.join(PRESETS)}"
            )
        positive = ("steps", "microbatches", "microbatch_size", "seq_len", "keep_ckpts")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{_flag(name)} must be a positive integer, got {value!r}")
        for name in (
            "warmup_steps", "eval_every", "eval_batches", "ckpt_every", "seed", "max_nonfinite",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{_flag(name)} must be a non-negative integer, got {value!r}")
        if self.eval_every and not self.eval_batches:
            raise ValueError("--eval-batches must be positive when --eval-every is set")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{_flag(name)} must be a finite number >= 0, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{_flag(name)} must be in [0, 1), got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if not isinstance(self.init_from, str):
            raise ValueError(f"--init-from must be a path, got {self.init_from!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        """The config of `to_json`'s text, every field given (what a launcher hands a worker)."""
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"{TRAIN_CONFIG_ENV} must hold every TrainConfig field, got {text!r}")
        return cls(**data)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def tokens_per_step(self) -> int:
        return self.microbatches * self.microbatch_size * self.seq_len


# Fields that may differ between a run and its resumption without changing the trajectory
# of the steps both share: a longer run, or another checkpoint cadence.
RESUMABLE_CHANGES = frozenset({"steps", "ckpt_every", "keep_ckpts", "eval_every", "eval_batches"})


def compute_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at the last step. Pure."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@dataclass(frozen=True, kw_only=True)
class RunPaths:
    """Where a run writes: config.json, metrics.jsonl, checkpoints/, final/model.safetensors."""

    out: Path

    @property
    def config(self) -> Path:
        return self.out / "config.json"

    @property
    def metrics(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def final_model(self) -> Path:
        return self.out / "final" / "model.safetensors"


def check_layout_fits(preset: str, tp: int, pp: int = 1) -> None:
    """ValueError if the preset cannot be split so: whole heads per TP rank, a layer per stage."""
    heads, layers = PRESETS[preset]["n_head"], PRESETS[preset]["n_layer"]
    if tp > 1 and heads % tp:
        raise ValueError(f"--tp {tp} must divide the {preset} preset's {heads} attention heads")
    if pp > layers:
        raise ValueError(f"--pp {pp} exceeds the {preset} preset's {layers} layers")
