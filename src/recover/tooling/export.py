"""A trained run leaves the project: a Hugging Face GPT-2 folder, and text sampled from the model.

Job: `export_hf(run, out)` writes a folder that `transformers.GPT2LMHeadModel.from_pretrained`
loads as it is: `config.json` and `model.safetensors` in GPT-2's layout, plus the tokenizer
(`tokenizer.json` for a BPE run or one prepared with `--tokenizer`; a byte run's tokenizer is
documented in the folder's README, since GPT-2's own vocabulary is not ours). `sample(run, prompt, ...)` generates text from a run's final
model or newest checkpoint, greedily or with temperature and top-k.

The model is GPT-2 exactly (nanoGPT's): the conversion fuses our separate q, k, v projections into
GPT-2's `c_attn`, transposes every linear weight into Conv1D's (in, out) orientation, keeps the
tied head, writes zero biases where our model has none (`bias=False`: adding an exact zero changes
no value), and sets `activation_function="gelu"` (the exact erf GELU we use, not GPT-2's tanh
approximation). Logits then match ours (tested: max abs difference 0 in fp32 on this machine).

Where the weights come from: `final/model.safetensors` when the run finished, else the newest valid
checkpoint (its model state). The model's shape comes from the run's `config.json` (preset, vocab,
sequence length).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from recover.runtime.update_guard import all_finite
from recover.training.config import RunPaths, TrainConfig
from recover.training.model import GPT, build_config


class ExportError(ValueError):
    """The run folder cannot be exported (no model in it, an unreadable config...)."""


def load_run_model(run: Path) -> tuple[GPT, dict]:
    """The run's model (final, else newest checkpoint) on the CPU in eval mode, and its config."""
    paths = RunPaths(out=Path(run))
    try:
        config = json.loads(paths.config.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{run}: not a run folder ({paths.config}: {e})") from None
    cfg = TrainConfig.from_dict(config["train"])
    vocab = int(config["data"]["vocab_size"])
    model = GPT(build_config(cfg.preset, vocab_size=vocab, block_size=cfg.seq_len))
    if paths.final_model.exists():
        from safetensors.torch import load_model

        load_model(model, str(paths.final_model))
        source = str(paths.final_model)
    else:
        from recover.checkpoint.folders import find_resume_point
        from recover.checkpoint.state import read_checkpoint

        point = find_resume_point(paths.checkpoints)
        if point is None:
            raise ExportError(f"{run}: no final model and no checkpoint to export")
        model.load_state_dict(read_checkpoint(point.path)["model"])  # whole, whatever the layout
        source = str(point.path)
    if not all_finite(model.parameters()):
        raise ExportError(f"{source} holds a value that is not finite: it is not exported")
    model.eval()
    return model, {**config, "source": source}


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our GPT's parameters in GPT-2's names and layout (see the module docstring)."""
    c = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    zeros = torch.zeros

    def bias(name: str, n: int) -> torch.Tensor:
        return sd[name] if name in sd else zeros(n)

    out = {
        "transformer.wte.weight": sd["transformer.wte.weight"],
        "transformer.wpe.weight": sd["transformer.wpe.weight"],
        "transformer.ln_f.weight": sd["transformer.ln_f.weight"],
        "transformer.ln_f.bias": bias("transformer.ln_f.bias", c.n_embd),
    }
    for i in range(c.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{theirs}{ln}.weight"] = sd[f"{ours}{ln}.weight"]
            out[f"{theirs}{ln}.bias"] = bias(f"{ours}{ln}.bias", c.n_embd)
        q, k, v = (sd[f"{ours}attn.{p}_proj.weight"] for p in "qkv")  # each (C, C): (out, in)
        out[f"{theirs}attn.c_attn.weight"] = torch.cat([q.t(), k.t(), v.t()], dim=1)  # (C, 3C)
        out[f"{theirs}attn.c_attn.bias"] = torch.cat(
            [bias(f"{ours}attn.{p}_proj.bias", c.n_embd) for p in "qkv"]
        )
        for name, width in (("attn.c_proj", c.n_embd), ("mlp.c_fc", 4 * c.n_embd)):
            out[f"{theirs}{name}.weight"] = sd[f"{ours}{name}.weight"].t().contiguous()
            out[f"{theirs}{name}.bias"] = bias(f"{ours}{name}.bias", width)
        out[f"{theirs}mlp.c_proj.weight"] = sd[f"{ours}mlp.c_proj.weight"].t().contiguous()
        out[f"{theirs}mlp.c_proj.bias"] = bias(f"{ours}mlp.c_proj.bias", c.n_embd)
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(run: Path, out: Path, tokenizer: str | Path | None = None) -> Path:
    """Write the run's model as a Hugging Face GPT-2 folder at `out` (see the module docstring).
    `tokenizer` ("byte", or a tokenizer.json) is the one written with it instead of the run's: a
    run on adopted token files (`prepare --from-bin`) has none of its own."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ExportError(
            "recover export --format hf needs transformers: pip install 'recover[hf]'"
        ) from None
    model, config = load_run_model(run)
    c = model.config
    given = None  # the size of the vocabulary of the tokenizer given, if one is
    if tokenizer is not None and str(tokenizer) != "byte":
        from tokenizers import Tokenizer

        try:
            given = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own kinds: one line
            raise ExportError(f"--tokenizer {tokenizer} is not a tokenizer.json: {e}") from None
        if given > c.vocab_size:
            raise ExportError(
                f"--tokenizer {tokenizer} has {given} ids, the model only {c.vocab_size}: it is "
                "not the tokenizer this run's ids came from"
            )
    hf_config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu",  # exact erf GELU, as our MLP
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,  # torch's LayerNorm default, ours
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,  # our end-of-document separator (byte 0, or BPE's <|endoftext|>)
    )
    hf = GPT2LMHeadModel(hf_config)
    state = gpt2_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise ExportError(f"GPT-2 layout mismatch: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    kind = (config["data"].get("tokenizer") or {}).get("kind", "byte")
    data_path = Path(config["data"].get("path", ""))
    if given is not None:
        shutil.copy(Path(str(tokenizer)), out / "tokenizer.json")
        how = "`tokenizer.json` (HF tokenizers: the one given to the export)"
    elif tokenizer is None and kind == "none":
        how = (
            "none. The run's data was adopted from token files (`recover prepare --from-bin`), "
            "whose ids name no tokenizer here; use the one those files were made with (`recover "
            "export --tokenizer FILE` writes it into this folder)"
        )
    elif tokenizer is None and kind in ("bpe", "hf") and (data_path / "tokenizer.json").exists():
        shutil.copy(data_path / "tokenizer.json", out / "tokenizer.json")
        how = (
            "`tokenizer.json` (HF tokenizers, byte-level BPE; id 0 is `<|endoftext|>`)"
            if kind == "bpe"
            else "`tokenizer.json` (HF tokenizers: the one the dataset was prepared with)"
        )
    else:
        how = (
            "bytes: token id = UTF-8 byte value (vocab 256), id 0 separates documents. Encode "
            "with `list(text.encode())`, decode with `bytes(ids).decode(errors='replace')`"
        )
    (out / "README.md").write_text(
        f"# Exported from a ReCoVer run\n\nRun: `{Path(run).resolve()}`; weights from "
        f"`{config['source']}`.\n\nGPT-2 architecture ({c.n_layer} layers, {c.n_head} heads, "
        f"width {c.n_embd}, context {c.block_size}); load with "
        "`transformers.GPT2LMHeadModel.from_pretrained(this_folder)`.\n\n"
        f"Tokenizer: {how}.\n"
    )
    return out


def _codec(config: dict, tokenizer: str | Path | None = None):
    """(encode, decode) between text and the run's token ids: the tokenizer its dataset was
    prepared with, or `tokenizer` ("byte", or a tokenizer.json) when given. A dataset adopted
    from token files (`prepare --from-bin`) has none: then `tokenizer` is needed."""
    from recover.data.tokenizer import load_tokenizer, load_tokenizer_file

    kind = (config["data"].get("tokenizer") or {}).get("kind", "byte")
    if tokenizer is None and kind == "none":
        raise ExportError(
            "this run's data was adopted from token files (prepare --from-bin), with no "
            "tokenizer to read or write text: give --tokenizer byte, or the tokenizer.json the "
            "token ids came from"
        )
    if str(tokenizer) == "byte" or (tokenizer is None and kind == "byte"):
        return (
            lambda text: list(text.encode()),
            lambda ids: bytes(i for i in ids if 0 < i < 256).decode(errors="replace"),
        )
    if tokenizer is not None:
        tok = load_tokenizer_file(Path(tokenizer))
    else:
        tok = load_tokenizer(Path(config["data"]["path"]))
    return tok.encode, tok.decode


@torch.no_grad()
def sample(
    run: Path,
    prompt: str,
    *,
    tokens: int = 200,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    tokenizer: str | Path | None = None,
) -> str:
    """Continue `prompt` by `tokens` tokens from the run's model: greedy when temperature is 0,
    else sampled from softmax(logits / temperature) over the `top_k` likeliest (all if None).
    `tokenizer` ("byte" or a tokenizer.json) replaces the run's (see `_codec`)."""
    if tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError("--tokens and --temperature must be >= 0, --top-k >= 1")
    model, config = load_run_model(run)
    encode, decode = _codec(config, tokenizer)
    ids = encode(prompt) or [0]
    x = torch.tensor([ids], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(tokens):
        context = x[:, -model.config.block_size :]
        logits, _ = model(context)
        logits = logits[:, -1, :]  # (1, vocab)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
        x = torch.cat([x, nxt], dim=1)
    return decode(x[0].tolist())
