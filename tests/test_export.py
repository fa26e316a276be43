"""A trained run leaves the project: `recover export --format hf` gives a folder that
transformers' GPT2LMHeadModel loads as is, with our logits; `recover sample` continues a prompt.
(transformers is an optional dependency: the export test skips where it is missing.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN_FLAGS, cli_here, run_cli


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    r = run_cli(["train", *TINY_TRAIN_FLAGS, "--steps", "6", "--data", str(tiny_dataset),
                 "--out", str(out)], timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.timeout(120)
def test_the_hf_export_gives_our_logits(trained, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from recover.tooling.export import load_run_model

    r = run_cli(["export", str(trained), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "README.md").exists()
    ours, _ = load_run_model(trained)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    eager = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    x = torch.randint(
        0, ours.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        a = ours(x)[0]
        diff = (a - hf(x).logits).abs().max().item()
        # The noise floor of fp32 summation order: GPT-2's own eager attention against its SDPA
        # path computes the same function in another order.
        floor = (hf(x).logits - eager(x).logits).abs().max().item()
    assert diff <= max(floor, 1e-6 * a.abs().max().item()), (diff, floor)
    # A wrong conversion (a transposed weight, GPT-2's tanh GELU) is off by far more than that.
    assert (a - eager(x).logits).abs().max().item() < 1e-3


@pytest.mark.timeout(60)
def test_sample_continues_the_prompt(trained):
    greedy = cli_here(["sample", str(trained), "--prompt", "replica ", "--tokens", "20"])
    assert greedy.returncode == 0, greedy.stderr
    again = cli_here(["sample", str(trained), "--prompt", "replica ", "--tokens", "20"])
    assert greedy.stdout == again.stdout and greedy.stdout.startswith("replica ")
    hot = cli_here(["sample", str(trained), "--prompt", "replica ", "--tokens", "20",
                   "--temperature", "1.0", "--top-k", "5", "--seed", "3"])  # fmt: skip
    assert hot.returncode == 0 and hot.stdout.startswith("replica ")
    bad = cli_here(["sample", str(trained), "--temperature", "-1"])
    assert bad.returncode != 0 and "temperature" in bad.stderr


def test_the_run_folder_records_the_models_shape(trained):
    import json

    model = json.loads((trained / "config.json").read_text())["model"]
    assert model["n_layer"] == 2 and model["n_head"] == 2 and model["n_embd"] == 64
    assert model["block_size"] == 32 and model["vocab_size"] == 256


@pytest.mark.timeout(60)
def test_a_model_that_is_not_finite_is_never_exported(trained, tmp_path):
    """A final model holding a NaN (written by hand: the trainer itself never writes one) is
    refused with one line naming the file, and nothing is exported."""
    import shutil

    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    final = run / "final" / "model.safetensors"
    state = load_file(final)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name].view(-1)[0] = float("nan")
    save_file(state, final)
    r = run_cli(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert r.returncode != 0 and "not finite" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "hf").exists()
