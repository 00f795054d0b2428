"""Typed shells over method specifications: a callback class is a keyword-only dataclass
whose fields are its options (inherited from the option dataclasses), and an unknown
option is a one-line error naming the class and the closest valid option.

Nothing here knows Lightning: :class:`~lightning_slsam.SAMCallback` applies these to each
method class it derives (see ``SAMCallback.__init_subclass__``).
"""

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
]

_T = TypeVar("_T", bound="ChecksOptions")


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
class ChecksOptions:
    """A base whose subclasses are keyword-only dataclasses (``eq=False``, ``repr=False``):
    their options are their fields, declared by inheriting option dataclasses (a method's
    :class:`~lightning_slsam.methods.spec.MethodOptions`, ...), so that their ``__init__``
    is the dataclass one that type checkers and jsonargparse read. It shows the options
    given in ``repr``, and names an unknown option with the class the user wrote, with the
    closest valid name (Python's own error would name no close option).

    The check is a ``__new__`` of a base class of its own: jsonargparse reads a class's own
    ``__new__`` as its signature.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        written = "__init__" in cls.__dict__  # a class's own __init__ stays (dataclass too)
        dataclass(cls, kw_only=True, eq=False, repr=False)
        if not written:
            # The fields' annotations are strings (postponed), written in other modules
            # than cls's: the __init__'s are the types, for jsonargparse and inspect.
            cls.__init__.__annotations__ = {**field_types(cls), "return": None}

    def __new__(cls: type[_T], *args: Any, **kwargs: Any) -> _T:
        if kwargs:
            check_options(cls, kwargs)
        obj = super().__new__(cls)  # type: ignore[misc]
        obj._given_options = dict(kwargs)  # for repr: the options as they were written
        return obj

    def __repr__(self) -> str:
        # The options given that differ from the signature's defaults.
        defaults = inspect.signature(type(self).__init__).parameters
        shown = [
            f"{k}={v!r}"
            for k, v in self.__dict__.get("_given_options", {}).items()
            if k not in defaults or defaults[k].default != v
        ]
        return f"{type(self).__name__}({', '.join(shown)})"
