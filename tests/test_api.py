"""The drop-in API with real processes: a script ReCoVer did not write, launched by `recover run`,
survives SIGKILLs on the failure-free trajectory; a respawned replica receives the script's own
optimizer and scheduler state; misuse of the API fails with a named error, never a hang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import recover.checkpoint
from conftest import (
    assert_faults_fired,
    child_env,
    events,
    finish,
    leftover_processes,
    run_cli,
    start_cli,
    wait_until,
)
from recover.record import read_metrics
from recover.runtime.env import COORDINATOR_ENV, REPLICA_ENV, SPEC_ENV

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
M = 6
# Long enough for a respawned replica (a warm fork) to join well before the end: the respawns
# joined at steps 5-7 (the FSDP2 script's replica of 2 ranks at 6-15) in full suite runs on 2
# cores, where a step takes 50-80 ms. The wake test, which needs the run going 2 s after a stop,
# paces its survivors rather than adding steps (the suite is CPU-bound; a paced step costs no
# more CPU than a plain one).
STEPS = 60


def start_run(out: Path, script: str | Path, *flags: str, script_args=()) -> subprocess.Popen:
    """`recover run FLAGS -- python SCRIPT --out OUT/result ...` (SCRIPT: a name in examples/,
    or a path; the job's folder is OUT/job), started with its output (stderr merged) piped."""
    cmd = [sys.executable, "-m", "recover.cli", "run", "--out", str(out / "job"), *flags, "--"]
    cmd += [sys.executable, str(EXAMPLES / script), "--out", str(out / "result"), *script_args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
    )


def recover_run(out: Path, script: str | Path, *flags: str, script_args=(), timeout: float = 150):
    """`start_run` run to its end (reaped on timeout), no process of it left behind."""
    r = finish(start_run(out, script, *flags, script_args=script_args), timeout)
    assert leftover_processes(str(out)) == [], "processes of the run were left behind"
    return r


def custom_with_replica_1(path: Path, change: str) -> Path:
    """A script that runs examples/train_custom.py, with the one-line `change` made in replica 1
    only (another flag, other data): what a misconfigured replica of a real job looks like."""
    path.write_text(
        "import os, runpy, sys\n"
        "import recover\n"
        "if os.environ['RECOVER_REPLICA_ID'] == '1':\n"
        f"    {change}\n"
        f"sys.argv[0] = {str(EXAMPLES / 'train_custom.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return path


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "result" / "losses.jsonl").read_text().splitlines()]


def assert_same_trajectory(reference: Path, out: Path, *, steps: int) -> None:
    """Every step recorded exactly once with all M microbatches; the committed losses within rtol
    1e-4 of the reference's, the final parameters within relative L2 1e-4."""
    ref, got = records(reference), records(out)
    assert [r["step"] for r in got] == list(range(steps)), "a step is missing or recorded twice"
    assert all(r["microbatches"] == M for r in got), "a step did not sum M microbatches"
    for a, b in zip(ref, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
    pa = torch.load(reference / "result" / "final.pt")
    pb = torch.load(out / "result" / "final.pt")
    num = sum(float(((pa[k] - pb[k]).double() ** 2).sum()) for k in pa) ** 0.5
    den = sum(float((pa[k].double() ** 2).sum()) for k in pa) ** 0.5
    assert num / den <= 1e-4, num / den


def custom_args(data: Path, steps: int = STEPS) -> list[str]:
    # Microbatches of 2 sequences of 32 tokens (the script's default is 4 of 64): the same code
    # paths at a quarter of the compute, which was most of this file's CPU time.
    return ["--data", str(data), "--steps", str(steps), "--microbatches", str(M),
            "--batch", "2", "--seq-len", "32"]  # fmt: skip


@pytest.fixture(scope="module")
def custom_reference(custom_token_file, tmp_path_factory) -> Path:
    """The failure-free run of the custom script, one replica: what every job of the script
    (any replica count, any failures) must reproduce, since M is the same."""
    out = tmp_path_factory.mktemp("custom-ref")
    r = recover_run(
        out, "train_custom.py", "--replicas", "1", script_args=custom_args(custom_token_file)
    )
    assert r.returncode == 0, r.stdout[-3000:]
    return out


@pytest.mark.timeout(240)
def test_a_script_of_its_own_survives_kills_and_its_respawns_get_its_state(
    custom_token_file, custom_reference, tmp_path
):
    """The script hands its update to the library (--early-update: attach(update=...)), which
    runs it while each step's vote completes, and then its next step's first microbatch
    (attach(ahead=...)). Replica 0, the writer, is SIGKILLed in its
    optimizer step of step 2 (its done report on record, so the step commits; its records never
    written), replica 1 in the backward of its second microbatch of step 3 (the first ran during
    step 2's vote); each is respawned at once.
    The survivor recomputes the lost ids of step 3 in the step (the run stays on the one-replica
    failure-free trajectory), and each respawned replica joins at a step boundary and receives
    the model, the SGD momentum and the LambdaLR state from a live replica (a joiner with a fresh
    optimizer or schedule would leave the trajectory).

    The record: the writer of step 3 (named by the coordinator with `records_from` 2: replica 2,
    the one survivor that saw step 2) writes step 2's record from what it kept. Every step is in
    the job's metrics.jsonl once, with the scalars its update returned (each update run during
    its vote) and those the script gave `replica.log`, in the
    script's own log once (`replica.committed_steps()`), and in TensorBoard once (the writers'
    mirrors); `recover compare` reads the job as a run."""
    tb = tmp_path / "tb"
    r = recover_run(
        tmp_path, "train_custom.py", "--replicas", "3", "--respawn", "0", "--tensorboard", str(tb),
        "--balance", "equal",  # (shares of 2: microbatch 1 of step 3 exists)
        "--fault", "kill:replica=0,step=2,phase=optimizer",
        "--fault", "kill:replica=1,step=3,phase=backward,microbatch=1",
        script_args=[*custom_args(custom_token_file), "--early-update"],
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    # (the reference steps its optimizer in the loop, after each commit)
    assert_same_trajectory(custom_reference, tmp_path, steps=STEPS)  # (the script's own log)
    job = tmp_path / "job"
    assert sorted(e["replica"] for e in events(job, "coordinator.member_dead"))[:2] == [0, 1]
    redone = {e["step"] for e in events(job, "coordinator.redo")}
    assert 3 in redone, redone
    transfers = {e["replica"] for e in events(job, "state_transfer")}
    assert transfers == {0, 1}, "a respawned replica never joined"

    steps = [e for e in read_metrics(job / "metrics.jsonl") if e["kind"] == "step"]
    assert sorted(e["step"] for e in steps) == list(range(STEPS)), "a step is missing or twice"
    by_step = {e["step"]: e for e in steps}
    # Replica 0 dies with its done report of step 2 on record. Whether the coordinator learns of
    # the death after the step's commit (replica 2, the writer of step 3's redo, fills step 2's
    # record: replica 1 died before its own step 3 ended) or before the others' done reports
    # (the commit's view names replica 1 the writer of step 2 at once) is a race of the
    # processes; either way step 2 is recorded once, by a survivor.
    assert by_step[1]["writer"] == 0 and by_step[2]["writer"] in (1, 2), (by_step[1], by_step[2])
    filled = [(e["replica"], e["steps"]) for e in events(job, "records_filled")]
    assert filled == ([(2, [2])] if by_step[2]["writer"] == 2 else []), filled
    assert all(e["microbatches"] == M and e["lr"] > 0 and e["grad_norm"] > 0 for e in steps)
    assert all(e["update_in_vote"] and e["parts"]["apply"] > 0 for e in steps), steps[:3]
    # The writer's first microbatch of each step ran during the last vote (the middle id of its
    # share of 2), but where the step's plan gave it other ids (a respawn's join moves shares).
    ahead = [s for s, e in by_step.items() if e.get("ahead")]
    assert len(ahead) >= STEPS // 2 and all(len(by_step[s]["ahead"]) == 1 for s in ahead), ahead
    own = {e["step"]: e["loss"] for e in records(tmp_path)}
    assert all(own[s] == e["loss"] for s, e in by_step.items()), "the two logs differ"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (s, pytest.approx(by_step[s]["loss"], rel=1e-6)) for s in range(STEPS)
    ]
    cmp = subprocess.run(
        [sys.executable, "-m", "recover.cli", "compare", str(custom_reference / "job"), str(job)],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    assert f"common committed steps     {STEPS}" in cmp.stdout, cmp.stdout


@pytest.mark.timeout(240)
def test_a_script_replica_woken_after_its_eviction_exits_4_and_writes_nothing(
    custom_token_file, custom_reference, tmp_path
):
    """Replica 0, the writer, stops (SIGSTOP) in its optimizer step of step 3, is evicted by its
    lease and woken 2 s later, while the others still train. It must not act on its stale view
    nor log its step: it exits 4 with one line and writes nothing. The others end cleanly: no
    SIGABRT when the evicted replica's exit closes the connections of the group they abandoned
    (they wait for its teardown before their interpreter ends), every step recorded once."""
    # Replica 1, a survivor, computes its (equal) share 4x slower from step 4: the 56 steps after
    # the stop last several seconds, not 3-5.
    r = recover_run(
        tmp_path, "train_custom.py", "--replicas", "3", "--lease", "0.5", "--balance", "equal",
        "--fault", "hang:replica=0,step=3,phase=optimizer,wake_after=2",
        "--fault", "slow:replica=1,step=4,factor=4",
        script_args=custom_args(custom_token_file),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "waking replica 0" in r.stdout, r.stdout[-3000:]
    assert "replica 0 was evicted by the coordinator (status 4)" in r.stdout, r.stdout[-3000:]
    for bad in ("Traceback", "terminate called", "SIGABRT"):
        assert bad not in r.stdout, r.stdout[-3000:]
    assert_same_trajectory(custom_reference, tmp_path, steps=STEPS)  # (its own log: once each)
    job = tmp_path / "job"
    (dead,) = events(job, "coordinator.member_dead")
    after = [
        rec
        for rec in read_metrics(job / "metrics.jsonl")
        if rec["t_wall"] > dead["t_wall"] and 0 in (rec.get("writer"), rec.get("replica"))
        and not rec.get("name", "").startswith(("coordinator.", "launcher."))
    ]  # fmt: skip
    assert after == [], "the evicted incarnation wrote to the run folder"
    steps = [e["step"] for e in read_metrics(job / "metrics.jsonl") if e["kind"] == "step"]
    assert sorted(steps) == list(range(STEPS))
    # Evicted by its lease long after step 3 committed, replica 0 never wrote that step's
    # record: the writer of step 4 (replica 1, the lowest survivor) filled it from what it kept.
    (filled,) = events(job, "records_filled")
    assert (filled["replica"], filled["steps"]) == (1, [3]), filled


@pytest.mark.timeout(240)
def test_sigterm_to_a_script_replica_is_a_planned_leave(
    custom_token_file, custom_reference, tmp_path
):
    """Replica 1's process gets a real SIGTERM (sent to itself as its step 5 begins, so the signal
    always meets the installed handler): its next done report asks to leave, the coordinator
    plans the step after without it, and nobody redoes anything; the run stays on the
    failure-free trajectory. (Leaving with `Leave` at the boundary, as before, cost the others a
    redo of the step they had begun with it in the plan.)"""
    script = tmp_path / "sigterm_at_step_5.py"
    script.write_text(
        "import os, runpy, signal, sys\n"
        "import recover\n"
        "if os.environ['RECOVER_REPLICA_ID'] == '1':\n"
        "    steps = recover.Replica.steps\n"
        "    def stopped_at_5(self, *args, **kwargs):\n"
        "        for step in steps(self, *args, **kwargs):\n"
        "            if step == 5:\n"
        "                os.kill(os.getpid(), signal.SIGTERM)\n"
        "            yield step\n"
        "    recover.Replica.steps = stopped_at_5\n"
        f"sys.argv[0] = {str(EXAMPLES / 'train_custom.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    r = recover_run(tmp_path, script, "--replicas", "3", script_args=custom_args(custom_token_file))
    assert r.returncode == 0, r.stdout[-3000:]
    assert_same_trajectory(custom_reference, tmp_path, steps=STEPS)
    job = tmp_path / "job"
    (stopped,) = events(job, "replica_stopped")
    assert stopped["replica"] == 1 and stopped["step"] == 7, stopped  # after step 6, its last
    assert not events(job, "coordinator.redo"), "a replica's planned leave cost a redo"
    (left,) = [
        e for e in events(job, "coordinator.epoch_changed") if "as they asked" in e["reason"]
    ]
    assert left["live"] == [0, 2]
    assert not events(job, "coordinator.member_dead")


@pytest.mark.timeout(120)
def test_python_in_the_command_is_the_launchers_and_one_without_torch_is_refused(tmp_path):
    """`recover run -- python SCRIPT` from a shell whose PATH does not hold the venv (it was not
    activated): the children's `python` is the launcher's interpreter all the same. A command
    naming a Python that cannot import torch is refused at once, in one line naming it, before
    any process starts (every replica would fail with the same ImportError)."""
    import os

    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nopen(sys.argv[1], 'w').write(sys.executable)\n")
    env = {**child_env(), "PATH": "/usr/bin:/bin"}  # as in a shell without the venv
    seen = tmp_path / "seen"
    cmd = [sys.executable, "-m", "recover.cli", "run", "--out", str(tmp_path / "job"), "--"]
    r = subprocess.run([*cmd, "python", str(probe), str(seen)], env=env, capture_output=True,
                       text=True, timeout=100)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.dirname(seen.read_text()) == os.path.dirname(sys.executable)
    other = shutil.which("python3", path="/usr/bin:/bin")
    if (
        other is None
        or subprocess.run([other, "-c", "import torch"], capture_output=True).returncode == 0
    ):
        pytest.skip("no Python without torch on this machine to refuse")
    r = subprocess.run([*cmd, other, str(probe), str(seen)], env=env, capture_output=True,
                       text=True, timeout=100)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    (said,) = r.stderr.strip().splitlines()
    assert other in said and "cannot import torch" in said, said


@pytest.mark.timeout(120)
def test_a_replica_with_other_settings_is_refused_with_the_field_named(custom_token_file, tmp_path):
    """The script's `config` is part of the fingerprint: a replica with another learning rate is
    refused at registration, naming the field, instead of silently diverging."""
    # Replica 1 runs with a 10x learning rate: the same script, one flag different.
    script = custom_with_replica_1(tmp_path / "lr_by_replica.py", "sys.argv += ['--lr', '0.5']")
    proc = start_run(
        tmp_path, script, "--replicas", "2", script_args=custom_args(custom_token_file, 4)
    )
    seen: list[str] = []
    try:
        # The refusal comes at registration; the other replica then waits for a run that cannot
        # form without it, so the launcher is stopped once the refused replica has exited.
        for line in proc.stdout:
            seen.append(line)
            if "exited with status 6" in line:
                break
        proc.terminate()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(seen)
    assert "fingerprint field 'config.lr' differs" in text, text[-3000:]
    assert "exited with status 6" in text, text[-3000:]
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(240)
def test_the_script_sharded_by_fsdp2_survives_a_rank_kill_and_rejoins(
    custom_token_file, custom_reference, tmp_path
):
    """examples/train_fsdp.py: the same model wrapped by the script with FSDP2 over the replica's
    mesh, 2 replicas of 2 ranks. Rank 0 of replica 1 is SIGKILLed in a forward: its mate stops on
    the lost peer (status 7, one line), replica 0 recomputes the lost ids; the replica is respawned
    and each of its ranks receives its position's shards of the model and of the SGD momentum
    (DTensors). The run equals the one-rank run of the unsharded script."""
    args = custom_args(custom_token_file)
    out = tmp_path / "fsdp"
    r = recover_run(
        out, "train_fsdp.py", "--replicas", "2", "--ranks-per-replica", "2", "--respawn", "0",
        "--fault", "kill:replica=1,rank=0,step=2,phase=forward", script_args=args,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "replica 1 rank 1 exited with status 7" in r.stdout
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    transfers = events(out / "job", "state_transfer")
    assert sorted((e["replica"], e["rank"]) for e in transfers) == [(1, 0), (1, 1)], transfers
    assert_same_trajectory(custom_reference, out, steps=STEPS)


@pytest.mark.timeout(120)
def test_the_nccl_reduce_is_refused_in_one_line_where_there_is_no_gpu(custom_token_file, tmp_path):
    """`--cross-reduce nccl` sums a script's gradients between GPUs. Where there are none (this
    machine): `recover run` refuses it in one line before anything starts; a replica started by
    hand with it in its spec (the many-machine way) says so in one line and exits 6 before it
    registers, so the run never counts it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: benchmarks/gpu_check.sh runs the NCCL path")
    args = custom_args(custom_token_file, 4)
    r = recover_run(tmp_path / "run", "train_custom.py", "--replicas", "2",
                    "--cross-reduce", "nccl", script_args=args, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--cross-reduce nccl needs a GPU per process" in r.stdout, r.stdout
    assert "[replica" not in r.stdout  # nothing started
    address = tmp_path / "coordinator.json"
    serve = start_cli(["coordinator", "serve", "--replicas", "1", "--port", "0",
                       "--address-file", str(address)])  # fmt: skip
    try:
        wait_until(address.exists, "the coordinator to listen", alive=[serve], timeout=30)
        port = json.loads(address.read_text())["port"]
        env = child_env() | {
            COORDINATOR_ENV: f"127.0.0.1:{port}", REPLICA_ENV: "0",
            SPEC_ENV: '{"cross_reduce": "nccl"}',
        }  # fmt: skip
        script = [sys.executable, str(EXAMPLES / "train_custom.py"), *args,
                  "--out", str(tmp_path / "by-hand")]  # fmt: skip
        hand = subprocess.run(script, capture_output=True, text=True, timeout=60, env=env)
        status = run_cli(["coordinator", "status", "--addr", f"127.0.0.1:{port}", "--json"])
    finally:
        serve.terminate()
        finish(serve, 30)
    assert hand.returncode == 6, hand.stdout + hand.stderr
    said = (hand.stdout + hand.stderr).strip().splitlines()
    assert any("--cross-reduce nccl sums gradients between GPUs" in x for x in said), said
    assert "Traceback" not in hand.stderr, hand.stderr
    assert json.loads(status.stdout)["members"] == []  # it never registered


@pytest.mark.timeout(180)
def test_a_deterministic_script_with_its_update_during_the_vote_keeps_its_bits(
    custom_token_file, tmp_path
):
    """--deterministic with a script: 3 replicas that run their update during the vote, one
    SIGKILLed in a backward (its ids recomputed in the step) and one in its update (after its done
    report: the step commits), give the bits of one replica stepping its optimizer in the loop:
    `recover compare --rtol 0` passes on every committed loss and the final parameters."""
    steps = 16
    args = custom_args(custom_token_file, steps)
    ref = recover_run(tmp_path / "one", "train_custom.py", "--replicas", "1", "--deterministic",
                      script_args=args)  # fmt: skip
    assert ref.returncode == 0, ref.stdout[-3000:]
    r = recover_run(
        tmp_path / "three", "train_custom.py", "--replicas", "3", "--deterministic",
        "--fault", "kill:replica=1,step=3,phase=backward",
        "--fault", "kill:replica=2,step=9,phase=optimizer",
        script_args=[*args, "--early-update"],
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    job = tmp_path / "three" / "job"
    assert_faults_fired(job)
    assert 3 in {e["step"] for e in events(job, "coordinator.redo")}
    steps_done = [e for e in read_metrics(job / "metrics.jsonl") if e["kind"] == "step"]
    assert sorted(e["step"] for e in steps_done) == list(range(steps))
    assert all(e["update_in_vote"] for e in steps_done)
    cmp = run_cli(["compare", str(tmp_path / "one" / "job"), str(job), "--rtol", "0"])
    assert cmp.returncode == 0 and "PASS" in cmp.stdout, cmp.stdout + cmp.stderr


@pytest.mark.timeout(240)
def test_a_script_checkpoints_its_own_state_and_resumes_on_the_same_trajectory(
    custom_token_file, tmp_path
):
    """examples/train_custom.py with --ckpt-every: the writer replica saves the script's own model,
    SGD momentum and LambdaLR state through recover.checkpoint (the code `recover train` uses).
    A run folder holding only the checkpoint after step 4 resumes (--resume, start_step from the
    checkpoint) and commits steps 4..7 on the uninterrupted run's trajectory."""
    steps = 8
    args = [*custom_args(custom_token_file, steps), "--ckpt-every", "4"]
    full = tmp_path / "full"
    r = recover_run(full, "train_custom.py", "--replicas", "2", script_args=args)
    assert r.returncode == 0, r.stdout[-3000:]
    saved = full / "result" / "checkpoints" / "step_00000004"
    state = recover.checkpoint.load(saved)
    assert state["meta"]["step"] == 4 and state["extra"]["scheduler"]["last_epoch"] == 4
    out = tmp_path / "resumed"
    shutil.copytree(saved, out / "result" / "checkpoints" / saved.name)
    r = recover_run(out, "train_custom.py", "--replicas", "2", script_args=[*args, "--resume"])
    assert r.returncode == 0, r.stdout[-3000:]
    ref, got = records(full), records(out)
    assert [x["step"] for x in got] == [4, 5, 6, 7]
    for a, b in zip(ref[4:], got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
    pa = torch.load(full / "result" / "final.pt")
    pb = torch.load(out / "result" / "final.pt")
    num = sum(float(((pa[k] - pb[k]).double() ** 2).sum()) for k in pa) ** 0.5
    den = sum(float((pa[k].double() ** 2).sum()) for k in pa) ** 0.5
    assert num / den <= 1e-4, num / den


@pytest.mark.timeout(120)
def test_data_that_depends_on_the_replica_is_caught_by_the_opt_in_check(
    custom_token_file, tmp_path
):
    """The contract broken on purpose: replica 1 reads other tokens for (step, j) than replica 0
    (as a data loader keyed by rank would). The example's check (check_data, every 5 steps)
    replays a microbatch on every replica; the run stops at step 0 saying the data differs."""
    script = custom_with_replica_1(
        tmp_path / "impure_data.py",
        "pure = recover.TokenWindows.batch; "
        "recover.TokenWindows.batch = lambda self, step, j: pure(self, step + 1, j)",
    )
    r = recover_run(
        tmp_path, script, "--replicas", "2", script_args=custom_args(custom_token_file, 6),
        timeout=100,
    )  # fmt: skip
    assert r.returncode != 0
    assert "PARAMETERS DIVERGED at step 0" in r.stdout, r.stdout[-3000:]
    assert "The data parts differ" in r.stdout, r.stdout[-3000:]
    assert leftover_processes(str(tmp_path)) == []


@pytest.mark.timeout(180)
def test_a_script_that_splits_its_replica_by_tensor_parallelism(tmp_path):
    """tests/scripts/tp_mlp.py applies tensor parallelism itself over `replica.mesh` (replicas of
    2 ranks, tp=2: both ranks compute the same ids, the loss counts once). Rank 1 of replica 1
    is SIGKILLed in a backward; the run equals the one-rank run of the same script."""
    script = Path(__file__).parent / "scripts" / "tp_mlp.py"

    def run(out: Path, *flags: str, tp: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "recover.cli", "run", "--out", str(out / "job"), *flags]
        cmd += ["--", sys.executable, str(script), "--tp", str(tp), "--out", str(out / "result")]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
        )
        return finish(proc, 150)

    assert run(tmp_path / "ref", "--replicas", "1", tp=1).returncode == 0
    r = run(
        tmp_path / "tp", "--replicas", "2", "--ranks-per-replica", "2",
        "--fault", "kill:replica=1,rank=1,step=4,phase=backward", tp=2,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert events(tmp_path / "tp" / "job", "coordinator.redo"), "the kill was not recovered from"
    assert_same_trajectory(tmp_path / "ref", tmp_path / "tp", steps=10)
    assert leftover_processes(str(tmp_path)) == []
