"""The replica spec: how every replica process of one job behaves, made once and passed down.

`ReplicaSpec` is the one place a replica-level setting is declared: its field carries the flag, the
help text and the check. The CLI builds it from flags (`add_spec_flags`, `ReplicaSpec.from_args`);
the launcher hands it to every child as one JSON variable (`to_json`, RECOVER_REPLICA_SPEC; see
recover.runtime.env) that the child's entry point reads back whole (`from_json`). Nothing turns
it back into flags, and nothing below the entry point reads it from anywhere but the object.

Adding a setting: a field here (flag, default, help, check), and its use. The launcher, the
worker's entry point and `recover run`'s scripts get it without a change.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from recover.logs import LOG_LEVELS
from recover.runtime.layout import ReplicaLayout
from recover.settings import add_flags, check_settings, given, json_fields, setting

if TYPE_CHECKING:
    from recover.addresses import PeerAddress
    from recover.runtime.collective_config import CollectiveConfig

MODES = ("recover", "checkpoint-restart", "shrink")
DEVICES = ("auto", "cpu", "cuda")
# How the cross-replica reduce moves gradients: gloo over a host copy (every device; verified),
# or NCCL between the GPUs (one GPU per process; not yet run on GPUs in this project).
CROSS_REDUCES = ("gloo", "nccl")


SCRIPTS = ("scripts",)  # the tag of a setting that holds for a user's script too (`recover run`)


@dataclass(frozen=True, kw_only=True)
class ReplicaSpec:
    layout: ReplicaLayout = field(default_factory=ReplicaLayout)
    mode: str = setting(
        "recover", "--mode",
        "recover: survive failures in-step (default). Baselines for comparison: "
        "checkpoint-restart (stop everything, restart from the last checkpoint) and shrink (drop "
        "the dead replica's microbatches; the global batch shrinks)",
        choices=MODES,
    )  # fmt: skip
    device: str = setting(
        "auto", "--device",
        "where replicas compute: auto (a GPU per process if any is visible, else the CPU), cpu or "
        "cuda (default: auto)",
        choices=DEVICES,
    )  # fmt: skip
    cross_reduce: str = setting(
        "gloo", "--cross-reduce",
        "how gradients are summed across replicas: gloo over a host copy (any device), or nccl "
        "between GPUs, one GPU per process, without the copy (not yet run on several GPUs in "
        "this project; refused where a process sees no GPU) (default: gloo)",
        choices=CROSS_REDUCES, tags=SCRIPTS,
    )  # fmt: skip
    heartbeat_s: float = setting(
        0.1, "--heartbeat", "heartbeat interval to the coordinator (default: 0.1)",
        metavar="S", low=(0.0, False), tags=SCRIPTS,
    )  # fmt: skip
    check_every: int = setting(
        50, "--check-every",
        "compare parameter hashes across replicas every N steps (0: never; default: 50)",
        metavar="N", low=(0, True),
    )  # fmt: skip
    watchdog_s: float = setting(
        5.0, "--watchdog",
        "in a replica of several ranks: a rank whose replica-mate is silent this long stops the "
        "whole replica, which the others then recover from (default: 5)",
        metavar="S", low=(0.0, False), tags=SCRIPTS,
    )  # fmt: skip
    stall_s: float = setting(
        300.0, "--stall-timeout",
        "a training thread busy this long without progress (a forward, a backward, a collective "
        "that never returns) ends its process, which the others then recover from (0: off; "
        "default: 300)",
        metavar="S", low=(0.0, True), tags=SCRIPTS,
    )  # fmt: skip

    reduce_deadline_s: float = setting(
        30.0, "--reduce-deadline",
        "a cross-replica reduce not complete this long after it started is abandoned and its "
        "replicas' vote decides (a redo without the silent replica); raise it for large models "
        "on slow links (default: 30)",
        metavar="S", low=(0.0, False), tags=SCRIPTS,
    )  # fmt: skip
    reduce_bucket_mb: float = setting(
        1.0, "--reduce-bucket",
        "a step's cross-replica reduce runs in buckets of this many MiB, each started during the "
        "last backward pass as soon as its gradients are final (smaller: more of the reduce "
        "overlapped, more ops; 0: the gradients in one op, after the backward; replicas of one "
        "rank over gloo; every replica of a run must use the same) (default: 1)",
        metavar="MB", low=(0.0, True), tags=SCRIPTS,
    )  # fmt: skip
    coordinator_grace_s: float = setting(
        10.0, "--coordinator-grace",
        "how long a replica waits for a coordinator that answers nothing (gone, or frozen) before "
        "it stops: it commits nothing meanwhile; after it, the lowest replica of the last view "
        "checkpoints the last committed step and every process exits with status 11 and the "
        "command to resume (default: 10)",
        metavar="S", low=(0.0, False), tags=SCRIPTS,
    )  # fmt: skip
    register_timeout_s: float = setting(
        180.0, "--register-timeout",
        "start-up: how long a replica waits for the run to form, or to admit it (default: 180)",
        metavar="S", low=(0.0, False), tags=SCRIPTS,
    )  # fmt: skip
    peak_tflops: float = setting(
        0.0, "--peak-tflops",
        "peak TFLOP/s of one device (GPU), for the MFU in the step line, the step records and "
        "the summary (0: from the GPU's name for known GPUs, dense bf16; no MFU on a CPU; "
        "default: 0)",
        metavar="X", low=(0.0, True),
    )  # fmt: skip
    tensorboard: str = setting(
        "", "--tensorboard",
        "also write the run's scalars (loss, val loss, lr, grad norm, tokens/s, step time) and "
        "events (failures, recoveries, joins, epochs) as TensorBoard event files in DIR, by the "
        "replica that writes the step records; metrics.jsonl stays the record (needs the "
        "tensorboard package: pip install 'recover[tensorboard]'; default: none)",
        metavar="DIR", tags=SCRIPTS,
    )  # fmt: skip
    wandb: str = setting(
        "", "--wandb",
        "also log the run's scalars and events to a W&B run in PROJECT (or ENTITY/PROJECT), one "
        "W&B run per run folder (a resumed run continues it), by the replica that writes the "
        "step records; W&B's files go to RUN/wandb (WANDB_MODE=offline keeps them there); "
        "metrics.jsonl stays the record (needs pip install 'recover[wandb]'; default: none)",
        metavar="PROJECT", tags=SCRIPTS,
    )  # fmt: skip
    # A replica-level setting like the others, so that one field reaches every replica process
    # (built-in workers and `recover run`'s scripts alike) inside the spec's JSON, checked once.
    deterministic: bool = setting(
        False, "--deterministic",
        "make every committed gradient and loss the same bits whatever fails, joins or straggles "
        "and whatever the replica count: each microbatch's gradient is a leaf of a tree fixed by "
        "the microbatch count, summed across replicas by an ordered reduce (docs/design.md, "
        "'Bitwise-identical recovery'); replicas of one rank, --mode recover (default: off)",
        tags=SCRIPTS,
    )  # fmt: skip
    ahead: bool = setting(
        True, "--ahead",
        "compute the next step's first microbatch while a step's vote is in flight, after its "
        "update (replicas of one rank: recover train's, and a script's that gives "
        "replica.attach() ahead=...; not with --deterministic): the commit keeps it for the "
        "next step, any other outcome drops it (--no-ahead: the next step starts its compute "
        "after the commit) (default: on)",
        tags=SCRIPTS,
    )  # fmt: skip
    log_level: str = setting(
        "info", "--log-level",
        "the least severe terminal lines shown: debug, info (the step lines; default), warning "
        "or error (the launcher and the coordinator use it too)",
        choices=LOG_LEVELS, tags=SCRIPTS,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ReplicaLayout):
            raise ValueError(f"layout must be a ReplicaLayout, got {self.layout!r}")
        check_settings(self)
        if self.deterministic and self.layout.ranks > 1:
            raise ValueError(
                f"--deterministic supports replicas of one rank; not yet {self.layout.describe()} "
                "(--shard, --tp, --pp)"
            )
        if self.deterministic and self.mode != "recover":
            raise ValueError(f"--deterministic needs --mode recover, got --mode {self.mode}")
        if self.cross_reduce == "nccl" and self.device == "cpu":
            raise ValueError(
                "--cross-reduce nccl reduces between GPUs: use --device cuda (or auto)"
            )

    # ---- what the components take ----------------------------------------------------------
    def why_not_ahead(self) -> str | None:
        """Why `recover train`'s replicas compute no microbatch of the next step during a
        step's vote (--ahead), or None where they do."""
        if not self.ahead:
            return "the run has --no-ahead"
        if self.deterministic:
            return "--deterministic computes no microbatch ahead (one leaf per id)"
        if self.layout.ranks > 1:
            return (
                f"replicas of {self.layout.describe()} compute no microbatch ahead (replicas of "
                "one rank do)"
            )
        return None

    def collective(self, peer: PeerAddress | None = None) -> CollectiveConfig:
        """The deadlines of the cross-replica collective (recover.runtime.collective), and the
        gloo devices of this process (`peer`, a recover.addresses.PeerAddress resolved at the
        entry point; None: gloo's default). The devices are the process's, not the job's: each
        host has its own interfaces, so they are not a field of this spec."""
        from recover.runtime.collective_config import CollectiveConfig

        # gloo's own timeout stays a backstop behind the deadline (it must not fire first).
        backstop = max(CollectiveConfig.pg_timeout_s, 2 * self.reduce_deadline_s)
        devices: dict[str, Any] = {}
        if peer is not None:
            devices = {"gloo_interfaces": peer.interfaces, "gloo_hostname": peer.hostname}
        return CollectiveConfig(
            op_deadline_s=self.reduce_deadline_s, pg_timeout_s=backstop,
            step_bucket_bytes=self.reduce_bucket_bytes, **devices,
        )  # fmt: skip

    @property
    def reduce_bucket_bytes(self) -> int:
        """--reduce-bucket in bytes, a whole number of fp32 values (0: one op)."""
        return int(self.reduce_bucket_mb * 2**20) // 4 * 4

    # ---- flags ---------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplicaSpec:
        """The spec of parsed flags (`add_spec_flags`); flags a parser lacks keep their default."""
        layout = ReplicaLayout(
            **{n: getattr(args, n) for n in ("pp", "shard", "tp") if hasattr(args, n)}
        )
        return cls(layout=layout, **given(cls, args))

    # ---- the one serialised form ---------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, *, name: str = "the replica spec") -> ReplicaSpec:
        """The spec of `to_json`'s text; a partial object keeps the defaults of the fields it
        lacks (so a person may set only what they change). ValueError naming `name` otherwise."""
        raw = json_fields(text, {f.name for f in fields(cls)}, name=name)
        layout = raw.pop("layout", {})
        if not isinstance(layout, dict):
            raise ValueError(f'{name}: layout must be an object like {{"shard": 2}}')
        return cls(layout=ReplicaLayout.from_dims(layout), **raw)


def add_spec_flags(parser: argparse.ArgumentParser, *, scripts: bool = False) -> None:
    """Add the spec's flags to a parser group (`scripts`: only those of the settings a user's
    script obeys, for `recover run`); `ReplicaSpec.from_args` reads them back."""
    group = parser.add_argument_group("what a replica is and how it behaves")
    if not scripts:  # a script builds its own layout
        for name, metavar, text in (
            ("shard", "S", "ranks per replica, one process each, that shard the model with FSDP2 "
             "(HSDP: sharded inside a replica, replicated across replicas). A worker with S > 1 "
             "runs under torchrun --nproc-per-node S"),
            ("tp", "T", "ranks per replica, one process each, that split every transformer block "
             "by tensor parallelism (T must divide the preset's n_head)"),
            ("pp", "P", "ranks per replica, one process each, that hold P consecutive pipeline "
             "stages (GPipe; the replica's microbatches are the pipeline's). The three combine: "
             "P x S x T ranks, each stage split by TP and sharded by FSDP2 over its S x T ranks"),
        ):  # fmt: skip
            group.add_argument(
                f"--{name}", type=int, default=1, metavar=metavar, help=f"{text} (default: 1)"
            )
    add_flags(group, ReplicaSpec, tag="scripts" if scripts else None)
