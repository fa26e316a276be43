"""Job files (`recover train --config`): TOML tables per flag group, flags override the file,
unknown tables and keys refused with the nearest valid name, and a run folder's config.json read
back as a job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.cli import parse_args
from recover.runtime.spec import ReplicaSpec
from recover.training.config import TrainConfig

JOB = """
[train]
preset = "tiny"
steps = 12
warmup-steps = 2      # dashes or underscores alike
lr = 1e-3

[run]
data = "datasets/tiny"
quiet = true

[replica]
shard = 2
stall_timeout = 60
reduce_deadline = 12.5

[supervision]
lease = 2
balance = "equal"

[launch]
replicas = 3
fault = ["kill:replica=1,step=3,phase=backward"]
"""


def job(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_job_file_sets_every_group_and_flags_override_it(tmp_path):
    path = job(tmp_path, JOB)
    a = parse_args(["train", "--config", str(path)])
    assert (a.preset, a.steps, a.warmup_steps, a.lr) == ("tiny", 12, 2, 1e-3)
    assert a.data == Path("datasets/tiny") and a.quiet is True
    assert (a.shard, a.stall_s, a.reduce_deadline_s) == (2, 60.0, 12.5)
    assert (a.lease_s, a.balance, a.replicas) == (2.0, "equal", 3)
    assert a.fault == ["kill:replica=1,step=3,phase=backward"]
    assert a.min_replicas == 1 and a.seed == TrainConfig().seed  # what the file leaves out
    b = parse_args(["train", "--config", str(path), "--steps", "7", "--balance", "throughput"])
    assert (b.steps, b.balance, b.warmup_steps) == (7, "throughput", 2)  # the flags win
    c = parse_args(
        ["train", "--config", str(path), "--fault", "exit:replica=0,step=1,phase=commit"]
    )
    assert len(c.fault) == 2  # specs add up


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "[train]\nwarmup_step = 3\n",
            "[train] unknown key 'warmup_step'; did you mean 'warmup_steps'?",
        ),
        ("[trian]\nsteps = 3\n", "unknown table [trian]; did you mean 'train'?"),
        (  # a key of another table: the table it belongs to is named
            "[train]\ntensorboard = 'tb'\n",
            "[train] has no key 'tensorboard': it belongs to [replica]; move it there",
        ),
        ("[replica]\nstall_timeot = 3\n", "did you mean 'stall_timeout'?"),
        ("[train]\nsteps = 'ten'\n", "[train] steps must be a number, got 'ten'"),
        ("[train]\nsteps = 2.5\n", "[train] steps must be an integer"),
        ("[supervision]\nbalance = 'fast'\n", "balance must be one of throughput, equal"),
        ("[launch]\nfault = 'kill:replica=0,step=1,phase=commit'\n", "must be a list of strings"),
        ("[run]\nquiet = 1\n", "[run] quiet must be true or false"),
        ("[train\n", "not TOML"),
    ],
)
def test_a_bad_job_file_is_refused_naming_what_is_wrong(tmp_path, text, message):
    path = job(tmp_path, text)
    with pytest.raises(ValueError) as e:
        parse_args(["train", "--config", str(path)])
    assert message in str(e.value) and str(path) in str(e.value)


def test_a_saved_config_json_is_a_job(tmp_path):
    spec = ReplicaSpec.from_json('{"layout": {"tp": 2}, "stall_s": 42.0, "peak_tflops": 3.5}')
    train = TrainConfig(preset="tiny", steps=9, microbatches=6)
    saved = {
        "format": 1,
        "train": train.to_dict(),
        "data": {"path": "/data/tiny", "content_hash": "sha256:x", "vocab_size": 256},
        "model": {"n_layer": 2},
        "launch": {"mode": "recover", "replicas": 2, "min_replicas": 2,
                   "faults": ["kill:replica=1,step=3,phase=backward"],
                   "replica": json.loads(spec.to_json())},
    }  # fmt: skip
    path = job(tmp_path, json.dumps(saved), "config.json")
    a = parse_args(["train", "--config", str(path), "--out", str(tmp_path / "again")])
    from recover.cli import train_config_from_args

    assert train_config_from_args(a) == train
    assert ReplicaSpec.from_args(a) == spec
    assert (a.replicas, a.min_replicas, a.data) == (2, 2, Path("/data/tiny"))
    assert a.fault == ["kill:replica=1,step=3,phase=backward"]


RUN_JOB = """
[launch]
replicas = 3
ranks_per_replica = 2
start_timeout = 20
fault = ["exit:replica=1,step=2,phase=forward"]
[supervision]
respawn = 0.5
[replica]
stall_timeout = 30
log_level = "warning"
"""


def test_recover_run_takes_a_job_file_and_saves_its_resolved_job(tmp_path):
    from recover.jobconfig import read_job_file

    path = job(tmp_path, RUN_JOB)
    a = parse_args(["run", "--config", str(path), "--replicas", "4", "--", "python", "t.py"])
    assert (a.replicas, a.ranks_per_replica, a.start_timeout, a.respawn) == (4, 2, 20.0, 0.5)
    assert (a.stall_s, a.log_level) == (30.0, "warning")
    assert a.fault == ["exit:replica=1,step=2,phase=forward"]
    assert a.script_command == ["--", "python", "t.py"]
    # what `recover run` saves as RUN/job.json is a job file that gives the same flags back
    assert a.resolved_job["launch"]["replicas"] == 4
    saved = job(tmp_path, json.dumps({"job": a.resolved_job, "command": ["python"]}), "job.json")
    assert read_job_file(saved) == a.resolved_job
    b = parse_args(["run", "--config", str(saved), "--", "python", "t.py"])
    assert {k: v for k, v in vars(b).items() if k != "config"} == {
        k: v for k, v in vars(a).items() if k != "config"
    }
    with pytest.raises(ValueError, match=r"\[train\].*did you mean 'run'|unknown table \[train\]"):
        parse_args(["run", "--config", str(job(tmp_path, "[train]\nsteps = 3\n")), "--", "x"])


def test_coordinator_serve_takes_a_job_file_with_one_table(tmp_path):
    text = '[coordinator]\nreplicas = 3\nlease = 2.5\nbalance = "equal"\nlog-level = "debug"\n'
    path = job(tmp_path, text)
    a = parse_args(["coordinator", "serve", "--config", str(path), "--lease", "4"])
    assert (a.replicas, a.lease_s, a.balance, a.log_level) == (3, 4.0, "equal", "debug")
    assert a.resolved_job["coordinator"]["lease"] == 4.0
    for bad, message in (
        ("[launch]\nreplicas = 3\n", r"unknown table \[launch\]"),
        ("[coordinator]\nreplica = 3\n", "did you mean 'replicas'"),
        ('[coordinator]\nreplicas = 3\nlog_level = "loud"\n', "must be one of debug"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_args(["coordinator", "serve", "--config", str(job(tmp_path, bad))])


def test_the_resolved_job_is_kept_for_recover_train(tmp_path):
    a = parse_args(["train", "--config", str(job(tmp_path, JOB)), "--steps", "20"])
    assert a.resolved_job["train"]["steps"] == 20
    assert a.resolved_job["launch"]["fault"] == ["kill:replica=1,step=3,phase=backward"]
    assert "out" not in a.resolved_job["run"]  # unset (None) values are left out


def test_a_key_is_overridden_by_its_address_in_the_file(tmp_path):
    """`--TABLE.KEY VALUE` is the flag of that key in that table: the file's value is overridden
    and the resolved job says so; a wrong table or key is refused naming the right one."""
    a = parse_args(["train", "--config", str(job(tmp_path, JOB)), "--train.lr", "3e-4",
                    "--supervision.lease=2.5"])  # fmt: skip
    assert (a.lr, a.lease_s) == (3e-4, 2.5)
    assert a.resolved_job["train"]["lr"] == 3e-4 and a.resolved_job["supervision"]["lease"] == 2.5
    serve = parse_args(["coordinator", "serve", "--replicas", "2", "--coordinator.node-lease", "3"])
    assert serve.node_lease_s == 3.0
    run = parse_args(["run", "--launch.replicas", "3", "--", "python", "t.py", "--train.lr", "1"])
    assert run.replicas == 3  # and the words after -- are the script's, left alone:
    assert run.script_command[-2:] == ["--train.lr", "1"]
    for argv, message in (
        (
            ["train", "--train.tensorboard", "x"],
            r"\[train\] has no key 'tensorboard': it is in \[replica\]",
        ),
        (["train", "--trian.lr", "1"], r"no table \[trian\]; did you mean 'train'"),
        (["train", "--train.lrr", "1"], "did you mean 'lr'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_args(argv)
