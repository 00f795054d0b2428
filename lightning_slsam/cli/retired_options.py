"""Configs saved by earlier versions keep loading: options a method no longer takes.

Up to 0.2, every method callback took the schedule options (``schedule``,
``sam_probability``, ``sam_interval``, ``looksam_alpha``, ``dense_one_pass``), and
LightningCLI writes every option into the ``config.yaml`` it saves beside a run. Since
0.3 only :class:`~lightning_slsam.SparseLayerSAM` takes them (SAM's other schedules are
their own classes: RST, LookSAM, S2SAM). A saved config that sets them to the value they
had when the method did not use them loads as before: the command drops them, says so in
one line, and passes a cleaned copy of the file to the parser. Any other value is an
error naming the class and the option (the callback's own message).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import yaml

from lightning_slsam.cli.checks import CONFIG_FLAGS, resolve_callback
from lightning_slsam.lightning.signatures import accepted_options

__all__ = ["RETIRED", "drop_retired_options"]

#: The options earlier versions wrote for every method, with the value that had no effect
#: on a method that does not run the schedule they configure.
RETIRED: dict[str, Any] = {
    "schedule": None,
    "sam_probability": 0.5,
    "sam_interval": 5,
    "looksam_alpha": 0.7,
    "dense_one_pass": False,
}


def _clean(entry: Any) -> list[str]:
    """Drop the retired no-op options of one ``trainer.callbacks`` entry; their names."""
    if not isinstance(entry, dict) or not isinstance(entry.get("init_args"), dict):
        return []
    cls = resolve_callback(entry.get("class_path"))
    if cls is None:
        return []
    taken = set(accepted_options(cls))
    init_args = entry["init_args"]
    dropped = [
        k for k, v in init_args.items() if k in RETIRED and k not in taken and v == RETIRED[k]
    ]
    for key in dropped:
        del init_args[key]
    return [f"{cls.__name__}.{key}" for key in dropped]


def drop_retired_options(args: list[str]) -> list[str]:
    """``args`` with each ``--config`` file that sets retired no-op options replaced by a
    cleaned copy (written to the temporary folder); other arguments unchanged.

    Example:
        >>> import tempfile, yaml
        >>> saved = {"trainer": {"callbacks": [{"class_path": "lightning_slsam.SAM",
        ...     "init_args": {"rho": 0.05, "schedule": None, "sam_interval": 5}}]}}
        >>> path = tempfile.mkstemp(suffix=".yaml")[1]
        >>> with open(path, "w") as handle:
        ...     _ = handle.write(yaml.safe_dump(saved))
        >>> args = drop_retired_options(["fit", "--config", path])  # a note on stderr
        >>> with open(args[2]) as cleaned:
        ...     yaml.safe_load(cleaned)["trainer"]["callbacks"][0]["init_args"]
        {'rho': 0.05}
    """
    out = list(args)
    for i, arg in enumerate(args[:-1]):
        path = args[i + 1]
        if arg not in CONFIG_FLAGS or not os.path.isfile(path):
            continue
        with open(path) as handle:
            loaded = yaml.safe_load(handle)
        trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
        callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
        listed = callbacks if isinstance(callbacks, list) else [callbacks]
        dropped = [name for entry in listed for name in _clean(entry)]
        if not dropped:
            continue
        fd, cleaned = tempfile.mkstemp(prefix="lightning_slsam_", suffix=".yaml")
        with os.fdopen(fd, "w") as handle:
            yaml.safe_dump(loaded, handle, sort_keys=False)
        out[i + 1] = cleaned
        print(
            f"lightning-slsam: {path}: dropped {', '.join(dropped)} (options of earlier"
            " versions that had no effect on these methods; only SparseLayerSAM takes them)",
            file=sys.stderr,
        )
    return out
