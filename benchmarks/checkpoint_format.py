"""Checkpoint format: the save stall, the resume time and the resume's peak host memory, side by side.

The committed state of a preset's model (gpt2-124m by default: its parameters and AdamW moments,
after one optimizer step) is saved and loaded three ways, in one run:
- async DCP: `recover.checkpoint.state.CheckpointWriter.save` (what `recover train` does):
  the training thread is blocked for `dcp_state` and DCP's staging copy; the write, fsyncs, CRC-32
  marker and publish run in the background;
- sync DCP: the same save, waited for (a synchronous full save of the same format);
- one file (the format before DCP): a CPU copy of the full state on the training thread, then
  torch.save + SHA-256 + write + fsync on a thread (as `recover train` did), read back whole.
The DCP checkpoint is resumed two ways: with `load_dcp_state`'s reader, which reads each tensor
straight into its place (what `recover train` does), and with DCP's own reader (`in_place=False`),
which loads each tensor into a temporary and copies it.

Figures: the stall (seconds the calling thread is blocked, median of `--repeats` saves after one
warm-up save), the total save time, the resume time (a fresh process: build the model and
optimizer, verify and load the newest checkpoint; median of `--repeats` resumes of each kind,
taken in turn), and the resume's peak host memory: the rise of the process's RSS high-water mark
(VmHWM, reset after imports) from its RSS after imports, over the state's bytes. Ratios printed:
async stall / sync save (target <= 0.10), async stall / one-file stall, peak resume memory / state
(target <= 1.2), for each reader.

    python benchmarks/checkpoint_format.py [--preset gpt2-124m] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from recover.checkpoint.folders import LEGACY_MAGIC, find_resume_point, read_legacy_checkpoint
from recover.checkpoint.state import CheckpointWriter, load_dcp_state
from recover.training.model import GPT, build_config
from recover.training.trainer import CHECKPOINT_ALIASES

VOCAB, BLOCK = 50257, 1024


def build(preset: str):
    torch.manual_seed(0)
    model = GPT(build_config(preset, vocab_size=VOCAB, block_size=BLOCK))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    return model, optimizer


def committed_state(preset: str):
    model, optimizer = build(preset)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # the moments exist, as in a committed state
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_bytes(model, optimizer) -> int:
    seen, total = set(), 0
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# ---- the one-file format, as recover train wrote it before DCP ---------------------------------
def _detach_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _detach_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_detach_copy(v) for v in obj)
    return obj


def _write_one_file(path: Path, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(LEGACY_MAGIC)
        f.write(hashlib.sha256(payload).digest())
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_one_file(directory: Path, step: int, model, optimizer) -> tuple[float, float]:
    """(stall, total) seconds of a save in the one-file form."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from recover.training.trainer import FULL_STATE

    t0 = time.perf_counter()
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL_STATE),
    }
    snapshot = _detach_copy(state)
    path = directory / f"step_{step:08d}.ckpt"
    thread = threading.Thread(target=_write_one_file, args=(path, snapshot))
    thread.start()
    stall = time.perf_counter() - t0
    thread.join()
    return stall, time.perf_counter() - t0


def save_dcp(writer: CheckpointWriter, step: int, model, optimizer, *, block: bool):
    """(stall, total) seconds of a DCP save: async (the call returns after staging) or sync."""
    from recover.checkpoint.state import dcp_state

    t0 = time.perf_counter()
    writer.save(step, dcp_state(model, optimizer, aliases=CHECKPOINT_ALIASES), {}, block=block,
                aliases=CHECKPOINT_ALIASES)  # fmt: skip
    stall = time.perf_counter() - t0
    writer.wait()
    return stall, time.perf_counter() - t0


# ---- resume, in a fresh process -------------------------------------------------------------
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def resume_child(kind: str, directory: str, preset: str) -> None:
    """Child: build the model and optimizer, load the newest checkpoint; print JSON figures."""
    base = _status_kb("VmRSS")
    try:  # reset the high-water mark to the current RSS (Linux: clear_refs 5)
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    t0 = time.perf_counter()
    model, optimizer = build(preset)
    if kind in ("dcp", "dcp-reader"):
        point = find_resume_point(Path(directory))
        load_dcp_state(point.path, model, optimizer, aliases=CHECKPOINT_ALIASES,
                       in_place=kind == "dcp")  # fmt: skip
    else:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from recover.training.trainer import FULL_STATE

        state = read_legacy_checkpoint(sorted(Path(directory).glob("*.ckpt"))[-1])
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=FULL_STATE)
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    print(json.dumps({"seconds": seconds, "rise_bytes": (peak - base) * 1024, "hwm_reset": reset,
                      "check": float(next(iter(optimizer.state.values()))["exp_avg"].sum())}))  # fmt: skip


def resume(kind: str, directory: Path, preset: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(directory), "--preset", preset],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        resume_child(args.child[0], args.child[1], args.preset)
        return
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    dcp_dir, file_dir = root / "dcp", root / "file"
    for d in (dcp_dir, file_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    load_at_start = os.getloadavg()[0]
    model, optimizer = committed_state(args.preset)
    size = state_bytes(model, optimizer)
    print(f"{args.preset}: state {size / 1e6:.0f} MB (parameters and AdamW moments, fp32); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    writer = CheckpointWriter(dcp_dir, keep=2)
    runs: dict[str, list[tuple[float, float]]] = {"async DCP": [], "sync DCP": [], "one file": []}
    step = 0
    for i in range(args.repeats + 1):  # the first round warms up (staging buffers, page cache)
        for name in runs:
            step += 1
            if name == "one file":
                figures = save_one_file(file_dir, step, model, optimizer)
                for old in sorted(file_dir.glob("*.ckpt"))[:-1]:
                    old.unlink()
            else:
                figures = save_dcp(writer, step, model, optimizer, block=name == "sync DCP")
            if i > 0:
                runs[name].append(figures)
            print(f"  round {i} {name:10s} stall {figures[0]:.3f} s, total {figures[1]:.3f} s",
                  flush=True)  # fmt: skip
    writer.close()
    med = {
        name: {
            "stall_s": statistics.median(r[0] for r in rows),
            "save_s": statistics.median(r[1] for r in rows),
        }
        for name, rows in runs.items()
    }
    loads: dict[str, list[dict]] = {"dcp": [], "dcp-reader": [], "file": []}
    for _ in range(args.repeats):
        for kind in loads:
            loads[kind].append(resume(kind, file_dir if kind == "file" else dcp_dir, args.preset))
            print(f"  resume {kind:10s} {loads[kind][-1]['seconds']:.3f} s, peak "
                  f"{loads[kind][-1]['rise_bytes'] / size:.3f}x the state", flush=True)  # fmt: skip
    med["DCP's reader"] = {}  # the same checkpoint as async DCP's, resumed through DCP's reader
    for kind, name in (("dcp", "async DCP"), ("dcp-reader", "DCP's reader"), ("file", "one file")):
        med[name]["resume_s"] = statistics.median(x["seconds"] for x in loads[kind])
        med[name]["resume_peak_over_state"] = statistics.median(
            x["rise_bytes"] / size for x in loads[kind]
        )
    ratios = {
        "async stall / sync DCP save": med["async DCP"]["stall_s"] / med["sync DCP"]["save_s"],
        "async stall / one-file stall": med["async DCP"]["stall_s"] / med["one file"]["stall_s"],
        "DCP resume / one-file resume": med["async DCP"]["resume_s"] / med["one file"]["resume_s"],
        "DCP resume / DCP's reader resume": (
            med["async DCP"]["resume_s"] / med["DCP's reader"]["resume_s"]
        ),
        "DCP resume peak / state": med["async DCP"]["resume_peak_over_state"],
        "DCP's reader resume peak / state": med["DCP's reader"]["resume_peak_over_state"],
        "one-file resume peak / state": med["one file"]["resume_peak_over_state"],
    }
    print(f"\nmedians of {args.repeats} (after a warm-up round), seconds:")
    print(f"{'':12s} {'stall':>8s} {'save':>8s} {'resume':>8s} {'resume peak/state':>18s}")
    for name, m in med.items():
        stall = f"{m['stall_s']:8.3f} {m['save_s']:8.3f}" if "stall_s" in m else f"{'':17s}"
        resume_s = f"{m['resume_s']:8.3f}" if "resume_s" in m else f"{'':8s}"
        peak = f"{m['resume_peak_over_state']:18.3f}" if "resume_s" in m else ""
        print(f"{name:12s} {stall} {resume_s} {peak}")
    print()
    for name, value in ratios.items():
        print(f"{name:32s} {value:.3f}")
    result = {
        "benchmark": "checkpoint_format",
        "preset": args.preset,
        "state_mb": size / 1e6,
        "repeats": args.repeats,
        "load_average_1m": {"start": load_at_start, "end": os.getloadavg()[0]},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },  # fmt: skip
        "medians": med,
        "ratios": ratios,
        "method": __doc__.split("\n\n")[1:3],
        "hwm_reset": all(x["hwm_reset"] for rows in loads.values() for x in rows),
        "resumes": loads,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
