"""Typed shells over method specifications: how a callback class gets one keyword option
per spec field, a signature that jsonargparse and ``help()`` read, an ``Args:`` docstring
section for each option, and a one-line error naming the class for an unknown option.

Nothing here knows Lightning: :class:`~lightning_slsam.SAMCallback` applies these to each
method class it derives (see ``SAMCallback.__init_subclass__``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_slsam.methods.options import unknown_option
from lightning_slsam.methods.spec import option_hint

__all__ = [
    "ChecksOptions",
    "accepted_options",
    "check_options",
    "shell_init",
    "stub_init",
    "with_options_doc",
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
    """Raise a ``TypeError`` naming ``cls`` and the unknown option, with the name it has
    for this method or where it belongs (the spec's ``option_hint``), else the closest
    valid one (:func:`~lightning_slsam.methods.options.unknown_option`)."""
    accepted = accepted_options(cls)
    spec = getattr(cls, "spec_class", None)
    for key in options:
        if key not in accepted:
            hint = option_hint(spec, key) if spec is not None else None
            raise unknown_option(cls.__name__, key, accepted, hint)


def shell_init(
    cls: type, base_init: Callable[..., None], own_options: dict[str, tuple[Any, Any]]
) -> Callable[..., None]:
    """``cls.__init__``: keyword options, the fields of ``cls.spec_class`` then the shell's
    ``own_options`` (name: (annotation, default)), with a signature naming each (which
    jsonargparse and ``help()`` read); it calls ``base_init`` with them."""

    def __init__(self: Any, **options: Any) -> None:
        base_init(self, **options)

    hints = typing.get_type_hints(cls.spec_class)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(cls.spec_class):
        if f.init:
            params.append(
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                  annotation=hints[f.name])
            )  # fmt: skip
    for name, (annotation, default) in own_options.items():
        params.append(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                              annotation=annotation)
        )  # fmt: skip
    __init__.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    spec_name = cls.spec_class.__name__
    __init__.__doc__ = f"Options of {cls.__name__}: see the class and :class:`{spec_name}`."
    return __init__


def _annotation_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def stub_init(cls: type) -> str:
    """``cls.__init__`` as the source of a stub (``def __init__(self, *, ...) -> None:
    ...``): what ``lightning/callbacks.pyi`` declares for each method class, so that type
    checkers and IDEs see its options. The spec's fields keep their annotations as written
    (``LayerSpec``, not its expansion)."""
    written = {f.name: f.type for f in dataclasses.fields(cls.spec_class) if f.init}
    lines = ["    def __init__(", "        self,", "        *,"]
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name != "self":
            text = _annotation_text(written.get(name, param.annotation))
            lines.append(f"        {name}: {text} = {param.default!r},")
    return "\n".join([*lines, "    ) -> None: ..."])


def _args_section(doc: str | None) -> dict[str, str]:
    """The entries of a Google-style docstring's ``Args:`` section, by option name."""
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Args:" not in lines:
        return {}
    entries: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Args:") + 1 :]:
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name is not None and line.strip():
            entries[name] += " " + line.strip()
    return entries


def with_options_doc(cls: type, base_doc: str | None) -> str:
    """``cls``'s docstring with an ``Args:`` section for every option: the spec's fields
    (documented on the spec classes) and the shell's own (in ``base_doc``'s ``Args:``),
    so that ``help()`` and the CLI's ``--help`` describe each one."""
    known: dict[str, str] = {}
    for klass in cls.spec_class.__mro__:
        for key, text in _args_section(klass.__doc__).items():
            known.setdefault(key, text)
    known.update(_args_section(base_doc))
    names = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    entries = [f"    {n}: {known[n]}" if n in known else f"    {n}: see {cls.spec_class.__name__}."
               for n in names]  # fmt: skip
    return inspect.cleandoc(cls.__doc__ or "") + "\n\nArgs:\n" + "\n".join(entries) + "\n"


class ChecksOptions:
    """Shows the options given in ``repr``, and names an unknown option with the class the
    user wrote (Python's own error would name ``SAMCallback.__init__``, where the keywords
    end up), with the closest valid name.

    A base class of its own rather than ``SAMCallback.__new__``: jsonargparse reads a class's own
    ``__new__`` as its signature, and would then accept none of ``SAMCallback``'s options
    passed on by a subclass's ``**kwargs``.
    """

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
