"""The gradient copies of one attempt, before and after "one buffer per attempt" (side by side).

Before: the snapshot (a flat copy of p.grad), a second copy of it as the reduce buffer
(`snapshot.to(device, copy=True)`, also on CPU), and at the commit a per-parameter copy of the
reduced buffer into p.grad. After: the snapshot is made where the group reduces and is reduced in
place, and at the commit every p.grad is a view of it (recover.runtime.grads.GradientSum).

Each path runs in its own process (peak RSS is per process), `--repeats` times, on the gradients
of a preset's model (default gpt2-124m), alternating the two; it prints the median time of the
copies per attempt and the peak RSS above the model's own, and the ratios. No reduce runs (one
process): what differs between the two paths is the copies alone.

    python benchmarks/gradient_buffers.py [--preset gpt2-124m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _one(path: str, preset: str) -> dict:
    import torch

    from recover.runtime.grads import GradientSum
    from recover.training.model import GPT, build_config

    torch.set_num_threads(1)
    model = GPT(build_config(preset, vocab_size=50257, block_size=1024))  # GPT-2 shapes
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = GradientSum(model.parameters(), device="cpu")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if path == "before":
        snapshot = grads.snapshot()
        buffer = snapshot.to("cpu", copy=True)  # what the step machine reduced
        offset = 0
        for p in grads.params:
            n = p.numel()
            g = buffer[offset : offset + n].view_as(p).to(p.dtype, copy=True)
            g.div_(8)
            p.grad = g
            offset += n
    else:
        buffer = grads.snapshot("cpu")
        grads.load(buffer, divide_by=8)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "extra_mib": (peak - base) / 1024, "values": grads.numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", choices=("before", "after"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.preset)))
        return
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for path in runs:
            out = subprocess.run(
                [sys.executable, __file__, "--one", path, "--preset", args.preset],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            runs[path].append(json.loads(out))
    med = {
        path: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "extra_mib")}
        for path, rs in runs.items()
    }
    values = runs["after"][0]["values"]
    print(f"{args.preset}: {values:,} gradient values ({values * 4 / 2**20:.0f} MiB fp32), "
          f"median of {args.repeats} runs each")  # fmt: skip
    for path, m in med.items():
        print(
            f"  {path:6}  copies {m['seconds'] * 1e3:7.1f} ms   peak RSS +{m['extra_mib']:7.0f} MiB"
        )
    print(f"  after/before: time {med['after']['seconds'] / med['before']['seconds']:.2f}x, "
          f"memory {med['after']['extra_mib'] / med['before']['extra_mib']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
