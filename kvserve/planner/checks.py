"""Validation of user-given planner figures, done once at the edge.

Every check raises `ConfigError(field, message)` naming the field and its allowed
range, so a bad flag or API argument reads as one clear line instead of a traceback
deep inside the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from kvserve.errors import ConfigError


def _is_number(value: object) -> bool:
    # bool is an int subclass; `True` chips is a mistake, not 1 chip
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive(field: str, value: object) -> float:
    """A finite number > 0."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(field, f"must be a finite number > 0, got {value!r}")
    return value


def non_negative(field: str, value: object) -> float:
    """A finite number >= 0."""
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(field, f"must be a finite number >= 0, got {value!r}")
    return value


def in_range(field: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    """A finite number in [low, high], or (low, high] when `low_open`."""
    ok = _is_number(value) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ConfigError(field, f"must be in {bracket}{low:g}, {high:g}], got {value!r}")
    return value


def integer(field: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    """An int (not a bool, not a float) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ConfigError(field, f"must be an integer >= {minimum}{upper}, got {value}")
    return value


def one_of(field: str, value: object, allowed: Collection[str]) -> str:
    if value not in allowed:
        raise ConfigError(field, f"must be one of {', '.join(sorted(allowed))}, got {value!r}")
    return value
