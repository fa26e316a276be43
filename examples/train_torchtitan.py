"""torchtitan's Llama 3 trained under ReCoVer, with torchtitan's own pipeline split, tensor
parallelism and FSDP2 inside every replica.

The model is torchtitan's (`torchtitan.models.llama3`, built with its own builders at its debug
model's dimensions, or at dim 64 for CPU tests), cut into pipeline stages by torchtitan's
splitter (whole-model parameter names kept), split by torchtitan's TP plan over the replica's
`tp` ranks and sharded by torchtitan's FSDP2 helper over its `shard` ranks. ReCoVer runs the
loop: each step's share goes to a `torch.distributed.pipelining` schedule through
`replica.pipeline()`, a failed rank's replica is recomputed in the same step by the others, and
a respawned replica receives every rank's part of the state. With one rank the same model trains
in the per-id form: the trajectory every layout and every failure must reproduce.

    pip install -e '.[torchtitan]'                                   # torchtitan, and triton
    recover run --replicas 2 --ranks-per-replica 8 --respawn 0 --preload torchtitan.models.llama3 \\
        --fault kill:replica=1,rank=5,step=2,phase=forward \\
        -- python examples/train_torchtitan.py --pp 2 --shard 2 --tp 2 --data data/custom.bin

Why the model and its parallelism from torchtitan inside this script, and not a ReCoVer train
step for torchtitan's trainer: torchtitan's `Trainer` owns the data loader, the step and the
optimizer step in one loop (`train_step`) whose fault tolerance (`[fault_tolerance]`) is torchft's
(skip the failed step, shrink the batch). Putting ReCoVer there means replacing that loop, which
is what this script is; torchtitan's parallelize entry points (`parallelize_llama`,
`pipeline_llm`) take its trainer's configs, so the script calls the helpers under them.

Shims for CPU, kept here: torchtitan's language models ask for FlexAttention or varlen
attention (block masks, GPU kernels); each layer's inner attention is set to torchtitan's dense
`ScaledDotProductAttention` (causal; one document per sequence here).
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from train_pipeline import clip_grad_norm, compute_step, keep_records

import recover


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, default=Path("data/custom.bin"))
    p.add_argument("--out", type=Path, default=Path("runs/torchtitan"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--size", choices=["debug", "tiny"], default="debug",
                   help="debug: torchtitan's debugmodel (dim 256); tiny: dim 64 (CPU tests)")  # fmt: skip
    p.add_argument("--layers", type=int, default=2, help="the model's first N layers")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per replica")
    p.add_argument("--shard", type=int, default=1, help="FSDP2 shards of each stage")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of each stage")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    return p.parse_args(argv)


def llama3_config(size, layers, tp=1):
    """torchtitan's Llama 3 built with its own builders: the debug model's dimensions (or dim 64
    for CPU tests), `layers` layers, q, k and v as three weights, the dense inner attention."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common import compute_ffn_hidden_dim as ffn_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (  # (module-private: pinned torchtitan==0.3.0)
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    # debugmodel's numbers (torchtitan.models.llama3.llama3_configs["debugmodel"]), or smaller
    dim, heads, vocab, multiple = (256, 16, 2048, 256) if size == "debug" else (64, 4, 256, 64)
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            n_layers=layers, dim=dim, n_heads=heads, hidden_dim=ffn_dim(dim, multiple_of=multiple),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000,
                                    scaling="llama"),
            # Three weights, not debugmodel's fused one: the fused module's state dict names
            # wq, wk and wv through a hook, which torch's state-dict helpers (the live transfer,
            # the final model) cannot follow to a module attribute.
            fuse_qkv=False,
            attn_backend="flex",
        ),
    )  # fmt: skip
    for layer in cfg.layers:  # CPU shim: dense causal attention instead of FlexAttention
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if tp > 1:  # torchtitan's TP plan, declared on the configs (no sequence parallelism)
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=False)
    return cfg


def tensor_parallel(model, tp_mesh):
    """torchtitan's own TP: `Module.parallelize` distributes each module's weights as its
    sharding config declares, on the mesh its `ParallelDims` names "tp". The replica's "tp"
    mesh is handed in (the one ReCoVer aborts and rebuilds with the replica), rather than a world
    mesh of torchtitan's own making."""
    from torchtitan.distributed import ParallelDims

    degree = tp_mesh.size()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=degree, pp=1, ep=1,
                        world_size=degree, spmd_backend="partial_dtensor")  # fmt: skip
    dims._single_axis_meshes = {"tp": tp_mesh}  # (private: pinned torchtitan==0.3.0)
    model.parallelize(dims)


def lm_loss(logits, targets):
    if hasattr(logits, "full_tensor"):  # TP: the vocabulary's parts, gathered
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def main():
    args = parse_args()
    torch.set_num_threads(1)
    replica = recover.Replica(  # first: it builds the replica's group and mesh
        microbatches=args.microbatches, pp=args.pp, shard=args.shard, tp=args.tp,
        config={"lr": args.lr, "seed": args.seed, "size": args.size, "layers": args.layers},
    )  # fmt: skip
    data = recover.TokenWindows(
        args.data, seq_len=args.seq_len, microbatch_size=args.batch,
        microbatches=args.microbatches, seed=args.seed,
    )  # fmt: skip
    torch.manual_seed(args.seed)  # the same whole model in every process, then split
    model = llama3_config(args.size, args.layers, args.tp).build()
    model.init_states()  # torchtitan's own initialisation
    stage = replica.mesh["pp"].get_local_rank() if args.pp > 1 else 0
    if args.pp > 1:  # torchtitan's split: this stage's modules, whole-model names kept
        from torchtitan.distributed.pipeline_parallel import (  # (pinned torchtitan==0.3.0)
            _generate_llm_fqn_per_model_part,
            _split_module,
        )

        names = _generate_llm_fqn_per_model_part(args.pp, len(model.layers))
        model = _split_module(model, names[stage])
    if args.tp > 1:  # TP inside each stage, then FSDP2 over it, as torchtitan orders them
        tensor_parallel(model, replica.mesh["tp"])
    if args.shard > 1:  # torchtitan's FSDP2: each block a unit, then the stage
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        apply_fsdp_to_decoder(
            model, replica.mesh["shard"], param_dtype=torch.float32,
            reduce_dtype=torch.float32, pp_enabled=args.pp > 1,
        )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    replica.attach(model, optimizer)

    pipe = kind = None
    if args.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        group = replica.mesh["pp"].get_group()
        # Under TP the activations between stages are DTensors over the "tp" mesh: each stage
        # rebuilds a received one on its own stage's "tp" ranks.
        tp_mesh = replica.mesh["tp"] if args.tp > 1 else None
        pipe = PipelineStage(
            model, stage, args.pp, torch.device("cpu"), group=group,
            get_mesh=lambda names, layout: tp_mesh if tuple(names) == ("tp",) else None,
        )  # fmt: skip
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    args.out.mkdir(parents=True, exist_ok=True)
    for step in replica.steps(args.steps):
        model.train()
        compute_step(
            replica, model, data, step, lm_loss, pipe, kind, stage == 0, stage == args.pp - 1
        )
        norm = clip_grad_norm(model, 1.0, replica.mesh["pp"].get_group() if pipe else None)
        optimizer.step()
        optimizer.zero_grad()
        replica.log(grad_norm=norm)
        keep_records(replica, args.out)


if __name__ == "__main__":
    main()
