"""``SAMMixin``: the one change a LightningModule needs for SL-SAM.

.. code-block:: python

    class LitClassifier(SAMMixin, L.LightningModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    trainer = L.Trainer(callbacks=[SparseLayerSAM(rho=0.01, layer_ratio=0.2)])

Without a SAM callback on the Trainer the module is an ordinary LightningModule with
automatic optimization: every Trainer feature works as usual. With one, the module
switches to manual optimization and the mixin runs the training step: it calls the
user's ``training_step`` once per gradient pass (``self.sam_pass`` is 1 or 2 while it
runs; ``self.log`` calls from the second pass, made at perturbed weights, are dropped),
steps the optimizer exactly once per training step through Lightning's wrapped
``optimizer.step()`` (so ``global_step``, checkpointing and loggers behave as under
automatic optimization), and steps LR schedulers honouring ``interval`` and
``frequency`` at the same points Lightning would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

if TYPE_CHECKING:
    from lightning_slsam.callback import SparseLayerSAM

__all__ = ["SAMMixin"]


def _sam_controller(module: Any) -> SparseLayerSAM | None:
    """The SAM callback attached to ``module``'s Trainer, if any."""
    from lightning_slsam.callback import SparseLayerSAM

    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return None
    found = [cb for cb in trainer.callbacks if isinstance(cb, SparseLayerSAM)]
    return found[0] if found else None


def _wrap_training_step(user_step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(user_step)
    def training_step(self: SAMMixin, *args: Any, **kwargs: Any) -> Any:
        # Nested calls (super().training_step, or our own passes) run the user's code.
        if self._slsam_pass or self._trainer is None:
            return user_step(self, *args, **kwargs)
        controller = _sam_controller(self)
        if controller is None:
            return user_step(self, *args, **kwargs)
        return self._slsam_training_step(controller, user_step, args, kwargs)

    training_step._slsam_wrapped = True  # type: ignore[attr-defined]
    return training_step


def _wrap_configure_optimizers(user_configure: Callable[..., Any]) -> Callable[..., Any]:
    # Under manual optimization Lightning drops `monitor` / `strict` from scheduler
    # configs; keeping the raw output lets the mixin step plateau schedulers itself.
    @functools.wraps(user_configure)
    def configure_optimizers(self: SAMMixin, *args: Any, **kwargs: Any) -> Any:
        output = user_configure(self, *args, **kwargs)
        self._slsam_optim_conf = output
        return output

    configure_optimizers._slsam_wrapped = True  # type: ignore[attr-defined]
    return configure_optimizers


def scheduler_configs(module: Any, trainer: Any) -> list[Any]:
    """The Trainer's LR scheduler configs as automatic optimization would build them.

    Same scheduler objects, but with ``monitor`` / ``strict`` / ``reduce_on_plateau``
    kept, which Lightning discards under manual optimization.
    """
    current = list(trainer.lr_scheduler_configs)
    raw = getattr(module, "_slsam_optim_conf", None)
    if raw is None or not current:
        return current
    try:
        from lightning.pytorch.core.optimizer import (
            _configure_optimizers,
            _configure_schedulers_automatic_opt,
        )
    except ImportError:  # a Lightning without these helpers: keep its own configs
        return current
    _, schedulers, monitor = _configure_optimizers(raw)
    # Raises Lightning's own clear error for e.g. a ReduceLROnPlateau without `monitor`.
    rebuilt = _configure_schedulers_automatic_opt(schedulers, monitor)
    same = len(rebuilt) == len(current) and all(
        a.scheduler is b.scheduler for a, b in zip(rebuilt, current)
    )
    return rebuilt if same else current


def _loss_of(output: Any) -> Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise MisconfigurationException(
            "With a SAM callback, `training_step` must return the loss: a scalar tensor or a"
            f" dict with key 'loss'. It returned {type(output).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
            + ". The mixin re-runs training_step for each gradient pass and needs that loss."
        )
    return loss.reshape(())


class SAMMixin:
    """Mixin for a ``LightningModule`` whose ``training_step`` returns the loss.

    Put it first in the bases: ``class Model(SAMMixin, L.LightningModule)``. The module
    keeps its ``training_step`` (returning a scalar loss or a dict with ``"loss"``) and
    its ``configure_optimizers`` (one optimizer, any ``torch.optim`` optimizer, with or
    without LR schedulers). Add :class:`~lightning_slsam.SparseLayerSAM` to the Trainer
    to train with SL-SAM; without it the module trains exactly as a plain module.

    While a SAM step runs, :attr:`sam_pass` tells ``training_step`` which gradient pass
    it is in (1: at the current weights, 2: at the perturbed weights), so code with side
    effects (e.g. updating a training metric) can act on pass 1 only.
    """

    _slsam_pass: int = 0
    _slsam_pending_plateau: list[tuple[str, int]] | None = None
    _slsam_optim_conf: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("training_step")
        if step is not None and not getattr(step, "_slsam_wrapped", False):
            cls.training_step = _wrap_training_step(step)  # type: ignore[attr-defined]
        configure = cls.__dict__.get("configure_optimizers")
        if configure is not None and not getattr(configure, "_slsam_wrapped", False):
            cls.configure_optimizers = _wrap_configure_optimizers(configure)  # type: ignore[attr-defined]

    # -- optimization mode ---------------------------------------------------------
    @property
    def automatic_optimization(self) -> bool:
        """``False`` while a SAM callback is attached (the mixin steps), else ``True``."""
        return _sam_controller(self) is None

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        # LightningModule.__init__ stores its default through the attribute, not this setter.
        raise AttributeError(
            "SAMMixin chooses the optimization mode itself: automatic without a SAM callback,"
            " manual with one. Remove the `self.automatic_optimization = ...` assignment."
        )

    @property
    def sam_pass(self) -> int:
        """Gradient pass of the running SAM step: 1 or 2, and 0 outside a SAM step."""
        return self._slsam_pass

    def log(self, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``, except that calls from SAM's second pass are dropped."""
        if self._slsam_pass >= 2:
            return
        super().log(*args, **kwargs)  # type: ignore[misc]

    def configure_callbacks(self) -> Any:
        """Refuse Trainer options that cannot work under manual optimization.

        Runs before Lightning's own check, so the error can point to the plugin's options.
        """
        controller = _sam_controller(self)
        trainer = self._trainer
        if controller is not None and trainer is not None:
            if trainer.gradient_clip_val:
                raise MisconfigurationException(
                    f"`Trainer(gradient_clip_val={trainer.gradient_clip_val})` cannot be used with"
                    " a SAM callback (Lightning refuses it under manual optimization). Set"
                    f" `SparseLayerSAM(gradient_clip_val={trainer.gradient_clip_val},"
                    f" gradient_clip_algorithm={trainer.gradient_clip_algorithm or 'norm'!r})`"
                    " instead: it clips the update gradient after unscaling."
                )
            if trainer.accumulate_grad_batches != 1:
                raise MisconfigurationException(
                    f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` cannot"
                    " be used with a SAM callback (Lightning refuses it under manual"
                    " optimization). Set `SparseLayerSAM(accumulate_grad_batches="
                    f"{trainer.accumulate_grad_batches})` instead."
                )
        return super().configure_callbacks()  # type: ignore[misc]

    # -- the SAM training step -------------------------------------------------------
    def _slsam_training_step(
        self,
        controller: SparseLayerSAM,
        user_step: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        trainer = self._trainer
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self._slsam_step_plateau_schedulers()

        micro_batches = controller._accumulate(trainer, args, kwargs)
        if micro_batches is None:
            return None  # buffered for gradient accumulation; the step comes later
        scale = 1.0 / controller.accumulate_grad_batches
        optimizer = self.optimizers()  # type: ignore[attr-defined]
        first_output: list[Any] = []
        passes_done = [0]

        def forward_backward() -> Tensor:
            passes_done[0] += 1
            self._slsam_pass = passes_done[0]
            try:
                total: Tensor | None = None
                for mb_args, mb_kwargs in micro_batches:
                    output = user_step(self, *mb_args, **mb_kwargs)
                    loss = _loss_of(output)
                    if passes_done[0] == 1 and not first_output:
                        first_output.append(output)
                    if scale != 1.0:
                        loss = loss * scale
                    # No active tensor reached the loss: nothing to back-propagate (norm 0).
                    if loss.requires_grad:
                        self.manual_backward(loss)  # type: ignore[attr-defined]
                    loss = loss.detach()
                    total = loss if total is None else total + loss
                assert total is not None
                return total
            finally:
                self._slsam_pass = 0

        def zero_grad() -> None:
            optimizer.zero_grad(set_to_none=True)

        def optimizer_step(skip: bool) -> None:
            optimizer.step()

        controller._run_step(self, forward_backward, zero_grad, optimizer_step)
        self._slsam_step_schedulers(trainer, batch_idx)
        output = first_output[0] if first_output else None
        if isinstance(output, dict):
            return {**output, "loss": output["loss"].detach()}
        return output.detach() if isinstance(output, Tensor) else output

    # -- LR schedulers (Lightning steps them only under automatic optimization) ----------
    def _slsam_step_schedulers(self, trainer: Any, batch_idx: int) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        last_batch = epoch_loop._num_ready_batches_reached()
        self._slsam_update_schedulers("step", batch_idx + 1, plateau=False)
        if last_batch:
            self._slsam_update_schedulers("epoch", trainer.current_epoch + 1, plateau=False)
        # Plateau schedulers read validation metrics, which Lightning logs after this batch:
        # they are stepped at the start of the next training step, with the same index.
        self._slsam_pending_plateau = [("step", batch_idx + 1)]
        if last_batch:
            self._slsam_pending_plateau.append(("epoch", trainer.current_epoch + 1))

    def _slsam_step_plateau_schedulers(self) -> None:
        pending, self._slsam_pending_plateau = self._slsam_pending_plateau, None
        for interval, index in pending or ():
            self._slsam_update_schedulers(interval, index, plateau=True)

    def _slsam_update_schedulers(self, interval: str, index: int, plateau: bool) -> None:
        trainer = self._trainer
        for config in trainer.lr_scheduler_configs:
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
            self.lr_scheduler_step(config.scheduler, monitor_val)  # type: ignore[attr-defined]
