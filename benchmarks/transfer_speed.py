"""State transfer to a joiner: three generations of the transfer and the raw ceiling, side by side.

Three processes build one epoch group over a TCPStore (as a new epoch with one joiner does): ranks
0 and 1 hold the committed state of a preset's model with its AdamW moments (the same state), rank
2 joins. Each path moves the state to rank 2:
- packed: rank 0 packs every tensor into one flat uint8 buffer (torch.cat) and broadcasts it, and
  the joiner clones each tensor's bytes out of it (the transfer of commit 19bfd45 and earlier);
- broadcast: rank 0 broadcasts every tensor from where it lies, received straight into a fresh
  buffer of its own, all in flight together (commit d8e0717); a broadcast reaches rank 1 too;
- p2p-1: `recover.runtime.transfer.transfer_state` over a group of ranks 0 and 2 only (one
  source, point to point, into fresh buffers);
- p2p-2: `transfer_state` over the group of all three (two sources, half of the state each);
- raw-1, raw-2: the ceiling: gloo point-to-point sends of as many bytes as p2p moves, as one flat
  buffer from rank 0 (raw-1) or a half from each of ranks 0 and 1 (raw-2), into a fresh buffer;
  raw-2-touched: into a buffer the joiner wrote before.
A barrier starts each path; the figure is the joiner's seconds from it to its state (received,
not yet loaded into a model); MB/s over the state dict's bytes. The paths take turns, each
repeat in a rotated order, and the medians are printed with the ratios; the load average is
recorded at every repeat. `--out` writes the figures as JSON.

    python benchmarks/transfer_speed.py [--preset gpt2-124m] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PATHS = (
    "packed", "broadcast", "p2p-1", "p2p-2", "raw-1", "raw-2", "raw-2-touched",
)  # fmt: skip


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


def _state_parts(work) -> tuple[str, list[torch.Tensor]]:
    """The state dict's header and tensors' bytes as d8e0717 and earlier described them (a
    tensor the state dict holds twice, the tied embedding, twice)."""
    from recover.runtime.transfer import _flatten

    tensors: list[torch.Tensor] = []
    structure = _flatten(work.transfer_state_dict(), tensors)
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return json.dumps({"structure": structure, "sizes": [p.numel() for p in parts]}), parts


def _packed(group, work, rank: int, abort) -> None:
    """19bfd45 and earlier: one packed buffer, broadcast, then cloned apart on the joiner."""
    if rank == 0:
        header, parts = _state_parts(work)
        flat = torch.cat(parts)
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


def _broadcast(group, work, rank: int, abort) -> None:
    """d8e0717: every tensor broadcast from where it lies into its own buffer, all in flight."""
    from recover.runtime.transfer import _unflatten

    header, parts = _state_parts(work) if rank == 0 else ("", [])
    size = torch.tensor([len(header.encode())], dtype=torch.int64)
    group.broadcast(size, src=0, should_abort=abort)
    raw = torch.empty(int(size[0]), dtype=torch.uint8)
    if rank == 0:
        raw.copy_(torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8))
    group.broadcast(raw, src=0, should_abort=abort)
    meta = json.loads(bytes(raw.numpy()).decode())
    if rank != 0:
        parts = [torch.empty(n, dtype=torch.uint8) for n in meta["sizes"]]
    group.broadcast_many(parts, src=0, should_abort=abort)
    if rank == 2:
        work.load_transfer_state(_unflatten(meta["structure"], parts))


def _raw(group, rank: int, sources: int, buffers: dict, abort) -> None:
    """The ceiling: one flat buffer per source, gloo send/recv, into `buffers["into"]`."""
    if rank == 2:
        into, bounds = buffers["into"], buffers["bounds"][sources]
        recvs = [(into[bounds[s] : bounds[s + 1]], s) for s in range(sources)]
        group.send_recv([], recvs, should_abort=abort)
    elif rank < sources:
        group.send_recv([(buffers[sources], group.world_size - 1)], [], should_abort=abort)


def _rank(rank: int, port: int, preset: str, repeats: int, out) -> None:
    from recover.runtime.collective import EpochGroup
    from recover.runtime.collective_config import CollectiveConfig
    from recover.runtime.transfer import describe_state, transfer_state

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0)
    work = _Work(preset)
    state_bytes = sum(p.numel() for p in _state_parts(work)[1])
    unique_bytes = sum(p.numel() for p in describe_state(work, torch.device("cpu"))[1])
    config = CollectiveConfig(build_timeout_s=60, op_deadline_s=600, pg_timeout_s=1200)
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    loads: list[float] = []
    epoch = 0
    for i in range(repeats):
        loads.append(os.getloadavg()[0])
        order = PATHS[i % len(PATHS) :] + PATHS[: i % len(PATHS)]
        for path in order:
            epoch += 1
            members = [0, 2] if path.endswith("-1") else [0, 1, 2]
            if rank not in members:
                continue
            me = members.index(rank)
            group = EpochGroup.build(
                store, epoch=epoch, rank=me, world_size=len(members), config=config
            )
            buffers: dict = {}
            if path.startswith("raw"):  # what is there before a transfer starts
                bounds = {1: [0, unique_bytes], 2: [0, unique_bytes // 2, unique_bytes]}
                buffers["bounds"] = bounds
                if rank == 2:
                    buffers["into"] = torch.empty(unique_bytes, dtype=torch.uint8)
                    if path.endswith("touched"):
                        buffers["into"].fill_(0)
                elif rank < int(path[4]):
                    sources = int(path[4])
                    n = bounds[sources][rank + 1] - bounds[sources][rank]
                    buffers[sources] = torch.ones(n, dtype=torch.uint8)
            group.allreduce_sum(torch.zeros(1), should_abort=lambda: None)  # start together
            t0 = time.perf_counter()
            if path == "packed":
                _packed(group, work, rank, lambda: None)
            elif path == "broadcast":
                _broadcast(group, work, rank, lambda: None)
            elif path.startswith("p2p"):
                transfer_state(
                    group, work, members=members, joined=[2], me=rank, should_abort=lambda: None
                )
            else:
                _raw(group, rank, int(path[4]), buffers, lambda: None)
            times[path].append(time.perf_counter() - t0)
            work.loaded = None
            del buffers
            group.abandon()
    if rank == 2:
        out.put({"state_bytes": state_bytes, "unique_bytes": unique_bytes, "times": times,
                 "load": loads})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load_before = os.getloadavg()
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
    load_after = os.getloadavg()
    medians = {path: statistics.median(t) for path, t in r["times"].items()}
    mb = r["state_bytes"] / 1e6
    print(f"{args.preset}: {r['state_bytes'] / 2**20:.1f} MiB of state dict "
          f"({r['unique_bytes'] / 2**20:.1f} MiB with the tied embedding once) to a joiner, "
          f"3 ranks, gloo on loopback, median of {args.repeats}; load average "
          f"{min(r['load']):.1f}-{max(r['load']):.1f}")  # fmt: skip
    for path in PATHS:
        print(f"  {path:10} {medians[path]:6.2f} s  {mb / medians[path]:7.0f} MB/s")
    pairs = [("p2p-2", "broadcast"), ("p2p-2", "packed"), ("p2p-2", "p2p-1"),
             ("p2p-2", "raw-2")]  # fmt: skip
    for new, old in pairs:
        print(f"  {new}/{old}: {medians[new] / medians[old]:.2f}x the time")
    if args.out:
        result = {
            "benchmark": "transfer_speed",
            "method": __doc__.split("\n\n")[1].replace("\n", " "),
            "machine": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            "preset": args.preset,
            "repeats": args.repeats,
            "state_bytes": r["state_bytes"],
            "unique_bytes": r["unique_bytes"],
            "load_average_per_repeat": r["load"],
            "load_average_before": load_before,
            "load_average_after": load_after,
            "seconds": r["times"],
            "median_s": medians,
            "mb_per_s_over_state_dict": {p: mb / m for p, m in medians.items()},
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
