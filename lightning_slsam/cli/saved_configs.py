"""Configs saved by earlier versions keep training what they trained.

LightningCLI writes every option of a SAM callback into the ``config.yaml`` it saves beside
a run. Since 0.3 a method's options are the ones its users need: the schedule options are
methods of their own (RST's coin on SL-SAM is ``SLSAMRST``, LookSAM's interval
``SLSAMLookSAM``, the depth cut ``CostAwareSLSAM``), ``SparseLayerSAM``'s presets fix what
``None`` used to leave to them, and the options no measurement favoured are gone
(``dense_warmup``, ``min_updates``, ``vectors_always_active``, ``dense_one_pass``,
``adaptive_eta``).

For each SAM callback of a ``--config`` file, :func:`upgrade_entry` works out what the
earlier version trained and writes the entry that trains the same today: a retired option
at the value that had no effect is dropped, ``None`` options take the values they stood
for, and a configuration that has a class of its own now moves to it (``SLSAMRST``, or
``SLSAMAblation`` for a preset with some settings changed). The command says so in one
line. A configuration that today's options cannot express (a dense warm-up, say) is an
error naming the option and what to do.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import yaml

from lightning_slsam.cli.checks import config_callbacks, config_files
from lightning_slsam.methods.options import RETIRED
from lightning_slsam.selection.bandit import DEFAULT_ALPHA

__all__ = ["UnsupportedConfig", "upgrade_configs", "upgrade_entry"]

_PACKAGE = "lightning_slsam"
#: The callback classes of earlier versions (their class paths may name the package or
#: its Lightning layer).
_OLD_CLASSES = {
    "SAM", "SparseLayerSAM", "RandomSLSAM", "TopSLSAM", "S2SAM", "SLS2SAM", "RST", "LookSAM",
    "ESAM", "SSAMF",
}  # fmt: skip
_BANDIT = ("SparseLayerSAM", "SLS2SAM")
#: What each preset of earlier versions set, where an option was left at ``None``.
_OLD_PRESETS = {
    "default": {"budget": "compute", "bandit_loss": "rank", "head_always_active": True,
                "scale_updates": True, "max_update_scale": 3.0},
    "paper": {"budget": "count", "bandit_loss": "shifted", "head_always_active": False,
              "scale_updates": False, "max_update_scale": None},
    "robust": {"budget": "count", "bandit_loss": "rank", "head_always_active": True,
               "scale_updates": True, "max_update_scale": None},
}  # fmt: skip
#: Today's presets in the same terms: budget, loss, step size, head rule, update cap.
_NEW_PRESETS = {
    "default": ("compute", "rank", 0.03, True, 3.0),
    "paper": ("count", "shifted", 1e-3, False, None),
}
_RANDOM_PRESETS = {"paper": (False, None), "default": (True, 3.0)}
#: Options that had no effect at these values (``dense_one_pass`` at any value but on
#: SL-SAM's random and interval schedules).
_NO_EFFECT = {
    "dense_warmup": (0, 0.0, None),
    "min_updates": (0, None),
    "vectors_always_active": (False, None),
    "dense_one_pass": (False, True),
    "adaptive_eta": (0.01,),
}
#: The class of today that runs an earlier class on another schedule.
_SCHEDULED = {
    ("SAM", "random"): "RST",
    ("SAM", "interval"): "LookSAM",
    ("SAM", "single"): "S2SAM",
    ("SparseLayerSAM", "random"): "SLSAMRST",
    ("SparseLayerSAM", "interval"): "SLSAMLookSAM",
    ("SparseLayerSAM", "single"): "SLS2SAM",
}
#: The schedule each class ran on its own.
_OWN_SCHEDULE = {"RST": "random", "LookSAM": "interval", "S2SAM": "single", "SLS2SAM": "single"}


class UnsupportedConfig(ValueError):
    """A saved configuration that today's options cannot express."""


def _class_name(class_path: Any) -> str | None:
    if not isinstance(class_path, str):
        return None
    module, _, name = class_path.rpartition(".")
    known = module in (_PACKAGE, f"{_PACKAGE}.lightning.callbacks", f"{_PACKAGE}.methods")
    return name if known and name in _OLD_CLASSES else None


def _refuse(name: str, option: str, value: Any, why: str) -> UnsupportedConfig:
    return UnsupportedConfig(
        f"{name}({option}={value!r}) was saved by an earlier version; {why} To rerun it as it"
        " ran, install the version that saved it."
    )


def upgrade_entry(entry: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ``trainer.callbacks`` entry that trains today what ``entry`` trained when it was
    saved, and what changed (empty when nothing did).

    Raises:
        UnsupportedConfig: for a configuration today's options cannot express.

    Example:
        >>> entry = {"class_path": "lightning_slsam.SparseLayerSAM", "init_args": {
        ...     "rho": None, "preset": "paper", "bandit_loss": None, "dense_warmup": None,
        ...     "schedule": "random", "sam_probability": 0.3, "sam_interval": 5}}
        >>> new, notes = upgrade_entry(entry)
        >>> new
        {'class_path': 'lightning_slsam.SLSAMRST', 'init_args': {'rho': 0.01, 'preset': 'paper', 'probability': 0.3}}
        >>> notes
        ['class SparseLayerSAM -> SLSAMRST', 'bandit_loss=None', 'dense_warmup=None', ...]
    """  # noqa: E501
    name = _class_name(entry.get("class_path"))
    args = dict(entry.get("init_args") or {})
    old = dict(args)
    earlier = set(args) & set(RETIRED) or args.get("preset") == "robust"
    if name is None or not (earlier or ("rho" in args and args["rho"] is None)):
        return entry, []  # another class, or a config of today
    schedule = args.pop("schedule", None) or "every_step"
    probability = args.pop("sam_probability", 0.5)
    interval, alpha = args.pop("sam_interval", 5), args.pop("looksam_alpha", 0.7)
    depth = args.pop("backprop_depth", 1.0)
    target = _SCHEDULED.get((name, schedule), name)
    if target == name and schedule not in ("every_step", _OWN_SCHEDULE.get(name)):
        raise _refuse(name, "schedule", schedule, "no class of today runs it.")
    if target != name and target in ("RST", "SLSAMRST"):
        args["probability"] = probability
    elif target != name and target in ("LookSAM", "SLSAMLookSAM"):
        args["interval"], args["alpha"] = interval, alpha
    if args.get("dense_one_pass") and schedule in ("random", "interval"):
        raise _refuse(name, "dense_one_pass", True, "no option of today runs it.")
    if depth not in (1, 1.0):
        if target != "SparseLayerSAM":
            raise _refuse(name, "backprop_depth", depth, f"with schedule={schedule!r}.")
        target, args["depth"] = "CostAwareSLSAM", depth
    # Options that no method takes today: dropped where they had no effect.
    for option, quiet in _NO_EFFECT.items():
        value = args.pop(option, quiet[0])
        if value not in quiet and option != "dense_one_pass":
            raise _refuse(name, option, value, "no option of today runs it.")
    if args.get("rho", 0.01) is None:
        args["rho"] = 0.5 if args.get("adaptive") else 0.01
    if name in _BANDIT:
        target = _bandit_settings(name, target, args)
    elif name == "RandomSLSAM":
        _random_settings(args)
    else:
        for option in ("head_always_active", "scale_updates", "max_update_scale"):
            value = args.pop(option, None)
            if value not in (None, False):
                raise _refuse(name, option, value, f"{target} takes no such option today.")
    where = _PACKAGE if target != "SLSAMAblation" else f"{_PACKAGE}.lightning.callbacks"
    new = {**entry, "class_path": f"{where}.{target}", "init_args": args}  # class_path(cls)
    dropped = sorted(set(old) - set(args))
    notes = [f"{k}={old[k]!r}" for k in dropped]
    notes += [f"{k}: {old[k]!r} -> {args[k]!r}" for k in args if k in old and old[k] != args[k]]
    notes += [f"{k}={args[k]!r}" for k in args if k not in old]
    if target != name:
        notes.insert(0, f"class {name} -> {target}")
    return new, notes


def _bandit_settings(name: str, target: str, args: dict[str, Any]) -> str:
    """Resolve an SL-SAM entry's preset and its ``None`` options as the earlier version did;
    name the preset that runs the same today, or move to ``SLSAMAblation``."""
    preset = args.get("preset", "paper" if name == "SLS2SAM" else "default")
    if preset not in _OLD_PRESETS:
        return target  # today's check names the bad value
    old = {k: args.pop(k, None) for k in (*_OLD_PRESETS[preset], "alpha_p")}
    chosen = {k: (v if old[k] is None else old[k]) for k, v in _OLD_PRESETS[preset].items()}
    loss = chosen["bandit_loss"]
    alpha = old["alpha_p"] if old["alpha_p"] is not None else DEFAULT_ALPHA.get(loss)
    scale = None
    if chosen["scale_updates"]:
        cap = chosen["max_update_scale"]
        scale = float(cap) if cap is not None else 1.0 / float(args.get("layer_ratio", 0.2))
    ran = (chosen["budget"], loss, alpha, bool(chosen["head_always_active"]), scale)
    for today, settings in _NEW_PRESETS.items():
        if ran == settings:
            args["preset"] = today
            return target
    if target != "SparseLayerSAM":
        raise _refuse(
            name, "preset", preset, "its settings are a preset's only, and today's"
            f" {target} takes the presets 'default' and 'paper'.",
        )  # fmt: skip
    args["preset"] = "paper"
    base = _NEW_PRESETS["paper"]
    for key, value, given in zip(
        ("budget", "bandit_loss", "alpha_p", "head_always_active", "max_update_scale"),
        ran, base,
    ):  # fmt: skip
        if value != given:
            args[key] = 1.0 if key == "max_update_scale" and value is None else value
    return "SLSAMAblation"


def _random_settings(args: dict[str, Any]) -> None:
    head = bool(args.pop("head_always_active", None) or False)
    scale = None
    if args.pop("scale_updates", None):
        cap = args.get("max_update_scale")
        scale = float(cap) if cap is not None else 1.0 / float(args.get("layer_ratio", 0.2))
    cap = args.pop("max_update_scale", None)
    for preset, settings in _RANDOM_PRESETS.items():
        if (head, scale) == settings:
            args["preset"] = preset
            return
    raise _refuse(
        "RandomSLSAM", "max_update_scale" if scale is not None else "head_always_active",
        cap if scale is not None else head,
        "Random-SL-SAM takes preset='paper' (no head rule, no scaling) or 'default' (the"
        " head every step, updates scaled up to 3x) today.",
    )  # fmt: skip


def upgrade_configs(args: list[str]) -> list[str]:
    """``args`` with each ``--config`` file whose SAM callbacks were saved by an earlier
    version replaced by an upgraded copy (written to the temporary folder), and a line on
    stderr saying what changed; other arguments unchanged.

    Raises:
        UnsupportedConfig: naming the file and the option, for a configuration that
            today's options cannot express.
    """
    out = list(args)
    for at, path, loaded in config_files(args):
        listed = config_callbacks(loaded)
        if not listed:
            continue
        changes = []
        for k, entry in enumerate(listed):
            if not isinstance(entry, dict):
                continue
            try:
                new, notes = upgrade_entry(entry)
            except UnsupportedConfig as err:
                raise UnsupportedConfig(f"{path}: trainer.callbacks[{k}]: {err}") from None
            if notes:
                listed[k] = new
                changes.append(f"{entry.get('class_path')}: {', '.join(notes)}")
        if not changes:
            continue
        loaded["trainer"]["callbacks"] = listed
        fd, upgraded = tempfile.mkstemp(prefix="lightning_slsam_", suffix=".yaml")
        with os.fdopen(fd, "w") as handle:
            yaml.safe_dump(loaded, handle, sort_keys=False)
        out[at] = upgraded
        print(
            f"lightning-slsam: {path} was saved by an earlier version; it trains the same"
            f" with {'; '.join(changes)}",
            file=sys.stderr,
        )
    return out
