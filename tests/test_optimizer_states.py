"""Optimizer states shaped unlike their parameter, under FSDP2: checkpointed and transferred per rank.

An optimizer that works on each rank's shard and keeps state shaped unlike it (Adafactor-style
factored second moments over the shard's rows and columns, and a ZeRO-style flat slice of the
shard) holds plain tensors for sharded (DTensor) parameters. DCP takes a plain tensor for a
replicated value: before recover.checkpoint saved them per rank, one rank's copy was kept and
every rank loaded it (silently wrong where the shards have one shape, as here). Two ranks of one
replica, real gloo groups, FSDP2 over a 1-D mesh.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the spawned ranks import this file)

from conftest import on_gloo_ranks  # noqa: E402


class ShardLocal(torch.optim.Optimizer):
    """Factored second moments (rows, columns) and a flat master slice, over this rank's shard."""

    def __init__(self, params, lr: float = 1e-2, beta2: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta2": beta2})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w = p.to_local() if hasattr(p, "to_local") else p
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["master"] = w.detach().reshape(-1).clone()  # (ZeRO-style: flat)
                    if g.dim() > 1:
                        state["row"] = torch.zeros(g.shape[0], 1)
                        state["col"] = torch.zeros(1, g.shape[1])
                    else:
                        state["var"] = torch.zeros_like(g)
                state["step"] += 1
                if g.dim() > 1:
                    state["row"].lerp_(g.square().mean(1, keepdim=True), 1 - group["beta2"])
                    state["col"].lerp_(g.square().mean(0, keepdim=True), 1 - group["beta2"])
                    v = state["row"] @ state["col"] / state["row"].mean().clamp(min=1e-30)
                else:
                    state["var"].lerp_(g.square(), 1 - group["beta2"])
                    v = state["var"]
                update = (g / (v.sqrt() + 1e-8)).reshape(-1)
                state["master"].add_(update, alpha=-group["lr"])
                w.copy_(state["master"].view_as(w))


def _model(mesh=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for sub in (model[0], model[2], model):
            fully_shard(sub, mesh=mesh)
    return model, ShardLocal(model.parameters())


def _trained(mesh, rank: int):
    model, opt = _model(mesh)
    for step in range(2):
        torch.manual_seed(100 * step + rank)  # each rank's own data: its shards' states differ
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _states(opt) -> list[dict]:
    return [
        {k: v.clone() for k, v in opt.state[p].items()}
        for g in opt.param_groups
        for p in g["params"]
    ]


def _equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def _rank(rank: int, folder: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import recover.checkpoint as ckpt
    from recover.runtime.script_work import ScriptWork

    mesh = init_device_mesh("cpu", (2,))
    model, opt = _trained(mesh, rank)
    mine = _states(opt)
    other = dist.get_world_size() - 1 - rank
    box = [None, None]
    dist.all_gather_object(box, mine)
    assert not _equal(box[other], mine)  # the ranks' states differ: a mix-up would show
    ckpt.save(folder, 2, model, opt)
    restored, opt2 = _model(mesh)
    saver = ckpt.Checkpointer(folder)
    assert saver.restore(restored, opt2) == 2
    saver.close()
    # The live transfer: this rank's state, laid out as a joiner's (recover.Replica sends each
    # rank's own part to the joiner's rank at the same place in the replica).
    joiner, opt3 = _model(mesh)
    sent = ScriptWork(model, opt, {}, None, None, one_rank=False).transfer_state_dict()
    ScriptWork(joiner, opt3, {}, None, None, one_rank=False).load_transfer_state(sent)
    return {
        "checkpoint": _equal(_states(opt2), mine),
        "transfer": _equal(_states(opt3), mine),
        "params": all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(model.parameters(), joiner.parameters(), strict=True)
        ),
    }


@pytest.mark.timeout(120)
def test_shard_local_optimizer_states_are_checkpointed_and_transferred_per_rank(tmp_path):
    folder = str(tmp_path / "checkpoints")
    results = on_gloo_ranks(_rank, folder)
    assert results == {r: {"checkpoint": True, "transfer": True, "params": True} for r in (0, 1)}

    # Another layout (one rank: no shards) cannot be given those states: refused, naming why.
    from recover.checkpoint import Checkpointer, CheckpointError

    model, opt = _model()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
    saver = Checkpointer(folder, process_group=None)
    with pytest.raises(CheckpointError, match="resumes in the layout that saved it"):
        saver.restore(model, opt)
    saver.close()
