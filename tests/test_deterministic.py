"""`--deterministic` with real processes and real faults: bit for bit, not within a tolerance.

Every run here is compared with one failure-free replica of the same seed and M, also
deterministic, by `recover compare --rtol 0`: the committed loss of every step and the final
parameters must be the same bits. Without the mode these runs differ from the one-replica run
in the last bits (4 replicas vs 1, tiny preset, 5 steps: loss 6e-8, parameters 3e-8 relative;
measured when the mode was built), so none of these checks passes with the feature removed.
The other invariants of docs/design.md are checked as in test_multireplica.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_multireplica import STEPS, train

from conftest import assert_invariants, cli_here, events
from recover.record import committed_steps

M = 6  # test_multireplica's FLAGS: tiny preset, M = 6, 5 steps


def bitwise_equal(reference: Path, out: Path, r) -> None:
    assert_invariants(reference, out, r, steps=STEPS, microbatches=M, rtol=0.0)
    compared = cli_here(["compare", "--rtol", "0", str(reference), str(out)])
    assert compared.returncode == 0 and "PASS" in compared.stdout, compared.stdout


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory) -> Path:
    """The failure-free trajectory: one replica of one rank, deterministic."""
    out = tmp_path_factory.mktemp("ref") / "one"
    r = train(tiny_dataset, out, "--replicas", "1", "--deterministic")
    assert r.returncode == 0, r.stdout
    return out


def test_four_replicas_equal_one_replica_bit_for_bit(reference, tiny_dataset, tmp_path):
    out = tmp_path / "four"
    r = train(tiny_dataset, out, "--replicas", "4", "--deterministic")
    bitwise_equal(reference, out, r)
    assert {e["replica"] for e in events(out, "replica_finished")} == {0, 1, 2, 3}


CASES = {
    # a second failure during the recovery (see test_multireplica's plan), then a kill in the
    # all-to-all of the ordered reduce: 4 replicas, 3 deaths, the last steps on one replica
    "three-of-four-die": [
        "--replicas", "4",
        "--fault", "kill:replica=2,step=2,phase=backward,microbatch=0",
        "--fault", "kill:replica=0,step=2,phase=forward,microbatch=2",
        "--fault", "kill:replica=3,step=3,phase=reduce",
    ],
    # a straggler: throughput-aware plans give it fewer ids, shares that are not tree nodes
    "straggler": ["--replicas", "3", "--fault", "slow:replica=1,step=1,factor=6"],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_faulted_run_equals_the_failure_free_one_bit_for_bit(
    case, reference, tiny_dataset, tmp_path
):
    out = tmp_path / case
    balance = "throughput" if case == "straggler" else "equal"  # equal: the plans are known
    r = train(tiny_dataset, out, "--balance", balance, "--deterministic", *CASES[case])
    bitwise_equal(reference, out, r)
    kills = [a for a in CASES[case] if a.startswith("kill:")]
    assert len(events(out, "failure_injected")) == len(kills)  # the faults really happened
    assert len(events(out, "coordinator.member_dead")) == len(kills)
    if case == "three-of-four-die":
        assert {e["replica"] for e in events(out, "replica_finished")} == {1}
    if case == "straggler":  # every replica finished: a share cut to no id ends no replica
        assert {e["replica"] for e in events(out, "replica_finished")} == {0, 1, 2}
        shares = [s["shares"] for s in _steps(out)]
        # The plan changed (at some step: shares follow measured throughput, which the suite's
        # load moves, and one CI run went back to equal shares by the last step); the bits did not.
        assert any(s != shares[0] for s in shares[1:]), shares


def _steps(out: Path) -> list[dict]:
    steps = committed_steps(out / "metrics.jsonl")
    return [steps[s] for s in sorted(steps)]


def test_bad_layouts_and_modes_are_refused_at_start(tiny_dataset, tmp_path):
    for extra, message in (
        (["--shard", "2"], "--deterministic supports replicas of one rank"),
        (["--mode", "shrink"], "--deterministic needs --mode recover"),
    ):
        r = train(tiny_dataset, tmp_path / extra[1], "--replicas", "2", "--deterministic", *extra)
        assert r.returncode != 0 and message in r.stdout, r.stdout[-2000:]


# The killed replica's warm-forked respawn joined at steps 5-15 in suite runs on 2 cores.
JOIN_STEPS = 50


@pytest.mark.timeout(240)
def test_a_respawned_joiner_changes_no_bit(tiny_dataset, tmp_path):
    """A killed replica is respawned and joins (live state transfer, then plans over 4 again)."""
    steps = ["--steps", str(JOIN_STEPS), "--deterministic"]
    reference = tmp_path / "one"
    r = train(tiny_dataset, reference, "--replicas", "1", *steps, timeout=150)
    assert r.returncode == 0, r.stdout
    out = tmp_path / "respawn"
    # --balance equal: under the throughput weights a replica measured slow on a loaded host was
    # planned no id at step 3 (seen in CI), so its backward, where the kill is, never ran.
    r = train(tiny_dataset, out, "--replicas", "4", "--respawn", "0", *steps, "--balance", "equal",
              "--fault", "kill:replica=2,step=3,phase=backward", timeout=150)  # fmt: skip
    assert_invariants(reference, out, r, steps=JOIN_STEPS, microbatches=M, rtol=0.0)
    transfers = events(out, "state_transfer")  # one per attempt that reached the joiner
    assert transfers and {t["replica"] for t in transfers} == {2}
    assert committed_steps(out / "metrics.jsonl")[JOIN_STEPS - 1]["replicas"] == 4
    compared = cli_here(["compare", "--rtol", "0", str(reference), str(out)])
    assert compared.returncode == 0 and "PASS" in compared.stdout, compared.stdout
