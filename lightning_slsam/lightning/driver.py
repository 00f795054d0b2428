"""The Lightning step driver: one SAM training step of a :class:`~lightning_slsam.SAMMixin`
module, from the Trainer's batch to the stepped optimizer and LR schedulers.

A :class:`StepDriver` does what automatic optimization would (accumulation, the gradient scaler,
clipping after unscaling, DDP's ``no_sync``, LR schedulers with ``monitor`` and ``strict``), reading
only the callback's :class:`LightningOptions` and ``engine`` (docs/training.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_slsam.core.passes import (
    LossOutput,
    PassRunner,
    loss_scale_reader,
    read_output,
    skip_with_scaler,
)
from lightning_slsam.core.step import LoopHooks
from lightning_slsam.lightning.compat import (
    attached_trainer,
    automatic_scheduler_configs,
    epoch_ends_with_this_batch,
    gradient_scaler,
)
from lightning_slsam.parallel.ddp import GradientAverager

__all__ = ["LightningOptions", "StepDriver", "driver_of", "find_sam_callback"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(kw_only=True, eq=False)
class LightningOptions:
    """The options of the Lightning layer, which the driver reads; the base of
    :class:`~lightning_slsam.SAMCallback`, by which the mixin finds it on a Trainer.

    Args:
        gradient_clip_val: clip the update gradient at this value after unscaling, instead
            of the Trainer flag (default ``None``; ``None`` or 0: no clipping).
        gradient_clip_algorithm: ``"norm"`` (default) or ``"value"``.
        accumulate_grad_batches: micro-batches per optimizer step (>= 1, default 1), instead
            of the Trainer flag: every pass runs over all micro-batches.
        plot: write the per-layer activation chart (PNG) at the end of fit (default ``True``).
    """

    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    accumulate_grad_batches: int = 1
    plot: bool = True


def find_sam_callback(trainer: Any) -> Any:
    """The SAM callback attached to ``trainer`` (``None``: no Trainer, or no SAM callback)."""
    if trainer is not None:
        for callback in trainer.callbacks:
            if isinstance(callback, LightningOptions):
                return callback
    return None


def driver_of(module: Any) -> StepDriver | None:
    """The step driver of ``module`` (``None`` before its first SAM step)."""
    return getattr(module, "_slsam_driver", None)


class StepDriver:
    """Runs the SAM training steps of one module during one fit.

    Args:
        module: the :class:`~lightning_slsam.SAMMixin` LightningModule.
        controller: the SAM callback on its Trainer (the options and the engine).
    """

    def __init__(self, module: Any, controller: Any) -> None:
        trainer = attached_trainer(module)
        self.module, self.controller, self.trainer = module, controller, trainer
        self.optimizer = module.optimizers()
        self.scaler = gradient_scaler(trainer)
        self.grad_scale = loss_scale_reader(self.scaler)
        #: Averages the active layers' gradients across processes (DDP); ``None`` on one.
        self.averager = GradientAverager() if trainer.world_size > 1 else None
        #: The LR scheduler configs as automatic optimization builds them.
        self.schedulers = automatic_scheduler_configs(
            getattr(module, "_slsam_optim_conf", None), list(trainer.lr_scheduler_configs)
        )
        self._zero_grad = functools.partial(self.optimizer.zero_grad, set_to_none=True)
        self._buffer: list[Call] = []
        self._clip_now = False
        #: Plateau schedulers due after the last batch, stepped at the next training step.
        self._pending_plateau: list[tuple[str, int]] = []
        #: The running step's passes, the user's training_step and its first output.
        self._passes: PassRunner | None = None
        self._user_step: Callable[..., Any] | None = None
        self._first_output: Any = None

    def training_step(self, user_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Buffer the batch, and once a group is complete run the SAM step over it; return
        what ``training_step`` returns to Lightning (the first pass's output, detached)."""
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if self._pending_plateau:
            self.step_pending_plateau_schedulers()
        # Accumulation: the step runs on a group's last batch, or the epoch's last.
        self._buffer.append((args, kwargs))
        k = self.controller.accumulate_grad_batches
        if len(self._buffer) < k and not epoch_ends_with_this_batch(self.trainer):
            return None
        micro_batches, self._buffer = self._buffer, []
        engine = self.controller.engine
        if engine is None:
            raise RuntimeError(f"{type(self.controller).__name__} ran a step before on_fit_start.")
        module = self.module
        self._user_step, self._first_output = user_step, None
        self._passes = PassRunner(
            micro_batches, self._loss, module.manual_backward,
            scale=1.0 / self.controller.accumulate_grad_batches, size=self._size,
            subset=self._subset, needs_per_sample=engine.parts.needs_per_sample,
            error=MisconfigurationException,
        )  # fmt: skip
        loop = LoopHooks(self._passes, self._zero_grad, self._optimizer_step, self.grad_scale,
                    self.averager, optimizer=self.optimizer)  # fmt: skip
        trainer = self.trainer
        try:
            with trainer.strategy.block_backward_sync() if self.averager else nullcontext():
                engine.step(loop)
        finally:
            module._slsam_pass, self._passes = 0, None
        if self.schedulers:
            self.step_schedulers(batch_idx)
        output = self._first_output
        if isinstance(output, Mapping):  # logits and the like: without their graphs
            loss = read_output(output, MisconfigurationException).loss
            return {**_detached(output), "loss": loss.detach()}
        if isinstance(output, Tensor):
            return read_output(output, MisconfigurationException).loss.detach()
        return output

    def _loss(self, call: Call) -> LossOutput:
        """One micro-batch's loss: the user's ``training_step``, run as pass 1 (at the
        current weights) or 2 (``SAMMixin.sam_pass``)."""
        module, number = self.module, self._passes.number  # type: ignore[union-attr]
        module._slsam_pass = number
        output = self._user_step(module, *call[0], **call[1])  # type: ignore[misc]
        if number == 1 and self._first_output is None:
            self._first_output = output
        return read_output(output, MisconfigurationException)

    def _size(self, call: Call) -> int:
        return self.module.sam_batch_size(call[0][0])

    def _subset(self, call: Call, index: Tensor) -> Call:
        args, kwargs = call
        batch = self.module.sam_subset_batch(args[0], index, self._size(call))
        return (batch, *args[1:]), kwargs

    def _optimizer_step(self, skip: bool) -> None:
        if skip and self.scaler is not None:
            skip_with_scaler(self.optimizer)
        self._clip_now = True
        try:
            self.optimizer.step()
        finally:
            self._clip_now = False

    def clip_gradients(self, optimizer: Any) -> None:
        """Clip the update gradient with the callback's options, during this driver's
        optimizer step only (the callback's ``on_before_optimizer_step`` calls it)."""
        clip = self.controller.gradient_clip_val
        if self._clip_now and clip:
            self.module.clip_gradients(
                optimizer,
                gradient_clip_val=clip,
                gradient_clip_algorithm=self.controller.gradient_clip_algorithm,
            )

    def step_schedulers(self, batch_idx: int) -> None:
        """Step the schedulers due after batch ``batch_idx``; queue the plateau ones for the
        next training step (they read validation metrics logged after this batch)."""
        trainer = self.trainer
        last_batch = epoch_ends_with_this_batch(trainer)
        self._update_schedulers("step", batch_idx + 1, plateau=False)
        if last_batch:
            self._update_schedulers("epoch", trainer.current_epoch + 1, plateau=False)
        self._pending_plateau = [("step", batch_idx + 1)]
        if last_batch:
            self._pending_plateau.append(("epoch", trainer.current_epoch + 1))

    def step_pending_plateau_schedulers(self) -> None:
        pending, self._pending_plateau = self._pending_plateau, []
        for interval, index in pending:
            self._update_schedulers(interval, index, plateau=True)

    def _update_schedulers(self, interval: str, index: int, plateau: bool) -> None:
        trainer = self.trainer
        for config in self.schedulers:
            if config.reduce_on_plateau != plateau or config.interval != interval:
                continue
            if index % config.frequency:
                continue
            monitor_val = None
            if config.reduce_on_plateau:
                monitor_val = trainer.callback_metrics.get(config.monitor)
                if monitor_val is None:
                    if config.strict:
                        raise MisconfigurationException(
                            f"ReduceLROnPlateau conditioned on metric {config.monitor} which is"
                            " not available. Available metrics are:"
                            f" {list(trainer.callback_metrics)}. Condition can be set using"
                            " `monitor` key in lr scheduler dict"
                        )
                    continue
            self.module.lr_scheduler_step(config.scheduler, monitor_val)


def _detached(output: Mapping) -> dict[str, Any]:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in output.items()}
