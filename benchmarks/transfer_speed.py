"""State transfer to a joiner, before and after sending tensors without packing (side by side).

Three processes build one epoch group over a TCPStore (as a new epoch with one joiner does): rank
0 holds the committed state of a preset's model with its AdamW moments, rank 1 holds it too, rank
2 joins. Each path moves the state from rank 0 to the others:
- before: pack every tensor into one flat uint8 buffer (torch.cat), broadcast it, and the joiner
  clones each tensor's bytes out of it (the transfer of commit 19bfd45 and earlier);
- after: `recover.runtime.transfer.transfer_state` (each tensor sent from where it lies, received
  straight into its own buffer).
The figure is the joiner's seconds from the start to its loaded state, and MB/s over the state's
bytes; the two paths alternate, `--repeats` times, and the medians are printed with the ratio.

    python benchmarks/transfer_speed.py [--preset gpt2-124m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class _Work:
    def __init__(self, preset: str) -> None:
        from recover.training.model import GPT, build_config

        torch.manual_seed(0)
        self.model = GPT(build_config(preset, vocab_size=50257, block_size=1024))
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()  # the moments exist, as in a committed state
        self.loaded = None

    def transfer_state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_transfer_state(self, state: dict) -> None:
        self.loaded = state


def _packed(group, work, rank: int, abort) -> int:
    """The earlier path: one packed buffer, broadcast, then cloned apart on the joiner."""
    from recover.runtime.transfer import _flatten

    if rank == 0:
        tensors: list[torch.Tensor] = []
        structure = _flatten(work.transfer_state_dict(), tensors)
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        flat = torch.cat(parts)
        header = json.dumps({"structure": structure, "sizes": [p.numel() for p in parts]})
        raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        sizes = torch.tensor([raw.numel(), flat.numel()], dtype=torch.int64)
    else:
        sizes = torch.zeros(2, dtype=torch.int64)
    group.broadcast(sizes, src=0, should_abort=abort)
    if rank != 0:
        raw = torch.empty(int(sizes[0]), dtype=torch.uint8)
        flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
    group.broadcast(raw, src=0, should_abort=abort)
    group.broadcast(flat, src=0, should_abort=abort)
    if rank == 2:
        meta = json.loads(bytes(raw.numpy()).decode())
        offsets = [0]
        for n in meta["sizes"]:
            offsets.append(offsets[-1] + n)
        pieces = [flat[offsets[i] : offsets[i + 1]].clone() for i in range(len(meta["sizes"]))]
        work.load_transfer_state(pieces)
    return int(sizes[1])


def _rank(rank: int, port: int, preset: str, repeats: int, out) -> None:
    from recover.runtime.collective import CollectiveConfig, EpochGroup
    from recover.runtime.transfer import transfer_state

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0)
    work = _Work(preset)
    config = CollectiveConfig(build_timeout_s=60, op_deadline_s=600, pg_timeout_s=1200)
    times: dict[str, list[float]] = {"before": [], "after": []}
    nbytes = 0
    for i in range(repeats):
        for path in ("before", "after"):
            epoch = 2 * i + (path == "after") + 1
            group = EpochGroup.build(store, epoch=epoch, rank=rank, world_size=3, config=config)
            t0 = time.perf_counter()
            if path == "before":
                nbytes = _packed(group, work, rank, lambda: None)
            else:
                transfer_state(
                    group, work, members=[0, 1, 2], joined=[2], me=rank, should_abort=lambda: None
                )
            times[path].append(time.perf_counter() - t0)
            group.abandon()
    if rank == 2:
        out.put({"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_rank, args=(r, port, args.preset, args.repeats, out)) for r in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: {[p.exitcode for p in procs]}")
    r = out.get()
    mb = r["bytes"] / 1e6
    print(f"{args.preset}: {r['bytes'] / 2**20:.0f} MiB of state to a joiner (3 ranks, gloo, "
          f"median of {args.repeats})")  # fmt: skip
    for path in ("before", "after"):
        print(f"  {path:6} {r[path]:6.2f} s  {mb / r[path]:7.0f} MB/s")
    print(f"  after/before: {r['after'] / r['before']:.2f}x the time")


if __name__ == "__main__":
    main()
