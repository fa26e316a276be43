"""Settings declared once: a dataclass field that carries its flag, its help text and its check.

Job: the one way a setting of a spec object (recover.runtime.spec.ReplicaSpec, the replica's;
recover.coordinator.state_store.CoordinatorOptions, the coordinator's) is declared (`setting`),
checked (`check_settings`: a ValueError that names the flag), offered as a flag (`add_flags`,
which may pick the settings of one tag, e.g. the coordinator settings a local launcher offers
too) and read back from parsed flags (`given`). A help text says `%(default)s` where it shows
the default, which comes from the field, so a default is written once.

What it must not do: know any spec's fields, or read the environment.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, Field, field, fields
from typing import Any, TypeVar

_T = TypeVar("_T")


def setting(
    default: _T,
    flag: str,
    help: str,
    *,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    low: tuple[float, bool] | None = None,
    tags: Sequence[str] = (),
) -> _T:
    """A spec field with its flag. `low`: (bound, inclusive) for numbers (None with no `choices`:
    a text setting); `tags`: the groups of commands that offer the flag besides the spec's own."""
    meta = {
        "flag": flag, "help": help, "metavar": metavar, "choices": choices, "low": low,
        "tags": frozenset(tags),
    }  # fmt: skip
    return field(default=default, metadata=meta)  # type: ignore[no-any-return]


def settings_of(cls: type) -> list[Field[Any]]:
    """The fields of `cls` that are settings (that have a flag)."""
    return [f for f in fields(cls) if "flag" in f.metadata]


def check_settings(obj: Any) -> None:
    """ValueError naming the flag of the first setting of `obj` whose value does not fit its
    declaration (a switch's bool, a choice, a number's bound, a text)."""
    for f in settings_of(type(obj)):
        value, meta = getattr(obj, f.name), f.metadata
        if f.type == "bool":  # a switch
            if not isinstance(value, bool):
                raise ValueError(f"{meta['flag']} must be true or false, got {value!r}")
            continue
        if meta["choices"] is not None:
            if value not in meta["choices"]:
                allowed = ", ".join(meta["choices"])
                raise ValueError(f"{meta['flag']} must be one of {allowed}, got {value!r}")
            continue
        if meta["low"] is None:  # a text setting (a path; empty: none)
            if not isinstance(value, str):
                raise ValueError(f"{meta['flag']} must be text, got {value!r}")
            continue
        number = f.type == "int" and not isinstance(value, bool) and isinstance(value, int)
        if f.type == "float":
            number = isinstance(value, int | float) and not isinstance(value, bool)
            number = number and math.isfinite(value)
        bound, inclusive = meta["low"]
        if not number or value < bound or (value == bound and not inclusive):
            kind = "an int" if f.type == "int" else "a finite number"
            rel = ">=" if inclusive else ">"
            raise ValueError(f"{meta['flag']} must be {kind} {rel} {bound:g}, got {value!r}")


def json_fields(text: str, known: set[str], *, name: str) -> dict[str, Any]:
    """The fields of a spec's JSON object (`text`), all among `known`; ValueError naming `name`
    for text that is not JSON, not an object, or has unknown fields."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{name} has unknown fields {unknown}; known: {sorted(known)}")
    return raw


def shown(value: Any) -> str:
    """A default as a help text shows it (1.0 as 1, 0.1 as 0.1)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_flags(
    group: argparse._ActionsContainer,
    cls: type,
    *,
    tag: str | None = None,
    keep_defaults: bool = True,
) -> None:
    """One flag per setting of `cls` (`tag`: only the settings of that tag). `keep_defaults`:
    the parsed namespace holds each default; False: a flag not given is absent from it, so that
    `given` returns what was said and the spec's defaults fill the rest."""
    for f in settings_of(cls):
        meta = f.metadata
        if tag is not None and tag not in meta["tags"]:
            continue
        default = f.default if f.default is not MISSING else None
        text = meta["help"].replace("%(default)s", shown(default))
        kept = default if keep_defaults else argparse.SUPPRESS
        if f.type == "bool":  # a switch: --X turns on what is off by default, --no-X the reverse
            action = argparse.BooleanOptionalAction if default else "store_true"
            group.add_argument(
                meta["flag"], dest=f.name, action=action, help=text,
                **({"default": default} if keep_defaults else {"default": argparse.SUPPRESS}),
            )  # fmt: skip
            continue
        # (an annotation is text: the spec modules have `from __future__ import annotations`)
        if not isinstance(f.type, str):
            raise TypeError(f"{cls.__name__}.{f.name}: annotation {f.type!r} is not text")
        kind = {"int": int, "float": float}.get(f.type, str)
        extra = {"choices": meta["choices"]} if meta["choices"] else {"metavar": meta["metavar"]}
        group.add_argument(meta["flag"], dest=f.name, type=kind, default=kept, help=text, **extra)


def given(cls: type, args: argparse.Namespace, *, tag: str | None = None) -> dict[str, Any]:
    """The settings of `cls` (of `tag`) that `args` holds, by field name."""
    return {
        f.name: getattr(args, f.name)
        for f in settings_of(cls)
        if (tag is None or tag in f.metadata["tags"]) and hasattr(args, f.name)
    }
