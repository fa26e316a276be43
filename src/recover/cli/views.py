"""The commands that look at runs: `export`, `sample`, `compare`, `status` and `plot`'s parser.

Job: their parsers, and the entry points of export (a Hugging Face folder), sample (text from a
run's model), compare (two runs' trajectories) and status (a live run's coordinator, found from its
folder); `recover plot` runs in recover.tooling.plot.

What it must not do: train, or write into a run folder other than export's output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recover.cli.flags import usage_error


def add_view_parsers(sub) -> None:
    """The parsers of `export`, `sample`, `compare`, `status` and `plot`."""
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
    exp.add_argument(
        "--tokenizer",
        default=None,
        metavar="byte|FILE",
        help="write this tokenizer (byte, or a tokenizer.json) with the model instead of the "
        "run's: a run on token files adopted with prepare --from-bin has none of its own "
        "(default: the run's)",
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


def run_export(args: argparse.Namespace) -> int:
    from recover.checkpoint.folders import CheckpointError
    from recover.tooling.export import ExportError, export_hf

    try:
        out = export_hf(args.run, args.out or args.run / "export-hf", tokenizer=args.tokenizer)
    except (ExportError, CheckpointError) as e:
        return usage_error(str(e))
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
        return usage_error(str(e))
    print(text)
    return 0


def run_status(args: argparse.Namespace) -> int:
    """`recover status RUN`: the coordinator of the run going on in RUN, found from the folder."""
    import json
    import os

    from recover.coordinator.channel import request_once
    from recover.coordinator.cli import format_status
    from recover.coordinator.outcomes import CoordinatorUnreachable
    from recover.launch import COORDINATOR_FILE, TOKEN_FILE
    from recover.runtime.env import TOKEN_ENV

    address, token_file = args.run / COORDINATOR_FILE, args.run / TOKEN_FILE
    if not address.exists():
        return usage_error(
            f"{address} does not exist: no multi-replica run is going on in {args.run} (the file "
            "lives as long as its coordinator; a one-replica run has none)"
        )
    try:
        info = json.loads(address.read_text())
        token = token_file.read_text().strip() if token_file.exists() else None
    except (OSError, ValueError) as e:
        return usage_error(f"cannot read {address} or {token_file}: {e}")
    token = token or os.environ.get(TOKEN_ENV) or None
    try:
        reply = request_once(info["host"], int(info["port"]), {"kind": "status"}, token=token)
    except CoordinatorUnreachable as e:
        return usage_error(
            f"the coordinator of {args.run} (pid {info.get('pid')}) does not answer: {e}"
        )
    if not reply.get("ok"):
        return usage_error(f"refused ({reply.get('code')}): {reply.get('reason')}")
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
        return usage_error(f"--rtol must be >= 0, got {args.rtol}")
    try:
        result = compare_runs(args.run_a, args.run_b)
    except (FileNotFoundError, ValueError) as e:
        return usage_error(str(e))
    print(format_comparison(result, args.rtol, args.run_a, args.run_b))
    return 0 if result.passes(args.rtol) else 1
