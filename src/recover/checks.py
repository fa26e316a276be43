"""Type checks of settings and message fields, shared by every layer (a leaf: no project import).

`bool` is a subclass of `int` in Python, so `isinstance(True, int)` holds; a setting or a field
that must be a number refuses booleans, and these two say so once. Both are type guards: past
a check, the type checker knows the value is an int (a number: `float` admits an int).
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["is_int", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """Whether `value` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """Whether `value` is an int or a float and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
