"""The `recover` command line: the only place that reads flags and the environment.

Subcommands: train, prepare, compare, coordinator, worker, bench. Each builds validated configs
and passes them down; errors a user can fix are printed as one `error: ...` line with exit 2.

Size: every command's flags and entry point in one module, by design: it is the only place that
reads flags and the environment.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import fields
from pathlib import Path

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
    group.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="stop (and checkpoint) when fewer replicas survive (default: 1)",
    )
    group.add_argument(
        "--lease",
        type=float,
        default=1.0,
        metavar="S",
        help="a replica silent this long is declared dead (default: 1.0)",
    )
    add_restart_flags(
        group,
        "restart a dead replica after DELAY seconds; it joins the running job at a step "
        "boundary and gets the state from a live replica (default: never)",
    )
    group.add_argument(
        "--balance",
        choices=("throughput", "equal"),
        default="throughput",
        help="microbatch shares by each replica's measured throughput, or equal (default: "
        "throughput)",
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


def supervision(args: argparse.Namespace) -> dict:
    """The supervision flags (add_supervision_flags) as LaunchConfig takes them."""
    return dict(
        min_replicas=args.min_replicas,
        lease_s=args.lease,
        respawn_s=args.respawn,
        max_restarts=args.max_restarts,
        balance=args.balance,
        coordinators=args.coordinators,
        state=args.state,
    )


def parse_faults(specs: list[str]):
    from recover.runtime.faults import parse_fault

    return tuple(parse_fault(s) for s in specs)


def default_out() -> Path:
    return Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recover",
        description="ReCoVer: resilient LLM pre-training that survives replica failures in-step.",
    )
    from recover import __version__

    parser.add_argument("--version", action="version", version=f"recover {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a GPT (prepares the built-in corpus on first use)",
        description="Train a GPT. With no --data, the built-in corpus (the Python standard "
        "library's source) is prepared under data/ on first use.",
    )
    train.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a job file: TOML with one table per flag group ([train], [run], [replica], "
        "[supervision], [launch]; keys are the flags without dashes), or a run folder's "
        "config.json; flags given here override it (--fault specs add to its list)",
    )
    add_train_config_flags(train)
    run = train.add_argument_group("run")
    run.add_argument(
        "--data",
        type=Path,
        default=None,
        metavar="DIR",
        help="a dataset folder made by `recover prepare` (default: the built-in corpus)",
    )
    run.add_argument(
        "--data-root",
        type=Path,
        default=DEFAULT_DATA_ROOT,
        metavar="DIR",
        help="where the built-in corpus is prepared (default: data)",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="run folder (default: runs/run-DATE-TIME); must be new or empty",
    )
    run.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its newest checkpoint"
    )
    run.add_argument("--quiet", action="store_true", help="no per-step lines")
    add_replica_flags(train)
    train.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="data-parallel replicas started on this machine, each its own process "
        "(default: 1, no coordinator)",
    )
    add_supervision_flags(train)
    train.add_argument(
        "--cold-start",
        action="store_true",
        help="start every replica process afresh (each imports torch itself) instead of forking "
        "it from one process that imported torch once (the default warm start: faster start-up "
        "and respawns, the same training)",
    )
    train.add_argument(
        "--standby",
        type=int,
        default=0,
        metavar="N",
        help="keep N warm standby processes (torch imported, dataset open, model built, not "
        "members); a dead replica's slot goes to one at once and a new one is started behind it; "
        "implies --respawn 0 unless --respawn is given (default: 0)",
    )

    worker = sub.add_parser(
        "worker",
        help="run one replica of a multi-node job (start one per replica, e.g. under torchrun)",
        description="Run one replica; it registers with the coordinator at --coordinator and "
        "trains until the last step. The shared token is read from $RECOVER_TOKEN.",
    )
    add_train_config_flags(worker)
    worker.add_argument(
        "--coordinator",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the coordinator's address, or every coordinator's (a leader and its standbys) "
        "(default: $RECOVER_COORDINATOR; required unless "
        "--launched)",
    )
    worker.add_argument(
        "--replica-id",
        type=int,
        metavar="R",
        help="this replica's id, an int >= 0, unique in the job (required unless --launched)",
    )
    worker.add_argument(
        "--launched",
        action="store_true",
        help="started by a local launcher: take the job (TrainConfig, replica spec, coordinator, "
        "replica id, faults) from the RECOVER_* variables it set, and ignore the job's flags",
    )
    worker.add_argument(
        "--data",
        type=Path,
        required=True,
        metavar="DIR",
        help="the dataset folder (`recover prepare`; the same content on every node)",
    )
    worker.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="the run folder on this node"
    )
    worker.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest checkpoint in --out (every replica of the job alike)",
    )
    add_replica_flags(worker)
    worker.add_argument(
        "--ifname",
        default=None,
        metavar="IF[,IF...]",
        help="the network interface(s) of every process group this replica builds: their "
        "address is what the other replicas dial (default: $RECOVER_IFNAME, else torch's "
        "$GLOO_SOCKET_IFNAME, else the address this host reaches a remote coordinator from; "
        "with a coordinator on 127.0.0.1, gloo's default)",
    )
    worker.add_argument(
        "--standby",
        action="store_true",
        help="a warm standby (recover train --standby, or a node agent's): build the replica, "
        'then wait unregistered for one line on stdin, e.g. {"RECOVER_REPLICA_ID": "1"}, that '
        "makes it that replica (instead of --replica-id); end of input: exit 0, nothing written",
    )

    script = sub.add_parser(
        "run",
        help="run any training script that uses recover.Replica as R fault-tolerant replicas",
        description="Start a coordinator and R replicas of COMMAND (each process gets the job's "
        "RECOVER_* variables, see docs/api.md), supervise them (respawn, faults, no orphans), "
        "and exit 0 when the run succeeded. Example: recover run --replicas 3 -- python "
        "train.py --steps 100",
    )
    script.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a job file: TOML with one table per flag group ([launch], [supervision], "
        "[replica]; keys are the flags without dashes), or a run folder's job.json; flags given "
        "here override it (--fault specs add to its list)",
    )
    script.add_argument(
        "--replicas", type=int, default=2, help="replicas started on this machine (default: 2)"
    )
    add_ranks_flag(script, "; the script builds its layout with Replica(shard=..., tp=...)")
    script.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder for the job's events (metrics.jsonl: failures, decisions, recoveries) "
        "(default: runs/run-DATE-TIME)",
    )
    add_supervision_flags(script)
    script.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="inject a fault into the script's replicas (repeatable); the grammar of "
        "`recover train --fault`",
    )
    from recover.runtime.spec import add_spec_flags

    add_spec_flags(script, scripts=True)  # the settings a script's replicas obey
    script.add_argument(
        "--start-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="every replica must have registered by then; after it the run forms with those "
        "there if they are at least --min-replicas (default: 60)",
    )
    add_start_flags(script)
    script.add_argument(
        "script_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the command of every process (after --), e.g. python train.py",
    )

    agent = sub.add_parser(
        "agent",
        help="one per node (srun, a pod): host the replica ids the coordinator gives this node",
        description="A node agent: asks the job's coordinator which replica ids this node hosts "
        "(a node that joins when every id is hosted is a standby node, handed the ids of a node "
        "that is lost), starts each with the job's RECOVER_* variables, restarts a dead one "
        "(--respawn), gives ids back on SIGTERM (a drain), and exits with a status a scheduler "
        "can act on (docs/multinode.md). Example: srun --ntasks-per-node 1 recover agent "
        "--coordinator node0:29400 -- python train.py",
    )
    agent.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the coordinator, then its standbys (default: $RECOVER_COORDINATOR)",
    )
    agent.add_argument("--node", default=None, help="this node's name (default: the host name)")
    agent.add_argument(
        "--slots",
        type=int,
        default=None,
        metavar="N",
        help="replicas this node hosts at most (default: its GPUs / --ranks-per-replica, 1 "
        "without GPUs)",
    )
    add_ranks_flag(agent, "")
    add_restart_flags(
        agent,
        "restart a dead replica here after DELAY seconds (default: never; its id is then given "
        "back for another node to host)",
    )
    agent.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="this node's events (metrics.jsonl, with its replicas' events) and fired faults "
        "(default: runs/agent-NODE)",
    )
    agent.add_argument(
        "--fault", action="append", default=[], metavar="SPEC",
        help="inject a fault into this node's replicas (repeatable; `recover train --fault`'s "
        "grammar); it fires once per --out folder",
    )  # fmt: skip
    agent.add_argument(
        "--start-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="give up (status 11) when no coordinator answered in S seconds (default: 60)",
    )
    agent.add_argument(
        "--stop-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM: how long the replicas get to leave at a step boundary (default: 30)",
    )
    agent.add_argument(
        "--relay",
        action="store_true",
        help="relay this node's replicas: they speak to the agent, which holds their sessions, "
        "leases and long-polls and sends the coordinator one beat and one batch of reports per "
        "step for the node (for jobs of thousands of replicas; one --coordinator address only)",
    )
    add_start_flags(agent)
    add_spec_flags(agent, scripts=True)
    agent.add_argument(
        "agent_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the command of every replica process (after --), e.g. python train.py",
    )

    exp = sub.add_parser(
        "export",
        help="write a run's model in another format (a Hugging Face GPT-2 folder)",
        description="Write the run's final model (else its newest checkpoint) as a folder that "
        "transformers.GPT2LMHeadModel.from_pretrained loads, with its tokenizer. Needs the "
        "optional transformers package (pip install 'recover[hf]').",
    )
    exp.add_argument("run", type=Path, metavar="RUN", help="the run folder (--out of train)")
    exp.add_argument("--format", choices=("hf",), default="hf", help="the format (default: hf)")
    exp.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="where (default: RUN/export-hf)"
    )
    smp = sub.add_parser(
        "sample",
        help="generate text from a run's model",
        description="Continue a prompt with the run's final model (else its newest checkpoint).",
    )
    smp.add_argument("run", type=Path, metavar="RUN", help="the run folder (--out of train)")
    smp.add_argument("--prompt", default="", help="the text to continue (default: empty)")
    smp.add_argument(
        "--tokens", type=int, default=200, metavar="N", help="tokens to generate (default: 200)"
    )
    smp.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0: greedy (the likeliest token each time); > 0: sample (default: 0)",
    )
    smp.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="with --temperature: sample among the K likeliest tokens only (default: all)",
    )
    smp.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    smp.add_argument(
        "--tokenizer",
        default=None,
        metavar="byte|FILE",
        help="read the prompt and write the text with this tokenizer (byte, or a "
        "tokenizer.json) instead of the run's: needed for a run on token files adopted with "
        "prepare --from-bin, which have none (default: the run's)",
    )

    cmp = sub.add_parser("compare", help="compare two run folders' trajectories")
    cmp.add_argument("run_a", type=Path, metavar="RUN_A", help="a run folder (--out of train)")
    cmp.add_argument("run_b", type=Path, metavar="RUN_B", help="the run folder to compare it with")
    cmp.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="tolerance for both the loss and the parameter distance (default: 1e-4)",
    )

    status = sub.add_parser(
        "status",
        help="members, epoch, step, shares and throughput of a running local job, by its folder",
        description="Ask the coordinator of the multi-replica run going on in RUN (recover train "
        "--replicas R, or recover run) for its status: it is found from RUN/coordinator.json, its "
        "token read from RUN/coordinator.token (mode 0600; else $RECOVER_TOKEN). Both exist only "
        "while the run goes on. For a coordinator elsewhere: recover coordinator status --addr.",
    )
    status.add_argument("run", type=Path, metavar="RUN", help="the run folder (--out of train)")
    status.add_argument(
        "--decisions",
        type=int,
        default=10,
        metavar="N",
        help="how many of the coordinator's recent decisions (default: 10)",
    )
    status.add_argument("--json", action="store_true", help="print the raw status reply")

    plot = sub.add_parser(
        "plot",
        help="PNGs of runs: loss, committed tokens, step time with failures marked, replicas",
        description="Draw loss against step (runs overlaid), committed tokens against wall time, "
        "step time with the failures, redos and joins marked, and live replicas over time, from "
        "each run folder's metrics.jsonl. Needs matplotlib (pip install 'recover[plot]').",
    )
    plot.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN", help="run folders (--out of train)"
    )
    plot.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="where (default: FIRST_RUN/plots)"
    )

    from recover.coordinator.cli import add_coordinator_parser
    from recover.data.cli import add_prepare_parser
    from recover.tooling.bench import add_bench_parser
    from recover.tooling.simulate.cli import add_simulate_parser

    add_prepare_parser(sub)
    add_coordinator_parser(sub)
    add_bench_parser(sub)
    add_simulate_parser(sub)
    return parser


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_train(args: argparse.Namespace) -> int:
    import os

    from recover.data.corpus import DataError
    from recover.data.prepare import ensure_dataset
    from recover.launch import LaunchConfig, LocalLauncher, check_gpu_placement
    from recover.runtime.env import TOKEN_ENV
    from recover.runtime.faults import check_faults_fit
    from recover.runtime.spec import ReplicaSpec

    # The launcher path stays torch-free: only the replica processes pay for importing torch.
    from recover.training.config import check_layout_fits
    from recover.training.runfolder import RunFolderError, read_dataset_info

    try:
        cfg = _checked_init_from(train_config_from_args(args))
        spec = _checked_dashboards(ReplicaSpec.from_args(args))
        lcfg = LaunchConfig(
            replicas=args.replicas,
            replica=spec,
            faults=parse_faults(args.fault),
            warm_start=not args.cold_start,
            standby=args.standby,
            **supervision(args),
        )
        check_faults_fit(lcfg.faults, steps=cfg.steps, microbatches=cfg.microbatches)
        check_layout_fits(cfg.preset, lcfg.layout.tp, lcfg.layout.pp)
        if cfg.warmup_steps >= cfg.steps:
            print(
                f"warning: --warmup-steps {cfg.warmup_steps} >= --steps {cfg.steps}: the learning "
                f"rate never reaches its peak --lr {cfg.lr:g} in this run",
                file=sys.stderr,
            )
        if args.device == "cuda":  # fail here, not in every replica (torch only for this check)
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device is visible")
        check_gpu_placement(lcfg)
    except ValueError as e:
        return _error(str(e))
    if args.resume and args.out is None:
        return _error("--resume needs --out: the run folder to continue")
    out = args.out or default_out()
    console = None if args.quiet else sys.stdout
    solo = lcfg.replicas == 1 and lcfg.ranks == 1 and not lcfg.faults and lcfg.mode == "recover"
    solo = solo and not lcfg.replica.deterministic  # that sum is the step machine's
    # One replica trains in this process (its lines bare, as a replica's); else this process is
    # the launcher, and its children log with the same level.
    _start_logging(args, "" if solo else "[launcher] ")
    try:
        data = args.data
        if data is None:
            data = ensure_dataset(args.data_root, show_progress=sys.stderr.isatty())
        if solo:
            from recover import exits
            from recover.checkpoint.folders import CheckpointError
            from recover.training.solo import train_single
            from recover.training.trainer import NonFiniteError

            try:
                train_single(
                    cfg, out=out, data_path=data, resume=args.resume, console=console,
                    device=args.device, peak_tflops=lcfg.replica.peak_tflops,
                    tensorboard=lcfg.replica.tensorboard, wandb=lcfg.replica.wandb,
                )  # fmt: skip
            except (CheckpointError, ValueError) as e:
                return _error(str(e))
            except NonFiniteError as e:
                print(f"error: {e}", file=sys.stderr)
                return exits.NONFINITE
            return 0
        info = read_dataset_info(data)
        launcher = LocalLauncher(
            cfg, lcfg, data=Path(data).resolve(), out=out, resume=args.resume,
            data_info=info, console=console, token=os.environ.get(TOKEN_ENV) or None,
        )  # fmt: skip
        return launcher.run()
    except (DataError, RunFolderError) as e:
        return _error(str(e))
    except OSError as e:  # the run folder cannot be written (full, read-only): one line
        if not _is_unwritable(e):
            raise
        return _unwritable(e)


def _checked_init_from(cfg):
    """`cfg` with --init-from made absolute, after a first look that a checkpoint is there (the
    replicas verify it in full as they load it; this keeps the launcher torch-free)."""
    from dataclasses import replace

    if not cfg.init_from:
        return cfg
    path = Path(cfg.init_from).resolve()
    folders = (path, path / "checkpoints")
    if not (path / "recover.json").exists() and not any(
        f.is_dir() and any(f.glob("step_*")) for f in folders
    ):
        raise ValueError(
            f"--init-from {path}: no checkpoint there (a step_N folder, a run folder or its "
            "checkpoints folder)"
        )
    return replace(cfg, init_from=str(path))


def _checked_dashboards(spec):
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


def run_script(args: argparse.Namespace) -> int:
    """`recover run`: the local launcher over a user's command."""
    import os
    from dataclasses import replace

    from recover.launch import LaunchConfig, ScriptLauncher
    from recover.runtime.env import TOKEN_ENV
    from recover.runtime.layout import ReplicaLayout
    from recover.runtime.spec import ReplicaSpec
    from recover.supervisor import check_command_interpreter

    command = list(args.script_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _error("recover run needs a command after --, e.g. recover run -- python train.py")
    try:
        # The launcher only counts a script's ranks: the script builds its own layout.
        spec = _checked_dashboards(ReplicaSpec.from_args(args))
        lcfg = LaunchConfig(
            replicas=args.replicas,
            replica=replace(spec, layout=ReplicaLayout(shard=args.ranks_per_replica)),
            faults=parse_faults(args.fault),
            start_timeout_s=args.start_timeout,
            warm_start=not args.cold_start,
            **supervision(args),
        )
        check_command_interpreter(command, os.environ)  # before any process starts
    except ValueError as e:
        return _error(str(e))
    _start_logging(args, "[launcher] ")
    launcher = ScriptLauncher(
        command,
        lcfg,
        out=args.out or default_out(),
        console=None if args.quiet else sys.stdout,
        token=os.environ.get(TOKEN_ENV) or None,
        job={"job": args.resolved_job, "command": command},
    )
    from recover.training.runfolder import RunFolderError

    try:
        return launcher.run()
    except RunFolderError as e:
        return _error(str(e))
    except OSError as e:  # the run folder cannot be written (full, read-only): one line
        if not _is_unwritable(e):
            raise
        return _unwritable(e)


def run_agent(args: argparse.Namespace) -> int:
    """`recover agent`: one node's agent (recover.agent)."""
    import os
    import socket
    from dataclasses import replace

    from recover.agent import AgentConfig, NodeAgent, _default_slots
    from recover.runtime.env import COORDINATOR_ENV, TOKEN_ENV, parse_address
    from recover.runtime.layout import ReplicaLayout
    from recover.runtime.spec import ReplicaSpec
    from recover.supervisor import check_command_interpreter

    command = list(args.agent_command)
    if command[:1] == ["--"]:
        command = command[1:]
    where = args.coordinator or os.environ.get(COORDINATOR_ENV)
    node = args.node or socket.gethostname()
    try:
        if not where:
            raise ValueError(f"--coordinator HOST:PORT is required (or {COORDINATOR_ENV})")
        coordinators = tuple(parse_address(a.strip(), "--coordinator") for a in where.split(","))
        if args.ranks_per_replica < 1:
            raise ValueError(f"--ranks-per-replica must be >= 1, got {args.ranks_per_replica}")
        spec = _checked_dashboards(ReplicaSpec.from_args(args))
        cfg = AgentConfig(
            coordinators=coordinators,
            command=tuple(command),
            node=node,
            slots=(
                args.slots if args.slots is not None else _default_slots(args.ranks_per_replica)
            ),
            replica=replace(spec, layout=ReplicaLayout(shard=args.ranks_per_replica)),
            respawn_s=args.respawn,
            max_restarts=args.max_restarts,
            out=args.out or Path("runs") / f"agent-{node}",
            faults=parse_faults(args.fault),
            start_timeout_s=args.start_timeout,
            stop_grace_s=args.stop_grace,
            warm_start=not args.cold_start,
            relay=args.relay,
        )
        check_command_interpreter(command, os.environ)
    except ValueError as e:
        return _error(str(e))
    _start_logging(args, f"[agent {node}] ")
    agent = NodeAgent(
        cfg, console=None if args.quiet else sys.stdout, token=os.environ.get(TOKEN_ENV) or None
    )
    try:
        return agent.run()
    except OSError as e:  # its folder cannot be written (full, read-only): one line
        if not _is_unwritable(e):
            raise
        return _unwritable(e)


def _is_unwritable(error: OSError) -> bool:
    import errno

    from recover.record import RecordUnwritable

    unwritable = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    return isinstance(error, RecordUnwritable) or error.errno in unwritable


def _unwritable(error: OSError) -> int:
    """A run folder that cannot be written, said in one line: exits.STORAGE."""
    from recover import exits
    from recover.record import RecordUnwritable

    what = (
        str(error)
        if isinstance(error, RecordUnwritable)
        else (f"cannot write {error.filename}: {error.strerror}" if error.filename else str(error))
    )
    _error(f"{what}: the run stops (free space, or give a writable --out)")
    return exits.STORAGE


def run_export(args: argparse.Namespace) -> int:
    from recover.checkpoint.folders import CheckpointError
    from recover.tooling.export import ExportError, export_hf

    try:
        out = export_hf(args.run, args.out or args.run / "export-hf")
    except (ExportError, CheckpointError) as e:
        return _error(str(e))
    print(f"wrote {out} (load it with transformers.GPT2LMHeadModel.from_pretrained)")
    return 0


def run_sample(args: argparse.Namespace) -> int:
    import torch

    from recover.checkpoint.folders import CheckpointError
    from recover.data import DataError
    from recover.tooling.export import ExportError, sample

    torch.set_num_threads(min(4, torch.get_num_threads()))
    try:
        text = sample(
            args.run, args.prompt, tokens=args.tokens, temperature=args.temperature,
            top_k=args.top_k, seed=args.seed, tokenizer=args.tokenizer,
        )  # fmt: skip
    except (ExportError, CheckpointError, ValueError, DataError) as e:
        return _error(str(e))
    print(text)
    return 0


def run_worker_cli(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace

    from recover import exits
    from recover.addresses import (
        AddressError,
        InterfaceChoice,
        export_for_torch,
        resolve_peer_address,
    )
    from recover.checkpoint.folders import CheckpointError
    from recover.data import DataError
    from recover.runtime.env import (
        TOKEN_ENV,
        RankEnv,
        ReplicaEnv,
        device_index,
        parse_address,
    )
    from recover.runtime.faults import check_faults_fit
    from recover.runtime.spec import ReplicaSpec
    from recover.training.config import TRAIN_CONFIG_ENV, TrainConfig, check_layout_fits
    from recover.training.worker import WorkerConfig, run_worker

    prepared = None
    if args.standby:  # a warm standby: the local launcher's, or a node agent's (by hand)
        try:
            prepared = _stand_by(args)
        except ValueError as e:
            return _error(str(e))
        if prepared is None:  # retired before it was needed: it leaves without a trace
            sys.stdout.flush()
            os._exit(0)
    try:
        if args.launched:  # the launcher's objects, as JSON, not flags parsed again
            env = ReplicaEnv.from_environ(os.environ)
            if TRAIN_CONFIG_ENV not in os.environ:
                raise ValueError(f"--launched but {TRAIN_CONFIG_ENV} is not set")
            cfg = TrainConfig.from_json(os.environ[TRAIN_CONFIG_ENV])
        else:
            from recover.runtime.env import COORDINATOR_ENV

            coordinator = args.coordinator or os.environ.get(COORDINATOR_ENV)
            if coordinator is None or args.replica_id is None:
                raise ValueError(
                    f"--coordinator (or ${COORDINATOR_ENV}) and --replica-id are required"
                )
            if args.replica_id < 0:
                raise ValueError(f"--replica-id must be >= 0, got {args.replica_id}")
            cfg = train_config_from_args(args)
            # HOST:PORT, or with standby coordinators HOST:PORT,HOST:PORT,...
            first, *standbys = [parse_address(a, "--coordinator") for a in coordinator.split(",")]
            env = ReplicaEnv(
                coordinator=first,
                standbys=tuple(standbys),
                replica_id=args.replica_id,
                token=os.environ.get(TOKEN_ENV) or None,
                faults=parse_faults(args.fault),
                spec=ReplicaSpec.from_args(args),
                ranks=RankEnv.from_environ(os.environ),
                device_index=device_index(os.environ),
                interfaces=InterfaceChoice.from_environ(os.environ),
            )
        if args.ifname is not None:  # this host's, so it holds under --launched too
            env = replace(env, interfaces=InterfaceChoice.from_environ({}, args.ifname))
        check_faults_fit(env.faults, steps=cfg.steps, microbatches=cfg.microbatches)
        check_layout_fits(cfg.preset, env.spec.layout.tp, env.spec.layout.pp)
        # Before anything registers: the address every group of this process advertises, one
        # choice, refused when its peers could not dial it (recover.addresses).
        peer = resolve_peer_address(env.coordinator, env.interfaces)
        wcfg = WorkerConfig(
            env=env,
            data=args.data,
            out=args.out,
            resume=args.resume,
            resume_command=_worker_resume_command(args),
            peer=peer,
        )
    except AddressError as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.ADDRESS
    except ValueError as e:
        return _error(str(e))
    # torch's own gloo groups (the replica's own, the checkpoint group) take only its variable.
    export_for_torch(env.interfaces, os.environ)
    from recover.logs import process_prefix, replica_name, setup_logging

    ranks = env.ranks.world_size if env.ranks is not None else 1
    rank = env.ranks.rank if env.ranks is not None else 0
    name = replica_name(env.replica_id, rank, ranks)
    setup_logging(env.spec.log_level, prefix=process_prefix(name, os.environ))
    logging.getLogger("recover.cli").log(
        logging.DEBUG if wcfg.peer.default else logging.INFO,
        "gloo advertises %s: %s",
        ", ".join(wcfg.peer.advertised) or "this host's name",
        wcfg.peer.reason,
    )
    import torch

    torch.set_num_threads(1)  # one core per replica process
    from recover.training.trainer import pick_device

    try:
        pick_device(
            env.spec.device, env.device_index
        )  # a clear error, not a traceback, when no GPU is visible
    except ValueError as e:
        return _error(str(e))
    try:
        code = run_worker(cfg, wcfg, prepared=prepared)
    except (DataError, CheckpointError) as e:
        code = _error(str(e))
    # Everything the replica owns is closed and flushed by now. Skip the interpreter's teardown:
    # destroying gloo process groups joins their I/O threads, which takes seconds at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stand_by(args: argparse.Namespace):
    """A standby: build the replica (torch, dataset, model and optimizer) with the job's spec,
    then wait, unregistered and writing nothing, for one line on stdin: the JSON object of the
    variables that make it a replica (RECOVER_REPLICA_ID, and from the local launcher its faults
    and device too), which are added to its environment. Started by hand (no --launched), the job
    comes from its flags and the line's RECOVER_REPLICA_ID becomes --replica-id. Returns the
    prepared replica, or None at end of input (retired, or its launcher is gone)."""
    import json
    import os

    import torch

    from recover.runtime.env import REPLICA_ENV, device_index, spec_from_environ
    from recover.runtime.spec import ReplicaSpec
    from recover.training.config import TRAIN_CONFIG_ENV, TrainConfig
    from recover.training.worker import prepare_replica

    if args.replica_id is not None:
        raise ValueError("--standby waits for its replica id on stdin: drop --replica-id")
    if args.launched:
        cfg = TrainConfig.from_json(os.environ[TRAIN_CONFIG_ENV])
        spec = spec_from_environ(os.environ)
    else:
        cfg, spec = train_config_from_args(args), ReplicaSpec.from_args(args)
    torch.set_num_threads(1)  # one core per replica process
    prepared = prepare_replica(
        cfg, data=args.data, spec=spec, device_index=device_index(os.environ)
    )
    line = sys.stdin.readline()
    if not line.strip():
        return None
    try:
        promotion = json.loads(line)
        rid = str(promotion[REPLICA_ENV])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"--standby: the line on stdin must be a JSON object with {REPLICA_ENV}, e.g. "
            f'{{"{REPLICA_ENV}": "1"}}; got {line.strip()[:80]!r}'
        ) from None
    if not rid.isdigit():
        raise ValueError(f"--standby: {REPLICA_ENV} must be an int >= 0, got {rid!r}")
    os.environ.update({str(k): str(v) for k, v in promotion.items()})
    if not args.launched:
        args.replica_id = int(rid)
    return prepared


def _worker_resume_command(args: argparse.Namespace) -> str:
    """What continues a worker's job after it stopped early: under a local launcher, the run's
    own resume command; started by hand, this very command with --resume."""
    import shlex

    if args.launched:
        from recover.launch import train_resume_command

        return train_resume_command(args.out)
    words = ["recover", *getattr(args, "argv", ["worker", "..."])]
    return shlex.join(words if "--resume" in words else [*words, "--resume"])


def run_status(args: argparse.Namespace) -> int:
    """`recover status RUN`: the coordinator of the run going on in RUN, found from the folder."""
    import json
    import os

    from recover.coordinator.cli import format_status
    from recover.coordinator.client import CoordinatorUnreachable, request_once
    from recover.launch import COORDINATOR_FILE, TOKEN_FILE
    from recover.runtime.env import TOKEN_ENV

    address, token_file = args.run / COORDINATOR_FILE, args.run / TOKEN_FILE
    if not address.exists():
        return _error(
            f"{address} does not exist: no multi-replica run is going on in {args.run} (the file "
            "lives as long as its coordinator; a one-replica run has none)"
        )
    try:
        info = json.loads(address.read_text())
        token = token_file.read_text().strip() if token_file.exists() else None
    except (OSError, ValueError) as e:
        return _error(f"cannot read {address} or {token_file}: {e}")
    token = token or os.environ.get(TOKEN_ENV) or None
    try:
        reply = request_once(info["host"], int(info["port"]), {"kind": "status"}, token=token)
    except CoordinatorUnreachable as e:
        return _error(f"the coordinator of {args.run} (pid {info.get('pid')}) does not answer: {e}")
    if not reply.get("ok"):
        return _error(f"refused ({reply.get('code')}): {reply.get('reason')}")
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    per_microbatch = None
    try:  # tokens per microbatch, from the run's config, for throughput in tokens/s
        train = json.loads((args.run / "config.json").read_text())["train"]
        per_microbatch = int(train["microbatch_size"]) * int(train["seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"run {args.run} | coordinator {info['host']}:{info['port']} (pid {info.get('pid')})")
    print(format_status(reply, args.decisions, tokens_per_microbatch=per_microbatch))
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from recover.tooling.compare import compare_runs, format_comparison

    if args.rtol < 0:
        return _error(f"--rtol must be >= 0, got {args.rtol}")
    try:
        result = compare_runs(args.run_a, args.run_b)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    print(format_comparison(result, args.rtol, args.run_a, args.run_b))
    return 0 if result.passes(args.rtol) else 1


# command -> (module, function): handlers are imported on use, so `recover train` never pays
# for the simulator's imports and the launcher path stays torch-free.
HANDLERS = {
    "train": ("recover.cli", "run_train"),
    "compare": ("recover.cli", "run_compare"),
    "plot": ("recover.tooling.plot", "run_plot"),
    "status": ("recover.cli", "run_status"),
    "run": ("recover.cli", "run_script"),
    "agent": ("recover.cli", "run_agent"),
    "export": ("recover.cli", "run_export"),
    "sample": ("recover.cli", "run_sample"),
    "worker": ("recover.cli", "run_worker_cli"),
    "coordinator": ("recover.coordinator.cli", "run_coordinator_cli"),
    "simulate": ("recover.tooling.simulate.cli", "run_simulate"),
    "bench": ("recover.tooling.bench", "run_bench"),
    "prepare": ("recover.data.cli", "run_prepare"),
}


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The parser of the (sub)command `args` came from, and its words: ("coordinator", "serve")."""
    words: list[str] = []
    while True:
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not sub or getattr(args, sub[0].dest, None) is None:
            return parser, tuple(words)
        words.append(getattr(args, sub[0].dest))
        parser = sub[0].choices[words[-1]]


# commands that take a job file (--config); their parsed args carry the resolved job
JOB_COMMANDS = (("train",), ("run",), ("coordinator", "serve"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a job file's values (`--config`) as the defaults of its flags:
    the flags given override the file; `args.resolved_job` is the job both describe, as a job
    file's tables. ValueError for a bad job file."""
    from recover.jobconfig import (
        COORDINATOR_SECTIONS,
        SECTIONS,
        job_defaults,
        read_job_file,
        resolved_job,
    )

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (what resumes it, said on a stop)
    command, words = _command_parser(parser, args)
    if words not in JOB_COMMANDS:
        return args
    sections = COORDINATOR_SECTIONS if words == ("coordinator", "serve") else SECTIONS
    if args.config is not None:
        tables = read_job_file(Path(args.config))
        command.set_defaults(
            **job_defaults(command, tables, source=str(args.config), sections=sections)
        )
        args = parser.parse_args(argv)
    args.resolved_job = resolved_job(command, args, sections)
    return args


def _start_logging(args: argparse.Namespace, prefix: str) -> None:
    """This process's terminal lines at --log-level, and the resolved job among them (debug)."""
    import json

    from recover.logs import setup_logging

    setup_logging(args.log_level, prefix=prefix)
    job = getattr(args, "resolved_job", None)  # (parse_args; absent for a hand-built Namespace)
    logging.getLogger("recover.cli").debug("job: %s", json.dumps(job, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    from importlib import import_module

    try:
        args = parse_args(argv)
    except ValueError as e:  # a bad job file
        return _error(str(e))
    if args.command in ("worker", "coordinator"):
        from recover.runtime.env import die_with_launcher

        die_with_launcher()
    module, function = HANDLERS[args.command]
    return getattr(import_module(module), function)(args)


if __name__ == "__main__":
    sys.exit(main())
