"""Flags that several commands share, and the small helpers of every command's entry point.

Job: the GPT trainer's settings as flags (`add_train_config_flags`, from TrainConfig's fields and
`TRAIN_HELP`), the replica's (`add_replica_flags`: --fault and the ReplicaSpec), the local
launcher's supervision and start flags, each declared once for train, run and agent; and the one
way a command says a user's error (`usage_error`: one line, exit 2) or a run folder it cannot write
(`storage_error`: exits.STORAGE).

What it must not do: build a command's parser (recover.cli.train, jobs, views) or run anything.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import fields
from pathlib import Path

from recover.coordinator.options import CoordinatorOptions
from recover.settings import add_flags, given
from recover.training.config import TrainConfig

DEFAULT_DATA_ROOT = Path("data")

TRAIN_HELP = {
    "preset": "model size: tiny (tests, fast on CPU), small, medium, gpt2-124m, gpt2-350m, gpt2-1b",
    "steps": "optimizer steps in the run",
    "microbatches": "M: microbatches summed per step (fixed for the run, whatever fails)",
    "microbatch_size": "B: sequences per microbatch",
    "seq_len": "T: tokens per sequence",
    "seed": "decides the initial parameters, the sample order and dropout",
    "lr": "peak learning rate, reached after warmup",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "steps of linear warmup",
    "weight_decay": "AdamW weight decay on matrices",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "clip the global gradient norm to this (0: no clipping)",
    "dropout": "dropout probability (masks seeded per microbatch id)",
    "precision": "fp32, or bf16: the forward pass under bf16 autocast; gradients, their sums "
    "and the optimizer state stay fp32",
    "eval_every": "validation loss every N steps and at the end (0: never)",
    "eval_batches": "validation microbatches per evaluation",
    "ckpt_every": "checkpoint every N steps (0: no periodic checkpoints)",
    "keep_ckpts": "keep the last K checkpoints",
    "init_from": "start a new run's model from the weights of another run's checkpoint (a "
    "step_N folder, or a run folder: its newest valid checkpoint); the optimizer and the schedule "
    "start fresh at step 0. A resumed run continues from its own checkpoints (default: none)",
    "max_nonfinite": "a step whose summed gradient or loss is not finite, or whose update makes "
    "any parameter or optimizer state non-finite, is skipped (never applied, or undone); stop "
    "the run after N such steps in a row (0: never stop)",
}


def add_train_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, its default and help from the dataclass."""
    group = parser.add_argument_group("trajectory (the same flags give the same committed steps)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        group.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=f.default,
            metavar=f.name.upper() if kind is not str else "NAME",
            help=f"{TRAIN_HELP[f.name]} (default: {f.default})",
        )


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})


def add_replica_flags(parser: argparse.ArgumentParser) -> None:
    """`--fault`, and every flag of the replica spec (recover.runtime.spec)."""
    from recover.runtime.faults import GRAMMAR
    from recover.runtime.spec import add_spec_flags

    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"inject a fault (repeatable): {GRAMMAR}",
    )
    add_spec_flags(parser)


def add_supervision_flags(parser: argparse.ArgumentParser) -> None:
    """How a local launcher supervises its replicas (`recover train` and `recover run`)."""
    group = parser.add_argument_group("supervision")
    # the coordinator's settings a launcher offers (--min-replicas, --lease, --balance), declared
    # once in CoordinatorOptions; the launcher hands them to its coordinator as they are
    add_flags(group, CoordinatorOptions, tag="launcher")
    add_restart_flags(
        group,
        "restart a dead replica after DELAY seconds; it joins the running job at a step "
        "boundary and gets the state from a live replica (default: never)",
    )
    group.add_argument(
        "--coordinators",
        type=int,
        default=1,
        metavar="N",
        help="N coordinators, one leading and the others standing by to take over when it dies "
        "or stalls; their state is kept in etcd (--state, or a private etcd started on "
        "127.0.0.1 and stopped with the run; needs Debian's etcd-server) (default: 1)",
    )
    group.add_argument(
        "--state",
        default=None,
        metavar="etcd://HOST:PORT[,...]",
        help="the etcd that keeps the coordinators' state (default: in memory with one "
        "coordinator, a private etcd with --coordinators > 1)",
    )


def add_restart_flags(group, respawn_help: str) -> None:
    """--respawn and --max-restarts (recover.supervisor's restart rule), for `recover train`,
    `recover run` and `recover agent`."""
    group.add_argument("--respawn", type=float, default=None, metavar="DELAY", help=respawn_help)
    group.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="respawns per replica (default: 3)"
    )


def add_ranks_flag(parser: argparse.ArgumentParser, more: str) -> None:
    """--ranks-per-replica of a script's replicas (`recover run`, `recover agent`)."""
    parser.add_argument(
        "--ranks-per-replica",
        type=int,
        default=1,
        metavar="N",
        help="processes per replica, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as "
        f"torchrun sets them{more} (default: 1)",
    )


def add_start_flags(parser: argparse.ArgumentParser) -> None:
    """--quiet and --cold-start: how a host of a script's replicas (`recover run`, `recover
    agent`) starts them and shows their output."""
    parser.add_argument("--quiet", action="store_true", help="do not echo the replicas' output")
    parser.add_argument(
        "--cold-start",
        action="store_true",
        help="start every process afresh instead of forking `python SCRIPT` (or `python -m "
        "MODULE`) from one process that imported torch once (the default warm start; other "
        "commands are always started afresh)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module the warm start imports once, besides torch, before it forks the "
        "script's processes: a heavy import of the script (torchtitan's model, transformers) "
        "paid once per host instead of in every process and respawn; repeatable",
    )


def preloads(args: argparse.Namespace) -> tuple[str, ...]:
    """--preload's modules, checked before anything starts: each a dotted module name whose
    top-level package this interpreter finds (found, not imported: the zygote imports it), and
    only with the warm start."""
    import importlib.util

    names = tuple(args.preload)
    if names and args.cold_start:
        raise ValueError("--preload imports modules for the warm start: drop --cold-start")
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"--preload {name!r}: not a module name (e.g. torchtitan.models)")
        if importlib.util.find_spec(name.split(".")[0]) is None:
            raise ValueError(
                f"--preload {name}: no module {name.split('.')[0]!r} in this Python "
                f"({sys.executable})"
            )
    return names


def supervision(args: argparse.Namespace) -> dict:
    """The supervision flags (add_supervision_flags) as LaunchConfig takes them."""
    return dict(
        **given(CoordinatorOptions, args, tag="launcher"),
        respawn_s=args.respawn,
        max_restarts=args.max_restarts,
        coordinators=args.coordinators,
        state=args.state,
    )


def parse_faults(specs: list[str]):
    from recover.runtime.faults import parse_fault

    return tuple(parse_fault(s) for s in specs)


def default_out() -> Path:
    return Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")


def usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def is_unwritable(error: OSError) -> bool:
    import errno

    from recover.record import RecordUnwritable

    unwritable = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    return isinstance(error, RecordUnwritable) or error.errno in unwritable


def storage_error(error: OSError) -> int:
    """A run folder that cannot be written, said in one line: exits.STORAGE."""
    from recover import exits
    from recover.record import RecordUnwritable

    what = (
        str(error)
        if isinstance(error, RecordUnwritable)
        else (f"cannot write {error.filename}: {error.strerror}" if error.filename else str(error))
    )
    usage_error(f"{what}: the run stops (free space, or give a writable --out)")
    return exits.STORAGE


def checked_dashboards(spec):
    """`spec` with its --tensorboard folder made absolute (every replica writes to the same
    folder, whatever its cwd), after checking that the dashboards asked for can be used
    (ValueError naming the package to install)."""
    from dataclasses import replace

    if spec.tensorboard:
        from recover.dashboards import check_tensorboard

        check_tensorboard()
        spec = replace(spec, tensorboard=str(Path(spec.tensorboard).resolve()))
    if spec.wandb:
        from recover.dashboards import check_wandb

        check_wandb(spec.wandb)
    return spec


def start_logging(args: argparse.Namespace, prefix: str) -> None:
    """This process's terminal lines at --log-level, and the resolved job among them (debug)."""
    import json

    from recover.logs import setup_logging

    setup_logging(args.log_level, prefix=prefix)
    job = getattr(args, "resolved_job", None)  # (parse_args; absent for a hand-built Namespace)
    logging.getLogger("recover.cli").debug("job: %s", json.dumps(job, sort_keys=True))
