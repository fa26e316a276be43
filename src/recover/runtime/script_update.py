"""A script's update run by the library: `replica.attach(..., update=fn)`.

Job: run the script's optimizer step (its clipping, `optimizer.step()`, schedule and
`zero_grad()`, as one callable) at the point the library chooses. In a replica of one rank that is
while the step's vote completes (the step machine's `StepHooks.apply_early`: from the moment this
replica's done report is sent), which takes the coordinator's round trip off the step's critical path,
as the built-in trainer's early update does. A replica of several ranks runs it after the commit
(its ranks would have to agree on an early update first).

Invariants:
- The update runs once per committed step, on the step's mean gradient, and its result is checked
  before the script's loop body sees it: a parameter or optimizer state value that is not finite
  is undone (the update guard's backup, recover.runtime.update_guard), and the step counts as
  skipped, exactly as when the script steps the optimizer itself.
- An update applied during a vote that ends in a redo or a stop never happened: the parameters,
  the optimizer's state and hyper-parameters (a scheduler's lr in `param_groups`), every
  `extra_state` object and the local gradient sum are put back bit for bit before the redo
  computes. The update must change nothing else (state it keeps outside these is not undone).
- The scalars the update returns go into the step's record once it committed, never those of an
  undone update.

Costs: per step a copy of the optimizer's hyper-parameters and of each extra object's
`state_dict()` (a scheduler's: a few numbers) besides the update guard's copy, which the step
pays anyway; the update itself moves off the critical path only in replicas of one rank.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from recover.runtime.grads import GradientSum
from recover.runtime.stall import StallGuard
from recover.runtime.update_guard import UpdateGuard
from recover.runtime.usage import UsageError

# What an update returns: scalars for the step's record (as `replica.log` takes), or None.
Update = Callable[[], Mapping[str, float | None] | None]
# A script's microbatch: compute (step, j), its forward pass and replica.backward(loss)
# (attach(ahead=...): the next step's first microbatch during the vote).
Compute = Callable[[int, int], None]


class Applied(NamedTuple):
    """What one run of the update gave."""

    scalars: dict[str, float | None]  # for the step's record
    finite: bool  # every parameter and optimizer state value it made is finite (this rank)
    seconds: float  # its time, with the guard's copy and check
    during_vote: bool  # it ran while the step's vote completed


class ScriptUpdate:
    """The script's update and what undoing it needs."""

    def __init__(
        self,
        update: Update,
        *,
        grads: GradientSum,
        guard: UpdateGuard,
        stall: StallGuard,
        extra: Mapping[str, Any],
    ) -> None:
        if not callable(update):
            raise TypeError(f"update must be a callable taking no arguments, got {update!r}")
        self.update, self.grads, self.guard = update, grads, guard
        self.stall, self.extra = stall, dict(extra)
        self.running = False  # inside the update: its optimizer step is the library's own
        # step -> what the update applied during its vote gave (None: nothing was applied, the
        # sum was not finite), until the commit takes it
        self._early: dict[int, Applied | None] = {}

    def apply(self, *, during_vote: bool = False) -> Applied:
        """Run the update on the mean gradient now in `.grad` (the guard saves the state before
        it); what it gave, with whether the parameters and optimizer state it made are finite.
        The gradient sum is cleared after it."""
        t0 = time.perf_counter()
        self.guard.save()
        with self._running():
            scalars = self.update()
        self.grads.clear()
        if scalars is None:
            scalars = {}
        if not isinstance(scalars, Mapping):
            raise UsageError(
                f"the update returned {type(scalars).__name__}: return None or a dict of "
                "scalars for the step's record (as replica.log takes)"
            )
        finite = self.guard.finite()
        return Applied(dict(scalars), finite, time.perf_counter() - t0, during_vote)

    def early(
        self, step: int, reduced: torch.Tensor, count: int, finite: bool
    ) -> Callable[[], None]:
        """StepHooks.apply_early: the update of `step` (its sum `reduced` over `count`
        microbatches) while the vote completes; returns its undo. A sum that is not finite is
        never applied (the commit skips the step)."""
        held = self.grads.hold()
        if not finite:
            self._early[step] = None
            return lambda: self._forget(step, held)
        groups = [_hyper(group) for group in self.guard.optimizer.param_groups]
        extra = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.extra.items()}
        self.grads.load(reduced, divide_by=count)
        self._early[step] = self.apply(during_vote=True)

        def undo() -> None:
            self.guard.restore()
            for group, saved in zip(self.guard.optimizer.param_groups, groups, strict=True):
                group.update(saved)
            for name, obj in self.extra.items():
                obj.load_state_dict(extra[name])
            self._forget(step, held)

        return undo

    def take(self, step: int) -> Applied | None:
        """What the update of `step`, applied during its vote, gave (None: nothing was
        applied, its sum was not finite)."""
        return self._early.pop(step)

    def _forget(self, step: int, held: Any) -> None:
        self._early.pop(step, None)
        self.grads.put_back(held)

    @contextmanager
    def _running(self) -> Iterator[None]:
        self.running = True
        try:
            with self.stall.busy("in the script's update"):
                yield
        finally:
            self.running = False


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group's hyper-parameters as they are now (tensors copied, so that an update
    writing into one in place is undone too)."""
    return {
        k: v.detach().clone() if torch.is_tensor(v) else copy.copy(v)
        for k, v in group.items()
        if k != "params"
    }


__all__ = ["Applied", "Compute", "ScriptUpdate", "Update"]
