"""The built-in GPT trainer: one client of `recover.runtime`, as a user's script would be.

- `config`: the resolved `TrainConfig` and run paths; `presets`: model shapes;
- `model`: the GPT; `parallel`: its layouts inside a replica (FSDP2 shards, TP, PP);
- `trainer`: one replica's model, optimizer and gradient sum;
- `worker`: a replica process of `recover train` (drives the step machine); `solo`: the loop of a
  one-replica run; `recorder`: what happens after every commit (record, evaluate, checkpoint);
- `checkpoint`, `metrics`, `runfolder`: the run's durable record.
"""
