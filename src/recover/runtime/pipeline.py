"""A replica's share of a step handed to a pipeline schedule at once (`Replica.pipeline()`).

Job: the per-id loop (`replica.microbatches()`, one `backward()` per id) cannot drive a
`torch.distributed.pipelining` schedule, which takes all of a replica's microbatches of a call
together and runs their forwards and backwards interleaved across the stages. A `PipelinePart`
is one attempt's share of the step in that form: the ids in the schedule's microbatch order
(`ids`, with the padding passes of a sharded replica in `real`), and what the library needs
from the schedule to keep its invariants:

- `schedule(cls, stages, loss_fn=...)`: builds the schedule with `n_microbatches=len(ids)`,
  `scale_grads=False` (the step sums per id and divides by M once, at the commit) and the loss
  function wrapped, and follows its stages' `forward_one_chunk` / `backward_one_chunk`. So the
  loss of each real id counts once in the step's loss (on the rank that holds the last stage),
  a padding pass's loss is scaled by 0 (its gradient is exactly zero), faults fire at the
  declared phases of the K-th microbatch the rank computes, and `Replica.microbatch_id` names
  the id whose forward runs (a stage seeds its randomness by it);
- `batch(fn)`: the part's microbatches concatenated along dim 0, as a schedule splits them
  (after `schedule`: a schedule that needs more microbatches than the part has grows it by
  padding passes, as for a sharded replica).

Invariants: each real id's gradient enters the rank's sum once and a padding pass's never. A loss
is matched to its microbatch by the output that the last stage's `forward_one_chunk` returned
for it (the schedule passes that object to the loss), never by call order: a schedule's shape
inference also calls the loss, on outputs of no microbatch, and those calls count nothing. A part
whose schedule ran no followed stage on this rank (not built by `part.schedule`), or computed
the losses of some of its microbatches only, is refused (`UsageError`). A new schedule may drop
the gradients that FSDP2 parameters hold, so the caller sets the sum of earlier parts aside
around each part (`Replica.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from recover.runtime.usage import UsageError

Phase = Callable[[str, int, "int | None"], None]


class StageFollower:
    """Follows the pipeline stages of a rank: each stage's per-chunk forward and backward report
    to the part in progress (`part`), whatever schedule calls them. A stage is followed once."""

    def __init__(self) -> None:
        self.part: PipelinePart | None = None

    def follow(self, stage: Any) -> None:
        if getattr(stage, "_recover_followed", False):
            return
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            part = self.part
            if part is None:
                return forward(chunk, *args, **kwargs)
            part._forward(chunk)
            try:
                out = forward(chunk, *args, **kwargs)
            finally:
                part.current = None
            if stage.is_last:  # the schedule computes this chunk's loss from this very object
                part._outputs.append((out, chunk))
                part._last_forwards += 1
            return out

        def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            part = self.part
            if part is not None:
                part._backward(chunk)
            out = backward(chunk, *args, **kwargs)
            if part is not None:
                part._done(chunk)
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage._recover_followed = True


class PipelinePart:
    """One attempt's share of the step for this rank's pipeline (see the module docstring).

    - `step`: the step;
    - `ids`: the microbatch ids, in the schedule's order (a sharded replica's padding passes
      repeat a real id: their loss is scaled by 0);
    - `real`: per position, whether it is a real id (False: a padding pass).
    """

    def __init__(
        self,
        step: int,
        plan: Sequence[tuple[int, bool]],
        *,
        first_index: int,
        add_loss: Callable[[int, float], None],
        phase: Phase,
        follower: StageFollower,
    ) -> None:
        self.step = step
        self.ids = [j for j, _ in plan]
        self.real = [bool(r) for _, r in plan]
        # The phase index of each position: the K-th real microbatch the rank computes in the
        # step (padding passes have none), counted on from the step's earlier parts.
        self._index: list[int | None] = []
        k = first_index
        for real in self.real:
            self._index.append(k if real else None)
            k += real
        self.next_index = k
        self._add_loss, self._phase, self._follower = add_loss, phase, follower
        self._forwards = 0  # chunk forwards of followed stages on this rank
        # The last stage's outputs whose loss is still to come, by chunk (each dropped once its
        # loss is computed: the schedule frees its activations, this must not keep them).
        self._outputs: list[tuple[Any, int]] = []
        self._last_forwards = 0  # chunk forwards of this rank's last stage
        self._counted: set[int] = set()  # chunks whose loss was computed
        self.current: int | None = None  # the id whose forward runs on this rank now
        self._batched = False  # batch() was called (the part's length is then fixed)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"PipelinePart(step={self.step}, ids={self.ids}, real={self.real})"

    def batch(self, fn: Callable[[int], Any]) -> tuple[torch.Tensor, ...]:
        """`fn(j)` for every id of the part (a tensor or a tuple of tensors, each with the
        microbatch along dim 0), concatenated along dim 0 in the part's order: what a schedule
        splits back into `len(part)` microbatches."""
        self._batched = True
        rows = [fn(j) for j in self.ids]
        if not rows:
            raise UsageError("this part has no microbatches")
        if isinstance(rows[0], torch.Tensor):
            return (torch.cat(rows),)
        return tuple(torch.cat(list(column)) for column in zip(*rows, strict=True))

    def _loss(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The schedule's `loss_fn`: `fn(output, target)`, counted in the step's loss once per
        real id, scaled by 0 for a padding pass; uncounted for an output of no microbatch."""

        def counted(output: Any, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            value = fn(output, target, *args, **kwargs)
            at = next((i for i, (out, _) in enumerate(self._outputs) if out is output), None)
            if at is None:  # shape inference's pass: no microbatch of the step
                return value
            n = self._outputs.pop(at)[1]
            if n in self._counted:
                raise UsageError(f"the schedule computed microbatch {n}'s loss twice")
            self._counted.add(n)
            if not self.real[n]:
                return value * 0.0  # a padding pass: its gradient is exactly zero
            self._add_loss(self.ids[n], float(value.detach()))
            return value

        return counted

    def schedule(
        self, cls: type, stages: Any, *, loss_fn: Callable[..., torch.Tensor], **kwargs: Any
    ) -> Any:
        """`cls(stages, n_microbatches=len(part), loss_fn=..., scale_grads=False, **kwargs)`
        with `loss_fn` counted per id and its stages followed (see the module docstring).
        `stages`: this rank's `PipelineStage`, or the list of them for a schedule of several
        stages per rank."""
        for forbidden in ("n_microbatches", "scale_grads"):
            if forbidden in kwargs:
                raise UsageError(
                    f"part.schedule sets {forbidden} itself (the part's length; summed gradients)"
                )
        listed = list(stages) if isinstance(stages, list | tuple) else [stages]
        for stage in listed:
            self._follower.follow(stage)
        # A schedule may need more microbatches than the part has (1F1B: at least as many as
        # stages; the interleaved ones: a multiple of their rounds), as a part of reassigned ids
        # after a failure often is: the part grows by padding passes (weight 0) to the fewest
        # the schedule takes. Every rank of the replica finds the same count (the same schedule
        # and stage counts), so its stages run the same microbatches.
        loss = self._loss(loss_fn)
        need = len(self.ids)
        stages_in_pipe = max(int(getattr(s, "num_stages", 1)) for s in listed)
        first_error: ValueError | None = None
        for n in range(need, need + 2 * stages_in_pipe + 1):
            try:
                schedule = cls(stages, n_microbatches=n, loss_fn=loss, scale_grads=False, **kwargs)
            except ValueError as e:  # (a count the schedule refuses)
                first_error = first_error or e
                continue
            if n > need:
                if self._batched:
                    raise UsageError(
                        f"{cls.__name__} needs {n} microbatches and this part has {need}: call "
                        "part.schedule(...) before part.batch(...), so the batch has the "
                        "padding passes the schedule adds"
                    )
                self._pad(n - need)
            return schedule
        assert first_error is not None  # (the range is never empty)
        raise first_error

    def _pad(self, k: int) -> None:
        """Add `k` padding passes (a real id's data, its loss scaled by 0, no fault phase)."""
        self.ids += [self.ids[0]] * k
        self.real += [False] * k
        self._index += [None] * k

    def check(self) -> None:
        """After the part: its schedule ran the followed stages, and a rank that computed losses
        computed one per microbatch."""
        if not self._forwards:
            raise UsageError(
                f"no pipeline stage of this rank ran a microbatch of the part {self.ids}: build "
                "its schedule with part.schedule(cls, stage, loss_fn=...) and run schedule.step "
                "with the part's batch once per part"
            )
        if self._last_forwards and len(self._counted) != len(self.ids):
            raise UsageError(
                f"the schedule computed {len(self._counted)} losses for the {len(self.ids)} "
                "microbatches of this part: build it with part.schedule(..., loss_fn=...) and "
                "run schedule.step once per part"
            )
        self._outputs = []

    # ---- what the followed stages report -------------------------------------------------------
    def _position(self, chunk: int) -> int:
        if not 0 <= chunk < len(self.ids):
            raise UsageError(
                f"a stage ran microbatch {chunk} of a part of {len(self.ids)}: build the "
                "schedule with part.schedule (n_microbatches=len(part))"
            )
        return chunk

    def _forward(self, chunk: int) -> None:
        n = self._position(chunk)
        self._forwards += 1
        self.current = self.ids[n]
        if self._index[n] is not None:
            self._phase("forward", self.step, self._index[n])

    def _backward(self, chunk: int) -> None:
        n = self._position(chunk)
        if self._index[n] is not None:
            self._phase("backward", self.step, self._index[n])

    def _done(self, chunk: int) -> None:
        n = self._position(chunk)
        if self._index[n] is not None:
            self._phase("done", self.step, self._index[n])
