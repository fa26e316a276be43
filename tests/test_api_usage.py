"""Misuse of the drop-in API fails at once with a UsageError that says what to change (never a
hang, never a silently wrong sum). In-process: one replica against an in-process coordinator."""

from __future__ import annotations

import pytest
import torch

from recover import Replica, UsageError
from recover.coordinator import CoordinatorOptions, CoordinatorServer


@pytest.fixture
def job():
    """A one-replica job; yields the variables a launcher would give its replica."""
    opts = CoordinatorOptions(expected_replicas=1, microbatches=0, lease_s=2.0)
    with CoordinatorServer(opts, store_port=0) as server:
        host, port = server.address
        yield {"RECOVER_COORDINATOR": f"{host}:{port}", "RECOVER_REPLICA_ID": "0"}


def attached(env, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replica = Replica(microbatches=2, env=env, **kw)
    replica.attach(model, optimizer)
    return replica, model, optimizer


def loss_of(model, step, j):
    x = torch.full((2, 3), float(step + j))
    return model(x).pow(2).mean()


@pytest.mark.timeout(30)
def test_a_correct_loop_commits_the_mean_gradient(job):
    """The control: with one replica the committed gradient is the mean over ids 0..M-1."""
    replica, model, optimizer = attached(job)
    for step in replica.steps(2):
        for j in replica.microbatches():
            replica.backward(loss_of(model, step, j))
        probe = torch.nn.Linear(3, 1)
        probe.load_state_dict(model.state_dict())
        for j in range(2):
            (loss_of(probe, step, j) / 2).backward()
        assert torch.allclose(model.weight.grad, probe.weight.grad, rtol=1e-6)
        assert replica.committed_microbatches == 2 and replica.is_writer
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.timeout(30)
def test_gradients_left_from_before_the_step_are_refused(job):
    replica, model, optimizer = attached(job)
    loss_of(model, 0, 0).backward()  # outside any step: would be added to step 0's sum
    with pytest.raises(UsageError, match="optimizer.zero_grad"):
        for _ in replica.steps(1):
            for _ in replica.microbatches():
                pass
    replica.close()


@pytest.mark.timeout(30)
def test_an_optimizer_step_inside_the_microbatches_is_refused(job):
    replica, model, optimizer = attached(job)
    with pytest.raises(UsageError, match="after the loop over microbatches"):
        for step in replica.steps(1):
            for j in replica.microbatches():
                replica.backward(loss_of(model, step, j))
                optimizer.step()
    replica.close()


@pytest.mark.timeout(30)
def test_a_microbatch_without_backward_is_refused(job):
    replica, model, optimizer = attached(job)
    with pytest.raises(UsageError, match=r"had no replica.backward\(loss\)"):
        for step in replica.steps(1):
            for j in replica.microbatches():
                loss_of(model, step, j).backward()  # not through the replica: not counted
    replica.close()


@pytest.mark.timeout(30)
def test_a_step_left_before_it_committed_is_refused(job):
    replica, model, optimizer = attached(job)
    with pytest.raises(UsageError, match="ended before it committed"):
        for _ in replica.steps(2):
            pass  # no microbatches(): nothing was computed nor committed
    replica.close()


@pytest.mark.timeout(30)
def test_calls_out_of_order_are_refused(job):
    replica = Replica(microbatches=2, env=job)
    with pytest.raises(UsageError, match="attach"):
        next(iter(replica.steps(1)))
    replica2, model, _ = attached(job)
    with pytest.raises(UsageError, match="inside `for step in replica.steps"):
        next(iter(replica2.microbatches()))
    with pytest.raises(UsageError, match="belongs inside"):
        replica2.backward(loss_of(model, 0, 0))
    replica.close()
    replica2.close()


def test_a_script_not_started_by_a_launcher_is_told_how_to_start():
    with pytest.raises(ValueError, match="RECOVER_COORDINATOR and RECOVER_REPLICA_ID not set"):
        Replica(microbatches=2, env={})
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        Replica(microbatches=0, env={})


@pytest.mark.timeout(30)
def test_a_non_finite_step_is_never_applied_and_too_many_stop_the_run(job):
    """Step 1's loss is NaN: the step commits as skipped (every .grad None, the optimizer step
    changes nothing), step 2 trains on; three NaN steps in a row raise NonFinite."""
    from recover import NonFinite

    replica, model, optimizer = attached(job)
    poisoned = {1, 3, 4, 5}
    seen = []
    with pytest.raises(NonFinite, match="3 consecutive steps"):
        for step in replica.steps(8):
            before = [p.detach().clone() for p in model.parameters()]
            for j in replica.microbatches():
                loss = loss_of(model, step, j)
                replica.backward(loss * float("nan") if step in poisoned else loss)
            optimizer.step()
            optimizer.zero_grad()
            after = list(model.parameters())
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            seen.append((step, replica.skipped, unchanged))
            assert all(torch.isfinite(p).all() for p in model.parameters())
    assert seen == [(0, False, False), (1, True, True), (2, False, False), (3, True, True),
                    (4, True, True)]  # fmt: skip
    replica.close()


@pytest.mark.timeout(30)
def test_a_non_finite_update_from_a_finite_gradient_is_undone(job):
    """Steps 1, 3, 4 and 5 scale the loss by 1e30: the gradient is finite (the step commits and
    .grad holds it), but AdamW squares it into a second moment that overflows fp32. When the loop
    comes back, the library finds the state not finite, puts the state of before the update back
    (bit for bit) and counts the step as skipped; three in a row raise NonFinite from the loop."""
    from recover import NonFinite

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    replica = Replica(microbatches=2, env=job)
    replica.attach(model, optimizer)
    poisoned = {1, 3, 4, 5}
    seen, before, grads_finite = [], None, []

    def state():
        out = [p.detach().clone() for p in model.parameters()]
        return out + [v.clone() for s in optimizer.state.values() for v in s.values()]

    with pytest.raises(NonFinite, match="3 consecutive steps"):
        for step in replica.steps(8):
            if before is not None:  # the previous step's outcome, as the loop came back
                now = state()
                unchanged = len(now) == len(before) and all(
                    torch.equal(a, b) for a, b in zip(before, now, strict=True)
                )
                seen.append((step - 1, replica.skipped, unchanged))
            before = state()
            for j in replica.microbatches():
                loss = loss_of(model, step, j)
                replica.backward(loss * 1e30 if step in poisoned else loss)
            grads_finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
            optimizer.step()
            optimizer.zero_grad()
    assert all(grads_finite)  # every step's gradient was finite: the sum's check let them pass
    assert seen == [(0, False, False), (1, True, True), (2, False, False), (3, True, True),
                    (4, True, True)]  # fmt: skip
    assert replica.skipped  # step 5, undone before NonFinite was raised
    assert all(torch.isfinite(t).all() for t in state())
    replica.close()


@pytest.mark.timeout(30)
def test_a_fault_that_could_never_fire_is_refused(job):
    """`recover run` cannot know the script's steps or M; the Replica checks its faults itself."""
    env = {**job, "RECOVER_FAULTS": "kill:replica=0,step=2,phase=forward,microbatch=5"}
    replica, model, optimizer = attached(env)
    with pytest.raises(ValueError, match="microbatch=5"):
        next(iter(replica.steps(4)))
    replica.close()
    env = {**job, "RECOVER_FAULTS": "kill:replica=0,step=9,phase=forward"}
    replica, model, optimizer = attached(env)
    with pytest.raises(ValueError, match="step=9 never comes"):
        next(iter(replica.steps(4)))
    replica.close()


@pytest.mark.timeout(30)
def test_a_scripts_steps_are_recorded_once_with_its_scalars_and_the_final_model(job, tmp_path):
    """Each committed step's record goes to RECOVER_EVENTS with the loss, M and the scalars the
    script logged; `committed_steps()` hands the same record to a log of the script's own; the
    finished job ends with a summary and the final model holding the model's last state."""
    from safetensors.torch import load_file

    from recover.record import committed_steps, read_metrics

    metrics = tmp_path / "job" / "metrics.jsonl"
    replica, model, optimizer = attached({**job, "RECOVER_EVENTS": str(metrics)})
    own = []
    for step in replica.steps(3):
        for j in replica.microbatches():
            replica.backward(loss_of(model, step, j))
        optimizer.step()
        optimizer.zero_grad()
        replica.log(lr=0.1, tokens=4, note=None)
        own += replica.committed_steps()
    recorded = committed_steps(metrics)
    assert sorted(recorded) == [0, 1, 2]
    assert [r["step"] for r in own] == [0, 1, 2]
    for r in own:
        got = recorded[r["step"]]
        assert got["loss"] == r["loss"] and got["lr"] == 0.1 and got["note"] is None
        assert got["microbatches"] == 2 and got["writer"] == 0
    (summary,) = [r for r in read_metrics(metrics) if r["kind"] == "summary"]
    assert summary["steps"] == 3
    final = load_file(str(metrics.parent / "final" / "model.safetensors"))
    assert torch.equal(final["weight"], model.weight.detach())


@pytest.mark.timeout(30)
def test_log_is_refused_outside_a_committed_step_and_for_what_is_not_a_scalar(job):
    replica, model, optimizer = attached(job)
    with pytest.raises(UsageError, match="after replica.microbatches"):
        replica.log(lr=0.1)
    steps = replica.steps(1)
    step = next(steps)
    with pytest.raises(UsageError, match="after replica.microbatches"):
        replica.log(lr=0.1)  # the step has not committed yet
    for j in replica.microbatches():
        replica.backward(loss_of(model, step, j))
    with pytest.raises(UsageError, match="the library writes itself"):
        replica.log(loss=1.0)
    with pytest.raises(UsageError, match="a scalar is a number"):
        replica.log(accuracy=torch.tensor(0.5))
    replica.log(accuracy=0.5)
    optimizer.step()
    optimizer.zero_grad()
    assert list(steps) == []


@pytest.mark.timeout(30)
def test_the_pipeline_form_needs_stages_and_microbatch_id_names_the_id_in_flight(job):
    """`replica.pipeline()` is for a replica cut into stages (Replica(pp=P)): on one rank it is
    refused, naming the per-id form. In the per-id form `microbatch_id` is the id handed out
    until its backward (a script seeds that microbatch's randomness by it), None outside."""
    replica, model, optimizer = attached(job)
    assert replica.microbatch_id is None
    with pytest.raises(UsageError, match=r"Replica\(pp=P\).*replica.microbatches\(\)"):
        for _ in replica.steps(1):
            for _ in replica.pipeline():
                pass
    replica.close()
    replica, model, optimizer = attached(job)
    seen = []
    for step in replica.steps(1):
        for j in replica.microbatches():
            seen.append(replica.microbatch_id == j)
            replica.backward(loss_of(model, step, j))
            seen.append(replica.microbatch_id is None)
        optimizer.step()
        optimizer.zero_grad()
    assert seen == [True, True] * 2


@pytest.mark.timeout(30)
def test_the_next_steps_first_microbatch_runs_during_the_vote_through_the_scripts_function(job):
    """attach(ahead=fn), with update=: once the update has run during a step's vote, fn computes
    the next step's first id (the middle of the share (0, 1): id 1), and microbatches() hands out
    only the other; every step still commits the mean gradient over both ids, on the parameters
    the step before made (one process stepping the same SGD in the loop is the reference)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe = torch.nn.Linear(3, 1)
    probe.load_state_dict(model.state_dict())
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9)
    replica = Replica(microbatches=2, env=job)
    with pytest.raises(UsageError, match="needs update=... too"):
        replica.attach(model, optimizer, ahead=lambda step, j: None)

    def update():
        optimizer.step()
        optimizer.zero_grad()

    ahead, handed = [], []

    def microbatch(step, j):
        replica.backward(loss_of(model, step, j))

    def microbatch_ahead(step, j):
        ahead.append((step, j, replica.microbatch_id))
        microbatch(step, j)

    replica.attach(model, optimizer, update=update, ahead=microbatch_ahead)
    for step in replica.steps(3):
        for j in replica.microbatches():
            handed.append((step, j))
            microbatch(step, j)
        for j in range(2):
            (loss_of(probe, step, j) / 2).backward()
        probe_optimizer.step()
        probe_optimizer.zero_grad()
        assert torch.allclose(model.weight, probe.weight, rtol=1e-6), step
        assert torch.allclose(model.bias, probe.bias, rtol=1e-6), step
    assert ahead == [(1, 1, 1), (2, 1, 1)]  # (none past the last step)
    assert handed == [(0, 0), (0, 1), (1, 0), (2, 0)]


@pytest.mark.timeout(30)
def test_an_ahead_function_without_backward_is_refused(job):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replica = Replica(microbatches=2, env=job)
    replica.attach(model, optimizer, update=lambda: optimizer.step(), ahead=lambda step, j: None)
    with pytest.raises(UsageError, match="without replica.backward"):
        for step in replica.steps(3):
            for j in replica.microbatches():
                replica.backward(loss_of(model, step, j))
    replica.close()
