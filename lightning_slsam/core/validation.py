"""Option checks shared by every part of the plugin: each raises a ``ValueError`` naming
the option, the value given and what is allowed.

>>> check_ratio("layer_ratio", 0.2)
0.2
>>> check_ratio("layer_ratio", 1.5)
Traceback (most recent call last):
...
ValueError: `layer_ratio` must be in (0, 1], got 1.5.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "check_choice",
    "check_finite_at_least",
    "check_flag",
    "check_int",
    "check_number",
    "check_path",
    "check_ratio",
    "check_value",
    "is_number",
    "is_ratio",
]


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_ratio(value: Any) -> bool:
    """Whether ``value`` is a fraction in (0, 1]."""
    return isinstance(value, (int, float)) and 0 < value <= 1


def check_ratio(name: str, value: Any) -> float:
    """A fraction in (0, 1]."""
    if not is_ratio(value):
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}.")
    return float(value)


def check_value(name: str, value: Any, ok: Callable[[float], bool], hint: str) -> float:
    """``value`` as a finite float passing ``ok``, else ``name=value is invalid: hint``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and ok(v)):
        raise ValueError(f"{name}={value!r} is invalid: {hint}")
    return v


def check_flag(name: str, value: Any) -> bool:
    """``True`` or ``False`` (not 0 or 1)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return value


def check_int(name: str, value: Any, minimum: int | None) -> int:
    """An integer (not a bool) of at least ``minimum`` (any integer for ``None``)."""
    if isinstance(value, bool) or not (
        isinstance(value, int) and (minimum is None or value >= minimum)
    ):
        must = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        raise ValueError(f"`{name}` must be {must}, got {value!r}.")
    return value


def check_number(
    name: str, value: Any, must: str, ok: Callable[[float], bool], kind: type = float
) -> Any:
    """A number (an ``int`` when ``kind`` is ``int``; never a bool) passing ``ok``;
    otherwise ``name must be <must>``."""
    types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, types) or not ok(value):
        raise ValueError(f"`{name}` must be {must}, got {value!r}.")
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> Any:
    """One of ``choices``; ``hint`` (e.g. what each choice means) ends the message."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {tuple(choices)}, got {value!r}{hint}.")
    return value


def check_path(name: str, path: Any, folder: bool) -> Any:
    """``None`` or an existing folder (``folder=True``) or file."""
    if path is not None and not (os.path.isdir(path) if folder else os.path.isfile(path)):
        raise ValueError(f"`{name}` {path!r} is not a {'folder' if folder else 'file'}.")
    return path


def check_finite_at_least(name: str, value: Any, minimum: float, what: str = "") -> float:
    """A finite number (not a bool) of at least ``minimum``."""
    if not (is_number(value) and minimum <= value < math.inf):
        raise ValueError(f"`{name}` must be a finite number >= {minimum:g}{what}, got {value!r}.")
    return float(value)
