"""One-line errors for the ``lightning-slsam`` command: :class:`OneLineParser` prints the
key, what is wrong, the value given and, for a typo, the closest valid name, and exits 2.

Example:

>>> message = '''Parser key "trainer.max_epochs":
...   Does not validate against any of the Union subtypes
...   Subtypes: [<class 'int'>, <class 'NoneType'>]
...   Errors:
...     - Expected a <class 'int'>
...     - Expected a <class 'NoneType'>
...   Given value type: <class 'str'>
...   Given value: abc'''
>>> one_line(message, [])
"trainer.max_epochs: expected int or None, got 'abc'"
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

__all__ = [
    "CALLBACK_FLAGS",
    "EARLIER_VERSION",
    "OneLineParser",
    "closest",
    "debugging",
    "fail",
    "one_line",
]

PROG = "lightning-slsam"


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name`` (case-insensitive), or ``None``.

    Example:
        >>> closest("SparseLayerSam", ["SAM", "SparseLayerSAM", "RandomSLSAM"])
        'SparseLayerSAM'
    """
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    found = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[found[0]] if found else None


def _type_name(text: str) -> str:
    """``<class 'int'>`` -> ``int``; ``typing.Literal['a', 'b']`` -> ``one of 'a', 'b'``."""
    text = text.strip()
    if match := re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>", text):
        return "None" if match.group(1) == "NoneType" else match.group(1)
    if match := re.fullmatch(r"typing\.Literal\[(.*)\]", text):
        return f"one of {match.group(1)}"
    return text


def _class_path_hint(path: str, reason: str) -> str:
    """``; did you mean 'module.Name'?`` for a class path whose last part has a typo."""
    module_name, _, name = path.rpartition(".")
    if "has no attribute" not in reason or not module_name:
        return ""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return ""
    public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    found = closest(name, public)
    return f"; did you mean '{module_name}.{found}'?" if found else ""


def _option_hint(path: str, option: str) -> str:
    """``; did you mean 'lr'?`` for an option ``class_path`` does not accept."""
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        accepted = [p for p in inspect.signature(cls).parameters if p not in ("args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        return ""
    found = closest(option, accepted)
    return f"; did you mean '{found}'?" if found else f"; its options: {', '.join(accepted)}"


#: Ends the error for an option flag meant for a callback other than the last.
CALLBACK_FLAGS = (
    ". A --trainer.callbacks.init_args.<option> flag sets the last callback of"
    " trainer.callbacks; for another, stack a config listing it (a later config's callback"
    " replaces one of the same class; docs/training.md, 'Stacked configs')"
)
#: Ends the error for an option a config's SAM callback does not have.
EARLIER_VERSION = (
    ". If an earlier development version saved this config: lightning-slsam {version}"
    " does not read its options; docs/changelog.md says what replaced them."
)


def one_line(message: str, options: Iterable[str]) -> str:
    """jsonargparse's error ``message`` as one line; ``options``: the parser's option
    strings, for an unrecognized argument's closest match."""
    if match := re.search(r"unrecognized arguments: (.+)", message):
        given = match.group(1).split()
        flags = [a.split("=")[0] for a in given if a.startswith("-")]
        found = closest(flags[0], options) if flags else None
        hint = f"; did you mean {found}?" if found else f"; see {PROG} fit --help"
        return f"unrecognized argument(s) {' '.join(given)}{hint}"
    keys = re.findall(r'Parser key "([^"]+)"', message)
    key = ".".join(keys) if keys else ""
    prefix = f"{key}: " if key else ""
    given = re.findall(r"Given value: (.*)", message)
    got = f", got {given[-1].strip()!r}" if given and "NestedArg" not in given[-1] else ""
    # A class path that does not import, or an option its class does not accept.
    if match := re.search(r"Problem with given class_path '([^']+)':\s*\n\s*(.+)", message):
        path, reason = match.group(1), match.group(2).strip()
        if option := re.fullmatch(r"Option '(\w+)' is not accepted", reason):
            name = option.group(1)
            hint = _option_hint(path, name)
            where = CALLBACK_FLAGS if key == "trainer.callbacks" and "did you" not in hint else ""
            return f"{prefix}{path} has no option '{name}'{hint}{where}"
        if not reason.startswith("Parser key"):
            return f"{prefix}class '{path}' not found ({reason}){_class_path_hint(path, reason)}"
    # A nested key: its own reason is the line after its "Parser key" line.
    if len(keys) > 1 and (match := re.search(rf'Parser key "{re.escape(keys[-1])}":\s*\n\s*(.+)',
                                             message)):  # fmt: skip
        reason = match.group(1).strip()
        if typed := re.fullmatch(r"Expected an? (.+?)\. Got value: (.*)", reason):
            return f"{prefix}expected {_type_name(typed.group(1))}, got {typed.group(2)!r}"
        return f"{prefix}{reason}"
    expected = [_type_name(t) for t in re.findall(r"- Expected an? (.+)", message)]
    expected = [t for t in expected if not t.startswith("path but")]
    if expected:
        return f"{prefix}expected {' or '.join(dict.fromkeys(expected))}{got}"
    lines = [line.strip(" -") for line in message.splitlines() if line.strip(" -")]
    first = lines[0] if lines else message
    if keys and len(lines) > 1 and first.startswith("Parser key"):
        first = lines[1]
    return f"{prefix}{first}{got}"


def _option_strings(parser: Any) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


class OneLineParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose errors are one line on stderr, exit code 2
    (``JSONARGPARSE_DEBUG=true``: jsonargparse's own)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or debugging():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        fail(one_line(message, _option_strings(parser)))


def fail(problem: str) -> NoReturn:
    """Print ``lightning-slsam: error: <problem>`` on stderr and exit with code 2."""
    print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def debugging() -> bool:
    """Whether ``JSONARGPARSE_DEBUG=true`` asks for full errors and tracebacks."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"
