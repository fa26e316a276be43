"""The scale simulator: determinism, analytic checks, policy costs, the paper scenario, validation.

All pure (no processes): each test runs the engine for milliseconds to a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from recover.tooling.simulate import Costs, JobShape, PoissonFailures, StepFailures, simulate
from recover.tooling.simulate.model import young_daly_interval_s
from recover.tooling.simulate.policies import POLICIES
from recover.tooling.simulate.scenarios import PAPER, GpuAssumptions, paper_scenario, read_bench
from recover.tooling.simulate.validate import validate_run

pytestmark = pytest.mark.timeout(30)

SMALL = JobShape(replicas=4, gpus_per_replica=1, microbatches=8, tokens_per_microbatch=10)
UNIT = Costs(
    microbatch_s=1.0, detect_s=0.5, rebuild_s=0.25, restart_s=3.0, ckpt_s=1.0, allreduce_alpha_s=0.0
)  # no all-reduce cost: times are microbatch counts


def test_same_seed_same_result_and_seed_matters():
    shape = JobShape(replicas=64, gpus_per_replica=8, microbatches=8192, tokens_per_microbatch=4096)
    costs = Costs(microbatch_s=0.06, allreduce_shard_bytes=2e9, repair_s=3600.0, rebuild_s=2.0)
    failures = PoissonFailures(gpu_rate_per_h=1e-3, correlated_fraction=0.2, node_gpus=16)
    for policy in POLICIES:
        a = simulate(policy, shape, costs, failures, seed=7, horizon_s=86400)
        b = simulate(policy, shape, costs, failures, seed=7, horizon_s=86400)
        c = simulate(policy, shape, costs, failures, seed=8, horizon_s=86400)
        assert a.as_dict() == b.as_dict()
        assert a.failures > 10
        assert a.as_dict() != c.as_dict()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_failures_gives_the_ideal_throughput_exactly(policy):
    shape = JobShape(replicas=64, gpus_per_replica=8, microbatches=8192, tokens_per_microbatch=4096)
    costs = Costs(microbatch_s=0.062, allreduce_shard_bytes=2e9)
    r = simulate(policy, shape, costs, None, max_steps=1000)
    step_s = 128 * 0.062 + 2 * 63 / 64 * 2e9 / 50e9 + 2 * 20e-6 * 6
    assert r.tokens_per_s == pytest.approx(8192 * 4096 / step_s, rel=1e-12)
    assert r.goodput == pytest.approx(1.0, rel=1e-12)
    assert r.steps == 1000 and r.failures == 0 and r.stopped == "max_steps"


def test_checkpoint_restart_goodput_matches_young_daly():
    # One GPU, MTBF 1 h, checkpoint 10 s, free restarts; 1-second steps; 3000 MTBFs simulated.
    shape = JobShape(replicas=1, gpus_per_replica=1, microbatches=1, tokens_per_microbatch=1)
    mtbf, ckpt = 3600.0, 10.0
    costs = Costs(microbatch_s=1.0, ckpt_s=ckpt, restart_s=0.0, detect_s=0.0)
    r = simulate("checkpoint-restart", shape, costs, PoissonFailures(gpu_rate_per_h=1.0),
                 seed=1, horizon_s=3000 * mtbf)  # fmt: skip
    first_order = 1.0 - math.sqrt(2 * ckpt / mtbf)  # 0.9255
    assert r.goodput == pytest.approx(first_order, abs=0.005)
    # exact expectation for exponential failures at the interval used
    tau, lam = young_daly_interval_s(mtbf, ckpt), 1.0 / mtbf
    exact = tau / ((math.exp(lam * (tau + ckpt)) - 1.0) / lam)
    assert r.goodput == pytest.approx(exact, rel=0.003)
    assert r.counters["ckpt_every_steps"] == round(tau)


def test_recover_in_step_cost_is_the_stated_formula():
    # Step 2 (t=4..6, 2 microbatches each) loses a replica at t=5: survivors finish their own at
    # 6, take ceil(2/3)=1 lost microbatch (to 7), rebuild (7.25); then steps of ceil(8/3)=3 s.
    failures = StepFailures(every=1, count=0, at=(2,), phase=0.5)
    r = simulate("recover", SMALL, UNIT, failures, max_steps=5)
    assert r.wall_s == pytest.approx(7.25 + 2 * 3.0)
    assert r.tokens == 5 * 8 * 10  # constant batch: every step has all M microbatches
    assert r.counters["microbatches_recomputed"] == 2


def test_shrink_discards_the_step_and_shrinks_the_batch():
    failures = StepFailures(every=1, count=0, at=(2,), phase=0.5)
    r = simulate("shrink", SMALL, UNIT, failures, max_steps=5)
    # steps 0,1 done at 4; failure at 5 discards step 2; stall to 5.75; 3 steps of 2 s, 6 mb each
    assert r.wall_s == pytest.approx(5.75 + 3 * 2.0)
    assert r.tokens == pytest.approx((2 * 8 + 3 * 6) * 10)
    assert r.counters["steps_discarded"] == 1


def test_checkpoint_restart_rolls_back_to_the_last_checkpoint():
    costs = replace(UNIT, ckpt_interval_s=6.0)
    failures = StepFailures(every=1, count=0, at=(4,), phase=0.5)
    r = simulate("checkpoint-restart", SMALL, costs, failures, max_steps=6)
    # checkpoint after step 2 (t=6..7); failure in step 4 at t=10; restart to 13.5; steps 3..5
    # again (checkpoint after 5 is not needed: the run ends)
    assert r.counters["steps_rolled_back"] == 1
    assert r.wall_s == pytest.approx(13.5 + 3 * 2.0)
    assert r.tokens == 6 * 80


def test_repairs_bring_replicas_back():
    failures = StepFailures(every=10, count=3, phase=0.5)
    no_repair = simulate("recover", SMALL, UNIT, failures, max_steps=200)
    repaired = simulate("recover", SMALL, replace(UNIT, repair_s=5.0), failures, max_steps=200)
    assert repaired.counters["joins"] == 3
    assert repaired.wall_s < no_repair.wall_s
    assert no_repair.tokens == repaired.tokens == 200 * 80


def test_spares_cover_failures_while_they_last():
    shape = JobShape(replicas=4, gpus_per_replica=1, microbatches=8, tokens_per_microbatch=10,
                     spares=1)  # fmt: skip
    failures = StepFailures(every=5, count=2, phase=0.5)
    r = simulate("spares", shape, UNIT, failures, max_steps=20)
    # steps 0-3 end at 8; failure at 9 discards step 4; stall + swap to 10.25; steps 4-8 end at
    # 20.25; failure at 21.25, no spare left: stall to 22, then 11 steps of 6 microbatches
    assert r.counters["spare_swaps"] == 1
    assert r.wall_s == pytest.approx(22.0 + 11 * 2.0)
    assert r.tokens == pytest.approx(9 * 80 + 11 * 60)


def test_quorum_lost_stops_the_run():
    shape = JobShape(replicas=2, gpus_per_replica=1, microbatches=4, tokens_per_microbatch=1,
                     min_replicas=2)  # fmt: skip
    r = simulate("recover", shape, UNIT, StepFailures(every=3, count=1), max_steps=10)
    assert r.stopped == "quorum_lost" and r.steps == 2


def test_paper_scenario_recover_beats_checkpoint_restart():
    p = paper_scenario(GpuAssumptions())
    rec = p["results"]["recover"]
    assert rec["failures"] == PAPER["failures"]  # all 32 fired within the budget
    assert rec["gpu_hours"] == pytest.approx(PAPER["gpu_hour_budget"])
    assert p["throughput_ratio_vs_ckpt"] > 1.0 and p["more_tokens_vs_ckpt"] > 0.0
    print(
        f"\nours {p['throughput_ratio_vs_ckpt']:.2f}x / +{p['more_tokens_vs_ckpt']:.1%} vs the "
        f"paper's {PAPER['throughput_ratio_vs_ckpt']}x / +{PAPER['more_tokens_vs_ckpt']:.1%}"
    )


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="replicas"):
        JobShape(replicas=0, gpus_per_replica=8, microbatches=8, tokens_per_microbatch=1)
    with pytest.raises(ValueError, match="detect_s"):
        Costs(microbatch_s=1.0, detect_s=-1.0)
    with pytest.raises(ValueError, match="correlated_fraction"):
        PoissonFailures(correlated_fraction=2.0)
    with pytest.raises(ValueError, match="one of horizon_s"):
        simulate("recover", SMALL, UNIT, None)
    with pytest.raises(ValueError, match="policy"):
        simulate("nope", SMALL, UNIT, None, max_steps=1)


def test_read_bench_derives_the_stated_figures(tmp_path):
    rec = {"benchmark": "recovery", "config": {"replicas": 4, "microbatches": 8},
           "rows": [{"phase": "reduce", "kill_to_commit_s": 0.5, "step_s": 0.4}]}  # fmt: skip
    ovh = {"benchmark": "overhead", "pairs": [
        {"plain_step_s": 1.0, "recover_step_s": 1.02}, {"plain_step_s": 1.0, "recover_step_s": 1.04},
        {"plain_step_s": 1.0, "recover_step_s": 1.03}]}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(rec))
    (tmp_path / "o.json").write_text(json.dumps(ovh))
    b = read_bench([tmp_path / "r.json", tmp_path / "o.json"], cpu_cores=2)
    mb = 0.4 / (2 * 2)  # 2 microbatches per replica, 4 processes on 2 cores
    assert b.cpu_microbatch_s == pytest.approx(mb)
    assert b.recovery_fixed_s == pytest.approx(0.5 - 1 * mb * 1.5)  # 1 extra at 3 live / 2 cores
    assert b.step_overhead_s == pytest.approx(0.03)


# ---- validation on synthetic run folders -----------------------------------------------------


def _write_run(folder: Path, *, mode: str | None, step_times: list[float], tokens: list[int],
               fail_step: int | None) -> Path:  # fmt: skip
    folder.mkdir()
    launch = {"replicas": 4, "faults": []}
    if mode:
        launch["mode"] = mode
    cfg = {"train": {"microbatches": 8, "microbatch_size": 2, "seq_len": 5, "ckpt_every": 0},
           "launch": launch}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    t, lines = 1000.0, []
    for i, (dt, tok) in enumerate(zip(step_times, tokens, strict=True)):
        if i == fail_step:
            lines.append(
                {
                    "kind": "event",
                    "name": "failure_injected",
                    "t_wall": t + 0.01,
                    "step": i,
                    "phase": "backward",
                    "microbatch": 0,
                    "replica": 3,
                }
            )
        t += dt
        lines.append({"kind": "step", "step": i, "t_wall": t, "step_s": dt, "tokens": tok,
                      "attempts": 2 if i == fail_step else 1})  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def test_validation_predicts_a_recover_run_and_catches_a_wrong_one(tmp_path):
    # 4 replicas on 4 cores, 2 microbatches of 0.1 s each; after the kill at step 10 the survivors
    # carry 3 microbatches (0.3 s); the failed step costs the stated formula.
    costs = Costs(microbatch_s=1.0, detect_s=0.05, rebuild_s=0.02)
    steps = [0.2] * 10 + [0.1 * 2 + 0.1 + 0.02 + 0.0] + [0.3] * 29
    good = _write_run(tmp_path / "good", mode=None, step_times=steps, tokens=[80] * 40,
                      fail_step=10)  # fmt: skip
    v = validate_run(good, costs, cpu_cores=4)
    assert v.mode == "recover" and v.failures == 1
    assert abs(v.rel_error) < 0.02
    slow = [0.2] * 10 + [2.0] + [0.6] * 29  # the run did far worse than the model says
    bad = _write_run(tmp_path / "bad", mode=None, step_times=slow, tokens=[80] * 40, fail_step=10)
    assert validate_run(bad, costs, cpu_cores=4).rel_error > 0.15


def test_validation_of_a_shrink_run(tmp_path):
    costs = Costs(microbatch_s=1.0, detect_s=0.05, rebuild_s=0.02)
    # step 10 is discarded 0.075 s in (backward of the first of 2 microbatches), a 0.07 s stall,
    # then redone by 3 replicas keeping 2 microbatches each: 0.2 s
    steps = [0.2] * 10 + [0.075 + 0.07 + 0.2] + [0.2] * 29
    tokens = [80] * 10 + [60] * 30
    run = _write_run(tmp_path / "shrink", mode="shrink", step_times=steps, tokens=tokens,
                     fail_step=10)  # fmt: skip
    v = validate_run(run, costs, cpu_cores=4)
    assert v.mode == "shrink"
    assert abs(v.rel_error) < 0.02


def test_cli_writes_all_figures(tmp_path, capsys):
    from recover.cli import main

    code = main(["simulate", "--out", str(tmp_path), "--scales", "512,4096", "--seeds", "1",
                 "--horizon-days", "1", "--mtbf-hours", "1,8", "--no-plots"])  # fmt: skip
    assert code == 0
    figures = json.loads((tmp_path / "simulate.json").read_text())
    ratio = figures["paper_scenario"]["throughput_ratio_vs_ckpt"]
    assert ratio > 1.0
    assert [row["gpus"] for row in figures["scale"]] == [512, 4096]
    assert f"{ratio:.2f}x | 2.23x" in capsys.readouterr().out  # ours beside the paper's
    assert main(["simulate", "--seeds", "0", "--out", str(tmp_path)]) == 2
