"""Pipeline schedules through the API: a script cuts its model into stages (and shards and splits
each stage) inside every replica, hands each step's share to a `torch.distributed.pipelining`
schedule through `replica.pipeline()`, and survives a real SIGKILL of one of its ranks on the
one-rank trajectory.

The process tests run examples/train_pipeline.py under `recover run`, 2 replicas per layout
(pp 2 x FSDP2 2 with 1F1B; pp 2 x TP 2 with GPipe; pp 2 with two stages per rank, the
interleaved 1F1B schedule and a respawn), against the same script's one-rank run (the per-id
loop): every step recorded once with all M, the committed losses within rtol 1e-4, the final
model (the stages merged by the writer) within relative L2 1e-4. The unit tests check how a
part counts the schedule's losses with stand-in stages: by the output of each microbatch, never
by call order (a schedule's shape inference calls the loss too), padding passes scaled by 0, and
misuse refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_api import recover_run

from conftest import assert_faults_fired, events
from recover.runtime.pipeline import PipelinePart, StageFollower
from recover.runtime.usage import UsageError

M = 6
ARGS = ["--microbatches", str(M), "--batch", "2", "--seq-len", "16", "--layers", "4",
        "--dim", "32"]  # fmt: skip


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "result" / "losses.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def pipeline_reference(custom_token_file, tmp_path_factory):
    """steps -> the script's one-rank run of that many steps (the per-id loop over the whole
    model): the trajectory (its learning-rate schedule spans the run's steps)."""
    runs: dict[int, Path] = {}

    def reference(steps: int) -> Path:
        if steps not in runs:
            out = tmp_path_factory.mktemp(f"pipeline-ref-{steps}")
            args = ["--data", str(custom_token_file), *ARGS, "--steps", str(steps)]
            r = recover_run(out, "train_pipeline.py", "--replicas", "1", script_args=args)
            assert r.returncode == 0, r.stdout[-3000:]
            runs[steps] = out
        return runs[steps]

    return reference


def assert_on_the_reference(reference: Path, out: Path, steps: int) -> list[dict]:
    ref, got = _records(reference), _records(out)
    assert [r["step"] for r in got] == list(range(steps)), "a step is missing or recorded twice"
    assert all(r["microbatches"] == M for r in got), "a step did not sum M microbatches"
    for a, b in zip(ref, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
    pa = load_file(reference / "job" / "final" / "model.safetensors")
    pb = load_file(out / "job" / "final" / "model.safetensors")  # every stage, merged
    assert sorted(pa) == sorted(pb)
    num = sum(float(((pa[k] - pb[k]).double() ** 2).sum()) for k in pa) ** 0.5
    den = sum(float((pa[k].double() ** 2).sum()) for k in pa) ** 0.5
    assert num / den <= 1e-4, num / den
    assert_faults_fired(out / "job")
    return got


# (layout, schedule, the killed rank and its fault, steps, whether the replica is respawned). The
# respawn is the 2-rank layout's: 36 steps give a respawned replica time to join (it did at steps
# 6-9 here, unloaded and under a full suite), which the 4-rank layouts would pay for with 8
# processes on 2 cores (0.3-0.6 s a step; 44 s of the suite for pp x FSDP2), so they run 16 steps. A pipeline of one stage per rank
# alone (pp 2) is what the 2-D layouts run with one axis fewer.
LAYOUTS = {
    "pp+shard": (["--pp", "2", "--shard", "2"], "1f1b", "rank=3,step=2,phase=backward", 16, False),
    "pp+tp": (["--pp", "2", "--tp", "2"], "gpipe", "rank=0,step=2,phase=forward,microbatch=1",
              16, False),
    # two stages per rank (stages r and r + 2 of 4), the interleaved 1F1B schedule; respawned:
    # each rank of the new replica receives both of its stages' state
    "pp-interleaved": (["--pp", "2"], "interleaved", "rank=1,step=2,phase=backward", 36, True),
}  # fmt: skip


# pp x TP runs with -m slow only: test_torchtitan.py's default test runs the same path in CI's run
# (2 replicas of pp 2 x TP 2 through replica.pipeline(), a rank SIGKILLed, the replica respawned,
# on the one-rank trajectory), and the two took 20 s and 29 s of a suite at its 10-minute budget.
SLOW_HERE = {"pp+tp"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_HERE else k for k in LAYOUTS],
)
def test_pipeline_replicas_survive_a_rank_kill_on_the_one_rank_trajectory(
    layout, custom_token_file, pipeline_reference, tmp_path
):
    """2 replicas of a pipeline layout; one rank of replica 1 is SIGKILLed inside a stage's
    forward or backward of step 2: its mates stop on the lost peer (status 7, one line each,
    even where the schedule re-raised the failed collective as its own error), replica 0
    recomputes the lost ids in the same step, and (where respawned) every rank of the new
    replica receives its stage's state at its position. The run stays on the one-rank run's
    trajectory. The pp x FSDP2 run also checkpoints step 8 (every rank of the writing replica
    writes its stage's shards under the whole model's names), and the one-rank form of the
    script resumes from it (DCP reshards on load) on the uninterrupted trajectory."""
    flags, schedule, fault, steps, respawn = LAYOUTS[layout]
    ranks = 1
    for size in flags[1::2]:
        ranks *= int(size)
    out = tmp_path / layout
    data = ["--data", str(custom_token_file), *ARGS, "--steps", str(steps)]
    checkpoints = ["--ckpt-every", "8"] if layout == "pp+shard" else []
    r = recover_run(
        out, "train_pipeline.py", "--replicas", "2", "--ranks-per-replica", str(ranks),
        *(["--respawn", "0"] if respawn else []), "--fault", f"kill:replica=1,{fault}",
        script_args=[*data, *flags, "--schedule", schedule, *checkpoints], timeout=200,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    killed = int(fault.split(",")[0].split("=")[1])
    mates = [k for k in range(ranks) if k != killed]
    for k in mates:
        assert f"replica 1 rank {k} exited with status 7" in r.stdout, r.stdout[-3000:]
    got = assert_on_the_reference(pipeline_reference(steps), out, steps)
    assert got[2]["attempts"] >= 2, got[2]  # the step was redone in the step, not skipped
    transfers = sorted((e["replica"], e["rank"]) for e in events(out / "job", "state_transfer"))
    assert transfers == ([(1, k) for k in range(ranks)] if respawn else []), transfers
    if checkpoints:
        assert_resumes_on_one_rank(out, pipeline_reference(steps), data, steps)


def assert_resumes_on_one_rank(staged: Path, reference: Path, data: list[str], steps: int) -> None:
    """The one-rank form resumes from the checkpoint `staged` saved at step 8 and finishes on
    the uninterrupted trajectory (the last steps' losses, the final model)."""
    saved = staged / "result" / "checkpoints"
    assert sorted(p.name for p in saved.iterdir() if p.name.startswith("step_")) == [
        "step_00000008"
    ]
    resumed = staged.parent / "resumed"
    (resumed / "result").mkdir(parents=True)
    shutil.copytree(saved, resumed / "result" / "checkpoints")
    r = recover_run(resumed, "train_pipeline.py", "--replicas", "1",
                    script_args=[*data, "--resume"])  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    got = _records(resumed)
    assert [x["step"] for x in got] == list(range(8, steps))
    for a, b in zip(_records(reference)[8:], got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
    pa = load_file(reference / "job" / "final" / "model.safetensors")
    pb = load_file(resumed / "job" / "final" / "model.safetensors")
    num = sum(float(((pa[k] - pb[k]).double() ** 2).sum()) for k in pa) ** 0.5
    den = sum(float((pa[k].double() ** 2).sum()) for k in pa) ** 0.5
    assert num / den <= 1e-4, num / den


# ---- how a part counts a schedule's losses (stand-in stages and schedule) ---------------------
class _Stage:
    """A stand-in pipeline stage: its chunk forward returns a fresh output per microbatch."""

    def __init__(self, is_last: bool) -> None:
        self.is_last = is_last

    def forward_one_chunk(self, chunk, *args, **kwargs):
        return torch.full((1,), float(chunk), requires_grad=True)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return None


class _Schedule:
    """Calls the loss once on an output of no microbatch (as shape inference does), then runs
    each chunk's forward, loss and backward, in order."""

    def __init__(self, stage, *, n_microbatches, loss_fn, scale_grads):
        assert scale_grads is False
        self.stage, self.n, self.loss_fn = stage, n_microbatches, loss_fn
        self.losses: list[float] = []

    def step(self, *, chunks=None):
        self.loss_fn(torch.ones(1), None)  # inference: counts nothing
        for i in chunks if chunks is not None else range(self.n):
            out = self.stage.forward_one_chunk(i)
            if self.stage.is_last:
                loss = self.loss_fn(out, None)
                self.losses.append(float(loss.detach()))
            self.stage.backward_one_chunk(i)


def _part(plan, phases=None, added=None):
    phase = (lambda *a: phases.append(a)) if phases is not None else (lambda *a: None)
    add = (lambda j, v: added.append((j, v))) if added is not None else (lambda j, v: None)
    follower = StageFollower()
    part = PipelinePart(5, plan, first_index=3, add_loss=add, phase=phase, follower=follower)
    follower.part = part
    return part


def test_a_part_counts_each_real_microbatch_once_by_its_output_and_zeroes_padding():
    phases, added = [], []
    part = _part([(7, True), (9, True), (7, False)], phases, added)
    assert part.ids == [7, 9, 7] and part.real == [True, True, False] and len(part) == 3
    schedule = part.schedule(_Schedule, _Stage(is_last=True), loss_fn=lambda out, _: out.sum() + 1)
    schedule.step()
    assert part._outputs == []  # no output (a last stage's activations) kept past its loss
    part.check()
    # each id's loss counted once, by its own output (the inference call counted nothing);
    # the padding pass's loss scaled to exactly 0
    assert added == [(7, 1.0), (9, 2.0)]
    assert schedule.losses == [1.0, 2.0, 0.0]
    # the phases of the K-th real microbatch of the rank's step (3 before this part)
    assert [p for p in phases if p[0] == "forward"] == [("forward", 5, 3), ("forward", 5, 4)]
    assert [p[0] for p in phases if p[2] == 4] == ["forward", "backward", "done"]
    assert part.next_index == 5


def test_a_part_refuses_a_schedule_that_skipped_losses_or_ran_no_stage():
    part = _part([(1, True), (2, True)])
    schedule = part.schedule(_Schedule, _Stage(is_last=True), loss_fn=lambda out, _: out.sum())
    schedule.step(chunks=[0])  # one of its two microbatches
    with pytest.raises(UsageError, match="1 losses for the 2 microbatches"):
        part.check()
    idle = _part([(1, True)])  # a schedule not built by part.schedule: no stage followed
    with pytest.raises(UsageError, match=r"build its schedule with part.schedule"):
        idle.check()
    with pytest.raises(UsageError, match="sets n_microbatches itself"):
        _part([(1, True)]).schedule(_Schedule, _Stage(True), loss_fn=abs, n_microbatches=1)
    stray = _part([(1, True)])
    stage = _Stage(is_last=True)
    stray.schedule(_Schedule, stage, loss_fn=lambda out, _: out.sum())
    with pytest.raises(UsageError, match="ran microbatch 1 of a part of 1"):
        stage.forward_one_chunk(1)


def test_a_stage_is_followed_once_and_runs_freely_outside_a_part():
    follower = StageFollower()
    stage = _Stage(is_last=False)
    follower.follow(stage)
    wrapped = stage.forward_one_chunk
    follower.follow(stage)
    assert stage.forward_one_chunk is wrapped  # not wrapped twice
    assert float(stage.forward_one_chunk(4)) == 4.0  # no part: the stage's own forward


class _NeedsTwo(_Schedule):
    """A schedule that refuses fewer microbatches than its 2 stages (as 1F1B does)."""

    def __init__(self, stage, *, n_microbatches, **kwargs):
        if n_microbatches < 2:
            raise ValueError(f"{n_microbatches} microbatches for 2 stages")
        super().__init__(stage, n_microbatches=n_microbatches, **kwargs)


def test_a_part_shorter_than_the_schedule_needs_grows_by_padding_passes():
    """A part of one reassigned id under a schedule that needs two microbatches: the part gets
    a padding pass (the id's data, loss scaled by 0, no fault phase), and the id counts once."""
    phases, added = [], []
    part = _part([(4, True)], phases, added)
    schedule = part.schedule(_NeedsTwo, _Stage(is_last=True), loss_fn=lambda out, _: out.sum() + 1)
    assert part.ids == [4, 4] and part.real == [True, False]
    assert part.batch(lambda j: torch.tensor([j]))[0].tolist() == [4, 4]
    schedule.step()
    part.check()
    assert added == [(4, 1.0)] and schedule.losses == [1.0, 0.0]
    assert [p for p in phases if p[0] == "forward"] == [("forward", 5, 3)]
    late = _part([(4, True)])
    late.batch(lambda j: torch.tensor([j]))  # the batch first: it would miss the padding
    with pytest.raises(UsageError, match="before part.batch"):
        late.schedule(_NeedsTwo, _Stage(is_last=True), loss_fn=lambda out, _: out.sum())
