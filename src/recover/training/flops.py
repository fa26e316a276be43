"""Achieved FLOP/s and model FLOPs utilisation (MFU) of a run, for the step line and the record.

Job: turn tokens per second into achieved FLOP/s with the model's training FLOPs per token (6N
plus attention, `GPT.flops_per_token`), and into MFU where the peak of the devices is known: given
(`--peak-tflops`), or looked up from the GPU's name in a small table of dense bf16 peaks. On a CPU,
or a GPU not in the table, MFU is not reported (None), never guessed.

Limits: the FLOPs are the model's nominal ones (a redone step's recomputed microbatches and the
evaluation are not counted, so a recovery lowers the achieved figure); MFU is taken against the
bf16 dense peak whatever `--precision` is.
"""

from __future__ import annotations

# Dense bf16 tensor-core peaks (TFLOP/s) of one GPU, from the vendors' data sheets, matched
# against torch.cuda.get_device_name() in order (the first name found in it wins).
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("V100", 125.0),  # fp16 tensor cores (no bf16)
)


def known_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name`, or None when it is not in the table."""
    for name, tflops in PEAK_TFLOPS:
        if name in device_name:
            return tflops
    return None


def device_peak_tflops(device: str, given: float = 0.0) -> float | None:
    """The peak TFLOP/s of one device of this process: `given` when > 0 (`--peak-tflops`), else
    the table's for a CUDA device, else None (a CPU: no MFU)."""
    if given > 0:
        return given
    if not device.startswith("cuda"):
        return None
    import torch

    return known_peak_tflops(torch.cuda.get_device_name(torch.device(device)))


def achieved_flop_per_s(flops_per_token: float, tokens: int, seconds: float) -> float:
    """FLOP/s of the whole job over one step (every replica's tokens)."""
    return flops_per_token * tokens / seconds if seconds > 0 else 0.0


def mfu(flop_per_s: float, peak_tflops: float | None, devices: int) -> float | None:
    """Achieved over peak FLOP/s of `devices` devices, 0..1; None without a known peak."""
    if peak_tflops is None or devices < 1:
        return None
    return flop_per_s / (peak_tflops * 1e12 * devices)


def format_flops(flop_per_s: float) -> str:
    """A FLOP/s figure with its unit: 12.3 TFLOP/s, 45.6 GFLOP/s, ..."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if flop_per_s >= scale:
            return f"{flop_per_s / scale:.1f} {unit}FLOP/s"
    return f"{flop_per_s:.0f} FLOP/s"
