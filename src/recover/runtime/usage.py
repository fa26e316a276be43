"""The one error a script gets for using the API out of its contract (`recover.UsageError`)."""

from __future__ import annotations


class UsageError(RuntimeError):
    """The script used the API out of its contract; the message says what to change."""
