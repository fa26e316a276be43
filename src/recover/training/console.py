"""The terminal side of a run: one human line per committed step and the end-of-run summary.

The durable record is `recover.record` (metrics.jsonl); these lines are for people watching.
"""

from __future__ import annotations

import math

from recover.training.flops import format_flops


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def format_rate(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def format_step_line(
    *,
    step: int,
    steps: int,
    loss: float,
    lr: float,
    tok_per_s: float,
    step_s: float,
    eta_s: float,
    flop_per_s: float | None = None,
    mfu: float | None = None,
) -> str:
    """The one human line per step: step | loss | lr | tok/s | FLOP/s | mfu | dt | eta (the
    achieved FLOP/s when the model's FLOPs per token are known, MFU when the peak is)."""
    width = len(str(steps))
    compute = "" if flop_per_s is None else f"{format_flops(flop_per_s)} | "
    if mfu is not None:
        compute += f"mfu {100 * mfu:.1f}% | "
    return (
        f"step {step:>{width}}/{steps} | loss {loss:.4f} | lr {lr:.2e} | "
        f"{format_rate(tok_per_s)} tok/s | {compute}{step_s * 1000:.0f} ms | "
        f"eta {format_duration(eta_s)}"
    )
