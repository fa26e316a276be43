"""A GPT language model in one readable file (nanoGPT style).

Job: map token ids (B, T) to next-token logits and, given targets, a mean cross-entropy loss.
It holds no distributed code: replicas, sharding and fault tolerance are applied from outside.

Presets (see PRESETS) range from `tiny` (tests; well under a second per microbatch on a laptop CPU)
to `gpt2-124m`. Dropout draws from torch's global RNG; the trainer seeds that RNG per microbatch id
from `(seed, step, j)`, so a microbatch gets the same dropout masks on any replica.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from recover.training.presets import PRESETS, GPTConfig, build_config  # noqa: F401 (re-exported)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout
        # Separate projections (not one fused 3C-wide one) so that tensor parallelism can give
        # each rank whole heads by splitting each of them column-wise.
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()  # batch, sequence length, n_embd
        # The head count is read from the projections' width (-1): all n_head heads here, or
        # this rank's share of them when the projections are split by tensor parallelism.
        q = self.q_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def embed(transformer: nn.ModuleDict, idx: torch.Tensor) -> torch.Tensor:
    """Token plus position embeddings, then dropout: (B, T) ids -> (B, T, C)."""
    pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
    return transformer.drop(transformer.wte(idx) + transformer.wpe(pos))  # pos broadcasts over B


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the output projection reuses the token embedding (fewer parameters, and
        # it trains better at small scale).
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections: keeps the residual stream's variance
        # from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        # Tied weights are counted once by parameters().
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = embed(self.transformer, idx)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        return logits, None if targets is None else lm_loss(logits, targets)

    def flops_per_token(self) -> float:
        """Approximate training FLOPs per token (6N + attention), for MFU reporting."""
        return training_flops_per_token(self.config, self.num_params())


def training_flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    """Forward + backward FLOPs per token of a GPT of `n_params` parameters: 6N for the matrix
    products, and 12 * n_layer * n_embd * T for attention over a context of T = block_size."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
