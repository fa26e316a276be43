"""The script of train_custom.py without ReCoVer: plain DDP with gradient accumulation (no_sync),
started by torchrun. The two loops side by side are in docs/api.md; `recover bench script` times
them against each other. A failure here ends the job: torchrun restarts every process.

    torchrun --standalone --nproc-per-node 3 examples/train_ddp.py --data data/custom.bin
"""

import contextlib
import gc
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from train_custom import build, optimizer_for, parse_args, seed_dropout


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, model = build(args)
    ddp = DistributedDataParallel(model)
    optimizer, scheduler = optimizer_for(model, args)
    mine = list(range(rank, args.microbatches, world))  # this rank's share of every step
    args.out.mkdir(parents=True, exist_ok=True)
    for step in range(args.steps):
        for k, j in enumerate(mine):
            x, y = data.batch(step, j)
            seed_dropout(args, step, j)
            last = k == len(mine) - 1  # DDP all-reduces (and averages over ranks) on the last
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(x)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                (loss / len(mine)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if rank == 0:
            record = {"step": step, "local_loss": float(loss.detach()), "time": time.time()}
            with open(args.out / "losses.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
    # DDP's reducer holds the process group: drop it first, so that the group's last reference
    # goes with destroy_process_group, which frees it with the GIL released. Freed by the
    # reducer instead, the group's destructor joins its worker threads holding the GIL, and a
    # worker that needs the GIL to free its last op hangs the exit (1 run in 3 on 2 cores).
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
