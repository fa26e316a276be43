"""What a replica is inside: its pipeline stages, FSDP2 shards and tensor-parallel ranks.

`ReplicaLayout(pp=2, tp=2)` is a replica of four ranks: the single frozen description of a
replica's shape that the CLI builds once and that the launcher, the links and the trainers read.
The mesh order is pp (outermost), shard, tp (innermost): on GPUs the TP ranks, which talk in every
layer, are then neighbours (the same host, the fastest links). A dimension of size 1 is not in
the mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recover.checks import is_int

DIMS = ("pp", "shard", "tp")  # mesh order, outermost first


@dataclass(frozen=True, kw_only=True)
class ReplicaLayout:
    pp: int = 1
    shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"--{name} must be an int >= 1, got {value!r}")

    @classmethod
    def from_dims(cls, dims: dict[str, int] | None) -> ReplicaLayout:
        """The inverse of `dims` (as a checkpoint records it); ValueError on an unknown name."""
        unknown = set(dims or {}) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown replica dimension(s) {sorted(unknown)}; known: {DIMS}")
        return cls(**(dims or {}))

    @property
    def dims(self) -> dict[str, int]:
        """The dimensions above 1, in mesh order: {"pp": 2, "tp": 2}; {} for one rank."""
        return {n: getattr(self, n) for n in DIMS if getattr(self, n) > 1}

    @property
    def ranks(self) -> int:
        """Processes per replica."""
        return math.prod((self.pp, self.shard, self.tp))

    @property
    def name(self) -> str:
        """The name: "pp+tp", or "single" for one rank."""
        return "+".join(self.dims) or "single"

    def flags(self) -> list[str]:
        """The command-line flags of this layout: ["--shard", "2", "--tp", "2"]."""
        return [x for name, size in self.dims.items() for x in (f"--{name}", str(size))]

    def describe(self) -> str:
        """The flags as text, for messages: "--shard 2 --tp 2", or "one rank"."""
        return " ".join(self.flags()) or "one rank"
