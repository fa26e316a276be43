"""Your own model, optimizer, schedule and data, made fault-tolerant by ReCoVer.

A small causal transformer written with plain PyTorch modules (nothing of ReCoVer's model), trained
with SGD + Nesterov momentum and a warmup-then-cosine LambdaLR on a nanoGPT-style token file.

    python examples/train_custom.py --make-data data/custom.bin      # once: a token file
    recover run --replicas 3 --fault kill:replica=1,step=3,phase=backward \\
        -- python examples/train_custom.py --data data/custom.bin --out runs/custom

With `--ckpt-every N` the writer checkpoints the model, optimizer and schedule every N steps
(`recover.checkpoint`: DCP folders in OUT/checkpoints); `--resume` continues from the newest.
"""

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import recover
import recover.checkpoint


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, default=Path("data/custom.bin"))
    p.add_argument("--make-data", type=Path, help="write a token file and exit")
    p.add_argument("--out", type=Path, default=Path("runs/custom"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the model computes (cpu, cuda)")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="start from the newest checkpoint")
    p.add_argument(
        "--early-update", action="store_true",
        help="hand the update to the library (attach(update=...)): it runs while each step's "
        "vote completes, off the step's critical path",
    )  # fmt: skip
    return p.parse_args(argv)


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2, seq_len=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):  # (B, T) -> (B, T, vocab)
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        return self.head(self.blocks(self.embed(x) + self.pos[:T], mask=mask, is_causal=True))


def build(args):
    """The script's own pieces, seeded alike in every process: data, model, optimizer, schedule."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same initial parameters on every replica
    data = recover.TokenWindows(
        args.data, seq_len=args.seq_len, microbatch_size=args.batch,
        microbatches=args.microbatches, seed=args.seed,
    )  # fmt: skip
    model = TinyLM(seq_len=args.seq_len).to(args.device)
    return data, model


def optimizer_for(model, args):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    warm = 3

    def schedule(s):  # linear warmup, then cosine to zero
        return (s + 1) / warm if s < warm else 0.5 + 0.5 * math.cos(math.pi * s / args.steps)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def update_of(model, optimizer, scheduler):
    """The update: clipping, the optimizer and schedule steps, on the mean gradient in .grad.
    Its scalars go into the step's record."""

    def update():
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return {"lr": lr, "grad_norm": float(norm)}

    return update


def seed_dropout(args, step, j):
    """The dropout of microbatch (step, j) from its own seed (torch.manual_seed would do too,
    at 0.1-0.3 ms a call on a machine without an initialized accelerator)."""
    recover.seed_generators(args.seed * 1_000_003 + step * args.microbatches + j)


def microbatch_of(replica, model, data, args):
    """One microbatch: its forward pass and backward, a pure function of (step, j)."""

    def microbatch(step, j):
        x, y = (t.to(args.device) for t in data.batch(step, j))
        seed_dropout(args, step, j)
        logits = model(x)
        replica.backward(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))

    return microbatch


def attach(replica, model, optimizer, scheduler, args, data):
    """The model, optimizer and schedule under the replica's care; with --early-update the
    update too (the library runs it during each step's vote where it can, then computes the
    next step's first microbatch while the vote completes: `ahead`)."""
    early = args.early_update
    replica.attach(
        model, optimizer, extra_state={"scheduler": scheduler},
        update=update_of(model, optimizer, scheduler) if early else None,
        ahead=microbatch_of(replica, model, data, args) if early else None,
    )  # fmt: skip


def train(replica, model, optimizer, scheduler, data, args, *, saver=None, start=0):
    """The loop: plain PyTorch, with each step's microbatches taken from the replica."""
    args.out.mkdir(parents=True, exist_ok=True)
    # the update, where the loop runs it (with --early-update the library does)
    update = None if args.early_update else update_of(model, optimizer, scheduler)
    microbatch = microbatch_of(replica, model, data, args)
    for step in replica.steps(args.steps, start_step=start):
        for j in replica.microbatches():  # this replica's ids, then any reassigned to it
            microbatch(step, j)
        # .grad holds the committed mean gradient over the step's M microbatches (with
        # --early-update the library has run the update already, during the step's vote)
        scalars = update() if update is not None else {}
        # Added to the step's record in the run's metrics.jsonl (with its loss and M), on every
        # replica: whichever writes it, now or after a writer is lost, has them.
        tokens = replica.committed_microbatches * args.batch * args.seq_len
        replica.log(**scalars, tokens=tokens)
        # This script keeps a log of its own too: the records this replica writes now (none on
        # the others), with any step a lost writer left unwritten, so it loses nothing either.
        for record in replica.committed_steps():
            with open(args.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({**record, "time": time.time()}) + "\n")
        if replica.is_writer:
            due = args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps
            if saver is not None and due:  # the state before step + 1, written in the background
                saver.save(step + 1, model, optimizer, extra={"scheduler": scheduler})


def main():
    args = parse_args()
    if args.make_data:  # the bytes of a few standard-library modules, one token per byte
        text = b"".join(Path(m.__file__).read_bytes() for m in (argparse, json, np))
        args.make_data.parent.mkdir(parents=True, exist_ok=True)
        recover.write_token_file(args.make_data, np.frombuffer(text, np.uint8).astype(np.uint16))
        return
    data, model = build(args)
    optimizer, scheduler = optimizer_for(model, args)
    replica = recover.Replica(
        microbatches=args.microbatches,
        config={"lr": args.lr, "seed": args.seed, "batch": args.batch, "data": data.content_hash},
        check_every=5,
        check_data=data.batch,  # opt-in: every 5 steps the replicas compare a replayed microbatch
    )
    attach(replica, model, optimizer, scheduler, args, data)
    saver, start = None, 0
    if args.ckpt_every or args.resume:
        saver = recover.checkpoint.Checkpointer(args.out / "checkpoints", keep=2)
    if args.resume:  # every replica loads the same newest valid checkpoint
        start = saver.restore(model, optimizer, extra={"scheduler": scheduler}) or 0
    train(replica, model, optimizer, scheduler, data, args, saver=saver, start=start)
    if saver is not None:
        saver.close()  # the last save is durable
    if replica.is_writer:
        torch.save(model.state_dict(), args.out / "final.pt")


if __name__ == "__main__":
    main()
