"""The replica side of fault tolerance: what runs inside every replica process.

- `api`: `recover.Replica`, the drop-in API a training script uses;
- `step_machine`: one step as plan -> compute -> snapshot -> reduce -> vote -> commit or redo;
- `collective`: the fault-tolerant cross-replica reduce (a failed group is marked unusable and
  torn down in the background); `collective_config`: its deadlines, its abort and its pure
  rules; `group_build`: the rendezvous of one epoch's group; `group_cache`: this rank's group of
  the newest epoch, on the store of the coordinator that leads now;
- `links`: the coordinator as one rank sees it, and the ranks of one replica acting as one;
- `layout`: `ReplicaLayout`, what a replica is inside (pp, shard, tp);
- `grads`: the gradient sum of an attempt; `transfer`: state for a joiner; `stall`: the stall
  guard; `faults`: declared fault injection; `env`: the variables a launcher hands a replica
  process; `script_work`: the `Work` of a user's script.

Nothing here imports `recover.training` or `recover.tooling`: the built-in trainer is one client of
this package, like any user's script. The control plane is `recover.coordinator` (its own
process); this package talks to it through `recover.coordinator.client` only.
"""
