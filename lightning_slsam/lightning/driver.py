"""The Lightning step driver: one SAM training step of a :class:`~lightning_slsam.SAMMixin`
module, from the Trainer's batch to the stepped optimizer and LR schedulers.

A :class:`StepDriver` belongs to the module (the mixin creates it at the first SAM step of
a fit) and owns everything Lightning does for an automatic-optimization step that manual
optimization leaves to the module:

- gradient accumulation: micro-batches are buffered and the step runs over the whole group
  (the epoch's last batch closes a partial group, as Lightning's accumulation does);
- the gradient scaler: the engine reads its loss scale, and a skipped step still makes it
  back off;
- clipping, after unscaling, inside Lightning's wrapped ``optimizer.step()``;
- the DDP ``no_sync`` context (the engine averages the active layers' gradients itself);
- LR scheduler stepping at the points Lightning would, ``monitor`` and ``strict`` included.

It reads the SAM callback's public options (``engine``, ``accumulate_grad_batches``,
``gradient_clip_val``, ``gradient_clip_algorithm``) and nothing private of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_slsam.core.contract import (
    PER_SAMPLE_NEEDED,
    PassOutput,
    StepContext,
    split_per_sample,
)
from lightning_slsam.lightning.compat import (
    attached_trainer,
    automatic_scheduler_configs,
    epoch_ends_with_this_batch,
    gradient_scaler,
    loss_scale_reader,
)
from lightning_slsam.parallel.ddp import GradientAverager

if TYPE_CHECKING:
    from lightning_slsam.core.engine import SparseSAMEngine

__all__ = ["SAMController", "StepDriver", "driver_of", "find_sam_callback", "loss_of"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


class SAMController:
    """What the driver reads from the SAM callback: the base of
    :class:`~lightning_slsam.SAMCallback`, and how the mixin recognises it on a Trainer.

    Attributes:
        engine: the method's engine (built at fit start; ``None`` before).
        accumulate_grad_batches: micro-batches per optimizer step.
        gradient_clip_val: clip value (``None`` or 0: no clipping).
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.
    """

    engine: SparseSAMEngine | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"


def find_sam_callback(trainer: Any) -> Any:
    """The SAM callback attached to ``trainer`` (setup refuses more than one), if any."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, SAMController)), None)


def driver_of(module: Any) -> StepDriver | None:
    """The step driver of ``module`` (``None`` before its first SAM step)."""
    return getattr(module, "_slsam_driver", None)


def loss_of(output: Any) -> tuple[Tensor, Tensor | None]:
    """The scalar loss of a ``training_step`` output and its per-sample losses, if given.

    A 1-D tensor is a vector of per-sample losses (averaged for the update:
    :func:`~lightning_slsam.core.contract.split_per_sample`); a dict may carry
    ``"per_sample_loss"`` next to ``"loss"``.
    """
    per_sample = output.get("per_sample_loss") if isinstance(output, Mapping) else None
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(loss, Tensor) and per_sample is None:
        loss, per_sample = split_per_sample(loss)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise MisconfigurationException(
            "With a SAM callback, `training_step` must return the loss: a scalar tensor, a"
            " 1-D tensor of per-sample losses, or a dict with key 'loss'. It returned"
            f" {type(output).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
            + ". The mixin re-runs training_step for each gradient pass and needs that loss."
        )
    return loss.reshape(()), (per_sample.detach().reshape(-1) if per_sample is not None else None)


class _Passes:
    """The ``forward_backward`` callable of one training step (the engine's protocol).

    ``subsets[i]`` restricts micro-batch ``i`` to those sample indices (an empty tensor
    skips it); ``backward=False`` runs the forward only; ``loss_scale`` multiplies the
    loss before the backward pass. The first full backward pass is
    pass 1 for ``SAMMixin.sam_pass``; every other call (second pass, ESAM's selection
    forward, SSAM-F's per-sample passes) is pass 2, whose logging is dropped.
    """

    def __init__(
        self,
        module: Any,
        user_step,
        micro_batches: list[Call],
        scale: float,
        needs_per_sample: bool = False,
    ) -> None:
        self.module, self.user_step = module, user_step
        self.micro_batches, self.scale = micro_batches, scale
        self.needs_per_sample = needs_per_sample
        self.first_output: Any = None
        self._full_passes = 0

    @property
    def batch_sizes(self) -> list[int]:
        return [self.module.sam_batch_size(args[0]) for args, _ in self.micro_batches]

    def __call__(
        self, subsets: list[Tensor] | None = None, backward: bool = True, loss_scale: float = 1.0
    ) -> Any:
        module = self.module
        first = subsets is None and backward and self._full_passes == 0
        self._full_passes += int(subsets is None and backward)
        module._slsam_pass = 1 if first else 2
        try:
            total: Tensor | None = None
            per_sample: list[Tensor | None] = []
            for i, (args, kwargs) in enumerate(self.micro_batches):
                index = subsets[i] if subsets is not None else None
                if index is not None and index.numel() == 0:
                    per_sample.append(None)
                    continue
                if index is not None:
                    size = module.sam_batch_size(args[0])
                    args = (module.sam_subset_batch(args[0], index, size), *args[1:])
                output = self.user_step(module, *args, **kwargs)
                loss, samples = loss_of(output)
                if samples is None and self.needs_per_sample:
                    raise MisconfigurationException(PER_SAMPLE_NEEDED)  # before any backward
                if first and self.first_output is None:
                    self.first_output = output
                per_sample.append(samples)
                if self.scale * loss_scale != 1.0:
                    loss = loss * (self.scale * loss_scale)
                # No active tensor reached the loss: nothing to back-propagate (norm 0).
                if backward and loss.requires_grad:
                    module.manual_backward(loss)
                loss = loss.detach()
                total = loss if total is None else total + loss
            assert total is not None, "every micro-batch of a pass was skipped"
            return PassOutput(total, per_sample)
        finally:
            module._slsam_pass = 0


class StepDriver:
    """Runs the SAM training steps of one module during one fit.

    Args:
        module: the :class:`~lightning_slsam.SAMMixin` LightningModule.
        controller: the SAM callback on its Trainer (the options and the engine).
    """

    def __init__(self, module: Any, controller: SAMController) -> None:
        trainer = attached_trainer(module)
        self.module, self.controller, self.trainer = module, controller, trainer
        self.optimizer = module.optimizers()
        self.scaler = gradient_scaler(trainer)
        #: Averages the active layers' gradients across processes (DDP); ``None`` on one.
        self.averager = GradientAverager() if trainer.world_size > 1 else None
        #: The LR scheduler configs as automatic optimization builds them (``monitor``,
        #: ``strict`` and ``reduce_on_plateau`` kept; the same scheduler objects).
        self.schedulers = automatic_scheduler_configs(
            getattr(module, "_slsam_optim_conf", None), list(trainer.lr_scheduler_configs)
        )
        self._buffer: list[Call] = []
        self._clip_now = False
        #: Plateau schedulers due after the last batch, stepped at the next training step.
        self._pending_plateau: list[tuple[str, int]] = []

    def serves(self, controller: SAMController) -> bool:
        """Whether this driver belongs to the module's current fit with ``controller``."""
        trainer = attached_trainer(self.module)
        return (
            self.controller is controller
            and self.trainer is trainer
            and trainer.optimizers[:1] == [self.optimizer.optimizer]
        )

    # -- the step ----------------------------------------------------------------------
    def training_step(self, user_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Buffer the batch, and once a group is complete run the SAM step over it; return
        what ``training_step`` returns to Lightning (the first pass's output, detached)."""
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.step_pending_plateau_schedulers()
        micro_batches = self._accumulate(args, kwargs)
        if micro_batches is None:
            return None  # buffered for gradient accumulation; the step comes later
        engine = self.controller.engine
        if engine is None:
            raise RuntimeError(f"{type(self.controller).__name__} ran a step before on_fit_start.")
        passes = _Passes(
            self.module, user_step, micro_batches, 1.0 / self.controller.accumulate_grad_batches,
            needs_per_sample=engine.needs_per_sample,
        )  # fmt: skip
        context = StepContext(grad_scale=loss_scale_reader(self.scaler), averager=self.averager)
        trainer = self.trainer
        # Under DDP the engine averages the active layers' gradients itself.
        with trainer.strategy.block_backward_sync() if trainer.world_size > 1 else nullcontext():
            engine.step(passes, self._zero_grad, self._optimizer_step, context)
        self.step_schedulers(batch_idx)
        output = passes.first_output
        if isinstance(output, Mapping):
            return {**output, "loss": loss_of(output)[0].detach()}
        return loss_of(output)[0].detach() if isinstance(output, Tensor) else output

    def _accumulate(self, args: tuple, kwargs: dict) -> list[Call] | None:
        self._buffer.append((args, kwargs))
        last = epoch_ends_with_this_batch(self.trainer)
        if len(self._buffer) < self.controller.accumulate_grad_batches and not last:
            return None
        group, self._buffer = self._buffer, []
        return group

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, skip: bool) -> None:
        if skip and self.scaler is not None:
            # A skipped step must still make the gradient scaler back off: hand it an
            # infinite gradient, so it skips the optimizer and lowers its scale.
            param = next(p for g in self.optimizer.param_groups for p in g["params"])
            param.grad = torch.full_like(param, float("inf"))
        self._clip_now = True
        try:
            self.optimizer.step()
        finally:
            self._clip_now = False

    def clip_gradients(self, optimizer: Any) -> None:
        """Clip the update gradient with the callback's options. Lightning's
        ``on_before_optimizer_step`` moment (after unscaling, before the update) is the only
        place for it: the SAM callback's hook calls this. Acts during this driver's
        optimizer step only."""
        clip = self.controller.gradient_clip_val
        if self._clip_now and clip:
            self.module.clip_gradients(
                optimizer,
                gradient_clip_val=clip,
                gradient_clip_algorithm=self.controller.gradient_clip_algorithm,
            )

    # -- LR schedulers (Lightning steps them only under automatic optimization) ----------
    def step_schedulers(self, batch_idx: int) -> None:
        """Step the non-plateau schedulers due after batch ``batch_idx``, and queue the
        plateau ones: they read validation metrics, which Lightning logs after this batch,
        so they are stepped at the start of the next training step, with the same index."""
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
