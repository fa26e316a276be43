"""A script for the tests: a small MLP whose replica may be split by tensor parallelism (the script
applies it over the replica's mesh), trained through recover.Replica on pure synthetic data.

    recover run --replicas 2 --ranks-per-replica 2 -- python tests/scripts/tp_mlp.py --tp 2 --out DIR
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import recover

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--out", type=Path, required=True)
args = p.parse_args()
M = 6

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
replica = recover.Replica(microbatches=M, tp=args.tp, check_every=3)
if args.tp > 1:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, replica.mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
replica.attach(model, optimizer)


def batch(step, j):  # pure in (step, j)
    g = torch.Generator().manual_seed(1000 * step + j)
    x = torch.randn(4, 8, generator=g)
    return x, x.flip(-1)


for step in replica.steps(args.steps):
    for j in replica.microbatches():
        x, y = batch(step, j)
        replica.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    if replica.is_writer:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "losses.jsonl", "a") as f:
            record = {"step": step, "loss": replica.loss, "microbatches": replica.committed_microbatches}  # fmt: skip
            f.write(json.dumps(record) + "\n")
full = {
    k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()
}
if replica.is_writer:
    torch.save(full, args.out / "final.pt")
