"""The cost of torch's deterministic kernels on one microbatch (what --deterministic switches on).

One process, one intra-op thread (as recover's workers run): forward and backward of one
microbatch of a preset's GPT, with `torch.use_deterministic_algorithms` on and off, interleaved
(which one first alternates), `--repeats` of each; prints the medians and their ratio, and writes
them as JSON with `--json`.

    python benchmarks/determinism_switches.py [--preset small] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from recover.training.model import GPT, build_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(build_config(args.preset, vocab_size=256, block_size=args.seq_len, dropout=0.0))
    x = torch.randint(0, 256, (args.batch, args.seq_len))
    y = torch.randint(0, 256, (args.batch, args.seq_len))

    def microbatch() -> float:
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up
        microbatch()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.repeats):
        for on in (True, False) if i % 2 == 0 else (False, True):
            torch.use_deterministic_algorithms(on)
            times[on].append(microbatch())
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{args.preset}, {args.batch}x{args.seq_len}, forward+backward: deterministic kernels "
        f"{on * 1000:.1f} ms, default {off * 1000:.1f} ms, ratio {on / off:.3f} "
        f"(medians of {args.repeats} interleaved)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "on_s": times[True], "off_s": times[False],
                       "ratio": on / off}, f)  # fmt: skip


if __name__ == "__main__":
    main()
