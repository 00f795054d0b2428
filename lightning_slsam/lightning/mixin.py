"""``SAMMixin``: the one change a LightningModule needs for SL-SAM.

With a SAM callback on the Trainer the module switches to manual optimization and the
mixin runs the step (:mod:`~lightning_slsam.lightning.driver`); without one it is an
ordinary LightningModule. See docs/training.md.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_slsam.core.passes import first_tensor, read_output, split_per_sample, subset_batch
from lightning_slsam.lightning.compat import attached_trainer, carry_step_progress
from lightning_slsam.lightning.driver import StepDriver, find_sam_callback

__all__ = ["SAMMixin"]


def _wrap_training_step(user_step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(user_step)
    def training_step(self: SAMMixin, *args: Any, **kwargs: Any) -> Any:
        # Nested calls (super().training_step, or the passes) run the user's code.
        trainer = None if self._slsam_pass else attached_trainer(self)
        if trainer is None:
            return user_step(self, *args, **kwargs)
        controller = find_sam_callback(trainer)
        if controller is None:
            output = user_step(self, *args, **kwargs)
            # Per-sample losses are averaged for automatic optimization.
            if isinstance(output, Tensor):
                return split_per_sample(output)[0]
            if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
                return {**output, "loss": read_output(output).loss}
            return output
        # A new driver for each fit (another callback, Trainer or optimizer).
        driver = self._slsam_driver
        if (
            driver is None
            or driver.controller is not controller
            or driver.trainer is not trainer
            or trainer.optimizers[:1] != [driver.optimizer.optimizer]
        ):
            driver = self._slsam_driver = StepDriver(self, controller)
        return driver.training_step(user_step, args, kwargs)

    training_step._slsam_wrapped = True  # type: ignore[attr-defined]
    return training_step


def _wrap_configure_optimizers(user_configure: Callable[..., Any]) -> Callable[..., Any]:
    # Keeps the raw output: manual optimization drops schedulers' `monitor` / `strict`.
    @functools.wraps(user_configure)
    def configure_optimizers(self: SAMMixin, *args: Any, **kwargs: Any) -> Any:
        output = user_configure(self, *args, **kwargs)
        self._slsam_optim_conf = output
        return output

    configure_optimizers._slsam_wrapped = True  # type: ignore[attr-defined]
    return configure_optimizers


class SAMMixin:
    """Mixin for a ``LightningModule`` whose ``training_step`` returns the loss (a scalar or
    a dict with ``"loss"``) and whose ``configure_optimizers`` returns one optimizer.

    List it first: ``class Model(SAMMixin, L.LightningModule)`` (or ``(SAMMixin,
    MyModule)``). With a SAM callback such as :class:`~lightning_slsam.SparseLayerSAM` on
    the Trainer it trains with it, else as a plain module. :attr:`sam_pass` tells
    ``training_step`` which pass runs, so side effects can act on pass 1 only.

    Example:
        >>> import tempfile
        >>> import lightning as L, torch
        >>> import torch.nn.functional as F
        >>> from lightning_slsam import SAMMixin, SparseLayerSAM
        >>> class LitClassifier(SAMMixin, L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(
        ...             torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         return F.cross_entropy(self.net(x), y)
        ...     def configure_optimizers(self):
        ...         return torch.optim.AdamW(self.parameters(), lr=1e-2)
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
        >>> data = torch.utils.data.TensorDataset(x, y)
        >>> sl_sam = SparseLayerSAM(layer_ratio=0.5, seed=0)
        >>> trainer = L.Trainer(
        ...     max_steps=8, callbacks=[sl_sam], default_root_dir=tempfile.mkdtemp(),
        ...     logger=False, enable_checkpointing=False, enable_progress_bar=False,
        ...     enable_model_summary=False)
        >>> trainer.fit(LitClassifier(), torch.utils.data.DataLoader(data, batch_size=8))
        >>> trainer.global_step, sl_sam.layer_names
        (8, ['net.0.weight', 'net.0.bias', 'net.2.weight', 'net.2.bias'])
        >>> round(sl_sam.mean_active_ratio, 2)  # SAM: 2.0 (two passes on every layer)
        0.97
    """

    _slsam_pass: int = 0
    _slsam_optim_conf: Any = None
    _slsam_driver: StepDriver | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Wraps the hooks the class defines or inherits from a base listed after the mixin.
        for name, wrap in (
            ("training_step", _wrap_training_step),
            ("configure_optimizers", _wrap_configure_optimizers),
        ):
            hook = getattr(cls, name, None)
            if inspect.isfunction(hook) and not getattr(hook, "_slsam_wrapped", False):
                setattr(cls, name, wrap(hook))

    @property
    def automatic_optimization(self) -> bool:
        """``False`` while a SAM callback is attached (the mixin steps), else ``True``."""
        return find_sam_callback(attached_trainer(self)) is None

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        # LightningModule.__init__ stores its default through the attribute, not this setter.
        raise AttributeError(
            "SAMMixin chooses the optimization mode itself: automatic without a SAM callback,"
            " manual with one. Remove the `self.automatic_optimization = ...` assignment."
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Carry the optimizer-step count across optimization modes when resuming (Lightning
        counts them apart). An override should call ``super().on_load_checkpoint(checkpoint)``."""
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        carry_step_progress(checkpoint, automatic=self.automatic_optimization)

    @property
    def sam_pass(self) -> int:
        """Gradient pass of the running SAM step: 1 or 2, and 0 outside a SAM step."""
        return self._slsam_pass

    def sam_batch_size(self, batch: Any) -> int:
        """Samples in ``batch``: the first dimension of its first tensor (ESAM, SSAM-F).
        Override it for a batch whose first tensor is not batch-major."""
        tensor = first_tensor(batch)
        if tensor is None or tensor.dim() == 0:
            raise MisconfigurationException(
                f"Cannot tell the batch size of a {type(batch).__name__} batch: override"
                " `sam_batch_size(batch)` (and `sam_subset_batch`) on the module."
            )
        return int(tensor.shape[0])

    def sam_subset_batch(self, batch: Any, index: Tensor, batch_size: int) -> Any:
        """``batch`` restricted to the samples ``index`` (1-D): every tensor whose first
        dimension is ``batch_size``, in dicts, lists and tuples. Override for other types."""
        return subset_batch(batch, index, batch_size)

    def log(self, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``, except that calls from SAM's second pass are dropped."""
        if self._slsam_pass >= 2:
            return
        super().log(*args, **kwargs)  # type: ignore[misc]

    def configure_callbacks(self) -> Any:
        """Refuse Trainer options manual optimization forbids, naming the callback's own."""
        trainer = attached_trainer(self)
        controller = find_sam_callback(trainer)
        if controller is not None and trainer is not None:
            name = type(controller).__name__
            if trainer.gradient_clip_val:
                raise MisconfigurationException(
                    f"`Trainer(gradient_clip_val={trainer.gradient_clip_val})` does not work with"
                    f" a SAM callback. Set `{name}(gradient_clip_val={trainer.gradient_clip_val},"
                    f" gradient_clip_algorithm={trainer.gradient_clip_algorithm or 'norm'!r})`"
                    " instead. See docs/training.md."
                )
            if trainer.accumulate_grad_batches != 1:
                raise MisconfigurationException(
                    f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` does"
                    f" not work with a SAM callback. Set `{name}(accumulate_grad_batches="
                    f"{trainer.accumulate_grad_batches})` instead. See docs/training.md."
                )
        return super().configure_callbacks()  # type: ignore[misc]
