"""The numerically sensitive tests, run again under every other CPU kernel set this machine has.

torch picks its CPU kernels (`default`, `avx2`, `avx512`) by what the processor offers, and
`ATEN_CPU_CAPABILITY` forces a lower set. Kernels differ in summation and fusion order, so where
a run first overflows, and how bf16 rounds, differs between machines: the non-finite guard's
tests once passed on the AMD machines they were written on and failed on an Intel Xeon. The
rest of the suite runs under this machine's best set; this file runs the tests whose outcome
depends on kernels (the non-finite guard, the deterministic mode's bits; bf16 autocast with -m
slow) under each other set this machine offers, in a child pytest, so that a kernel difference
shows up here and not on a user's machine.

Cost: about 25 s per kernel set on 2 cores (the deterministic faulted and respawn runs, 21 s,
are left to the main run: the kernels that make their bits are the four-vs-one test's; bf16's
recovery, 25 s more, runs with -m slow).

`default`, torch's scalar fallback, is what a processor without AVX2 gets: no x86-64 server
processor of the last ten years (Intel since 2013, AMD since 2015). Where this machine offers
another vectorised set besides its own (an AVX-512 machine: `avx2`), that one runs in the default
suite and `default` is marked `slow` (`pytest -m slow tests/test_cpu_kernels.py` runs it); where
`default` is the only other set (an AVX2 machine), it runs in the default suite. So every run of
the suite exercises at least one kernel set besides the machine's own, and the suite stays within
its 10 minutes on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import child_env

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
SENSITIVE = [
    "tests/test_update_guard.py",
    "tests/test_nonfinite.py",
    "tests/test_deterministic.py",
]
# bf16 autocast's test (five runs, 25 s here) runs under the other sets with -m slow only: its
# tolerance is the bf16 noise floor it measures between failure-free layouts on the machine and
# kernels it runs on, so a kernel set that rounds otherwise moves its floor with its result; the
# main run checks that rule on this machine's set. The tests above have fixed expectations (where a
# run first overflows, the same bits), which a kernel set can break.
BF16 = ["tests/test_multirank.py::test_bf16_autocast_recovers_on_the_bf16_trajectory"]
# The deterministic faulted runs and the respawn test recover the same bits as the four-vs-one
# test computes: their kernels are the same; the main run covers their recovery.
# The refusals of bad layouts compute nothing.
SKIPPED_HERE = (
    "not test_a_respawned_joiner_changes_no_bit and not faulted_run_equals "
    "and not test_bad_layouts_and_modes_are_refused_at_start"
)
ORDER = ["default", "avx2", "avx512"]


def kernel_sets() -> tuple[str, list[str]]:
    """The set this process runs, and every set this machine's processor offers."""
    best = os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()
    current = best.lower()
    if current not in ORDER:  # e.g. a build that reports a set we do not name
        return current, [current]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    offered = ["default"]
    if " avx2" in flags:
        offered.append("avx2")
    if " avx512f" in flags and " avx512bw" in flags and " avx512vl" in flags:
        offered.append("avx512")
    return current, offered


CURRENT, OFFERED = kernel_sets()
OTHERS = [k for k in OFFERED if k != CURRENT]


def in_default_suite(kernels: str) -> bool:
    """Whether `pytest` runs this set: all but `default` where another vectorised set runs here."""
    return kernels != "default" or not [k for k in OTHERS if k != "default"]


def _marked(kernels: str):
    return kernels if in_default_suite(kernels) else pytest.param(kernels, marks=pytest.mark.slow)


def test_this_machine_offers_more_than_one_kernel_set():
    """Every x86-64 processor has at least `default` and the set torch picked for it; where
    that is `default` itself there is nothing else to run, and the parametrised test is empty."""
    assert "default" in OFFERED
    assert CURRENT in OFFERED or CURRENT not in ORDER


def test_the_default_suite_runs_at_least_one_other_kernel_set():
    """Whatever the processor, `pytest` (not only `pytest -m slow`) exercises a set besides its own."""
    in_suite = [k for k in OTHERS if in_default_suite(k)]
    assert in_suite or not OTHERS, OTHERS


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kernels", [_marked(k) for k in OTHERS])
def test_sensitive_tests_pass_under(kernels: str, tmp_path):
    _passes_under(kernels, SENSITIVE, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kernels", OTHERS)
def test_bf16_recovery_passes_under(kernels: str, tmp_path):
    _passes_under(kernels, BF16, tmp_path)


def _passes_under(kernels: str, tests: list[str], tmp_path) -> None:
    env = {**child_env(), "ATEN_CPU_CAPABILITY": kernels}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.stdout.strip().lower() == kernels, probe.stdout + probe.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, "-k", SKIPPED_HERE, "-q", "-n", "0",
         "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pytest"), "-o", "addopts="],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=230,
    )  # fmt: skip
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, f"under ATEN_CPU_CAPABILITY={kernels}:\n{tail}"
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
