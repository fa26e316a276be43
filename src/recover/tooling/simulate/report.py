"""Report: Markdown tables for the terminal and the README, the JSON of all figures, PNG plots.

Job: format what scenarios.py and validate.py computed; compute nothing new except ratios.
matplotlib is optional: it is imported inside `write_plots`, which returns no paths and a reason
when it is missing (install the `plot` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

from recover.tooling.simulate.scenarios import PAPER, POLICY_ORDER

__all__ = [
    "format_paper",
    "format_scale_table",
    "format_mtbf_table",
    "format_validation",
    "write_json",
    "write_plots",
]


def _gpus(n: int) -> str:
    return f"{n // 1000}k" if n >= 4000 else str(n)


def format_paper(paper: dict, sensitivity: list[dict] | None = None) -> str:
    res = paper["results"]
    lines = [
        "Paper scenario: 512 GPUs = 64 replicas x 8, 8192 microbatches/step, a replica failure "
        "every 5 steps (32 in all), no repairs, each policy until it has held 234 GPU-hours",
        "",
        "| policy | tokens (B) | tok/s | tok/s per live GPU | steps | failures hit |",
        "|---|---|---|---|---|---|",
    ]
    for p, r in res.items():
        lines.append(
            f"| {p} | {r['tokens'] / 1e9:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_live_gpu_s']:,.0f} | {r['steps']:.0f} | {r['failures']} |"
        )
    lines += [
        "",
        "| recover vs checkpoint-restart | ours | paper |",
        "|---|---|---|",
        f"| effective throughput ratio | {paper['throughput_ratio_vs_ckpt']:.2f}x | "
        f"{PAPER['throughput_ratio_vs_ckpt']:.2f}x |",
        f"| more tokens at 234 GPU-hours | {paper['more_tokens_vs_ckpt'] * 100:.1f}% | "
        f"{PAPER['more_tokens_vs_ckpt'] * 100:.1f}% |",
        f"| (per-live-GPU throughput ratio) | {paper['per_live_gpu_ratio_vs_ckpt']:.2f}x | |",
    ]
    if sensitivity:
        lines += ["", "Sensitivity to the restart cost of checkpoint-restart (ours):", ""]
        lines += ["| restart (s) | throughput ratio | more tokens |", "|---|---|---|"]
        for s in sensitivity:
            lines.append(f"| {s['restart_s']:.0f} | {s['throughput_ratio_vs_ckpt']:.2f}x | "
                         f"{s['more_tokens_vs_ckpt'] * 100:.1f}% |")  # fmt: skip
    return "\n".join(lines)


def format_scale_table(rows: list[dict]) -> str:
    lines = [
        "| GPUs | job MTBF (h) | policy | tok/s (M) | tok/s per live GPU | goodput | "
        "M tokens per GPU-hour | failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for p in POLICY_ORDER:
            r = row["policies"][p]
            lines.append(
                f"| {_gpus(row['gpus'])} | {row['job_mtbf_h']:.2f} | {p} | "
                f"{r['tokens_per_s'] / 1e6:.2f} | {r['tokens_per_live_gpu_s']:,.0f} | "
                f"{r['goodput'] * 100:.2f}% | {r['tokens_per_gpu_hour'] / 1e6:.2f} | "
                f"{r['failures']:.1f} |"
            )
    return "\n".join(lines)


def format_mtbf_table(rows: list[dict]) -> str:
    head = "| job MTBF (h) | " + " | ".join(f"{p} goodput" for p in POLICY_ORDER) + " |"
    lines = [head, "|" + "---|" * (len(POLICY_ORDER) + 1)]
    for row in rows:
        cells = " | ".join(f"{row['policies'][p]['goodput'] * 100:.2f}%" for p in POLICY_ORDER)
        lines.append(f"| {row['job_mtbf_h']:g} | {cells} |")
    return "\n".join(lines)


def format_validation(rows: list[dict], tolerance: float) -> str:
    lines = [
        "| run | mode | steps | failures | measured tok/s | predicted tok/s | error | within |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in rows:
        ok = "yes" if abs(v["rel_error"]) <= tolerance else "NO"
        lines.append(
            f"| {v['run']} | {v['mode']} | {v['steps']} | {v['failures']} | "
            f"{v['measured_tokens_per_s']:,.0f} | {v['predicted_tokens_per_s']:,.0f} | "
            f"{v['rel_error'] * 100:+.1f}% | {ok} ({tolerance * 100:.0f}%) |"
        )
    return "\n".join(lines)


def write_json(path: Path, figures: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2, default=str) + "\n")


def write_plots(out: Path, scale_rows: list[dict], mtbf_rows: list[dict]) -> tuple[list[Path], str]:
    """PNG plots of the sweeps; returns (paths written, why none were written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install 'recover[plot]'): no PNG written"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if scale_rows:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        xs = [row["gpus"] for row in scale_rows]
        for p in POLICY_ORDER:
            axes[0].plot(xs, [r["policies"][p]["tokens_per_s"] for r in scale_rows], "o-", label=p)
            axes[1].plot(xs, [r["policies"][p]["tokens_per_live_gpu_s"] for r in scale_rows],
                         "o-", label=p)  # fmt: skip
        axes[0].set(xscale="log", yscale="log", xlabel="GPUs", ylabel="effective tokens/s",
                    title="Effective throughput vs scale")  # fmt: skip
        axes[1].set(xscale="log", xlabel="GPUs", ylabel="tokens/s per live GPU",
                    title="Per-live-GPU throughput vs scale")  # fmt: skip
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out / "throughput_vs_scale.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if mtbf_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [row["job_mtbf_h"] for row in mtbf_rows]
        for p in POLICY_ORDER:
            ax.plot(xs, [r["policies"][p]["goodput"] for r in mtbf_rows], "o-", label=p)
        ax.set(xscale="log", xlabel="job MTBF (hours)", ylabel="goodput (of failure-free)",
               title=f"Goodput vs MTBF at {mtbf_rows[0]['gpus']:,} GPUs")  # fmt: skip
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / "goodput_vs_mtbf.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written, ""
