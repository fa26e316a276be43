"""A script's update run by the library (`replica.attach(update=...)`,
recover.runtime.script_update): applied during the vote and undone bit for bit by a redo, its
scheduler and hyper-parameters included; refused where it breaks its contract. The whole path
under a real kill is in test_api.py (the script run with --early-update)."""

from __future__ import annotations

import math

import pytest
import torch
from test_update_guard import _equal, _state

from recover.runtime.grads import GradientSum
from recover.runtime.script_update import ScriptUpdate
from recover.runtime.stall import StallGuard
from recover.runtime.update_guard import UpdateGuard
from recover.runtime.usage import UsageError


class Script:
    """A script's pieces: a model, SGD with momentum, a multiplicative schedule (it scales the
    lr in param_groups at every step, so a redo that kept the stepped lr would differ), and the
    update as the script writes it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=0.5)
        self.grads = GradientSum(self.model.parameters(), device="cpu")
        self.returns: object = None

    def update(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return {"lr": lr, "grad_norm": float(norm)} if self.returns is None else self.returns

    def library(self) -> ScriptUpdate:
        return ScriptUpdate(
            self.update, grads=self.grads, guard=UpdateGuard(self.optimizer),
            stall=StallGuard(0, replica=0), extra={"scheduler": self.scheduler},
        )  # fmt: skip

    def compute(self, step: int, ids) -> None:
        """The step's microbatches `ids`, summed into .grad (as replica.backward does)."""
        for j in ids:
            g = torch.Generator().manual_seed(step * 100 + j)
            x = torch.randn(3, 4, generator=g)
            loss = self.model(x).square().mean()
            loss.backward()
            self.grads.add_loss(j, float(loss.detach()))

    def everything(self) -> dict:
        """The model, the optimizer's state and lr, the scheduler's state."""
        out = _state(self.model, self.optimizer)
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        out.update({f"sched.{k}": v for k, v in self.scheduler.state_dict().items()})
        return out


def test_an_update_applied_during_the_vote_is_undone_with_its_schedule_bit_for_bit():
    """The update of step 1 runs during the vote, then the outcome is a redo: the parameters,
    the momentum, the lr in param_groups, the scheduler and the local sum are what they were,
    and the redo's update gives the bits of a script that stepped once, after the commit."""
    early, plain = Script(), Script()
    library = early.library()
    for s in (early, plain):  # one step, so that momentum and the schedule have moved
        s.compute(0, range(3))
        s.grads.load(s.grads.snapshot(), divide_by=3)
        s.update()
        s.grads.clear()
    for s in (early, plain):
        s.compute(1, range(2))  # the attempt's ids; id 2 comes in the redo
    before, local = early.everything(), early.grads.snapshot()
    undo = library.early(1, early.grads.snapshot(), 3, True)
    assert not _equal(early.everything(), before)  # it did run
    undo()
    assert _equal(early.everything(), before)
    assert torch.equal(early.grads.snapshot(), local)
    with pytest.raises(KeyError):  # nothing of the undone update is left to be taken
        library.take(1)
    for s in (early, plain):  # the redo: id 2 on top of the kept sum, then the commit
        s.compute(1, [2])
    library.early(1, early.grads.snapshot(), 3, True)
    applied = library.take(1)
    plain.grads.load(plain.grads.snapshot(), divide_by=3)
    expected = plain.update()
    assert applied.finite and applied.during_vote and applied.scalars == expected
    assert _equal(early.everything(), plain.everything())
    assert all(p.grad is None for p in early.model.parameters())  # the sum was cleared after


def test_a_sum_that_is_not_finite_is_never_handed_to_the_update():
    s = Script()
    library = s.library()
    s.compute(0, range(2))
    before, local = s.everything(), s.grads.snapshot()
    undo = library.early(0, torch.full_like(local, math.nan), 2, False)
    assert library.take(0) is None and _equal(s.everything(), before)
    undo()  # (a redo after it: the local sum is still there)
    assert torch.equal(s.grads.snapshot(), local)


def test_an_update_that_makes_a_value_not_finite_says_so_and_one_that_returns_junk_is_refused():
    s = Script()
    library = s.library()
    s.compute(0, range(2))
    s.grads.load(s.grads.snapshot(), divide_by=2)
    s.optimizer.param_groups[0]["lr"] = math.inf  # the update makes every parameter infinite
    assert not library.apply().finite
    library.guard.restore()  # (what the Replica does then on every rank)
    assert all(bool(torch.isfinite(p).all()) for p in s.model.parameters())
    s.returns = [1.0]
    s.optimizer.param_groups[0]["lr"] = 0.1
    s.compute(1, range(2))
    s.grads.load(s.grads.snapshot(), divide_by=2)
    with pytest.raises(UsageError, match="return None or a dict of scalars"):
        library.apply()
