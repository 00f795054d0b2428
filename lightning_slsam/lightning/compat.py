"""Every use of private Lightning internals, each with the version it was checked against
(Lightning 2.6.6), so that a release that breaks one changes this module only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "attached_trainer",
    "automatic_scheduler_configs",
    "carry_step_progress",
    "epoch_ends_with_this_batch",
    "gradient_scaler",
    "spawns_processes",
    "with_subcommand_help",
]


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or ``None``. Lightning 2.6.6:
    ``LightningModule._trainer`` (the ``trainer`` property raises without one)."""
    return getattr(module, "_trainer", None) if module is not None else None


def epoch_ends_with_this_batch(trainer: Any) -> bool:
    """Whether the batch being trained is the epoch's last one. Lightning 2.6.6:
    ``fit_loop.epoch_loop._num_ready_batches_reached()``, the test its own gradient
    accumulation uses to close a partial group at the end of an epoch."""
    return bool(trainer.fit_loop.epoch_loop._num_ready_batches_reached())


def gradient_scaler(trainer: Any) -> Any:
    """The mixed-precision gradient scaler of ``trainer`` (``None`` without one). Lightning
    2.6.6: the ``scaler`` of ``MixedPrecision`` (16-bit AMP) and ``FSDPPrecision``."""
    return getattr(trainer.precision_plugin, "scaler", None)


def automatic_scheduler_configs(raw: Any, current: list[Any]) -> list[Any]:
    """The LR scheduler configs automatic optimization would build from ``configure_optimizers``'s
    output ``raw``: ``current``'s (the Trainer's, under manual optimization) with ``monitor``,
    ``strict`` and ``reduce_on_plateau`` kept. Lightning 2.6.6:
    ``lightning.pytorch.core.optimizer._configure_optimizers`` and
    ``_configure_schedulers_automatic_opt`` (without them: ``current``)."""
    if raw is None or not current:
        return current
    try:
        from lightning.pytorch.core.optimizer import (
            _configure_optimizers,
            _configure_schedulers_automatic_opt,
        )
    except ImportError:
        return current
    _, schedulers, monitor = _configure_optimizers(raw)
    # Raises Lightning's own clear error for e.g. a ReduceLROnPlateau without `monitor`.
    rebuilt = _configure_schedulers_automatic_opt(schedulers, monitor)
    same = len(rebuilt) == len(current) and all(
        a.scheduler is b.scheduler for a, b in zip(rebuilt, current)
    )
    return rebuilt if same else current


def spawns_processes(strategy: Any) -> bool:
    """Whether ``strategy`` trains in spawned child processes (``ddp_spawn``). Lightning 2.6.6:
    its launcher is a ``_MultiProcessingLauncher``."""
    from lightning.pytorch.strategies.launchers.multiprocessing import (
        _MultiProcessingLauncher,
    )

    return isinstance(getattr(strategy, "launcher", None), _MultiProcessingLauncher)


def with_subcommand_help(
    add_lightning_subcommands: Callable[[], None], parser: Any, helps: dict[str, str]
) -> None:
    """Run ``LightningCLI._add_subcommands`` (``add_lightning_subcommands``) with ``helps``
    (by name) as the ``--help`` line of Lightning's subcommands. Lightning 2.6.6: it adds them
    to the action ``parser.add_subcommands()`` returns, captured here."""
    added: list[Any] = []
    original = parser.add_subcommands

    def capture(*args: Any, **options: Any) -> Any:
        action = original(*args, **options)
        add_subcommand = action.add_subcommand

        def with_help(command: str, command_parser: Any, **kwargs: Any) -> Any:
            if command in helps:
                kwargs["help"] = helps[command]
            return add_subcommand(command, command_parser, **kwargs)

        action.add_subcommand = with_help
        added.append(action)
        return action

    parser.add_subcommands = capture
    try:
        add_lightning_subcommands()
    finally:
        del parser.add_subcommands
        for action in added:
            del action.add_subcommand


def carry_step_progress(checkpoint: dict[str, Any], automatic: bool) -> None:
    """Copy, in a checkpoint being loaded, the optimizer-step count of the optimization mode
    that ran last into the mode that resumes (``automatic``). Lightning 2.6.6 counts them apart:
    ``epoch_loop.automatic_optimization.optim_progress`` and
    ``epoch_loop.manual_optimization.optim_step_progress``."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    auto = loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer")
    manual = loop.get("epoch_loop.manual_optimization.optim_step_progress")
    if not auto or not manual or "step" not in auto:
        return
    done_auto = auto["step"]["total"]["completed"]
    done_manual = manual["total"]["completed"]
    # Each switch copies the count over, so the mode that ran last has the larger count.
    if automatic and done_manual > done_auto:
        auto["step"] = {k: dict(v) for k, v in manual.items()}
        auto["zero_grad"] = {k: {**v, "started": v["completed"]} for k, v in manual.items()}
    elif not automatic and done_auto > done_manual:
        loop["epoch_loop.manual_optimization.optim_step_progress"] = {
            k: dict(v) for k, v in auto["step"].items()
        }
