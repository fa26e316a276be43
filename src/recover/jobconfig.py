"""Job files: `recover train|run|coordinator serve --config job.toml` (or a run folder's
`config.json` or `job.json`).

Job: turn a job file into defaults for the command's flags, so that a job can be described by a
file and any flag given on the command line overrides it. A TOML file has one table per flag
group of `recover train --help`; its keys are the long flags without their dashes (`-` or `_`
alike):

    [train]          # the trajectory: preset, steps, microbatches, lr, warmup_steps, ...
    [run]            # data, data_root, out, resume, quiet
    [replica]        # what a replica is: shard, tp, pp, mode, device, stall_timeout, ...
    [supervision]    # min_replicas, lease, respawn, max_restarts, balance
    [launch]         # replicas, fault (a list of specs), cold_start, standby

On the command line, `--TABLE.KEY VALUE` (`--train.lr 3e-4`) overrides a key by its address in
the file, the same as its flag (`--lr 3e-4`); the table must be the key's.

`recover run` has the same tables but [train] (its [launch] holds replicas, ranks_per_replica,
out, fault, start_timeout, quiet); `recover coordinator serve` has one, [coordinator].

A run folder's `config.json` (what `recover train` saved) is read as the same sections: its
`train` settings, its dataset's path, and its `launch` (the replica count and spec, the mode, the
faults); what it holds only for people (`model`, the dataset's hash) is left out. A run folder's
`job.json` (what `recover run` saved: `resolved_job`'s tables under "job") is read as it is.

Invariants: an unknown table or key is refused with the nearest valid name; a value of the wrong
type or outside a flag's choices is refused naming its table and key. The values go through each
flag's own type, and the configs built from the flags check them as they check flags. Parsing is
stdlib `tomllib`; nothing here reads the environment.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

from recover.checks import is_number

# argparse group title (its start) -> the job file's table
SECTIONS = {
    "trajectory": "train",
    "run": "run",
    "what a replica": "replica",
    "supervision": "supervision",
    "options": "launch",
}
# `recover coordinator serve`: its job file has one table, of its flags and the run's settings
COORDINATOR_SECTIONS = {"options": "coordinator", "the run's settings": "coordinator"}
NOT_IN_FILES = {"help", "config"}  # flags a job file cannot set


def _key(action: argparse.Action) -> str:
    long = [o for o in action.option_strings if o.startswith("--")]
    return long[0][2:].replace("-", "_") if long else action.dest


def job_keys(
    parser: argparse.ArgumentParser, sections: dict[str, str] = SECTIONS
) -> dict[str, dict[str, argparse.Action]]:
    """table -> key -> the flag's action, for a command's parser (`sections`: group title's
    start -> table)."""
    tables: dict[str, dict[str, argparse.Action]] = {}
    for group in parser._action_groups:
        section = next((s for t, s in sections.items() if group.title.startswith(t)), None)
        if section is None:
            continue
        for action in group._group_actions:
            if action.option_strings and action.dest not in NOT_IN_FILES:
                tables.setdefault(section, {})[_key(action)] = action
    return tables


def read_job_file(path: Path) -> dict[str, dict[str, Any]]:
    """A job file's tables: TOML, or a run folder's config.json (by its suffix)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    if path.suffix == ".json":
        try:
            saved = json.loads(text)
            if "job" in saved:  # a `recover run` folder's job.json
                return dict(saved["job"])
            return tables_of_saved_config(saved)
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"--config {path}: not a run folder's config.json ({e})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not TOML: {e}") from None


def tables_of_saved_config(saved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The job tables of what `recover train` saved as RUN/config.json."""
    from dataclasses import fields

    from recover.runtime.spec import ReplicaSpec

    tables: dict[str, dict[str, Any]] = {"train": dict(saved["train"])}
    if saved.get("data", {}).get("path"):
        tables["run"] = {"data": saved["data"]["path"]}
    launch = saved.get("launch", {})
    tables["launch"] = {"replicas": launch.get("replicas", 1), "fault": launch.get("faults", [])}
    if "min_replicas" in launch:
        tables["supervision"] = {"min_replicas": launch["min_replicas"]}
    replica: dict[str, Any] = {"mode": launch["mode"]} if "mode" in launch else {}
    spec = launch.get("replica") or {}
    replica.update(spec.pop("layout", {}))
    flags = {f.name: f.metadata["flag"] for f in fields(ReplicaSpec) if "flag" in f.metadata}
    replica.update({flags[name][2:].replace("-", "_"): v for name, v in spec.items()})
    if replica:
        tables["replica"] = replica
    return tables


def _nearest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(choices))}"


def _home(known: dict[str, dict[str, argparse.Action]], key: str) -> str | None:
    """The table that holds `key`, if any does."""
    return next((table for table, keys in known.items() if key in keys), None)


def dotted_flags(
    parser: argparse.ArgumentParser, argv: list[str], sections: dict[str, str] = SECTIONS
) -> list[str]:
    """`argv` with each `--TABLE.KEY[=VALUE]` (a job file's table and key, e.g. `--train.lr
    3e-4`) written as the flag it names (`--lr 3e-4`), so that a job file's value can be
    overridden by its address in the file. Words after `--` (a command) are left alone.
    ValueError naming the table or key that does not exist (and the table a key belongs to)."""
    known = job_keys(parser, sections)
    out: list[str] = []
    for i, word in enumerate(argv):
        if word == "--":
            return out + argv[i:]
        name, eq, value = word[2:].partition("=")
        if not word.startswith("--") or "." not in name:
            out.append(word)
            continue
        section, _, raw_key = name.partition(".")
        if section not in known:
            raise ValueError(f"{word}: no table [{section}]{_nearest(section, known)}")
        key = raw_key.replace("-", "_")
        action = known[section].get(key)
        if action is None:
            home = _home(known, key)
            where = f": it is in [{home}]" if home else _nearest(key, known[section])
            raise ValueError(f"{word}: [{section}] has no key {raw_key!r}{where}")
        flag = next(o for o in action.option_strings if o.startswith("--"))
        out.append(f"{flag}={value}" if eq else flag)
    return out


def job_defaults(
    parser: argparse.ArgumentParser,
    tables: dict[str, Any],
    *,
    source: str,
    sections: dict[str, str] = SECTIONS,
) -> dict[str, Any]:
    """dest -> value for `parser.set_defaults`, from a job file's tables. ValueError names the
    file (`source`), the table and the key of the first thing wrong."""
    known = job_keys(parser, sections)
    defaults: dict[str, Any] = {}
    for section, table in tables.items():
        if section not in known:
            raise ValueError(f"{source}: unknown table [{section}]{_nearest(section, known)}")
        if not isinstance(table, dict):
            raise ValueError(f"{source}: [{section}] must be a table of keys")
        for raw_key, value in table.items():
            key = raw_key.replace("-", "_")
            action = known[section].get(key)
            if action is None:
                home = _home(known, key)
                if home:  # a key of another table: name the table it belongs to
                    raise ValueError(
                        f"{source}: [{section}] has no key {raw_key!r}: it belongs to "
                        f"[{home}]; move it there"
                    )
                raise ValueError(
                    f"{source}: [{section}] unknown key {raw_key!r}{_nearest(key, known[section])}"
                )
            defaults[action.dest] = _value(action, value, f"{source}: [{section}] {raw_key}")
    return defaults


def resolved_job(
    parser: argparse.ArgumentParser, args: argparse.Namespace, sections: dict[str, str] = SECTIONS
) -> dict[str, dict[str, Any]]:
    """The job the parsed flags (file and command line together) describe, as a job file's
    tables; paths as text, unset values (None) left out. `job_defaults` reads it back."""
    tables: dict[str, dict[str, Any]] = {}
    for section, keys in job_keys(parser, sections).items():
        for key, action in keys.items():
            value = getattr(args, action.dest, None)
            if value is None:
                continue
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, list | tuple):
                value = [str(v) for v in value]
            tables.setdefault(section, {})[key] = value
    return tables


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    """`value` as the flag of `action` would give it."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where} must be a list of strings, got {value!r}")
        return [action.type(v) if action.type else v for v in value]
    if value is None or isinstance(value, dict | list):
        raise ValueError(f"{where} must be a single value, got {value!r}")
    kind = action.type
    if kind in (int, float) and not is_number(value):
        raise ValueError(f"{where} must be a number, got {value!r}")
    if kind is int and not isinstance(value, int):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    try:
        value = kind(value) if kind is not None else value
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    if action.choices is not None and value not in action.choices:
        allowed = ", ".join(map(str, action.choices))
        raise ValueError(f"{where} must be one of {allowed}, got {value!r}")
    return value
