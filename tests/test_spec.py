"""The replica spec and the launcher's environment: one object, one serialised form, clear errors."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest

from recover.runtime.env import SPEC_ENV, RankEnv, ReplicaEnv, device_index
from recover.runtime.layout import ReplicaLayout
from recover.runtime.spec import ReplicaSpec, add_spec_flags
from recover.training.config import TrainConfig


def _parse(argv: list[str], **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_spec_flags(parser, **kw)
    return parser.parse_args(argv)


def test_every_setting_has_a_flag_with_help_and_its_default_shown():
    parser = argparse.ArgumentParser()
    add_spec_flags(parser)
    by_dest = {a.dest: a for a in parser._actions}
    for f in fields(ReplicaSpec):
        if f.name == "layout":
            continue
        action = by_dest[f.name]
        assert action.help and action.default == f.default, f.name
        assert action.choices or "default" in action.help, f.name
    assert {"pp", "shard", "tp"} <= set(by_dest)


def test_flags_make_the_spec_and_json_brings_it_back_whole():
    spec = ReplicaSpec.from_args(
        _parse(["--shard", "2", "--tp", "2", "--watchdog", "7.5", "--stall-timeout", "0",
                "--mode", "shrink", "--check-every", "3"])
    )  # fmt: skip
    assert spec.layout == ReplicaLayout(shard=2, tp=2) and spec.layout.ranks == 4
    assert (spec.watchdog_s, spec.stall_s, spec.mode, spec.check_every) == (7.5, 0.0, "shrink", 3)
    assert ReplicaSpec.from_json(spec.to_json()) == spec
    # A switch that is on by default is turned off by --no-X (and --X says it again).
    assert spec.ahead and spec.why_not_ahead() is not None  # (replicas of 4 ranks)
    assert ReplicaSpec.from_args(_parse([])).why_not_ahead() is None
    off = ReplicaSpec.from_args(_parse(["--no-ahead"]))
    assert not off.ahead and "--no-ahead" in off.why_not_ahead()
    assert ReplicaSpec.from_args(_parse(["--ahead"])).ahead
    assert "--deterministic" in ReplicaSpec(deterministic=True).why_not_ahead()
    # A launcher's child gets it through the environment, with who it is.
    env = ReplicaEnv(coordinator=("127.0.0.1", 5000), replica_id=3, spec=spec, token="t")
    back = ReplicaEnv.from_environ(env.to_environ())
    assert back == env


def test_a_partial_spec_keeps_the_defaults_and_a_wrong_one_is_named():
    spec = ReplicaSpec.from_json('{"stall_s": 600, "layout": {"shard": 2}}')
    assert spec == ReplicaSpec(stall_s=600.0, layout=ReplicaLayout(shard=2))
    for text, match in (
        ('{"stal_s": 1}', r"unknown fields \['stal_s'\]"),
        ("[1]", "must be a JSON object"),
        ("{not json", "is not JSON"),
        ('{"layout": {"dp": 2}}', "unknown replica dimension"),
        ('{"watchdog_s": 0}', "--watchdog must be a finite number > 0"),
        ('{"check_every": -1}', "--check-every must be an int >= 0"),
        ('{"heartbeat_s": true}', "--heartbeat must be a finite number > 0"),
        ('{"mode": "torchft"}', "--mode must be one of recover, checkpoint-restart, shrink"),
    ):
        with pytest.raises(ValueError, match=match):
            ReplicaSpec.from_json(text, name=SPEC_ENV)
    env = {"RECOVER_COORDINATOR": "h:1", "RECOVER_REPLICA_ID": "0", SPEC_ENV: '{"stall_s": -1}'}
    with pytest.raises(ValueError, match="--stall-timeout must be a finite number >= 0"):
        ReplicaEnv.from_environ(env)


def test_a_subset_of_flags_for_scripts_and_the_rest_keep_their_defaults():
    args = _parse(["--watchdog", "9"], scripts=True)
    assert not hasattr(args, "mode") and not hasattr(args, "shard")
    assert {"watchdog_s", "stall_s", "heartbeat_s"} <= set(vars(args))
    assert ReplicaSpec.from_args(args) == ReplicaSpec(watchdog_s=9.0)


def test_the_ranks_of_a_replica_come_whole_or_not_at_all():
    assert RankEnv.from_environ({}) is None
    full = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert RankEnv.from_environ(full) == RankEnv(
        rank=1, world_size=2, master_addr="127.0.0.1", master_port=29500
    )
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set"):
        RankEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK must be an int"):
        RankEnv.from_environ({**full, "RANK": "x"})
    assert device_index({"LOCAL_RANK": "3"}) == 3
    assert device_index({"RECOVER_DEVICE_INDEX": "1", "LOCAL_RANK": "3"}) == 1


def test_the_train_config_crosses_to_a_worker_whole():
    cfg = TrainConfig(steps=7, lr=3e-4, precision="bf16")
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    partial = json.dumps({"steps": 7})
    with pytest.raises(ValueError, match="every TrainConfig field"):
        TrainConfig.from_json(partial)


def test_the_reduce_deadline_reaches_the_collective():
    """A setting added later (--reduce-deadline): one field in the spec, and every process that
    builds the collective gets it, from a flag or from the launcher's JSON."""
    spec = ReplicaSpec.from_args(_parse(["--reduce-deadline", "90"]))
    assert ReplicaSpec.from_json(spec.to_json()).collective().op_deadline_s == 90.0
    assert spec.collective().pg_timeout_s >= 90.0  # gloo's backstop never fires first
    assert ReplicaSpec().collective().op_deadline_s == 30.0
    assert ReplicaSpec.from_args(_parse(["--reduce-deadline", "5"], scripts=True)).collective()
    with pytest.raises(ValueError, match="--reduce-deadline must be a finite number > 0"):
        ReplicaSpec(reduce_deadline_s=0)
