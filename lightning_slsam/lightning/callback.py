"""``SAMCallback``, the Lightning side every SAM method shares: the setup checks, the engine
(seeded alike on every process), per-step logging, the end-of-fit record and the checkpointed
state. The module's :class:`~lightning_slsam.lightning.driver.StepDriver` runs the step.

Example:

>>> from lightning_slsam import SparseLayerSAM
>>> callback = SparseLayerSAM(layer_ratio=0.3, gradient_clip_val=1.0)
>>> callback.spec.layer_ratio, callback.layer_ratio, callback.gradient_clip_val
(0.3, 0.3, 1.0)
>>> callback  # the options that differ from the defaults
SparseLayerSAM(layer_ratio=0.3, gradient_clip_val=1.0)
>>> SparseLayerSAM(accumulate_grad_batches=0)
Traceback (most recent call last):
...
ValueError: SparseLayerSAM: `accumulate_grad_batches` must be an integer >= 1, got 0.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_slsam.core.caller import warn
from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.frontend import follow_trainable, run_seed
from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.core.perturbation import BackupPool
from lightning_slsam.core.record import (
    RATIO_METRIC,
    fit_message,
    fit_summary,
    fresh_stem,
    out_of_sampling,
    record_dir,
    write_record,
)
from lightning_slsam.core.state import (
    CheckpointMismatch,
    apply_method_state,
    differs_by_trainable,
    method_state,
)
from lightning_slsam.core.step import StepResult
from lightning_slsam.lightning.compat import (
    attached_trainer,
)
from lightning_slsam.lightning.driver import LightningOptions, find_sam_callback
from lightning_slsam.lightning.setup_checks import (
    LIGHTNING_OPTIONS,
    FitWarnings,
    check_engine,
    check_fit_setup,
    check_lightning_options,
    check_one_optimizer,
    prepare_compiled,
)
from lightning_slsam.lightning.signatures import ChecksOptions, options_class
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, default_seed
from lightning_slsam.selection.rules import LayerSelection

__all__ = [
    "PROGRESS_BAR",
    "SAMCallback",
    "estimated_stepping_batches",
]


#: A warning from process 0 only, attributed to the user's line (``trainer.fit(...)``).
_warn = rank_zero_only(warn)


def _quiet(message: str) -> None:
    """A ``warn`` that drops the message (a partition rebuilt only to name its tensors)."""


PROGRESS_BAR = {
    "sl_layers": "slsam/active_layers",
    "sl_ratio": "slsam/active_ratio",
    "sl_entropy": "slsam/entropy",
}
#: The progress bar's counts: shown as integers (``sl_layers=19``, not ``19.000``).
PROGRESS_BAR_COUNTS = frozenset({"sl_layers"})


class _Count(int):
    """A progress-bar count: an ``int`` even where the bar shows decimals (Rich's ``.3f``)."""

    def __format__(self, spec: str) -> str:
        if spec[-1:] in tuple("eEfFgG%"):
            spec = spec[:-1].partition(".")[0] + "d"
        return int.__format__(self, spec)


@options_class
class SAMCallback(Callback, ChecksOptions, LightningOptions, MethodOptions):
    """Base of the plugin's SAM methods; use a method class such as ``SparseLayerSAM``.

    A keyword-only dataclass (:func:`~lightning_slsam.lightning.signatures.options_class`) of
    the method's options (``SLSAMOptions`` for ``SparseLayerSAM``, ...) and
    :class:`~lightning_slsam.lightning.driver.LightningOptions`, checked by building
    :attr:`spec` from :attr:`spec_class`. A subclass that adds options is an ``@options_class``.

    Attributes:
        frequency_csv_path, frequency_plot_path: where the end-of-fit record went.
    """

    _options_root: ClassVar[bool] = True  # where accepted_options stops looking
    # The end-of-fit line; off where the lightning-slsam command prints its run summary.
    _fit_message: ClassVar[bool] = True
    #: The method's specification class (its options and how it builds its engine).
    spec_class: ClassVar[type[MethodSpec]] = MethodSpec

    @property
    def method(self) -> str:
        """Short name of the method (its registry key, in logs and checkpoints)."""
        return self.spec_class.name

    def __post_init__(self) -> None:
        # A bad option's message names the class written (a user's subclass too).
        label, name = self.spec_class.label, type(self).__name__
        missing = [n for n in self.spec_class.option_names() if n not in self.__dataclass_fields__]
        if missing:
            raise TypeError(
                f"{name} lacks {label}'s options {missing}: inherit the option dataclass that"
                " declares them and decorate the class with @options_class"
                " (lightning_slsam.lightning.signatures; docs/extending.md)."
            )
        try:
            #: The method's validated options (:class:`~lightning_slsam.methods.spec.MethodSpec`).
            self.spec = self.spec_class(
                **{n: getattr(self, n) for n in self.spec_class.option_names()}
            )
            checked = check_lightning_options(**{n: getattr(self, n) for n in LIGHTNING_OPTIONS})
        except ValueError as err:
            message = str(err).removeprefix(f"{label}: ")
            raise ValueError(f"{name}: {message}") from None
        for key, value in {**self.spec.options(), **checked}.items():
            object.__setattr__(self, key, value)  # as checked (a list of patterns a tuple)
        self.partition: LayerPartition | None = None
        self.engine: SAMEngine | None = None
        self.frequency_csv_path: str | None = None
        self.frequency_plot_path: str | None = None
        self._pending_state: dict[str, Any] | None = None
        self._logged: StepResult | None = None
        self._warnings = FitWarnings()
        #: The coverage check's warning of the last fit (``None``: it passed), for the summary.
        self.coverage_note: str | None = None

    @property
    def update_scale(self) -> float | None:
        """The cap on a drawn layer's update factor ``1 / q`` (``None``: no scaling)."""
        return self.spec.update_scale

    def selection_metrics(self) -> dict[str, float]:
        """Extra per-step metrics of the method's selection (the bandit's floor counts)."""
        return {}

    @property
    def layer_names(self) -> list[str]:
        """Names of the layers, in model order (empty before setup)."""
        return list(self.partition.names) if self.partition is not None else []

    @property
    def selection(self) -> LayerSelection:
        """The layer-selection rule (available after setup)."""
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__} is not set up yet: call trainer.fit first.")
        return self.engine.selection

    @property
    def probs(self) -> Tensor:
        """Current selection probabilities (float64, one per layer)."""
        return self.selection.probs

    @property
    def active_mask(self) -> Tensor | None:
        """Bool mask of the layers updated in the last training step."""
        result = self.engine.last_result if self.engine is not None else None
        return result.active_mask if result is not None else None

    @property
    def mean_active_ratio(self) -> float:
        """The run's mean "Active Ratio": the parameter fraction with a gradient, summed over
        the passes (the paper's measure: AdamW 1.0, SAM 2.0)."""
        return self.engine.mean_active_ratio if self.engine is not None else math.nan

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_fit_setup(self, trainer, pl_module)
        self._warnings.add()  # for this fit only: removed at teardown

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._warnings.remove()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_one_optimizer(self, trainer)
        prepare_compiled(
            type(self).__name__, pl_module, self.spec.samples_layers, rank_zero_info, _warn
        )
        partition = self.spec.partition(pl_module, warn=_warn)
        old = self.partition
        if self.engine is not None and old is not None and old.signature() == partition.signature():
            self.engine.partition = partition  # a second fit() continues the same state
        else:
            self.engine = self._build_engine(partition, pl_module)
        self.partition = partition
        check_engine(self, trainer, pl_module, self.engine)
        try:  # before the first step
            self.engine.parts.check_optimizer(trainer.optimizers[0])
        except ValueError as err:
            raise MisconfigurationException(str(err)) from None
        # A checkpoint of other trainable tensors waits for the first batch (epoch-start
        # hooks, such as a finetuning callback's unfreezing, set the trainable set).
        if self._pending_state is not None and not differs_by_trainable(
            self._pending_state, self.partition
        ):
            state, self._pending_state = self._pending_state, None
            self._apply_state(state)
        self._logged = self.engine.last_result  # a second fit() logs its own steps only
        if trainer.ckpt_path is None:  # before any progress bar: the warning has its own line
            self._check_coverage(trainer)

    def _build_engine(self, partition: LayerPartition, module: torch.nn.Module) -> SAMEngine:
        trainer = attached_trainer(module)
        several = trainer is not None and trainer.world_size > 1
        seed = run_seed(
            self.spec.seed, default_seed, trainer.strategy.broadcast if several else None
        )
        try:
            return self.spec.build_engine(module, seed=seed, partition=partition, warn=_warn)
        except ValueError as err:  # options that do not fit this model or run
            raise MisconfigurationException(str(err)) from None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.engine is not None:  # a schedule over the run (ARWP's noise) reads it
            self.engine.planned_steps = estimated_stepping_batches(trainer)
        if trainer.ckpt_path is not None:  # resumed: the steps left are known from here on
            self._check_coverage(trainer)

    def _check_coverage(self, trainer: pl.Trainer) -> None:
        # Too few updates per sampled layer (selection.coverage); kept for the summary.
        self.coverage_note = None
        if self.engine is None:
            return
        steps = estimated_stepping_batches(trainer) - trainer.global_step
        self.coverage_note = self.spec.coverage_warning(self.engine, steps, type(self).__name__)
        if self.coverage_note is not None:
            _warn(self.coverage_note)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Runs inside the wrapped optimizer.step(), after mixed precision has unscaled: the
        # driver clips there, before the callbacks listed after this one see the gradients.
        driver = getattr(pl_module, "_slsam_driver", None)
        if driver is not None and self.gradient_clip_val:
            driver.clip_gradients(optimizer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Between steps every partition tensor is trainable: a difference is the model's
        # (or another callback's) own change of its trainable set.
        engine = self.engine
        if engine is not None and engine.freezer.trainable_changed(pl_module):
            self._follow_trainable(trainer, pl_module)
        if self._pending_state is not None and self.engine is not None:
            state, self._pending_state = self._pending_state, None
            self._apply_state(state)
            self._logged = self.engine.last_result

    def _follow_trainable(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.engine is not None
        followed = follow_trainable(self.spec, self.engine, pl_module, _warn, type(self).__name__,
                                    trainer.global_step, MisconfigurationException)  # fmt: skip
        if followed is None:
            return
        engine, line = followed
        check_engine(self, trainer, pl_module, engine)
        self.engine, self.partition = engine, engine.partition
        rank_zero_info(line)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        result = self.engine.last_result if self.engine is not None else None
        if result is None or result is self._logged:
            return  # no step yet, or a micro-batch buffered for accumulation
        self._logged = result
        metrics = self.engine.step_metrics(result, distributed=trainer.world_size > 1)
        metrics.update(self.selection_metrics())
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        # Short names for the progress bar only. log() makes floats, so the counts go into
        # the bar's dict as ints (kept there until the next fit).
        for name, key in PROGRESS_BAR.items():
            count = name in PROGRESS_BAR_COUNTS
            pl_module.log(name, metrics[key], prog_bar=not count, logger=False, batch_size=1)
            if count:
                trainer.progress_bar_metrics[name] = _Count(round(metrics[key]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.engine is None or self.partition is None:
            return
        self.engine.perturbation.pool = BackupPool()  # the weight backups are not needed now
        # trainer.log_dir is a collective under DDP: every rank asks, rank 0 writes.
        directory = record_dir(trainer)
        if trainer.is_global_zero and self.engine.sampled():
            self.frequency_csv_path, self.frequency_plot_path = write_record(
                fresh_stem(directory, versioned=not trainer.loggers),
                self.engine,
                self.partition,
                plot=self.plot,
                title=f"{type(self).__name__}: how often each layer was trained",
                layer_ratio=getattr(self.spec, "layer_ratio", None),
            )
        # Also in callback_metrics: under ddp_spawn, what the launching process gets back.
        trainer.callback_metrics[RATIO_METRIC] = torch.tensor(self.mean_active_ratio)
        if self._fit_message:
            rank_zero_info(fit_message(type(self).__name__, self.engine, self.frequency_plot_path))

    def summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """After ``fit``: the run's mean active ratio, per-layer chart and ``out_of_sampling``
        tensors, in the process that called ``fit`` under ``ddp_spawn`` too."""
        partition = self.partition or self.spec.partition(trainer.lightning_module, warn=_quiet)
        summary = fit_summary(trainer, self.mean_active_ratio, self.frequency_plot_path)
        return {**summary, "out_of_sampling": out_of_sampling(partition)}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning files a callback's state under its class name: an earlier version's
        # state (no "tensor_names") filed under another class's name does not resume.
        states = checkpoint.get("callbacks") or {}
        old = [k for k, v in states.items() if isinstance(v, dict) and "engine" in v
               and "method" in v and "tensor_names" not in v]  # fmt: skip
        if self.state_key not in states and old:
            raise MisconfigurationException(
                f"{type(self).__name__}: the checkpoint's SAM state was saved by"
                f" lightning-slsam 0.2 or earlier under the class name {old[0]!r}, and does"
                " not resume under another (no migration before 1.0: docs/changelog.md)."
            )

    def state_dict(self) -> dict[str, Any]:
        if self.engine is None or self.partition is None or self._pending_state is not None:
            return dict(self._pending_state or {})
        return method_state(self.method, self.spec, self.engine)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.engine is None:
            self._pending_state = state_dict  # applied once the partition exists
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        assert self.engine is not None and self.partition is not None
        try:
            apply_method_state(
                state, self.engine, owner=type(self).__name__, spec=self.spec,
                warn=_warn, preset=getattr(self, "preset", None),
            )  # fmt: skip
        except CheckpointMismatch as err:
            raise MisconfigurationException(str(err)) from None


def estimated_stepping_batches(trainer: pl.Trainer) -> float:
    """``trainer.estimated_stepping_batches``, counting the SAM callback's own
    ``accumulate_grad_batches`` (the Trainer's stays 1): use it to size step-based LR
    schedules. ``math.inf`` for a run of no finite length."""
    total = trainer.estimated_stepping_batches  # also sets up the train dataloader
    sam = find_sam_callback(trainer)
    k = sam.accumulate_grad_batches if sam is not None else 1
    if k == 1 or not math.isfinite(total):
        return total
    batches = trainer.num_training_batches
    if not math.isfinite(batches):
        return total if trainer.max_steps != -1 else math.inf
    per_epoch = math.ceil(batches / k)  # the epoch's last batch closes a partial group
    steps = per_epoch * max(trainer.max_epochs or 1, 1)
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps
