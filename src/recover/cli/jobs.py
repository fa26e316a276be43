"""`recover run` and `recover agent`: any training script as fault-tolerant replicas.

Job: their parsers, and their entry points: `run_script` (a coordinator and R local replicas of
the user's command, supervised) and `run_agent` (one node agent of a job across machines, started
by the user's scheduler: docs/multinode.md).

What it must not do: supervise (recover.launch, recover.agent) or know the script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recover.cli.flags import (
    add_ranks_flag,
    add_restart_flags,
    add_start_flags,
    add_supervision_flags,
    checked_dashboards,
    default_out,
    is_unwritable,
    parse_faults,
    preloads,
    start_logging,
    storage_error,
    supervision,
    usage_error,
)


def add_job_parsers(sub) -> None:
    """The parsers of `run` and `agent`."""
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


def run_script(args: argparse.Namespace) -> int:
    """`recover run`: the local launcher over a user's command."""
    import os
    from dataclasses import replace

    from recover.launch import LaunchConfig, ScriptLauncher, check_gpu_placement
    from recover.runtime.env import TOKEN_ENV
    from recover.runtime.layout import ReplicaLayout
    from recover.runtime.spec import ReplicaSpec
    from recover.supervisor import check_command_interpreter

    command = list(args.script_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return usage_error(
            "recover run needs a command after --, e.g. recover run -- python train.py"
        )
    try:
        # The launcher only counts a script's ranks: the script builds its own layout.
        spec = checked_dashboards(ReplicaSpec.from_args(args))
        lcfg = LaunchConfig(
            replicas=args.replicas,
            replica=replace(spec, layout=ReplicaLayout(shard=args.ranks_per_replica)),
            faults=parse_faults(args.fault),
            start_timeout_s=args.start_timeout,
            warm_start=not args.cold_start,
            preload=preloads(args),
            **supervision(args),
        )
        if spec.cross_reduce == "nccl":  # a GPU per process here (a script checks its own too)
            check_gpu_placement(lcfg)
        check_command_interpreter(command, os.environ)  # before any process starts
    except ValueError as e:
        return usage_error(str(e))
    start_logging(args, "[launcher] ")
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
        return usage_error(str(e))
    except OSError as e:  # the run folder cannot be written (full, read-only): one line
        if not is_unwritable(e):
            raise
        return storage_error(e)


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
        spec = checked_dashboards(ReplicaSpec.from_args(args))
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
            preload=preloads(args),
            relay=args.relay,
        )
        check_command_interpreter(command, os.environ)
    except ValueError as e:
        return usage_error(str(e))
    start_logging(args, f"[agent {node}] ")
    agent = NodeAgent(
        cfg, console=None if args.quiet else sys.stdout, token=os.environ.get(TOKEN_ENV) or None
    )
    try:
        return agent.run()
    except OSError as e:  # its folder cannot be written (full, read-only): one line
        if not is_unwritable(e):
            raise
        return storage_error(e)
