"""The model of train_custom.py, sharded by FSDP2 inside each replica (HSDP), made fault-tolerant.

Every replica is several ranks (processes); the script shards its own model over the replica's
mesh that ReCoVer gives it, exactly as it would under torchrun. ReCoVer deals the replica's
microbatches over those ranks and sums each rank's gradient shard across replicas.

    recover run --replicas 2 --ranks-per-replica 2 --fault kill:replica=1,rank=1,step=3,phase=backward \\
        -- python examples/train_fsdp.py --data data/custom.bin --out runs/fsdp
"""

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from train_custom import attach, build, optimizer_for, parse_args, train

import recover


def main():
    args = parse_args()
    replica = recover.Replica(  # first: it builds the replica's group and mesh
        microbatches=args.microbatches,
        shard=2,  # ranks per replica (recover run --ranks-per-replica 2)
        config={"lr": args.lr, "seed": args.seed, "batch": args.batch},
    )
    data, model = build(args)
    for layer in model.blocks.layers:  # FSDP2, as the script would apply it anyway
        fully_shard(layer, mesh=replica.mesh)
    fully_shard(model, mesh=replica.mesh)
    optimizer, scheduler = optimizer_for(model, args)  # after sharding: over the shards
    attach(replica, model, optimizer, scheduler, args, data)
    train(replica, model, optimizer, scheduler, data, args)
    # The full model, gathered inside the replica (every rank takes part), saved by the writer.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if replica.is_writer:
        torch.save(full, args.out / "final.pt")


if __name__ == "__main__":
    main()
