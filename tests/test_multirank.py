"""Replicas of several ranks: HSDP (FSDP2 inside a replica) and tensor parallel, with the
fault-tolerant reduce across replicas.

Real processes and real faults: 2 replicas x 2 ranks against the failure-free one-rank run with
the same seed and M. A fault hits one rank of a replica; its replica-mate must stop (peer error
or watchdog), the coordinator must declare that replica dead, and the other replica must finish
the step with all M microbatches on the same trajectory. Every process of the run must be gone
at the end.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_multireplica import STEPS, M, failure_free_run, train

from conftest import TRAJECTORY_RTOL, events
from conftest import assert_invariants as check_invariants
from recover.checkpoint.state import read_checkpoint
from recover.launch import LaunchConfig, check_gpu_placement
from recover.runtime.faults import parse_fault
from recover.runtime.layout import ReplicaLayout
from recover.runtime.spec import ReplicaSpec
from recover.tooling.compare import compare_runs
from recover.training.config import check_layout_fits


def assert_invariants(reference: Path, out: Path, r) -> None:
    check_invariants(reference, out, r, steps=STEPS, microbatches=M)


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory) -> Path:
    return failure_free_run(tiny_dataset, tmp_path_factory)


def two_by_two(data: Path, out: Path, layout: str, *extra: str):
    # Equal shares: replica 1 holds ids 3, 4, 5 of every step (the plan is predictable).
    flags = ["--replicas", "2", f"--{layout}", "2", "--watchdog", "2", "--balance", "equal"]
    return train(data, out, *flags, *extra)


def hsdp(data: Path, out: Path, *extra: str):
    return two_by_two(data, out, "shard", *extra)


def assert_two_ranks_per_replica(out: Path, layout: str, *, split: bool) -> None:
    """Each replica really is two processes; `split`: each holds part of the model."""
    ranks = {(e["replica"], e["rank"]): e for e in events(out, "rank_started")}
    assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in (0, 1):
        held = [ranks[r, k]["local_values"] for k in (0, 1)]
        assert all(ranks[r, k]["layout"] == layout for k in (0, 1))
        assert min(held) > 0 and max(held) < ranks[r, 0]["model_values"], held
        if split:  # FSDP2: the two halves are the whole model
            assert sum(held) == ranks[r, 0]["model_values"], held


def test_two_replicas_of_two_sharded_ranks_equal_one_rank(reference, tiny_dataset, tmp_path):
    out = tmp_path / "hsdp"
    r = hsdp(tiny_dataset, out)
    assert_invariants(reference, out, r)
    assert {e["replica"] for e in events(out, "replica_finished")} == {0, 1}
    assert not events(out, "coordinator.member_dead")
    assert_two_ranks_per_replica(out, "shard", split=True)


def test_killed_rank_stops_its_replica_and_the_other_finishes_the_step(
    reference, tiny_dataset, tmp_path
):
    out = tmp_path / "kill"
    r = hsdp(tiny_dataset, out, "--fault", "kill:replica=1,rank=1,step=2,phase=backward")
    assert_invariants(reference, out, r)
    (injected,) = events(out, "failure_injected")
    assert (injected["replica"], injected["rank"], injected["step"]) == (1, 1, 2)
    (lost,) = events(out, "replica_mate_lost")
    assert (lost["replica"], lost["rank"]) == (1, 0)  # the mate stopped itself ...
    (dead,) = events(out, "coordinator.member_dead")
    assert dead["replica_id"] == 1  # ... and the coordinator saw the whole replica go
    (redo,) = events(out, "coordinator.redo")
    assert redo["step"] == 2 and sorted(redo["lost"]) == [3, 4, 5]
    assert {e["replica"] for e in events(out, "replica_finished")} == {0}


def test_hung_rank_is_caught_by_the_watchdog(reference, tiny_dataset, tmp_path):
    out = tmp_path / "hang"
    r = hsdp(tiny_dataset, out, "--fault", "hang:replica=1,rank=1,step=2,phase=forward")
    assert_invariants(reference, out, r)  # includes: the stopped rank was reaped
    (lost,) = events(out, "replica_mate_lost")
    assert (lost["replica"], lost["rank"], lost["mate"]) == (1, 0, 1)
    assert "silent" in lost["reason"]
    # Before ending itself, the watchdog dumped every thread's stack to the rank's output.
    dump = r.stdout.split("replica 1 rank 0: the stacks of all threads", 1)
    assert len(dump) == 2 and "in _watch" in dump[1] and "in _lost" in dump[1], r.stdout[-3000:]
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [1]


def test_a_frozen_rank_stops_its_replica_through_the_stall_guard(reference, tiny_dataset, tmp_path):
    # Rank 1's training thread blocks in a forward while its watchdog thread keeps ticking (the
    # watchdog alone would never fire); its mate blocks in FSDP2's all-gather with it. The stall
    # guard ends the frozen rank (and its stuck mate) after 2 s; replica 0 finishes the step.
    out = tmp_path / "freeze"
    r = hsdp(
        tiny_dataset, out, "--stall-timeout", "2",
        "--fault", "freeze:replica=1,rank=1,step=2,phase=forward",
    )  # fmt: skip
    assert_invariants(reference, out, r)
    # Which of the two ranks' guards fires first is a race: the mate's last tick (its own forward
    # phase, just before the all-gather that then waits) can come before or after rank 1 froze.
    # Either way it is the stall guard that stopped replica 1.
    assert {e["rank"] for e in events(out, "stalled") if e["replica"] == 1}, "no stall caught"
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [1]
    assert {e["replica"] for e in events(out, "replica_finished")} == {0}


def test_killed_leader_takes_its_replica_down_during_the_reduce(reference, tiny_dataset, tmp_path):
    out = tmp_path / "leader"
    r = hsdp(tiny_dataset, out, "--fault", "kill:replica=1,rank=0,step=3,phase=reduce")
    assert_invariants(reference, out, r)
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [1]
    assert "replica 1 rank 1 exited with status 7" in r.stdout  # its follower stopped itself


def test_two_replicas_of_two_tensor_parallel_ranks_equal_one_rank(
    reference, tiny_dataset, tmp_path
):
    out = tmp_path / "tp"
    r = two_by_two(tiny_dataset, out, "tp")
    assert_invariants(reference, out, r)
    # Blocks are split, embeddings and norms are whole on both ranks: each holds more than half.
    assert_two_ranks_per_replica(out, "tp", split=False)


def test_two_replicas_of_two_pipeline_stages_equal_one_rank(reference, tiny_dataset, tmp_path):
    out = tmp_path / "pp"
    r = two_by_two(tiny_dataset, out, "pp")
    assert_invariants(reference, out, r)
    assert_two_ranks_per_replica(out, "pp", split=False)  # the tied embedding is on both ends


@pytest.mark.parametrize(
    "layout, fault, dead, step, lost",
    [
        # A TP rank dies in the forward of its second microbatch: its mate is inside the same
        # all-reduce of that forward.
        ("tp", "kill:replica=0,rank=1,step=1,phase=forward,microbatch=1", 0, 1, [0, 1, 2]),
        # The last stage dies in the backward of its second microbatch; the first stage is then
        # waiting for that microbatch's gradient.
        ("pp", "kill:replica=1,rank=1,step=2,phase=backward,microbatch=1", 1, 2, [3, 4, 5]),
    ],
)
def test_a_rank_killed_inside_a_layout(
    layout, fault, dead, step, lost, reference, tiny_dataset, tmp_path
):
    out = tmp_path / f"{layout}-kill"
    r = two_by_two(tiny_dataset, out, layout, "--fault", fault)
    assert_invariants(reference, out, r)
    (mate,) = events(out, "replica_mate_lost")
    assert (mate["replica"], mate["rank"]) == (dead, 0)  # rank 0 stopped itself
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [dead]
    (redo,) = events(out, "coordinator.redo")
    assert redo["step"] == step and sorted(redo["lost"]) == lost
    assert {e["replica"] for e in events(out, "replica_finished")} == {1 - dead}


@pytest.mark.parametrize(
    "layout, resume_as",
    [("shard", ["--replicas", "2"]), ("pp", ["--replicas", "2", "--tp", "2", "--watchdog", "2"])],
)
def test_quorum_lost_checkpoints_the_whole_state_and_another_layout_resumes_it(
    layout, resume_as, reference, tiny_dataset, tmp_path
):
    # The run needs both replicas: replica 1 losing a rank stops it. Replica 0's two ranks each
    # write their own part of the state into one DCP checkpoint (no gather): --resume with
    # another layout (FSDP2 shards -> one rank per replica; pipeline stages -> tensor parallel)
    # reads the parts it needs and continues the same trajectory.
    out = tmp_path / f"quorum-{layout}"
    r = two_by_two(
        tiny_dataset, out, layout, "--min-replicas", "2",
        "--fault", "kill:replica=1,rank=1,step=2,phase=backward",
    )  # fmt: skip
    assert r.returncode != 0 and "quorum lost" in r.stdout
    ckpt = out / "checkpoints" / "step_00000002"
    assert [c.name for c in (out / "checkpoints").iterdir()] == [ckpt.name]
    shards = sorted(f.stat().st_size for f in ckpt.glob("*.distcp"))
    assert len(shards) == 2 and min(shards) > 0.2 * sum(shards), shards  # both ranks wrote
    state = read_checkpoint(ckpt)
    assert all(isinstance(k, str) for k in state["optimizer"]["state"])  # by name
    assert state["meta"]["layout"] == {layout: 2}  # (who saved it: for people, not checked)
    resumed = train(tiny_dataset, out, *resume_as, "--resume")
    assert_invariants(reference, out, resumed)
    layouts = {e["layout"] for e in events(out, "rank_started")}
    assert layouts == {layout, "tp" if layout == "pp" else "single"}, layouts


def keep_up_to(run: Path, out: Path, step: int) -> None:
    """A copy of `run` as it stood when the checkpoint of `step` was published: its config, that
    checkpoint, and the records of the steps before it (nothing of the later steps or events)."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.json", out / "config.json")
    name = f"step_{step:08d}"
    shutil.copytree(run / "checkpoints" / name, out / "checkpoints" / name)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if (r := json.loads(ln))["kind"] == "step" and r["step"] < step]
    (out / "metrics.jsonl").write_text("".join(kept))


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "replicas",
    [2, pytest.param(4, marks=pytest.mark.slow)],  # (4: the same, with 8 processes)
)
def test_a_checkpoint_of_sharded_replicas_resumes_as_tp_replicas_and_as_one_rank(
    replicas, reference, tiny_dataset, tmp_path
):
    # Replicas of --shard 2: the writer replica's two ranks each write their own shards of the
    # checkpoint after step 2 (no gather). It resumes as 2 replicas of --tp 2, and as one rank:
    # each reads its part, and both land on the failure-free trajectory.
    sharded = tmp_path / "sharded"
    r = train(
        tiny_dataset, sharded, "--replicas", str(replicas), "--shard", "2", "--watchdog", "5",
        "--ckpt-every", "2", timeout=240,
    )  # fmt: skip
    assert_invariants(reference, sharded, r)
    ckpt = sharded / "checkpoints" / "step_00000002"
    shards = sorted(f.stat().st_size for f in ckpt.glob("*.distcp"))
    assert len(shards) == 2 and min(shards) > 0.2 * sum(shards), shards  # both ranks wrote
    assert read_checkpoint(ckpt)["meta"]["layout"] == {"shard": 2}
    for name, flags in (("tp", ["--replicas", "2", "--tp", "2", "--watchdog", "5"]), ("one", [])):
        out = tmp_path / name
        keep_up_to(sharded, out, 2)
        resumed = train(tiny_dataset, out, *flags, "--resume", timeout=240)
        assert resumed.returncode == 0, resumed.stdout[-4000:]
        assert {e["step"] for e in events(out, "resumed")} == {2}
        assert {e["path"] for e in events(out, "resumed")} == {str(out / ckpt.relative_to(sharded))}
        result = compare_runs(reference, out)  # steps 0, 1 sharded; 2.. in the new layout
        assert result.common_steps == STEPS and result.max_loss_rel_diff <= TRAJECTORY_RTOL, result
        assert result.param_rel_l2 is not None and result.param_rel_l2 <= TRAJECTORY_RTOL, result
    assert {e["layout"] for e in events(tmp_path / "tp", "rank_started")} == {"tp"}


def test_two_dimensional_replicas_shard_by_tp(reference, tiny_dataset, tmp_path):
    # 2 replicas of 2 x 2 ranks (FSDP2 across TP pairs). Rank 3 (shard 1, tp 1) of replica 1
    # dies in the backward of step 2; its three mates stop, the other replica finishes the step.
    out = tmp_path / "2d"
    r = train(
        tiny_dataset, out, "--replicas", "2", "--shard", "2", "--tp", "2", "--watchdog", "2",
        "--balance", "equal", "--fault", "kill:replica=1,rank=3,step=2,phase=backward",
    )  # fmt: skip
    assert_invariants(reference, out, r)
    ranks = {(e["replica"], e["rank"]): e for e in events(out, "rank_started")}
    assert sorted(ranks) == [(r, k) for r in (0, 1) for k in range(4)]
    assert {e["layout"] for e in ranks.values()} == {"shard+tp"}
    held = [ranks[0, k]["local_values"] for k in range(4)]
    assert max(held) < ranks[0, 0]["model_values"] / 2, held  # split both ways
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [1]
    (redo,) = events(out, "coordinator.redo")
    assert redo["step"] == 2 and sorted(redo["lost"]) == [3, 4, 5]


@pytest.mark.parametrize(
    "inside, layout, fault",
    [
        # Stages split by TP (mesh pp x tp: ranks 0, 1 are stage 0). The last stage's tp-1 rank
        # dies in the backward of its first microbatch of step 2.
        (["--tp", "2"], "pp+tp", "kill:replica=1,rank=3,step=2,phase=backward"),
        # Stages sharded by FSDP2 (mesh pp x shard): two pipelines per replica, the replica's
        # ids dealt over them. The first stage's shard-1 rank dies in a forward.
        (["--shard", "2"], "pp+shard", "kill:replica=0,rank=1,step=3,phase=forward"),
    ],
)
def test_pipeline_stages_that_are_split_or_sharded(
    inside, layout, fault, reference, tiny_dataset, tmp_path
):
    out = tmp_path / layout
    r = train(
        tiny_dataset, out, "--replicas", "2", "--pp", "2", *inside, "--watchdog", "2",
        "--balance", "equal", "--fault", fault,
    )  # fmt: skip
    assert_invariants(reference, out, r)
    ranks = {(e["replica"], e["rank"]): e for e in events(out, "rank_started")}
    assert sorted(ranks) == [(r, k) for r in (0, 1) for k in range(4)]
    assert {e["layout"] for e in ranks.values()} == {layout}
    dead = parse_fault(fault).replica
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [dead]
    assert {e["replica"] for e in events(out, "replica_finished")} == {1 - dead}


def bf16_tolerance(*failure_free: Path) -> float:
    """bf16's noise floor, measured here: the largest difference (relative loss per step, relative
    L2 of the final parameters) between failure-free bf16 runs of different layouts, or the
    stated tolerance where that is larger. Autocast rounds the weights to bf16 at every forward,
    so a layout's other summation order (a 1e-7 difference in fp32) flips roundings and grows
    within a few steps to a spread that depends on the CPU's bf16 kernels. Between one rank and
    2 x 2 sharded ranks, measured on an AMD EPYC with AVX-512 BF16: 2.8e-5 of the parameters; on
    the same machine limited to AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2):
    1.13e-4, as issue 14 reported from an EPYC without AVX-512. A fixed bound cannot hold on both;
    this one is measured on the machine that runs the test."""
    spreads = [TRAJECTORY_RTOL]
    for a, b in itertools.combinations(failure_free, 2):
        c = compare_runs(a, b)
        assert c.param_rel_l2 is not None, (a, b)
        spreads += [c.max_loss_rel_diff, c.param_rel_l2]
    return max(spreads)


@pytest.mark.timeout(300)  # four runs, two of them 2 x 2 ranks
def test_bf16_autocast_recovers_on_the_bf16_trajectory(reference, tiny_dataset, tmp_path):
    # --precision bf16 runs the forward under bf16 autocast (gradients, sums and optimizer state
    # stay fp32): a different trajectory from fp32, which a recovered run must still follow.
    # Like is compared with like: the recovered 2 x 2 sharded run against the failure-free run of
    # the same layout, within bf16's noise floor measured between failure-free layouts.
    bf16 = ("--precision", "bf16")
    one, two, sharded = tmp_path / "bf16-one", tmp_path / "bf16-two", tmp_path / "bf16-hsdp"
    for r in (
        train(tiny_dataset, one, "--replicas", "1", *bf16),
        train(tiny_dataset, two, "--replicas", "2", "--balance", "equal", *bf16),
        hsdp(tiny_dataset, sharded, *bf16),
    ):
        assert r.returncode == 0, r.stdout[-3000:]
    tol = bf16_tolerance(one, two, sharded)
    # Autocast really ran: it moved the trajectory from fp32's by more than bf16's own noise.
    assert compare_runs(reference, one).param_rel_l2 > tol
    out = tmp_path / "bf16-hsdp-kill"
    r = hsdp(tiny_dataset, out, *bf16, "--fault", "kill:replica=1,rank=1,step=2,phase=backward")
    check_invariants(sharded, out, r, steps=STEPS, microbatches=M, rtol=tol)
    # Hence within twice the floor of the one-rank bf16 trajectory (through the sharded one).
    check_invariants(one, out, r, steps=STEPS, microbatches=M, rtol=2 * tol)
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [1]


def _launch(replicas: int, faults=(), *, shard=1, tp=1, pp=1, **spec) -> LaunchConfig:
    layout = ReplicaLayout(shard=shard, tp=tp, pp=pp)
    return LaunchConfig(
        replicas=replicas, faults=faults, replica=ReplicaSpec(layout=layout, **spec)
    )


@pytest.mark.unit
def test_layout_flags_are_checked():
    spec = parse_fault("kill:replica=1,rank=1,step=2,phase=backward,microbatch=1")
    assert (spec.rank, spec.microbatch) == (1, 1)
    with pytest.raises(ValueError, match="rank 2"):
        _launch(2, (parse_fault("kill:replica=0,rank=2,step=1,phase=reduce"),), shard=2)
    with pytest.raises(ValueError, match="--shard"):
        _launch(2, shard=0)
    assert _launch(2, shard=2, tp=2).ranks == 4
    with pytest.raises(ValueError, match="must divide the tiny preset's 2 attention heads"):
        check_layout_fits("tiny", 3)
    check_layout_fits("small", 4)
    with pytest.raises(ValueError, match="--pp 3 exceeds the tiny preset's 2 layers"):
        check_layout_fits("tiny", 1, 3)
    assert _launch(2, shard=2, tp=2, pp=2).ranks == 8
    # The cross-replica reduce over NCCL: GPUs only, one per process, checked before any start.
    with pytest.raises(ValueError, match="--cross-reduce nccl reduces between GPUs"):
        _launch(2, device="cpu", cross_reduce="nccl")
    with pytest.raises(ValueError, match="--cross-reduce must be one of gloo, nccl"):
        _launch(2, cross_reduce="mpi")
    nccl = _launch(2, shard=2, cross_reduce="nccl")
    with pytest.raises(ValueError, match="4 processes, 2 GPUs visible"):
        check_gpu_placement(nccl, gpus=2)
    check_gpu_placement(nccl, gpus=4)
    with pytest.raises(ValueError, match="a replica of 2 ranks on GPUs needs 2 GPUs"):
        check_gpu_placement(_launch(2, shard=2), gpus=1)
    check_gpu_placement(_launch(4), gpus=1)  # gloo across: replicas share a GPU
    check_gpu_placement(_launch(2, shard=2, device="cpu"), gpus=1)
    assert _launch(2, tp=2, pp=2).layout.dims == {"pp": 2, "tp": 2}  # mesh order


def _gpu_case(flags: list[str], gpus: int):
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= gpus
    return pytest.param(
        flags,
        marks=[pytest.mark.gpu, pytest.mark.skipif(not enough, reason=f"needs {gpus} GPU(s)")],
        id=" ".join(flags),
    )


@pytest.mark.parametrize(
    "flags",
    [
        # Two replicas of one rank share one GPU; the cross-replica reduce on gloo (host copy).
        _gpu_case(["--replicas", "2"], 1),
        _gpu_case(["--replicas", "2", "--precision", "bf16"], 1),
        # NCCL inside a replica (its two ranks on two GPUs) ...
        _gpu_case(["--replicas", "2", "--shard", "2", "--watchdog", "5"], 2),
        # ... and NCCL across replicas (a GPU per process).
        _gpu_case(["--replicas", "2", "--cross-reduce", "nccl"], 2),
    ],
)
@pytest.mark.timeout(600)  # up to three runs, each starting CUDA
def test_on_gpus_a_killed_replica_is_recovered(flags, tiny_dataset, tmp_path):
    # The GPU smoke run: the reference is a one-replica run on the GPU (same precision), so
    # the check is the recovery, not CPU against GPU arithmetic.
    precision = flags[flags.index("--precision") :][:2] if "--precision" in flags else []
    reference = tmp_path / "gpu-one"
    r = train(tiny_dataset, reference, "--replicas", "1", "--device", "cuda", *precision)
    assert r.returncode == 0, r.stdout
    out = tmp_path / "gpu"
    r = train(
        tiny_dataset, out, *flags, "--device", "cuda", "--balance", "equal",
        "--fault", "kill:replica=1,step=2,phase=backward", timeout=180,
    )  # fmt: skip
    if precision:  # bf16: like with like, within bf16's noise floor measured on this GPU
        failure_free = tmp_path / "gpu-failure-free"
        ff = train(
            tiny_dataset, failure_free, *flags, "--device", "cuda", "--balance", "equal",
            timeout=180,
        )  # fmt: skip
        assert ff.returncode == 0, ff.stdout[-3000:]
        tol = bf16_tolerance(reference, failure_free)
        check_invariants(failure_free, out, r, steps=STEPS, microbatches=M, rtol=tol)
        check_invariants(reference, out, r, steps=STEPS, microbatches=M, rtol=2 * tol)
    else:
        assert_invariants(reference, out, r)
    assert {e["device"] for e in events(out, "rank_started")} >= {"cuda:0"}
    assert [d["replica_id"] for d in events(out, "coordinator.member_dead")] == [1]
