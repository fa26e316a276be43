"""Your own model cut into pipeline stages, each stage sharded by FSDP2 and split by tensor
parallelism, inside every replica (3-D), made fault-tolerant by ReCoVer.

A small GPT-style transformer written with plain PyTorch modules. With `--pp P --shard S --tp T`
each replica is P x S x T ranks (`recover run --ranks-per-replica P*S*T`): the script cuts the
model into P stages as torch's pipelining recipe does (build the whole model, keep this stage's
layers, so every parameter keeps its whole-model name), splits each block over the tp ranks
(`parallelize_module`), shards each stage over the shard ranks (`fully_shard`), and runs each
step's share through a `torch.distributed.pipelining` schedule (`--schedule gpipe|1f1b`).
ReCoVer hands the share over at once (`replica.pipeline()`), recomputes the ids a failure lost
in the same step, and sums each rank's gradient part across replicas. With one rank per replica
(the default) the same model trains with the per-id loop (`replica.microbatches()`): that run is
the trajectory every layout and every failure must reproduce.

    python examples/train_custom.py --make-data data/custom.bin      # once: a token file
    recover run --replicas 2 --ranks-per-replica 2 --fault kill:replica=1,rank=1,step=3,phase=backward \\
        -- python examples/train_pipeline.py --pp 2 --data data/custom.bin --out runs/pipeline

Dropout is seeded per (step, microbatch, layer) in each block (`replica.microbatch_id` names the
microbatch whose forward runs, also inside a schedule), so it does not depend on where the
stages are cut or which rank runs them.
"""

import argparse
import json
import math
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import recover
import recover.checkpoint


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, default=Path("data/custom.bin"))
    p.add_argument("--out", type=Path, default=Path("runs/pipeline"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per replica")
    p.add_argument("--shard", type=int, default=1, help="FSDP2 shards of each stage")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of each stage")
    p.add_argument(
        "--schedule", choices=["gpipe", "1f1b", "interleaved"], default="gpipe",
        help="interleaved: 1F1B over 2 stages per rank (stages r and r + P), with --shard 1",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="where the model computes (cpu, cuda)")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint")
    return p.parse_args(argv)


class Block(nn.Module):
    """Pre-norm attention and MLP; q, k, v and the MLP's first layer split column-wise under TP
    (each rank gets whole heads), the two output projections row-wise."""

    def __init__(self, dim, heads, layer):
        super().__init__()
        self.layer, self.head_dim = layer, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.seed = None  # () -> the seed of this block's dropout in the running microbatch

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            f(h).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        a = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(B, T, -1)
        )
        seed = self.seed(self.layer) if self.training and self.seed is not None else None
        if seed is not None:
            recover.seed_generators(seed)  # dropout of (step, microbatch, layer)
        x = x + F.dropout(self.proj(a), 0.1, self.training)
        return x + F.dropout(self.down(F.gelu(self.up(self.ln2(x)))), 0.1, self.training)


class GPT(nn.Module):
    """The whole model; a stage is a copy with the other stages' parts removed (None)."""

    def __init__(self, args, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, args.dim)
        self.pos = nn.Parameter(torch.zeros(args.seq_len, args.dim))
        self.layers = nn.ModuleDict(
            {str(i): Block(args.dim, args.heads, i) for i in range(args.layers)}
        )
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, vocab)

    def forward(self, x):
        if self.embed is not None:  # the first stage: tokens in
            x = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.layers.values():
            x = block(x)
        if self.head is not None:  # the last stage: logits out
            x = self.head(self.norm(x))
        return x


def layers_of(stage, stages, n):
    """The layers of `stage`: contiguous and balanced."""
    return range(stage * n // stages, (stage + 1) * n // stages)


def cut(model, mine, stages):
    """This rank's part of the whole model: the layers of its stages `mine`; the embedding with
    the first stage, the norm and head with the last. Parameter names stay the whole model's."""
    n = len(model.layers)
    keep = {i for stage in mine for i in layers_of(stage, stages, n)}
    for i in list(model.layers):
        if int(i) not in keep:
            del model.layers[i]
    if 0 not in mine:
        model.embed, model.pos = None, None
    if stages - 1 not in mine:
        model.norm, model.head = None, None
    return model


class StageOf(nn.Module):
    """One of several stages a rank holds (an interleaved schedule): the part's modules of that
    stage, shared with the part (which is what the replica attaches: whole-model names)."""

    def __init__(self, part, stage, stages, n_layers):
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        self.embed, self.pos = (part.embed, part.pos) if self.first else (None, None)
        self.blocks = nn.ModuleList(part.layers[str(i)] for i in layers_of(stage, stages, n_layers))
        self.norm, self.head = (part.norm, part.head) if self.last else (None, None)

    def forward(self, x):
        if self.first:
            x = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def compute_step(replica, model, data, step, loss_fn, pipe=None, kind=None, first=True, last=True):
    """The step's microbatches: the per-id form without stages (`pipe` None), else each attempt's
    share at once through a schedule of `kind` over this rank's stage(s) `pipe` (the first stage
    takes the inputs, the last the targets). When it returns the step has committed."""
    device = next(model.parameters()).device
    if pipe is None:
        for j in replica.microbatches():
            x, y = (t.to(device) for t in data.batch(step, j))  # a pure function of (step, j)
            replica.backward(loss_fn(model(x), y))
        return
    for part in replica.pipeline():
        schedule = part.schedule(kind, pipe, loss_fn=loss_fn)  # first: it may pad the part
        batch = part.batch(partial(data.batch, step))  # (step, j) of each id, stacked
        x, y = (t.to(device) for t in batch)
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()


def keep_records(replica, out):
    """This script's own log: the records this replica writes now (a lost writer's first)."""
    for record in replica.committed_steps():
        with open(out / "losses.jsonl", "a") as f:
            f.write(json.dumps({**record, "time": time.time()}) + "\n")


def clip_grad_norm(model, max_norm, pp_group=None):
    """torch's clip_grad_norm_ over the whole model: each stage's squared norm (a DTensor's norm
    is taken over its mesh: FSDP2 shards, TP parts) summed over the stages."""
    sq = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for p in model.parameters():
        if p.grad is not None:
            n = torch.linalg.vector_norm(p.grad)
            n = n.full_tensor() if hasattr(n, "full_tensor") else n
            sq += n.double() ** 2
    if pp_group is not None:
        torch.distributed.all_reduce(sq, group=pp_group)
    total = float(sq.sqrt())
    coef = min(1.0, max_norm / (total + 1e-6))
    for p in model.parameters():
        if p.grad is not None and coef < 1.0:
            p.grad.mul_(coef)
    return total


def main():
    args = parse_args()
    torch.set_num_threads(1)
    layout = {"pp": args.pp, "shard": args.shard, "tp": args.tp}
    replica = recover.Replica(  # first: it builds the replica's group and mesh
        microbatches=args.microbatches, **layout,
        config={"lr": args.lr, "seed": args.seed, "batch": args.batch, "layers": args.layers},
    )  # fmt: skip
    data = recover.TokenWindows(
        args.data, seq_len=args.seq_len, microbatch_size=args.batch,
        microbatches=args.microbatches, seed=args.seed,
    )  # fmt: skip
    if args.schedule == "interleaved" and args.shard > 1:
        raise SystemExit("--schedule interleaved here runs stages that share the rank's FSDP2 "
                         "units: use it with --shard 1")  # fmt: skip
    torch.manual_seed(args.seed)  # the same whole model in every process, then cut
    model = GPT(args).to(args.device)
    stage = replica.mesh["pp"].get_local_rank() if args.pp > 1 else 0  # this rank's place
    per_rank = 2 if args.schedule == "interleaved" and args.pp > 1 else 1
    stages = args.pp * per_rank
    mine = [stage + k * args.pp for k in range(per_rank)]  # looped: stages r, r + P, ...
    model = cut(model, mine, stages)

    def dropout_seed(layer):
        j = replica.microbatch_id  # None in a schedule's shape inference: no microbatch's forward
        return (
            None if j is None else ((args.seed * 1_000_003 + replica.step) * 4099 + j) * 131 + layer
        )

    for block in model.layers.values():
        block.seed = dropout_seed
    if args.tp > 1:  # TP inside each block, then FSDP2 over the stage (torch's 2-D recipe)
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}  # fmt: skip
        for block in model.layers.values():
            parallelize_module(block, replica.mesh["tp"], plan)
    if args.shard > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=replica.mesh["shard"])
        fully_shard(model, mesh=replica.mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    warm = 3
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warm if s < warm else 0.5 + 0.5 * math.cos(math.pi * s / args.steps),
    )
    replica.attach(model, optimizer, extra_state={"scheduler": scheduler})
    # Checkpoints: DCP folders to which every rank of the writing replica writes its own part
    # (its stage's parameters under their whole-model names, its shards); any layout restores
    # them, one rank included. Created on every rank (a collective inside the replica).
    saver, start = None, 0
    if args.ckpt_every or args.resume:
        saver = recover.checkpoint.Checkpointer(args.out / "checkpoints", keep=2)
    if args.resume:
        start = saver.restore(model, optimizer, extra={"scheduler": scheduler}) or 0

    pipe = kind = None
    if args.pp > 1:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        group, device = replica.mesh["pp"].get_group(), torch.device(args.device)
        if per_rank == 1:
            pipe = PipelineStage(model, stage, stages, device, group=group)
        else:
            n = args.layers
            pipe = [PipelineStage(StageOf(model, s, stages, n), s, stages, device, group=group)
                    for s in mine]  # fmt: skip
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                "interleaved": ScheduleInterleaved1F1B}[args.schedule]  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    for step in replica.steps(args.steps, start_step=start):
        model.train()
        compute_step(
            replica, model, data, step, lm_loss, pipe, kind, stage == 0, stage == args.pp - 1
        )
        # .grad holds the committed mean gradient over the step's M microbatches
        norm = clip_grad_norm(model, 1.0, replica.mesh["pp"].get_group() if pipe else None)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        replica.log(lr=lr, grad_norm=norm)
        keep_records(replica, args.out)
        due = args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps
        if due:  # every rank of the writing replica saves its part (is_writer: its first rank)
            writer = replica.intra.relay(replica.is_writer) if replica.intra else replica.is_writer
            if writer:
                saver.save(step + 1, model, optimizer, extra={"scheduler": scheduler})
    if saver is not None:
        saver.close()  # the last save is durable


if __name__ == "__main__":
    main()
