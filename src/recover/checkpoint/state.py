"""Checkpoint content: the training state as DCP items, saved by every rank and loaded into any layout.

Job: save the committed training state (model, optimizer, any extra state, and our metadata: the
next step to run, the trajectory config, the dataset hash) so that a resumed run continues on
exactly the trajectory of an uninterrupted one, in any layout. Sample order and dropout are pure
functions of (seed, step, j), so no RNG state is needed. The folders it is published in, and their
verification, are `recover.checkpoint.folders`; the format is documented in docs/checkpoints.md.

The form saved: every rank passes DCP its own part of the state (`dcp_state`): the model's state
dict and the optimizer's flattened per-parameter state (`state.FQN.exp_avg`), both from torch's
`get_*_state_dict` helpers, so FSDP2 and tensor-parallel parameters are DTensors holding this
rank's shard, and the optimizer's hyperparameters once per group (`param_groups@H`, see `_GROUPS`;
checkpoints that hold them per parameter and setting, `param_groups.FQN.lr`, still load). DCP
records each tensor's global shape and every chunk's offsets, so a checkpoint of any layout loads
into any other (`load_dcp_state`): resharding is DCP's planner reading the chunks that overlap each
rank's part. Tied weights are saved once, under their canonical name (`aliases`).

Invariants:
- `on_saved` (the `checkpoint_saved` event) is called only once the folder is published and its
  parent fsynced (recover.checkpoint.folders).
- Fencing: with a `fence`, the leading rank asks it before the save starts (the answer is agreed
  by the replica's ranks) and again just before the rename; a writer evicted meanwhile removes its
  temporary folder and publishes and announces nothing.
- One process group: a replica of several ranks saves over its own checkpoint group (a gloo group
  of the replica's ranks, built for this and used by nothing else, so the background save never
  interleaves with the training's collectives); a one-rank replica saves without any group.
- A state holding a non-finite value (a parameter or optimizer state) is never saved: `save`
  raises `CheckpointError` before anything is written (agreed over the replica's ranks).
- Only the last `keep` checkpoints are kept (an old folder is renamed to a temporary name first,
  so a prune cut short never leaves a half-deleted checkpoint under a valid name).

Cost: on the training thread, only DCP's staging copy of this rank's part (`dcp.async_save`: a
memcpy into buffers kept from one save to the next). Planning, serialisation, the writes and fsyncs
run on DCP's background thread; the marker's CRC-32 pass over the files runs on the leading rank's
checkpoint thread. Errors there surface at the next save or at `close()`. Loading creates a fresh
optimizer's state one parameter at a time (`_create_optimizer_state`) and reads each tensor
straight into its place (`dcp_reader.InPlaceReader`): peak host memory 1.03x the state on
gpt2-124m, against 1.23x for the same resume through DCP's own reader (a temporary per tensor)
and 1.24x before both changes (the one-file form needed 2.67x; benchmarks/checkpoint_format.py,
medians of 3, side by side). The hyperparameters saved once per group take a tiny model's save
from 286 DCP items to 78 (0.30 s vs 0.42 s, load 3-6).

Size: the writer (the save with its staging, publish and fence) and the reader of saved state
(into a model and optimizer, or as plain state dicts) side by side, so that what one writes and the
other expects stay together; the folders are recover.checkpoint.folders, the in-place DCP reader
recover.checkpoint.dcp_reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from recover.checkpoint.dcp_reader import InPlaceReader, UnreadableRecord
from recover.checkpoint.folders import (
    FORMAT,
    MARKER,
    CheckpointError,
    _describe_files,
    _fsync_dir,
    _marker_crc32,
    _remove,
    checkpoint_path,
    find_resume_point,
    list_checkpoints,
    open_checkpoint,
    verify_checkpoint,
)
from recover.processes import host_name
from recover.runtime.update_guard import all_finite, on_every_rank

# Per-parameter optimizer state, flattened: `state.FQN.exp_avg`, `param_groups.FQN.lr`.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# The optimizer's hyperparameters, saved once per parameter group (DCP would write each of the
# ~11 settings of every parameter as an object of its own): `optimizer.param_groups@H`, a tuple of
# the groups of the parameters this rank holds ({"params": [FQN...], "lr": ..., ...}; DCP saves a
# tuple whole, and would split a list of dicts), H a hash of their names, so that the ranks that
# hold the same parameters write one copy and pipeline stages each their own.
_GROUPS = "param_groups@"
# A one-rank replica saves and loads with `no_dist=True` on purpose: DCP's warning about it says
# nothing to our users.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


def _alias_keys(flat: dict, aliases: Mapping[str, str], *, prefixes: tuple[str, ...]) -> dict:
    """`flat` with every key naming an aliased parameter renamed to its canonical name; an alias
    whose canonical key is already there (the same tied tensor) is dropped."""
    if not aliases:
        return flat
    out: dict = {}
    renamed: dict = {}
    for key, value in flat.items():
        new = key
        for prefix in prefixes:
            for alias, canonical in aliases.items():
                head = f"{prefix}{alias}"
                if key == head or key.startswith(head + "."):
                    new = f"{prefix}{canonical}{key[len(head) :]}"
        (renamed if new != key else out)[new] = value
    for key, value in renamed.items():
        if key not in out:
            out[key] = value
        elif _storage(out[key]) != _storage(value):
            raise ValueError(f"{key} and its alias are different tensors: not tied, name no alias")
    return out


def _storage(value: Any) -> Any:
    """What identifies a tensor's memory (a DTensor's local part), to tell a tied alias."""
    if not isinstance(value, torch.Tensor):
        return id(value)
    local = value.to_local() if hasattr(value, "to_local") else value
    return (local.data_ptr(), tuple(local.shape))


def dcp_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> dict:
    """This rank's part of the state, in the form DCP saves and reshards: `model` (FQN -> tensor
    or DTensor), `optimizer` (flattened per parameter; absent while the optimizer has no state:
    asking torch for it would create it, with one step counted), `extra` (each object's
    state_dict()). `aliases` {FQN: canonical FQN} names tied parameters saved once."""
    aliases = dict(aliases or {})
    state: dict = {"model": _alias_keys(get_model_state_dict(model), aliases, prefixes=("",))}
    if optimizer is not None and optimizer.state:
        flat = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        flat = _rank_local_keys(model, flat)
        flat = _alias_keys(flat, aliases, prefixes=("state.", "param_groups."))
        state["optimizer"] = _collapse_groups(flat)
    if extra:
        state["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    return state


# The suffix of a rank-local optimizer state's key: "@rank" and the rank's coordinate in its
# parameter's device mesh ("state.FQN.NAME@rank0.1").
_RANK_LOCAL = "@rank"


def _rank_local_keys(model: torch.nn.Module, flat: dict) -> dict:
    """`flat` with each rank-local optimizer state renamed to this rank's own key.

    A rank-local state is a plain tensor (not a DTensor) of at least one dimension kept for a
    sharded (DTensor) parameter: an optimizer that works on the local shard and keeps state shaped
    unlike it (Adafactor-style factored moments over the shard's rows and columns; a ZeRO-style
    optimizer's slice). DCP takes a plain tensor for a replicated value: every rank would save it
    under one name, one rank's copy would be kept, and every rank would load that copy (silently
    wrong where the shapes agree). Each rank's is its own item here, under its mesh coordinate;
    such a state is resumed by the layout that saved it (DCP cannot reshard what it cannot see
    the layout of)."""
    sharded = {name: p for name, p in model.named_parameters() if isinstance(p, DTensor)}
    if not sharded:
        return flat
    out: dict = {}
    for key, value in flat.items():
        fqn = key[len("state.") :].rpartition(".")[0] if key.startswith("state.") else ""
        p = sharded.get(fqn)
        if p is not None and _rank_local(value):
            coordinate = p.device_mesh.get_coordinate() or ()
            key = f"{key}{_RANK_LOCAL}{'.'.join(str(c) for c in coordinate)}"
        out[key] = value
    return out


def _rank_local(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0


def _collapse_groups(flat: dict) -> dict:
    """`flat` (a flattened optimizer state) with its `param_groups.FQN.NAME` keys replaced by one
    `param_groups@H` object: the tuple of the distinct groups of settings, each with its FQNs."""
    out: dict = {}
    groups: dict[str, dict] = {}  # the exact value of its settings -> group
    settings: dict[str, dict] = {}
    for key, value in flat.items():
        if key.startswith("param_groups."):
            fqn, _, name = key[len("param_groups.") :].rpartition(".")
            settings.setdefault(fqn, {})[name] = value
        else:
            out[key] = value
    for fqn, values in settings.items():
        exact = repr(
            sorted((k, v.tolist() if torch.is_tensor(v) else v) for k, v in values.items())
        )
        groups.setdefault(exact, {**values, "params": []})["params"].append(fqn)
    if groups:
        names = "\n".join(sorted(settings)).encode()
        out[_GROUPS + hashlib.sha256(names).hexdigest()[:16]] = tuple(groups.values())
    return out


def _expand_groups(optimizer: dict) -> dict:
    """A loaded optimizer part with every `param_groups@H` object (a checkpoint of the collapsed
    form) back as `param_groups.FQN.NAME` keys; a checkpoint of the older form has those keys."""
    out = {k: v for k, v in optimizer.items() if not k.startswith(_GROUPS)}
    for key, groups in optimizer.items():
        if not key.startswith(_GROUPS):
            continue
        for group in groups:
            for fqn in group["params"]:
                for name, value in group.items():
                    if name != "params":
                        out[f"param_groups.{fqn}.{name}"] = value
    return out


# ---- the marker and verification ------------------------------------------------------------


# ---- writing --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that is durable on disk: what `checkpoint_saved` reports."""

    step: int  # the next step to run
    path: Path
    bytes: int
    seconds: float  # from the save's start to the fsync of the parent folder
    stall_s: float = 0.0  # of which the training thread was blocked (the staging copy)


class CheckpointWriter:
    """Saves checkpoints with `dcp.async_save` (every rank of the replica its own part) and
    publishes them from the leading rank; keeps the last `keep`.

    `process_group`: the replica's checkpoint group (None: one rank, no group). Every rank of the
    replica calls `save` together (a collective). `on_saved` is called on the leading rank's
    checkpoint thread once a checkpoint is durable, never before; an error in it is recorded like
    a failed save."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        on_saved: Callable[[SavedCheckpoint], None] | None = None,
        fence: Callable[[], bool] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.on_saved = on_saved
        self.fence = fence  # asked by the leading rank (see the module docstring)
        self.group = process_group
        self.leads = process_group is None or dist.get_rank(process_group) == 0
        # Kept from one save to the next: the staging copy reuses its buffers.
        self._stager = DefaultStager(StagingOptions(False, False, False, False))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stall_s = 0.0

    def _agree(self, go: bool, tmp: str) -> tuple[bool, str]:
        """The leading rank's decision and temporary folder name, on every rank."""
        if self.group is None:
            return go, tmp
        box: list[Any] = [(go, tmp)]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _finite(self, state: dict) -> bool:
        """Whether every floating value of the state is finite, on every rank of the replica: a
        non-finite state is never written (nor over a finite one)."""
        ok = all_finite(v for v in _flatten(state).values() if torch.is_tensor(v))
        return on_every_rank(ok, self.group)

    def save(
        self,
        step: int,
        state: dict,
        meta: Mapping[str, Any],
        *,
        aliases: Mapping[str, str] | None = None,
        block: bool = False,
    ) -> Path | None:
        """Save `state` (a `dcp_state` dict: this rank's part) as the checkpoint of `step`, with
        `meta` (JSON values) in it, and the `aliases` dcp_state used (for readers); returns its
        path, or None when fenced. The training thread
        is blocked for the staging copy; the checkpoint is durable when `on_saved` is called (at
        the latest when `wait()` returns; `block`: before this returns)."""
        self.wait()
        path = checkpoint_path(self.directory, step)
        if not self._finite(state):
            raise CheckpointError(
                f"refused to checkpoint step {step}: its state holds a value that is not finite "
                "(a parameter or optimizer state); the newest checkpoint in "
                f"{self.directory} is the last finite state"
            )
        go = self.fence is None or not self.leads or self.fence()
        go, tmp_name = self._agree(go, f"{path.name}.tmp.{host_name()}.{os.getpid()}")
        if not go:  # evicted: nothing is written, anywhere
            return None
        tmp = self.directory / tmp_name
        if self.leads:
            self.directory.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
        if self.group is not None:
            dist.barrier(group=self.group)  # the folder is clean before anyone writes into it
        meta = {"step": step, **meta}
        t0 = time.perf_counter()
        future = dcp.async_save(
            {**state, "recover_meta": json.dumps(meta)},
            storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
            process_group=self.group,
            no_dist=self.group is None,
            async_stager=self._stager,
        )
        self.last_stall_s = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._finish,
            args=(future, step, path, tmp, meta, dict(aliases or {}), t0, self.last_stall_s),
            name="checkpoint-writer",
            daemon=True,
        )
        self._thread.start()
        if block:
            self.wait()
        return path

    def _finish(self, future, step, path, tmp, meta, aliases, t0: float, stall: float) -> None:
        try:
            future.result()  # every rank's files and DCP's .metadata are written and fsynced
            if not self.leads:
                return
            files = _describe_files(tmp)
            marker = {
                "format": FORMAT,
                "step": step,
                "meta": meta,
                "aliases": aliases,
                "files": files,
                "saved_at": time.time(),
            }
            marker["marker_crc32"] = _marker_crc32(marker)
            with open(tmp / MARKER, "w") as f:
                json.dump(marker, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if self.fence is not None and not self.fence():  # evicted while it wrote
                _remove(tmp)
                return
            if path.exists():  # the same step saved again (a resumed run): replace it whole
                self._discard(path)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            size = sum(f["bytes"] for f in files.values()) + (path / MARKER).stat().st_size
            saved = SavedCheckpoint(step, path, size, time.perf_counter() - t0, stall)
            if self.on_saved is not None:
                self.on_saved(saved)
            for _, old in list_checkpoints(self.directory)[: -self.keep]:
                self._discard(old)
        except BaseException as e:  # recorded and re-raised on the training thread by wait()
            self._error = e
            if self.leads:
                _remove(tmp)

    def _discard(self, old: Path) -> None:
        """Remove a published checkpoint: renamed to a temporary name first (atomic), so that
        a removal cut short leaves a temporary, never a half checkpoint under a valid name."""
        trash = old.with_name(f"{old.name.split('.')[0]}.old.tmp.{host_name()}.{os.getpid()}")
        try:
            os.replace(old, trash)
        except FileNotFoundError:
            return
        _remove(trash)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"checkpoint save failed: {error}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._stager.close()


# ---- reading --------------------------------------------------------------------------------


def _check_shapes(path: Path, metadata, flat: dict) -> None:
    """CheckpointError naming the first tensor whose global shape differs from the checkpoint's
    (another model shape), or that the checkpoint lacks."""
    saved_keys = metadata.state_dict_metadata
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        saved = saved_keys.get(key)
        base = key.partition(_RANK_LOCAL)[0]
        rank_local = _RANK_LOCAL in key or (
            saved is None and any(k.startswith(base + _RANK_LOCAL) for k in saved_keys)
        )
        if rank_local and (
            saved is None
            or (isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != value.shape)
        ):
            raise CheckpointError(
                f"checkpoint {path} cannot give this rank its {base.removeprefix('optimizer.')}: "
                "the optimizer kept it for each rank's own shard, shaped unlike the parameter, "
                "which cannot be resharded; it resumes in the layout that saved it (as many "
                "ranks along the parameter's mesh), not this one"
            )
        if saved is None:
            raise CheckpointError(
                f"checkpoint {path} has no {key}: it was saved from another model or optimizer"
            )
        if isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {key} of shape {tuple(saved.size)}, this model's is "
                f"{tuple(value.shape)}: it was saved from a model of another shape"
            )


def _flatten(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def load_dcp_state(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
    process_group: dist.ProcessGroup | None = None,
    in_place: bool = True,
) -> None:
    """Load the checkpoint folder `path` into `model`, `optimizer` and `extra`, whatever layout
    saved it: each rank reads the chunks of its own part (a collective over `process_group`, the
    replica's checkpoint group; None for one rank), each tensor straight into its place
    (`in_place=False`: through DCP's own reader, for comparison). CheckpointError on another
    model's checkpoint, or on a file that cannot be read (naming it)."""
    reader = InPlaceReader(path) if in_place else dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: DCP metadata: {e}") from e
    saved_keys = metadata.state_dict_metadata
    aliases = dict(aliases or {})
    with_optimizer = optimizer is not None and any(
        k.startswith("optimizer.state.") for k in saved_keys
    )
    if with_optimizer and not optimizer.state:
        _create_optimizer_state(model, optimizer)  # the tensors to load into
    state = dcp_state(model, optimizer if with_optimizer else None, extra=extra, aliases=aliases)
    if with_optimizer:  # ask for the hyperparameters in the form the checkpoint has them
        saved_groups = [
            k.partition(".")[2] for k in saved_keys if k.startswith(f"optimizer.{_GROUPS}")
        ]
        if saved_groups:  # every rank reads every group object (a few, small)
            mine = {k: v for k, v in state["optimizer"].items() if not k.startswith(_GROUPS)}
            state["optimizer"] = {**mine, **dict.fromkeys(saved_groups)}
        else:  # a checkpoint of the older form: an object per parameter and setting
            state["optimizer"] = _expand_groups(state["optimizer"])
    _check_shapes(path, metadata, _flatten({k: v for k, v in state.items() if k != "extra"}))
    try:
        dcp.load(
            state, storage_reader=reader, process_group=process_group,
            no_dist=process_group is None,
        )  # fmt: skip
    except (Exception, CheckpointException) as e:
        raise _load_error(path, e) from e
    model_state = _unalias(state["model"], get_model_state_dict(model).keys(), aliases, "")
    set_model_state_dict(model, model_state)
    if with_optimizer:
        own = get_optimizer_state_dict(model, optimizer, options=_FLAT).keys()
        loaded = {
            k.partition(_RANK_LOCAL)[0]: v for k, v in _expand_groups(state["optimizer"]).items()
        }
        flat = _unalias(loaded, own, aliases, ("state.", "param_groups."))
        set_optimizer_state_dict(model, optimizer, flat, options=_FLAT)
    for name, obj in (extra or {}).items():
        obj.load_state_dict(state["extra"][name])


def _load_error(path: Path, error: BaseException) -> CheckpointError:
    """The CheckpointError for a failed `dcp.load`: DCP wraps each rank's error in a
    CheckpointException whose text is a traceback; this names the first one's cause."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    if isinstance(error, UnreadableRecord):
        return CheckpointError(
            f"checkpoint {path} is corrupt: {error}; delete it to resume from an older one"
        )
    return CheckpointError(f"checkpoint {path} could not be loaded: {error}")


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state, as torch's state_dict helpers do (a step at learning
    rate 0 with zero gradients), but so that a resume's peak host memory stays at the state
    itself: the zero gradients are stride-0 (no gradient buffer per parameter), and each parameter
    takes its step alone, the largest first, so that a step's temporaries (AdamW: two of its
    parameter's size, 0.21x the state on gpt2-124m when all stepped at once) come while little
    of the state exists. Sharded (DTensor) parameters go through torch's own helper."""
    groups = [list(group["params"]) for group in optimizer.param_groups]
    if any(p.grad is not None or isinstance(p, DTensor) for params in groups for p in params):
        get_optimizer_state_dict(model, optimizer, options=_FLAT)
        return
    order = sorted(
        ((i, p) for i, params in enumerate(groups) for p in params if p.requires_grad),
        key=lambda item: -item[1].numel(),
    )
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        for i, p in order:
            p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
            for j, group in enumerate(optimizer.param_groups):
                group["params"] = [p] if j == i else []
            optimizer.step()
            p.grad = None
    finally:
        for group, params, lr in zip(optimizer.param_groups, groups, lrs, strict=True):
            group["params"] = params
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():  # loaded in place: each must own its memory
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and not value.is_contiguous():
                state[name] = value.contiguous()


def _unalias(loaded: dict, wanted, aliases: Mapping[str, str], prefixes) -> dict:
    """`loaded` (keys under canonical names) with the keys `wanted` (this rank's own names)."""
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    out = {}
    for key in wanted:
        if key in loaded:
            out[key] = loaded[key]
            continue
        for prefix in prefixes:
            for alias, canonical in aliases.items():
                head = f"{prefix}{alias}"
                if key == head or key.startswith(head + "."):
                    out[key] = loaded[f"{prefix}{canonical}{key[len(head) :]}"]
    return out


def _unflatten_optimizer(flat: dict) -> dict:
    """{"state": {FQN: {name: value}}, "param_groups": {FQN: {name: value}}} from the flat keys
    (the last dotted part is the state's or the hyperparameter's name)."""
    out: dict = {"state": {}, "param_groups": {}}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        out.setdefault(kind, {}).setdefault(fqn, {})[name] = value
    return out


def read_checkpoint(path: Path | str) -> dict:
    """The whole content of a checkpoint as plain CPU objects: {"model": {FQN: tensor},
    "optimizer": {"state": {FQN: {...}}, "param_groups": {FQN: {...}}} or None, "extra": {...},
    "meta": {...}}. Verified first (CheckpointError naming the path). Reads every tensor whole:
    needs host memory for the full state. A file of the older form is read too (its optimizer
    state as that form saved it)."""
    path = Path(path)
    point = open_checkpoint(path)
    if point.legacy_state is not None:
        s = point.legacy_state
        return {"model": s["model"], "optimizer": s.get("optimizer"), "extra": {},
                "meta": point.meta}  # fmt: skip
    marker = verify_checkpoint(path, checksums=False)  # (checked in full by open_checkpoint)
    reader = InPlaceReader(path)
    metadata = reader.read_metadata()
    flat: dict = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = None  # a pickled object: DCP puts it in place
    try:
        dcp.load(flat, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise _load_error(path, e) from e
    parts: dict = {"model": {}, "optimizer": {}, "extra": {}}
    for key, value in flat.items():
        top, _, rest = key.partition(".")
        if top in parts:
            parts[top][rest] = value
    model = parts["model"]
    for alias, canonical in marker.get("aliases", {}).items():
        if canonical in model:
            model.setdefault(alias, model[canonical])  # one tensor, as in the tied model
    extra: dict = {}
    for key, value in parts["extra"].items():  # nested back: name -> its state dict
        node = extra
        *heads, last = key.split(".")
        for h in heads:
            node = node.setdefault(h, {})
        node[last] = value
    return {
        "model": model,
        "optimizer": (
            _unflatten_optimizer(_expand_groups(parts["optimizer"])) if parts["optimizer"] else None
        ),
        "extra": extra,
        "meta": marker["meta"],
    }


def load_latest(directory: Path) -> dict | None:
    """The newest valid checkpoint's content (read_checkpoint), or None if there is none."""
    point = find_resume_point(directory)
    return None if point is None else read_checkpoint(point.path)
