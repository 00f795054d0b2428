"""The ``lightning-slsam`` command's checks before it builds anything: a run to train, the
SAM callbacks' options and the Trainer options that clash with them. Each returns one line
naming the problem and the fix, or ``None``."""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import yaml
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_slsam.cli.errors import CALLBACK_FLAGS, EARLIER_VERSION
from lightning_slsam.lightning.callback import SAMCallback

__all__ = [
    "CONFIG_FLAGS",
    "SUBCOMMANDS",
    "asks_help",
    "callback_entry",
    "check_callback_options",
    "check_sam_trainer",
    "config_callbacks",
    "config_files",
    "missing_run",
    "resolve_callback",
    "stack_callbacks",
    "stacked",
]

CONFIG_FLAGS = ("-c", "--config")
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def command_line_value(text: str) -> Any:
    """A command-line value read as YAML, ``1e-8`` (a string in YAML 1.1) as a float."""
    value = yaml.safe_load(text)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def asks_help(args: list[str]) -> bool:
    """Whether ``args`` ask for help (``--help``, ``--KEY.help CLASS``) or
    ``--print_config``, which need no run.

    Example:
        >>> asks_help(["fit", "--trainer.callbacks.help", "lightning_slsam.SAM"])
        True
        >>> asks_help(["fit", "--config", "run.yaml"])
        False
    """
    keys = {a.split("=")[0] for a in args}
    return bool({"-h", "--help", "--print_config"} & keys) or any(
        k.startswith("--") and k.endswith(".help") for k in keys
    )


def missing_run(args: list[str]) -> str | None:
    """The error for ``fit`` (or another subcommand) with neither a config nor a model."""
    command = next((a for a in args if a in SUBCOMMANDS), None)
    given = any(a in CONFIG_FLAGS or a.split("=")[0] in ("--config", "--model") for a in args)
    if command is None or asks_help(args) or given:
        return None
    return (
        f"`lightning-slsam {command}` needs a run: give --config RUN.yaml (or --model and"
        " --data class paths), or --demo for the packaged demo."
    )


def check_callback_options(args: list[str]) -> str | None:
    """Build every SAM callback that ``args`` configure (``--config`` files, then flags):
    the first error, prefixed with where the callback came from, or ``None``."""
    entries: list[tuple[str, dict[str, Any]]] = []  # (where, {class_path, init_args})
    i = 0
    while i < len(args):
        arg, value = args[i], None
        if "=" in arg and arg.startswith("-"):
            arg, value = arg.split("=", 1)
        elif i + 1 < len(args) and arg.startswith("--") and not args[i + 1].startswith("--"):
            value = (
                args[i + 1]
                if arg in CONFIG_FLAGS or arg.startswith("--trainer.callbacks")
                else None
            )
            i += value is not None
        i += 1
        if value is None:
            continue
        if arg in CONFIG_FLAGS and os.path.isfile(value):
            with open(value) as handle:
                loaded = yaml.safe_load(handle)
            trainer = (loaded or {}).get("trainer") if isinstance(loaded, dict) else None
            callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
            if callbacks is not None:
                listed = callbacks if isinstance(callbacks, list) else [callbacks]
                entries = stacked(entries, [
                    (f"{value}: trainer.callbacks[{k}]", callback_entry(c))
                    for k, c in enumerate(listed)
                ])  # fmt: skip
        elif arg in ("--trainer.callbacks", "--trainer.callbacks+"):
            loaded = yaml.safe_load(value)
            listed = loaded if isinstance(loaded, list) else [loaded]
            new = [(f"{arg}={value}", callback_entry(c)) for c in listed]
            entries = new if arg == "--trainer.callbacks" else entries + new
        elif arg.startswith("--trainer.callbacks.") and entries:
            key = arg[len("--trainer.callbacks.") :].removeprefix("init_args.")
            where, entry = entries[-1]
            entry["init_args"] = {**entry["init_args"], key: command_line_value(value)}
            entries[-1] = (f"{arg}={value}", entry)
    for where, entry in entries:
        cls = resolve_callback(entry.get("class_path"))
        if cls is None:
            continue
        try:
            cls(**entry["init_args"])
        except (TypeError, ValueError, MisconfigurationException) as err:
            # a flag's unknown option (not a typo) may have meant another callback
            flag = where.startswith("--trainer.callbacks.") and "has no option" in str(err)
            flag = flag and "did you mean" not in str(err)
            if flag:
                return f"{where}: {str(err).rstrip('.')}{CALLBACK_FLAGS}."
            typo = "did you mean" in str(err)  # the hint names the option meant
            if ": trainer.callbacks[" in where and "has no option" in str(err) and not typo:
                from lightning_slsam import __version__

                ending = EARLIER_VERSION.format(version=__version__)
                return f"{where}: {str(err).rstrip('.')}{ending}"
            return f"{where}: {err}"
    return None


Listed = list[tuple[str, dict[str, Any]]]  # (where, {class_path, init_args}) per callback


def stacked(earlier: Listed, later: Listed) -> Listed:
    """The callbacks of two stacked ``--config`` files: the later file's follow the
    earlier's, each replacing one of its class, a SAM callback any earlier SAM callback.

    Example:
        >>> task = [("task.yaml", callback_entry("my.Monitor"))]
        >>> sam = [("method.yaml", callback_entry("lightning_slsam.SAM"))]
        >>> esam = [("other.yaml", callback_entry("lightning_slsam.ESAM"))]
        >>> [where for where, _ in stacked(stacked(task, sam), esam)]
        ['task.yaml', 'other.yaml']
    """
    result = list(earlier)
    for where, entry in later:
        sam = resolve_callback(entry["class_path"]) is not None
        same = [k for k, (_, e) in enumerate(result) if e["class_path"] == entry["class_path"]
                or (sam and resolve_callback(e["class_path"]) is not None)]  # fmt: skip
        result = [item for k, item in enumerate(result) if k not in same]
        result.append((where, entry))  # last: a trailing init_args flag reaches it
    return result


def config_files(args: list[str]) -> Iterator[tuple[int, str, Any]]:
    """``(position in args, path, parsed YAML)`` of each existing ``--config`` file."""
    for i, arg in enumerate(args[:-1]):
        path = args[i + 1]
        if arg in CONFIG_FLAGS and os.path.isfile(path):
            with open(path) as handle:
                yield i + 1, path, yaml.safe_load(handle)


def config_callbacks(loaded: Any) -> list[Any] | None:
    """A parsed config's ``trainer.callbacks`` as a list (``None`` when it has none)."""
    trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
    callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
    if not callbacks:
        return None
    return callbacks if isinstance(callbacks, list) else [callbacks]


def stack_callbacks(args: list[str]) -> list[str]:
    """``args`` with the ``trainer.callbacks`` of two or more ``--config`` files combined by
    :func:`stacked` (jsonargparse keeps only the last list) into a ``--trainer.callbacks=[...]``
    after the last such file; otherwise ``args`` unchanged."""
    found: list[tuple[int, Listed]] = []
    for at, path, loaded in config_files(args):
        listed = config_callbacks(loaded)
        if listed:
            found.append((at, [(path, callback_entry(c)) for c in listed]))
    if len(found) < 2 or any(e["class_path"] is None for _, lst in found for _, e in lst):
        return args
    entries: Listed = []
    for _, listed in found:
        entries = stacked(entries, listed)
    combined = json.dumps([entry for _, entry in entries])
    at = found[-1][0] + 1
    return [*args[:at], f"--trainer.callbacks={combined}", *args[at:]]


def callback_entry(item: Any) -> dict[str, Any]:
    """A ``trainer.callbacks`` item (a class path or a mapping) as ``{"class_path": ...,
    "init_args": {...}}``; ``class_path`` is ``None`` for anything else.

    Example:
        >>> callback_entry("lightning_slsam.SAM")
        {'class_path': 'lightning_slsam.SAM', 'init_args': {}}
    """
    if isinstance(item, str):
        return {"class_path": item, "init_args": {}}
    if isinstance(item, dict):
        return {
            "class_path": item.get("class_path"),
            "init_args": dict(item.get("init_args") or {}),
        }
    return {"class_path": None, "init_args": {}}


def resolve_callback(class_path: Any) -> type[SAMCallback] | None:
    """The SAM callback class that ``class_path`` names, or ``None`` for anything else."""
    if not isinstance(class_path, str):
        return None
    module_name, _, name = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name or "lightning_slsam")
    except ImportError:
        return None
    cls = getattr(module, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, SAMCallback) else None


def _get(entry: Any, key: str) -> Any:
    """``entry[key]`` of a parsed config entry (a jsonargparse Namespace or a dict)."""
    getter = getattr(entry, "get", None)
    return getter(key) if callable(getter) else None


def check_sam_trainer(trainer: Any) -> str | None:
    """The parsed ``trainer`` section's conflict with a SAM callback (more than one, or
    Lightning's clipping or accumulation), as one line, or ``None``."""
    listed = _get(trainer, "callbacks") or []
    listed = listed if isinstance(listed, list) else [listed]
    sam = [(k, cls) for k, entry in enumerate(listed)
           if (cls := resolve_callback(_get(entry, "class_path"))) is not None]  # fmt: skip
    if len(sam) > 1:
        names = ", ".join(f"[{k}] {cls.__name__}" for k, cls in sam)
        return (
            f"trainer.callbacks has {len(sam)} SAM callbacks ({names}); keep exactly one (a"
            " variant is an option, e.g. SparseLayerSAM's preset, or a class, e.g. SLSAMRST)."
        )
    if not sam:
        return None
    k, cls = sam[0]
    where = f"trainer.callbacks[{k}] ({cls.__name__}) init_args"
    clip = _get(trainer, "gradient_clip_val")
    if clip:
        algorithm = _get(trainer, "gradient_clip_algorithm") or "norm"
        return (
            f"trainer.gradient_clip_val={clip} cannot be used with {cls.__name__} (manual"
            f" optimization): give `gradient_clip_val: {clip}` and `gradient_clip_algorithm:"
            f" {algorithm}` in {where}, or --trainer.callbacks.gradient_clip_val={clip}"
            f" --trainer.callbacks.gradient_clip_algorithm={algorithm} after its"
            " --trainer.callbacks+= flag (docs/training.md)."
        )
    accumulate = _get(trainer, "accumulate_grad_batches")
    if accumulate not in (None, 1):
        return (
            f"trainer.accumulate_grad_batches={accumulate} cannot be used with {cls.__name__}"
            f" (manual optimization): give `accumulate_grad_batches: {accumulate}` in {where},"
            f" or --trainer.callbacks.accumulate_grad_batches={accumulate} after its"
            " --trainer.callbacks+= flag (docs/training.md)."
        )
    return None
