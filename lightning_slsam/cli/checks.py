"""What the ``lightning-slsam`` command checks before it builds anything: a run to train,
every SAM callback's options (with where each came from), the Trainer options that clash
with a SAM callback, and -- for ``--print_config`` -- the values the SAM callbacks'
``None`` options take.

Each check returns one line naming the problem and the fix (``None`` when all is well);
the command prints it and exits with code 2.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

import yaml
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_slsam.lightning.callback import SAMCallback

__all__ = [
    "CONFIG_FLAGS",
    "SUBCOMMANDS",
    "annotate_print_config",
    "asks_help",
    "check_callback_options",
    "check_sam_trainer",
    "missing_run",
    "resolve_callback",
]

CONFIG_FLAGS = ("-c", "--config")
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def asks_help(args: list[str]) -> bool:
    """Whether ``args`` ask for help (``--help``, any ``--KEY.help CLASS``) or the config
    (``--print_config``): none of them needs a run, and nothing is checked or trained.

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
        " --data class paths), or --demo for the packaged demo (MiniLM-L6 on Rotten"
        " Tomatoes)."
    )


def check_callback_options(args: list[str]) -> str | None:
    """Build every SAM callback that ``args`` configure (``trainer.callbacks`` in the
    ``--config`` files, then ``--trainer.callbacks...`` flags) and return the first error,
    naming where the callback came from, its class, the option and the fix."""
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
                entries = [
                    (f"{value}: trainer.callbacks[{k}]", _entry(c)) for k, c in enumerate(listed)
                ]
        elif arg in ("--trainer.callbacks", "--trainer.callbacks+"):
            loaded = yaml.safe_load(value)
            listed = loaded if isinstance(loaded, list) else [loaded]
            new = [(f"{arg}={value}", _entry(c)) for c in listed]
            entries = new if arg == "--trainer.callbacks" else entries + new
        elif arg.startswith("--trainer.callbacks.") and entries:
            key = arg[len("--trainer.callbacks.") :].removeprefix("init_args.")
            where, entry = entries[-1]
            entry["init_args"] = {**entry["init_args"], key: yaml.safe_load(value)}
            entries[-1] = (f"{arg}={value}", entry)
    for where, entry in entries:
        cls = resolve_callback(entry.get("class_path"))
        if cls is None:
            continue
        try:
            cls(**entry["init_args"])
        except (TypeError, ValueError, MisconfigurationException) as err:
            return f"{where}: {err}"  # the callback's messages name its class
    return None


def _entry(item: Any) -> dict[str, Any]:
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
    """The parsed ``trainer`` section's conflicts with a SAM callback, as one line in the
    YAML / flag form: more than one SAM callback, or Lightning's own clipping or
    accumulation (which it refuses under manual optimization)."""
    listed = _get(trainer, "callbacks") or []
    listed = listed if isinstance(listed, list) else [listed]
    sam = [(k, cls) for k, entry in enumerate(listed)
           if (cls := resolve_callback(_get(entry, "class_path"))) is not None]  # fmt: skip
    if len(sam) > 1:
        names = ", ".join(f"[{k}] {cls.__name__}" for k, cls in sam)
        return (
            f"trainer.callbacks has {len(sam)} SAM callbacks ({names}); keep exactly one:"
            " a method is one callback (a SAM variant is an option of it, e.g."
            " SparseLayerSAM's preset or schedule)."
        )
    if not sam:
        return None
    k, cls = sam[0]
    where = f"trainer.callbacks[{k}] ({cls.__name__}) init_args"
    clip = _get(trainer, "gradient_clip_val")
    if clip:
        algorithm = _get(trainer, "gradient_clip_algorithm") or "norm"
        return (
            f"trainer.gradient_clip_val={clip} cannot be used with {cls.__name__} (Lightning"
            " refuses it under manual optimization): remove it and give the callback"
            f" `gradient_clip_val: {clip}` and `gradient_clip_algorithm: {algorithm}` in"
            f" {where}, or the flags --trainer.callbacks.gradient_clip_val={clip}"
            f" --trainer.callbacks.gradient_clip_algorithm={algorithm} right after the"
            " callback's --trainer.callbacks+= flag. It clips the update gradient after"
            " unscaling."
        )
    accumulate = _get(trainer, "accumulate_grad_batches")
    if accumulate not in (None, 1):
        return (
            f"trainer.accumulate_grad_batches={accumulate} cannot be used with {cls.__name__}"
            " (Lightning refuses it under manual optimization): remove it and give the"
            f" callback `accumulate_grad_batches: {accumulate}` in {where}, or the flag"
            f" --trainer.callbacks.accumulate_grad_batches={accumulate} right after the"
            " callback's --trainer.callbacks+= flag."
        )
    return None


def annotate_print_config(text: str) -> str:
    r"""``--print_config``'s YAML with a comment on each SAM callback option left ``null``
    that takes a value (from ``preset``, ``adaptive`` or the method's defaults), e.g.
    ``bandit_loss: null  # takes effect: rank``. The config itself is unchanged: ``null``
    still means "decided by the preset".

    Example:
        >>> text = (
        ...     "trainer:\n  callbacks:\n  - class_path: lightning_slsam.SparseLayerSAM\n"
        ...     "    init_args:\n      preset: robust\n      bandit_loss: null\n"
        ...     "      seed: null\n")
        >>> print(annotate_print_config(text), end="")
        trainer:
          callbacks:
          - class_path: lightning_slsam.SparseLayerSAM
            init_args:
              preset: robust
              bandit_loss: null  # takes effect: rank
              seed: null
    """
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
    listed = _get(trainer, "callbacks") or []
    listed = listed if isinstance(listed, list) else [listed]
    resolved: list[dict[str, Any]] = []  # per "- class_path:" line of a SAM callback
    for entry in listed:
        cls = resolve_callback(_get(entry, "class_path"))
        if cls is None:
            continue
        given = dict(_get(entry, "init_args") or {})
        try:
            spec = cls(**given).spec
        except (TypeError, ValueError, MisconfigurationException):
            resolved.append({})
            continue
        resolved.append({k: getattr(spec, k) for k, v in given.items()
                         if v is None and getattr(spec, k, None) is not None})  # fmt: skip
    lines, current, indent = text.splitlines(keepends=True), None, -1
    for i, line in enumerate(lines):
        depth = len(line) - len(line.lstrip())
        if match := re.match(r"^(\s*)- class_path: (\S+)\s*$", line):
            sam = resolve_callback(match.group(2)) is not None and resolved
            current, indent = (resolved.pop(0) if sam else None), len(match.group(1))
            continue
        if current is None or (line.strip() and depth <= indent):
            current = None if line.strip() and depth <= indent else current
            continue
        if match := re.match(r"^(\s+)(\w+): null$", line.rstrip("\n")):
            key = match.group(2)
            if key in current:
                shown = yaml.safe_dump(current[key], default_flow_style=True).strip()
                shown = shown.removesuffix("...").strip()
                lines[i] = f"{line.rstrip()}  # takes effect: {shown}\n"
    return "".join(lines)
