"""A DTensor gradient laid out unlike its parameter (torchtitan's tensor parallelism leaves the
norms' gradients and the row-split projections' as partial sums over the TP ranks) enters the
step's sum as the parameter's own layout: reduced and split like the weight, never a rank's
partial term taken for the whole gradient.

Two gloo ranks over a mesh of 2; the gradients are set by hand, each rank a different term.
"""

from __future__ import annotations

import pytest
import torch

from conftest import on_gloo_ranks


def _rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from recover.runtime.grads import GradientSum, set_aside

    mesh = init_device_mesh("cpu", (2,))
    norm = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    proj = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))

    def partial_grads(scale: float) -> None:  # rank r holds the term (r + 1) * scale
        term = float(rank + 1) * scale
        norm.grad = DTensor.from_local(torch.full((4,), term), mesh, [Partial()])
        proj.grad = DTensor.from_local(torch.full((4, 2), term), mesh, [Partial()])

    sums = GradientSum([norm, proj], device="cpu")
    partial_grads(1.0)
    flat = sums.snapshot()
    # the whole gradient is 1 + 2 = 3: the norm's all of it, the projection's rows of this rank
    got = {"norm": flat[:4].tolist(), "proj": flat[4:8].tolist()}
    # a second schedule's gradients added to the first's, both partial, in the weights' layout
    partial_grads(1.0)
    with set_aside([norm, proj]):
        partial_grads(10.0)  # the terms 10 and 20: 30
    got["after_set_aside"] = [
        tuple(norm.grad.placements) == (Replicate(),),
        tuple(proj.grad.placements) == (Shard(0),),
        norm.grad.to_local().tolist(),
        proj.grad.to_local().flatten().tolist(),
    ]
    return got


@pytest.mark.timeout(60)
def test_partial_gradients_enter_the_sum_in_their_parameters_layout():
    results = on_gloo_ranks(_rank)
    for rank in (0, 1):
        assert results[rank] == {
            "norm": [3.0] * 4,
            "proj": [3.0] * 4,  # this rank's 2 rows of 2
            "after_set_aside": [True, True, [33.0] * 4, [33.0] * 4],
        }, results[rank]
