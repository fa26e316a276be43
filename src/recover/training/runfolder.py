"""The run folder (`--out DIR`): refuse one that holds another run, write `config.json`, and on
`--resume` check that the folder's run is the one asked for; one live launcher per folder
(`lock_run_folder`). Torch-free (the launcher uses it).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from recover.training.config import RESUMABLE_CHANGES, RunPaths, TrainConfig
from recover.training.presets import build_config

CONFIG_FORMAT = 1
LOCK_FILE = ".launcher.lock"  # held (flock) by the live launcher of the run; not the record


class RunFolderError(ValueError):
    """--out names a folder that cannot hold this run (another run, or a different config)."""


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def open_run_folder(
    paths: RunPaths, cfg: TrainConfig, *, data_info: dict, resume: bool, launch: dict | None = None
) -> None:
    """Create or validate the run folder; write config.json. Raise RunFolderError on conflict."""
    check_run_folder(paths, cfg, data_info=data_info, resume=resume)
    out = paths.out
    out.mkdir(parents=True, exist_ok=True)
    record = {"format": CONFIG_FORMAT, "train": cfg.to_dict(), "data": data_info}
    if data_info.get("vocab_size"):  # the model's whole shape, so that the folder explains itself
        model = build_config(
            cfg.preset, vocab_size=int(data_info["vocab_size"]), block_size=cfg.seq_len,
            dropout=cfg.dropout,
        )  # fmt: skip
        record["model"] = model.to_dict()
    if launch:
        record["launch"] = launch
    _write_json_atomic(paths.config, record)


def check_run_folder(paths: RunPaths, cfg: TrainConfig, *, data_info: dict, resume: bool) -> None:
    """RunFolderError if `paths.out` cannot take this run (open_run_folder's checks, nothing
    written): another run or other files there without --resume; with --resume, no run, or one
    of other settings or data. Torch-free, so a refusal costs no import."""
    out = paths.out
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out}: exists and is not a folder")
    has_run = paths.config.exists()
    if resume:
        if not has_run:
            raise RunFolderError(f"--resume: {out} holds no run (no config.json) to resume")
        saved = json.loads(paths.config.read_text())
        old = TrainConfig.from_dict(saved["train"]).to_dict()
        new = cfg.to_dict()
        changed = sorted(k for k in new if old.get(k) != new[k] and k not in RESUMABLE_CHANGES)
        if changed:
            diffs = ", ".join(
                f"--{k.replace('_', '-')} {old.get(k)!r} -> {new[k]!r}" for k in changed
            )
            raise RunFolderError(
                f"--resume: {out} holds a run with other settings ({diffs}); "
                "resume with the run's own settings or choose another --out"
            )
        if saved.get("data", {}).get("content_hash") != data_info.get("content_hash"):
            raise RunFolderError(
                f"--resume: {out} was trained on another dataset "
                f"(hash {saved.get('data', {}).get('content_hash')!r}, "
                f"now {data_info.get('content_hash')!r})"
            )
    elif out.exists() and any(p.name != LOCK_FILE for p in out.iterdir()):
        what = "another run" if has_run else "other files"
        raise RunFolderError(
            f"--out {out}: the folder holds {what}; pass --resume to continue it or choose an "
            "empty or new folder"
        )


def lock_run_folder(out: Path) -> int:
    """Take the run folder's lock for this launcher's lifetime (the returned descriptor; it is
    not inherited by children). A second launcher on the same folder (a --resume into a live run,
    or the same --out twice) is refused with RunFolderError naming the holder's pid. The lock is
    the kernel's (flock): a launcher that dies, even by SIGKILL, holds it no longer."""
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderError(
            f"--out {out}: another launcher (pid {holder}) is running this run; wait for it to "
            "end (or stop it) before starting or resuming a job in this folder"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def read_dataset_info(path: Path) -> dict:
    """What a run records about its dataset, read from the dataset's meta.json (no torch)."""
    meta_path = Path(path) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        return {
            "path": str(Path(path).resolve()),
            "content_hash": meta["content_hash"],
            "vocab_size": meta["vocab_size"],
            "tokenizer": meta.get("tokenizer"),
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunFolderError(
            f"--data {path}: not a dataset made by `recover prepare` ({meta_path}: {e})"
        ) from e
