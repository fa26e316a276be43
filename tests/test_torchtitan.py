"""torchtitan's Llama 3 under ReCoVer (examples/train_torchtitan.py): torchtitan's model, its
pipeline split, its tensor parallelism and its FSDP2 inside every replica, a rank SIGKILLed
mid-step, the run on the one-rank trajectory.

torchtitan lives in an environment of its own: its pins (datasets, then huggingface-hub) conflict
with the dev extra's transformers. CI makes `.venv-torchtitan` (`pip install torch==2.13.0 -e
'.[torchtitan]'`); the tests run the script with that interpreter (or RECOVER_TORCHTITAN_PYTHON,
or this one where torchtitan imports; recover is installed there too, and launches the runs) and
skip, saying so, where there is none.

The default run kills a rank of 2 replicas of 2 stages x TP 2 and respawns it, every rank
receiving its part; the slow one does the same to 2 replicas of 2 stages x FSDP2 2 x TP 2 (8
ranks each, 16 processes). Its paths are each in the default run: torchtitan's stages under TP
with a respawn here, and a respawn of FSDP2-sharded stages in tests/test_pipeline.py; what only
the slow run has is a respawn receiving 2-D (FSDP2 x TP) DTensors.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_pipeline import assert_on_the_reference

from conftest import EXAMPLES, child_env, events, finish, leftover_processes

ROOT = Path(__file__).resolve().parents[1]
M = 6


def _torchtitan_python() -> str | None:
    given = os.environ.get("RECOVER_TORCHTITAN_PYTHON")
    if given:
        return given
    own = ROOT / ".venv-torchtitan" / "bin" / "python"
    if own.exists():
        return str(own)
    return sys.executable if importlib.util.find_spec("torchtitan") else None


PYTHON = _torchtitan_python()
pytestmark = pytest.mark.skipif(
    PYTHON is None,
    reason="torchtitan is not installed: make .venv-torchtitan (python3 -m venv .venv-torchtitan "
    "&& .venv-torchtitan/bin/pip install torch==2.13.0 -e '.[torchtitan]'), as .ci/run does",
)


def run_torchtitan(out: Path, data: Path, *flags: str, steps: int, layout=(), timeout: float = 200):
    """`recover run FLAGS -- TORCHTITAN_PYTHON examples/train_torchtitan.py ...`, to its end,
    launched by that Python with torchtitan preloaded: every process is forked with torch and
    torchtitan imported (about 4 s of CPU each to import afresh: 34 s against 15 s for the
    default test's 9 processes on 2 cores)."""
    preload = ["--preload", "torchtitan.models.llama3",
               "--preload", "torchtitan.distributed.pipeline_parallel"]  # fmt: skip
    cmd = [PYTHON, "-m", "recover.cli", "run", "--out", str(out / "job"), *preload, *flags, "--",
           PYTHON, str(EXAMPLES / "train_torchtitan.py"), "--out", str(out / "result"),
           "--data", str(data), "--size", "tiny", "--microbatches", str(M), "--batch", "2",
           "--seq-len", "16", "--steps", str(steps), *layout]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
    )
    r = finish(proc, timeout)
    assert leftover_processes(str(out)) == [], "processes of the run were left behind"
    return r


def _kill_run(tmp_path, data, *, steps, layout, ranks, fault, respawn):
    ref = tmp_path / "ref"
    r = run_torchtitan(ref, data, "--replicas", "1", steps=steps)
    assert r.returncode == 0, r.stdout[-3000:]
    out = tmp_path / "killed"
    r = run_torchtitan(
        out, data, "--replicas", "2", "--ranks-per-replica", str(ranks),
        *(["--respawn", "0"] if respawn else []), "--fault", f"kill:replica=1,{fault}",
        steps=steps, layout=layout,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Traceback" not in r.stdout, r.stdout[-3000:]
    got = assert_on_the_reference(ref, out, steps)
    assert got[2]["attempts"] >= 2, got[2]  # recomputed in the step
    return out, r


@pytest.mark.timeout(240)
def test_torchtitan_llama_in_tensor_parallel_stages_survives_a_kill_and_its_respawn_gets_its_parts(
    custom_token_file, tmp_path
):
    """2 replicas of torchtitan's Llama 3 in 2 stages (torchtitan's split, 1F1B) x torchtitan's
    TP over 2 ranks; a last-stage rank of replica 1 is SIGKILLed in its backward of step 2: its
    3 mates stop (status 7), replica 0 recomputes the lost ids in the step, the replica is
    respawned and each of its 4 ranks receives its stage's TP part of the model and of AdamW's
    moments; the run stays on the one-rank trajectory. (24 steps: preloaded, the respawn joined
    at step 4 of 30 here.)"""
    out, r = _kill_run(tmp_path, custom_token_file, steps=24, layout=["--pp", "2", "--tp", "2"],
                       ranks=4, fault="rank=3,step=2,phase=backward", respawn=True)  # fmt: skip
    for rank in range(3):
        assert f"replica 1 rank {rank} exited with status 7" in r.stdout, r.stdout[-3000:]
    transfers = sorted((e["replica"], e["rank"]) for e in events(out / "job", "state_transfer"))
    assert transfers == [(1, k) for k in range(4)], transfers


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchtitan_llama_in_3d_replicas_survives_a_kill_and_its_respawn_gets_its_shards(
    custom_token_file, tmp_path
):
    """2 replicas of torchtitan's Llama 3, each 8 ranks: 2 stages x torchtitan's FSDP2 over 2
    ranks x its TP over 2 ranks. A rank of replica 1 is SIGKILLed in a forward of step 2, its 7
    mates stop, the replica is respawned, and each of its 8 ranks receives its part of the model
    and of AdamW's moments. (16 processes on 2 cores. 60 steps: cold, the respawned ranks took
    tens of seconds to register while the survivor ran 80 steps; preloaded they fork with
    torchtitan imported.)"""
    out, r = _kill_run(tmp_path, custom_token_file, steps=60,
                       layout=["--pp", "2", "--shard", "2", "--tp", "2"], ranks=8,
                       fault="rank=5,step=2,phase=forward", respawn=True)  # fmt: skip
    assert "respawning replica 1" in r.stdout, r.stdout[-3000:]
    transfers = sorted((e["replica"], e["rank"]) for e in events(out / "job", "state_transfer"))
    assert transfers == [(1, k) for k in range(8)], transfers
