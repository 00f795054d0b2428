"""Callback classes as keyword-only dataclasses of their options: :func:`options_class`
makes the dataclass, :class:`ChecksOptions` names an unknown option and the closest valid
one. Nothing here knows Lightning."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any, TypeVar, dataclass_transform, get_type_hints

from lightning_slsam.methods.options import unknown_option

__all__ = [
    "ChecksOptions",
    "accepted_options",
    "check_options",
    "field_types",
    "options_class",
]

_T = TypeVar("_T", bound="ChecksOptions")
_C = TypeVar("_C", bound=type)


def accepted_options(cls: type) -> list[str]:
    """The keyword options ``cls(...)`` accepts: the named parameters of its ``__init__``,
    and of the base classes' while an ``__init__`` passes ``**kwargs`` on (a user's
    subclass may); a generated ``__init__`` names every option itself."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        for param in params:
            keyword = param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            if keyword and param.name not in ("self", *names):
                names.append(param.name)
        if klass.__dict__.get("_options_root") or not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def check_options(cls: type, options: dict[str, Any]) -> None:
    """Raise a ``TypeError`` naming ``cls`` and the unknown option, with the closest valid
    one (:func:`~lightning_slsam.methods.options.unknown_option`)."""
    accepted = accepted_options(cls)
    for key in options:
        if key not in accepted:
            raise unknown_option(cls.__name__, key, accepted)


def field_types(cls: type) -> dict[str, Any]:
    """The types of ``cls``'s dataclass fields, each resolved (``typing.get_type_hints``)
    in the module of the class that declares it."""
    names, types = {f.name for f in fields(cls)}, {}  # type: ignore[arg-type]
    for klass in reversed(cls.__mro__):
        own = {n: h for n, h in vars(klass).get("__annotations__", {}).items() if n in names}
        if own:
            namespace = vars(sys.modules[klass.__module__])
            types.update(get_type_hints(SimpleNamespace(__annotations__=own), namespace))
    return types


@dataclass_transform(kw_only_default=True, eq_default=False, field_specifiers=(field,))
def options_class(cls: _C) -> _C:
    """Make ``cls`` a keyword-only dataclass of its options (``eq=False``, ``repr=False``):
    the fields it declares and those of its dataclass bases. An ``__init__`` written on the
    class is kept; a generated one is annotated with the resolved types (:func:`field_types`)
    for ``inspect.signature`` and jsonargparse.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(kw_only=True, eq=False)
        ... class Sizes:
        ...     width: int = 4
        >>> @options_class
        ... class Box(ChecksOptions, Sizes):
        ...     depth: int = 1
        >>> Box(width=8).width, Box(width=8).depth
        (8, 1)
        >>> Box(widht=8)
        Traceback (most recent call last):
        ...
        TypeError: Box has no option 'widht'; did you mean 'width'?
    """
    written = "__init__" in cls.__dict__
    dataclass(cls, kw_only=True, eq=False, repr=False)
    if not written:
        # Postponed annotations are strings of the declaring modules: resolve them here.
        cls.__init__.__annotations__ = {**field_types(cls), "return": None}  # type: ignore[misc]
    return cls


class ChecksOptions:
    """A base whose ``__new__`` refuses an unknown option with the closest valid one (in a base:
    jsonargparse reads a class's own ``__new__`` as its signature), and whose ``repr`` shows the
    options given that differ from the defaults. Example: :func:`options_class`."""

    def __new__(cls: type[_T], *args: Any, **kwargs: Any) -> _T:
        if kwargs:
            check_options(cls, kwargs)
        obj = super().__new__(cls)  # type: ignore[misc]
        obj._given_options = dict(kwargs)  # for repr: the options as they were written
        return obj

    def __repr__(self) -> str:
        defaults = inspect.signature(type(self).__init__).parameters
        shown = [
            f"{k}={v!r}"
            for k, v in self.__dict__.get("_given_options", {}).items()
            if k not in defaults or defaults[k].default != v
        ]
        return f"{type(self).__name__}({', '.join(shown)})"
