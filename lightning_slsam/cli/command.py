"""The ``lightning-slsam`` command: LightningCLI plus the packaged demo.

.. code-block:: bash

    lightning-slsam fit --demo                         # the demo (configs/demo.yaml)
    lightning-slsam fit --demo --trainer.max_steps=100 # the demo, shorter
    lightning-slsam fit --config my_run.yaml           # your own run
    lightning-slsam fit --demo --print_config          # show the demo's full configuration
    lightning-slsam --help                             # the command and its subcommands

A SAM method is a callback in ``trainer.callbacks`` (the model inheriting
:class:`~lightning_slsam.SAMMixin`); the demo's values apply only with ``--demo``.
"""

from __future__ import annotations

import glob
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from importlib import resources
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback, ProgressBar, Timer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from lightning_slsam.cli.checks import (
    SUBCOMMANDS,
    asks_help,
    check_callback_options,
    check_sam_trainer,
    missing_run,
    stack_callbacks,
)
from lightning_slsam.cli.errors import OneLineParser, debugging, fail
from lightning_slsam.cli.progress import LineProgress
from lightning_slsam.core.record import layers_line
from lightning_slsam.lightning.callback import estimated_stepping_batches
from lightning_slsam.lightning.compat import spawns_processes, with_subcommand_help
from lightning_slsam.lightning.driver import find_sam_callback
from lightning_slsam.lightning.forgetting import ForgettingMonitor
from lightning_slsam.parallel.ddp import release_process_group

__all__ = ["SLSAMCLI", "demo_config_path", "main", "release_process_group"]

_DEMO_FLAG = "--demo"
#: ``lightning-slsam --help``: what the command is, its subcommands and where to start.
DESCRIPTION = (
    "Train Lightning models with Sparse-Layer SAM (SL-SAM), SAM and related methods, each"
    " a callback in trainer.callbacks. Start with `lightning-slsam fit --demo`"
    " (docs/quickstart.md)."
)
#: The line of each subcommand in ``lightning-slsam --help``.
SUBCOMMAND_HELP = {
    "fit": "Train a model, with a SAM method from trainer.callbacks (--demo: the packaged demo).",
    "validate": "Run one evaluation epoch on the validation set.",
    "test": "Run one evaluation epoch on the test set.",
    "predict": "Run the model on the predict set and return its predictions.",
}
#: The top of ``lightning-slsam fit --help``.
FIT_DESCRIPTION = (
    "Train a model from --config files and flags. --demo trains the packaged demo offline:"
    " MiniLM-L6 on Rotten Tomatoes with SparseLayerSAM(), from"
    " lightning_slsam/configs/demo.yaml, which other flags override (`--demo --print_config`"
    " shows it)."
)
#: The ``trainer.callback_metrics`` key of the last validation loop's step.
VALIDATED_AT = "slsam/validated_at_step"


class SLSAMCLI(LightningCLI):
    """``LightningCLI`` with ``--demo``, one-line errors for SAM callback options and a run
    summary after ``fit`` (on global rank zero)."""

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        parser.description = DESCRIPTION
        for subcommand in SUBCOMMANDS:
            described = FIT_DESCRIPTION if subcommand == "fit" else SUBCOMMAND_HELP[subcommand]
            kwargs[subcommand] = {
                "description": described,
                "epilog": methods_epilog(),
                **kwargs.get(subcommand, {}),
            }
        with_subcommand_help(
            lambda: super(SLSAMCLI, self)._add_subcommands(parser, **kwargs),
            parser,
            SUBCOMMAND_HELP,
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        if isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
            return
        # Parsed here: the parent warns when `args` and sys.argv are both set.
        argv = _with_demo_config(list(sys.argv[1:] if args is None else args))
        problem = None if asks_help(argv) else missing_run(argv) or check_callback_options(argv)
        argv = stack_callbacks(argv)  # a task's callbacks stay beside a method config's
        if problem:
            fail(problem)
        self.config = parser.parse_args(argv)
        subcommand = self.config.get("subcommand")
        trainer = self.config.get(f"{subcommand}.trainer") if subcommand else None
        problem = check_sam_trainer(trainer) if trainer is not None else None
        if problem:
            fail(problem)

    def before_fit(self) -> None:
        # Under ddp_spawn: fixes the log folder's version before the children start.
        if spawns_processes(self.trainer.strategy):
            _ = self.trainer.log_dir
        # The run summary replaces the method's end-of-fit line.
        sam = find_sam_callback(self.trainer)
        if sam is not None:
            sam._fit_message = False

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        given = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        given = given if isinstance(given, list) else [given]  # one callback, not in a list
        own_bar = any(isinstance(c, ProgressBar) for c in given)
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.append(_ValidationStep())
        bar = trainer.progress_bar_callback
        if bar is not None and not own_bar and not sys.stdout.isatty():
            # Rich's bar shows nothing in a log file until the run ends.
            trainer.callbacks[trainer.callbacks.index(bar)] = LineProgress()
        return trainer

    def fit(self, **kwargs: Any) -> None:
        """``trainer.fit(**kwargs)``; a run ended by SIGTERM or SIGINT prints its summary
        and exits with ``128 + signal`` (143, 130; docs/quickstart.md)."""
        trainer = self.trainer
        with _SignalRecord() as record:
            try:
                trainer.fit(**kwargs)
            except SystemExit as stop:
                # Lightning: SIGTERMException (exit code 0) on SIGTERM, sys.exit(1) on Ctrl-C.
                signum = signal.SIGTERM if isinstance(stop, SIGTERMException) else record.signum
                if signum is None or trainer.state.status != TrainerStatus.INTERRUPTED:
                    raise
                if trainer.is_global_zero:
                    name = signal.Signals(signum).name
                    summary = run_summary(trainer, _local_log_dir(trainer), signal_name=name)
                    print("\n".join(summary), flush=True)
                raise SystemExit(128 + signum) from None

    def after_fit(self) -> None:
        trainer = self.trainer
        log_dir = trainer.log_dir  # a broadcast under multi-process strategies: every rank
        if trainer.is_global_zero:
            print("\n".join(run_summary(trainer, log_dir)), flush=True)


class _ValidationStep(Callback):
    """Keeps the step of the last validation loop (not the sanity check) for the summary."""

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            trainer.callback_metrics[VALIDATED_AT] = torch.tensor(float(trainer.global_step))


class _SignalRecord:
    """Records a SIGINT so that the run's end can name it (Lightning names SIGTERM)."""

    signum: int | None = None

    def __enter__(self) -> _SignalRecord:
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def _interrupt(self, signum: int, frame: Any) -> None:
        self.signum = signum
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _local_log_dir(trainer: Any) -> str:
    """``trainer.log_dir`` without its broadcast: an interrupted run may have lost its peers."""
    logger = trainer.loggers[0] if trainer.loggers else None
    folder = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
    return folder or trainer.default_root_dir


def _last_checkpoint(trainer: Any) -> str | None:
    """The newest checkpoint file a ``ModelCheckpoint`` of ``trainer`` wrote (``None``: none)."""
    folders = {cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    found = [p for folder in folders for p in glob.glob(os.path.join(folder, "*.ckpt"))]
    return max(found, key=os.path.getmtime) if found else None


def run_summary(trainer: Any, log_dir: str | None, signal_name: str | None = None) -> list[str]:
    """The lines printed after ``fit``: method, final validation metrics, active ratio,
    sampling, chart and log folder; with ``signal_name``, the signal and last checkpoint."""
    sam = find_sam_callback(trainer)
    method = type(sam).__name__ if sam is not None else "no SAM method"
    lines = ["", f"Run summary ({method}, {trainer.global_step} steps)"]
    cut = _cut_short(trainer, signal_name)
    if cut:
        lines.append(f"  {cut}")
    if signal_name is not None:
        last = _last_checkpoint(trainer)
        lines.append(f"  last checkpoint: {last or 'none written'}")
    metrics = _validation_metrics(trainer)
    measured = trainer.callback_metrics.get(VALIDATED_AT)
    if not metrics:
        lines.append("  final validation metrics: n/a (no validation ran)")
    for name, value in metrics.items():
        if name.startswith("val") and measured is not None:
            when = f"validated at step {int(measured)}"
        else:
            when = "last logged value"
        lines.append(f"  final {name}: {value:.4f} ({when})")
    if sam is None:
        lines.append("  method: plain optimizer steps (no SAM callback in trainer.callbacks)")
    else:
        summary = sam.summary(trainer)
        preset = getattr(sam.spec, "preset", None)
        if preset is not None:
            words = sam.spec.PRESET_WORDS[preset]
            lines.append(f"  {type(sam).__name__} preset: {preset!r} ({words})")
        ratio = summary["mean_active_ratio"]
        said = "n/a (no step ran)" if math.isnan(ratio) else f"{ratio:.3f}x over the passes"
        lines.append(f"  {type(sam).__name__} mean active ratio: {said} (SAM: 2.0x, AdamW: 1.0x)")
        engine = sam.engine  # None in the launching process under ddp_spawn
        if engine is not None:
            lines.append(f"  {layers_line(engine)}")
        if summary["out_of_sampling"]:
            lines.append(f"  {summary['out_of_sampling']}")
        if summary["layer_frequency_png"]:
            lines.append(f"  per-layer chart: {summary['layer_frequency_png']}")
        if getattr(sam, "coverage_note", None):
            lines.append(f"  warning: {sam.coverage_note}")
    lines += _forgetting_lines(trainer)
    lines.append(f"  log dir: {log_dir or trainer.default_root_dir}")
    return lines


def _cut_short(trainer: Any, signal_name: str | None = None) -> str | None:
    """What stopped a run before its planned length, at which step, or ``None``."""
    if spawns_processes(trainer.strategy):  # the launching process counted no steps
        return None
    planned = estimated_stepping_batches(trainer)
    if signal_name is not None:
        of = "" if math.isinf(planned) else f" of {int(planned)}"
        return (
            f"interrupted by {signal_name} at step {trainer.global_step}{of}; the metrics"
            " below are those of a shortened run"
        )
    if math.isinf(planned) or trainer.global_step >= planned:
        return None
    timer = next((cb for cb in trainer.callbacks if isinstance(cb, Timer)), None)
    left = timer.time_remaining() if timer is not None else None
    if trainer.interrupted:
        why = "interrupted"
    elif left is not None and left <= 0:
        why = f"max_time ran out ({timer.time_elapsed():.0f} s of training)"
    else:
        why = "a callback stopped it (e.g. early stopping)"
    return (
        f"stopped at step {trainer.global_step} of {int(planned)}: {why}; the metrics below"
        " are those of a shortened run"
    )


def _forgetting_lines(trainer: Any) -> list[str]:
    """A forgetting monitor's first and last measurement (``forgetting/*`` in the logs)."""
    lines = []
    for monitor in trainer.callbacks:
        if not isinstance(monitor, ForgettingMonitor) or len(monitor.history) < 2:
            continue
        (_, first), (step, last) = monitor.history[0], monitor.history[-1]
        lines.append(
            f"  forgetting ({type(monitor).__name__}, reference text): loss"
            f" {first['loss']:.3f} -> {last['loss']:.3f} ({last['loss'] - first['loss']:+.3f}"
            f" nats), accuracy {first['accuracy']:.3f} -> {last['accuracy']:.3f}, KL from the"
            f" start {last['kl']:.3f} at step {step}"
        )
    return lines


def _validation_metrics(trainer: Any) -> dict[str, float]:
    """The final validation metrics: the checkpoint's monitor, then every ``val*`` one."""
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
    subcommand, so that every other flag overrides it."""
    if _DEMO_FLAG not in args:
        return args
    args = [a for a in args if a != _DEMO_FLAG]
    for i, arg in enumerate(args):
        if arg in SUBCOMMANDS:
            return [*args[: i + 1], "--config", demo_config_path(), *args[i + 1 :]]
    return args


def methods_epilog() -> str:
    """The end of ``fit --help``: the SAM method classes and how to see one's options."""
    from lightning_slsam.lightning.callbacks import METHODS, class_path

    classes = dict.fromkeys(class_path(cls) for cls, _ in METHODS.values() if cls is not None)
    return (
        "SAM methods are callbacks (the model inheriting lightning_slsam.SAMMixin): add one"
        f" with --trainer.callbacks+=CLASS. Classes: {', '.join(classes)}. To list one's"
        " options: --trainer.callbacks.help lightning_slsam.SparseLayerSAM (or another class)."
    )


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``lightning-slsam``: runs :class:`SLSAMCLI` on ``args`` (default
    ``sys.argv[1:]``); returns ``None`` (exit code 0)."""
    # The tokenizers library warns at the first fork after tokenising.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        SLSAMCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_class=OneLineParser,
            args=None if args is None else list(args),
        )
    except MisconfigurationException as err:
        # A setup check's refusal: one line, exit 2.
        if debugging():
            raise
        fail(" ".join(str(err).split()))
    except KeyboardInterrupt:  # Ctrl-C before the training loop (which handles its own)
        print("lightning-slsam: interrupted by SIGINT before training started", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    release_process_group()


if __name__ == "__main__":
    main()
