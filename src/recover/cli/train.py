"""`recover train` and `recover worker`: the built-in GPT trainer's commands.

Job: their parsers, and their entry points: `run_train` (one replica in this process, or R local
replicas under the launcher, on the built-in corpus or a prepared dataset) and `run_worker_cli`
(one replica process of a job: launched by the local launcher or a node agent, started by hand or
torchrun on another machine, or a warm standby waiting for the id it will take).

What it must not do: hold the trainer's logic (recover.training) or supervise (recover.launch).

Size: two commands whose entry points share their checks and their ways out (a bad flag, an
address refused, an unwritable run folder); the worker's includes the warm standby's wait.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from recover.cli.flags import (
    DEFAULT_DATA_ROOT,
    add_replica_flags,
    add_supervision_flags,
    add_train_config_flags,
    checked_dashboards,
    default_out,
    is_unwritable,
    parse_faults,
    start_logging,
    storage_error,
    supervision,
    train_config_from_args,
    usage_error,
)


def add_train_parsers(sub) -> None:
    """The parsers of `train` and `worker`."""
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


def run_train(args: argparse.Namespace) -> int:
    import os

    from recover.data.corpus import DataError
    from recover.data.prepare import ensure_dataset
    from recover.launch import LaunchConfig, LocalLauncher, check_gpu_placement
    from recover.runtime.env import TOKEN_ENV
    from recover.runtime.faults import check_faults_fit
    from recover.runtime.spec import ReplicaSpec

    # The launcher path stays torch-free: only the replica processes pay for importing torch.
    from recover.training.config import RunPaths, check_layout_fits
    from recover.training.runfolder import RunFolderError, check_run_folder, read_dataset_info

    try:
        cfg = _checked_init_from(train_config_from_args(args))
        spec = checked_dashboards(ReplicaSpec.from_args(args))
        lcfg = LaunchConfig(
            replicas=args.replicas,
            replica=spec,
            faults=parse_faults(args.fault),
            warm_start=not args.cold_start,
            standby=args.standby,
            **supervision(args),
        )
        check_faults_fit(
            lcfg.faults, steps=cfg.steps, microbatches=cfg.microbatches, ahead=spec.why_not_ahead()
        )
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
        return usage_error(str(e))
    if args.resume and args.out is None:
        return usage_error("--resume needs --out: the run folder to continue")
    out = args.out or default_out()
    console = None if args.quiet else sys.stdout
    solo = lcfg.replicas == 1 and lcfg.ranks == 1 and not lcfg.faults and lcfg.mode == "recover"
    solo = solo and not lcfg.replica.deterministic  # that sum is the step machine's
    # One replica trains in this process (its lines bare, as a replica's); else this process is
    # the launcher, and its children log with the same level.
    start_logging(args, "" if solo else "[launcher] ")
    try:
        data = args.data
        if data is None:
            data = ensure_dataset(args.data_root, show_progress=sys.stderr.isatty())
        if solo:
            # The run folder's refusals before torch is imported (seconds, for a one-line error).
            paths = RunPaths(out=out)
            check_run_folder(paths, cfg, data_info=read_dataset_info(data), resume=args.resume)
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
                return usage_error(str(e))
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
        return usage_error(str(e))
    except OSError as e:  # the run folder cannot be written (full, read-only): one line
        if not is_unwritable(e):
            raise
        return storage_error(e)


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
            return usage_error(str(e))
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
        check_faults_fit(
            env.faults, steps=cfg.steps, microbatches=cfg.microbatches,
            ahead=env.spec.why_not_ahead(),
        )  # fmt: skip
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
        return usage_error(str(e))
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
        return usage_error(str(e))
    try:
        code = run_worker(cfg, wcfg, prepared=prepared)
    except (DataError, CheckpointError) as e:
        code = usage_error(str(e))
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
