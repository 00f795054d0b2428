"""The ``lightning-slsam`` command: LightningCLI plus the packaged demo and ``compare``.

.. code-block:: bash

    lightning-slsam fit --demo                         # the demo (configs/demo.yaml)
    lightning-slsam fit --demo --trainer.max_steps=100 # the demo, shorter
    lightning-slsam fit --config my_run.yaml           # your own run
    lightning-slsam fit --demo --print_config          # show the demo's full configuration
    lightning-slsam compare --config task.yaml --methods adamw,sam,slsam --seeds 3

Model and datamodule are given by ``class_path`` (any ``LightningModule`` /
``LightningDataModule``); SL-SAM is switched on by listing
``lightning_slsam.SparseLayerSAM`` (or another method) in ``trainer.callbacks``, with a
model that inherits :class:`~lightning_slsam.SAMMixin`. The demo's values are used only
with ``--demo``: they are never merged into a run silently. A typo or an invalid value in
a SAM callback's options ends the command with one line naming the option, the class and
the fix. After ``fit`` a short summary is printed: the final validation metrics, the
method's mean active ratio and per-layer chart, and the log folder.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from importlib import resources
from typing import Any

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_slsam.callback import SAMCallback
from lightning_slsam.compat import add_cli_subcommand, spawns_processes
from lightning_slsam.driver import find_sam_callback

__all__ = ["SLSAMCLI", "demo_config_path", "main"]

_CONFIG_FLAGS = ("-c", "--config")
_DEMO_FLAG = "--demo"
_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_COMPARE_HELP = (
    "train several methods over several seeds and write the comparison table and plots"
    " (lightning-slsam compare --help)"
)


class SLSAMCLI(LightningCLI):
    """``LightningCLI`` with ``--demo``, the ``compare`` subcommand in its help, short
    errors for SAM callback options, and a summary after ``fit``.

    Command-line style arguments (``args=None`` reads ``sys.argv[1:]``) may name
    ``--demo`` to run on the packaged ``configs/demo.yaml``; the summary is printed on
    global rank zero only (under ``ddp_spawn``, by the launching process).
    """

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        # Lists `compare` (handled by main() before this parser runs) beside Lightning's
        # subcommands, so that --help and the missing-subcommand error show it.
        compare = LightningArgumentParser(description=_COMPARE_HELP)
        add_cli_subcommand(
            lambda: super(SLSAMCLI, self)._add_subcommands(parser, **kwargs),
            parser, "compare", compare, _COMPARE_HELP,
        )  # fmt: skip

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        if isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
            return
        # Parsed here rather than by the parent, which warns when `args` and sys.argv are
        # both set: with the demo config added, `args` is always set.
        argv = _with_demo_config(list(sys.argv[1:] if args is None else args))
        problem = _missing_run(argv) or check_callback_options(argv)
        if problem:
            print(f"lightning-slsam: error: {problem}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        self.config = parser.parse_args(argv)

    def before_fit(self) -> None:
        # Under ddp_spawn the training runs in child processes: fixing the log folder's
        # version here makes the children write where this process will look afterwards.
        if spawns_processes(self.trainer.strategy):
            _ = self.trainer.log_dir

    def after_fit(self) -> None:
        trainer = self.trainer
        log_dir = trainer.log_dir  # a broadcast under multi-process strategies: every rank
        if not trainer.is_global_zero:
            return
        lines = ["", "SL-SAM run summary"]
        metrics = _validation_metrics(trainer)
        if not metrics:
            lines.append("  final validation metrics: n/a (no validation ran)")
        for name, value in metrics.items():
            lines.append(f"  final {name}: {value:.4f} (after {trainer.global_step} steps)")
        sam = find_sam_callback(trainer)
        if sam is None:
            lines.append("  method: AdamW (no SAM callback in trainer.callbacks)")
        else:
            summary = sam.summary(trainer)
            lines.append(
                f"  {type(sam).__name__} mean active ratio: {summary['mean_active_ratio']:.3f}x"
                " over the passes (SAM: 2.0x, AdamW: 1.0x)"
            )
            lines.append(f"  per-layer chart: {summary['layer_frequency_png'] or 'not written'}")
        lines.append(f"  log dir: {log_dir or trainer.default_root_dir}")
        print("\n".join(lines), flush=True)


def _validation_metrics(trainer: Any) -> dict[str, float]:
    """The run's final validation metrics: the checkpoint's monitor first, then every
    ``val*`` metric."""
    found = trainer.callback_metrics
    names = [
        cb.monitor
        for cb in trainer.callbacks
        if isinstance(getattr(cb, "monitor", None), str) and cb.monitor in found
    ]
    names += sorted(k for k in found if k.startswith("val") and k not in names)
    return {name: float(found[name]) for name in names if found[name].numel() == 1}


def demo_config_path() -> str:
    """Path of the packaged demo configuration, ``lightning_slsam/configs/demo.yaml``."""
    return str(resources.files("lightning_slsam") / "configs" / "demo.yaml")


def _with_demo_config(args: list[str]) -> list[str]:
    """``args`` with ``--demo`` replaced by ``--config <demo.yaml>`` right after the
    subcommand.

    Placed first, the demo's values are the base that every other flag (and any further
    ``--config``) overrides. Without ``--demo`` nothing is added.
    """
    if _DEMO_FLAG not in args:
        return args
    args = [a for a in args if a != _DEMO_FLAG]
    for i, arg in enumerate(args):
        if arg in _SUBCOMMANDS:
            return [*args[: i + 1], "--config", demo_config_path(), *args[i + 1 :]]
    return args


def _missing_run(args: list[str]) -> str | None:
    """The error for ``fit`` (or another subcommand) with neither a config nor a model."""
    command = next((a for a in args if a in _SUBCOMMANDS), None)
    asks_help = {"-h", "--help", "--print_config"} & {a.split("=")[0] for a in args}
    given = any(a in _CONFIG_FLAGS or a.split("=")[0] in ("--config", "--model") for a in args)
    if command is None or asks_help or given:
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
                if arg in _CONFIG_FLAGS or arg.startswith("--trainer.callbacks")
                else None
            )
            i += value is not None
        i += 1
        if value is None:
            continue
        if arg in _CONFIG_FLAGS and os.path.isfile(value):
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
        cls = _resolve(entry.get("class_path"))
        if cls is None:
            continue
        try:
            cls(**entry["init_args"])
        except TypeError as err:
            return f"{where}: {err}"
        except (ValueError, MisconfigurationException) as err:
            return f"{where}: {cls.__name__}: {err}"
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


def _resolve(class_path: Any) -> type[SAMCallback] | None:
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


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning-slsam``: runs :class:`SLSAMCLI` on ``args`` (default
    ``sys.argv[1:]``).

    Returns ``None`` so that the console script's ``sys.exit(main())`` exits with 0.
    """
    # The demo tokenises before DataLoader workers may fork; the tokenizers library would
    # otherwise warn (and disable its threads) at the first fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["compare"]:
        from lightning_slsam.compare import main as compare

        compare(argv[1:])
        return
    SLSAMCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=None if args is None else list(args),
    )
    release_process_group()


def release_process_group() -> None:
    """Destroys the default process group that a distributed strategy left behind.

    Lightning's strategies keep the group alive after ``fit``; a gloo group still alive
    when the interpreter exits can abort the process ("terminate called without an active
    exception", exit code -6) after a run that succeeded. Called only once the run has
    ended without an error: after a fault on one rank, the other ranks may still wait in
    a collective, and destroying the group would wait with them.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
