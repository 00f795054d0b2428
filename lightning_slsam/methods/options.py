"""Option checks with one message format (:func:`invalid`): a bad value raises a
``ValueError`` reading ``[<class>: ]\\`name\\` must be <what is allowed>, got <value>.``

A :class:`Rule` is one option's check; the ``check_*`` functions apply the common ones.

>>> RATIO("layer_ratio", 0.2)
0.2
>>> RATIO("layer_ratio", 1.5)
Traceback (most recent call last):
...
ValueError: `layer_ratio` must be in (0, 1], got 1.5.
>>> number(0, None, low_open=True, note=" (the SAM radius)")("rho", -1, owner="SAM")
Traceback (most recent call last):
...
ValueError: SAM: `rho` must be a finite number > 0 (the SAM radius), got -1.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FLAG",
    "RATIO",
    "Rule",
    "check_choice",
    "check_flag",
    "check_int",
    "check_number",
    "invalid",
    "number",
    "one_of",
    "patterns",
    "unknown_option",
]


def invalid(
    name: str, value: Any, must: str, owner: str | None = None, hint: str = ""
) -> ValueError:
    """The error for a bad option value, ``[<owner>: ]`name` must be <must>, got <value>[<hint>].``
    (``owner``: the class the user wrote; ``hint`` starts with its punctuation)."""
    where = f"{owner}: " if owner else ""
    return ValueError(f"{where}`{name}` must be {must}, got {value!r}{hint}.")


def unknown_option(owner: str, name: str, accepted: Sequence[str]) -> TypeError:
    """The error for an option ``owner`` does not take, naming the closest valid one (else
    the valid ones)."""
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = (
        f"did you mean {close[0]!r}?" if close else f"valid options: {', '.join(sorted(accepted))}."
    )
    return TypeError(f"{owner} has no option {name!r}; {hint}")


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Rule:
    """What one option allows: ``ok(value)``, said in words by ``must`` (for the message);
    ``convert`` normalises an accepted value (an int radius to a float, say)."""

    must: str
    ok: Callable[[Any], bool]
    convert: Callable[[Any], Any] = _same
    hint: str = ""

    def __call__(self, name: str, value: Any, owner: str | None = None) -> Any:
        """``value``, converted, if allowed; else the :func:`invalid` error."""
        if not self.ok(value):
            raise invalid(name, value, self.must, owner, self.hint)
        return self.convert(value)

    def or_none(self, meaning: str = "") -> Rule:
        """This rule, with ``None`` allowed too (``meaning``: what ``None`` stands for)."""
        return Rule(
            f"None{meaning} or {self.must}",
            lambda v: v is None or self.ok(v),
            lambda v: None if v is None else self.convert(v),
            self.hint,
        )


def _real(value: Any, integer: bool = False) -> bool:
    kind = numbers.Integral if integer else numbers.Real
    return isinstance(value, kind) and not isinstance(value, bool)


def number(
    low: float | None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    note: str = "",
) -> Rule:
    """A finite number (an ``int`` with ``integer``; never a bool) within the bounds, each
    open or closed; ``note`` ends the words."""

    def ok(v: Any) -> bool:
        if not _real(v, integer) or not math.isfinite(v):
            return False
        above = low is None or (v > low if low_open else v >= low)
        return above and (high is None or (v < high if high_open else v <= high))

    if low is not None and high is not None:
        must = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        kind = "an integer" if integer else "a finite number"
        must = f"{kind} {'>' if low_open else '>='} {low:g}"
    else:
        must = "an integer" if integer else "a finite number"
    return Rule(must + note, ok, int if integer else float)


#: A fraction in (0, 1] (a layer ratio, say).
RATIO = number(0, 1, low_open=True)
#: ``True`` or ``False`` (not 0 or 1).
FLAG = Rule("True or False", lambda v: isinstance(v, bool))


def one_of(choices: Sequence[Any], hint: str = "") -> Rule:
    """One of ``choices``; ``hint`` (e.g. ``": 'a' means ..."``) ends the message."""
    options = tuple(choices)
    return Rule(f"one of {options}", lambda v: any(v == c for c in options), hint=hint)


def _compiles(items: Any) -> bool:
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        return False
    try:
        for item in items:
            re.compile(item)
    except (re.error, TypeError):
        return False
    return True


def patterns(example: str) -> Rule:
    """A list of regular expressions (a bare string is refused: ``[...]`` it), converted
    to a list; ``example`` shows one."""
    return Rule(f"a list of regular expressions, e.g. {example}", _compiles, list)


def check_flag(name: str, value: Any) -> bool:
    """``True`` or ``False`` (not 0 or 1)."""
    return FLAG(name, value)


def check_int(name: str, value: Any, minimum: int | None) -> int:
    """An integer (not a bool) of at least ``minimum`` (any integer for ``None``)."""
    return number(minimum, integer=True)(name, value)


def check_number(
    name: str, value: Any, must: str, ok: Callable[[float], bool], kind: type = float
) -> Any:
    """A number (an ``int`` when ``kind`` is ``int``; never a bool) passing ``ok``;
    otherwise ``name must be <must>``. The value is returned as given."""
    types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, types) or not ok(value):
        raise invalid(name, value, must)
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> Any:
    """One of ``choices``; ``hint`` (e.g. what each choice means) ends the message."""
    return one_of(choices, hint)(name, value)
