"""``SAMCallback``: what every SAM method of the plugin shares on the Lightning side.

Each method (:mod:`lightning_slsam.methods`: SL-SAM, SAM, RST, ESAM, ...) is a subclass
that chooses its layer selection, perturbation and schedule; this base class owns the
rest: the layer partition, the engine, gradient accumulation and clipping, what is logged,
the end-of-fit record and the checkpointed state. The :class:`~lightning_slsam.SAMMixin`
on the module runs the training step through it.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import inspect
import math
import os
import re
import typing
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_slsam.checks import check_choice, check_flag
from lightning_slsam.compat import (
    attached_trainer,
    epoch_ends_with_this_batch,
    gradient_scaler,
    is_compiled,
    loss_scale_reader,
)
from lightning_slsam.dense_specs import SAMSpec
from lightning_slsam.distributed import GradientAverager
from lightning_slsam.engine import SparseSAMEngine, StepContext, StepResult
from lightning_slsam.layers import LayerPartition
from lightning_slsam.metrics import (
    normalized_entropy,
    plot_layer_frequency,
    write_layer_frequency_csv,
)
from lightning_slsam.mixin import SAMMixin, scheduler_configs
from lightning_slsam.perturbation import BackupPool
from lightning_slsam.selection import LayerSelection
from lightning_slsam.specs import SCHEDULES, MethodSpec, default_seed

__all__ = ["SCHEDULES", "SAMCallback", "estimated_stepping_batches"]

_CLIP_ALGORITHMS = ("norm", "value")
#: The options of the Lightning layer alone (the method's own are its spec's fields).
_LIGHTNING_OPTIONS: dict[str, tuple[Any, Any]] = {
    "gradient_clip_val": (float | None, None),
    "gradient_clip_algorithm": (str, "norm"),
    "accumulate_grad_batches": (int, 1),
    "plot": (bool, True),
}
_PROGRESS_BAR = {
    "sl_layers": "slsam/active_layers",
    "sl_ratio": "slsam/active_ratio",
    "sl_entropy": "slsam/entropy",
}


#: Strategies that shard or wrap parameters, refused at setup on any number of devices.
_SHARDED_STRATEGIES = {"DeepSpeedStrategy", "XLAStrategy", "FSDPStrategy", "ModelParallelStrategy"}

#: Lightning warnings that do not apply under a SAM callback, silenced during its fit only.
#: ModelCheckpoint warns that step checkpoints under manual optimization hold the post-step
#: weights: that is what automatic optimization saves too, and the mixin restores the
#: unperturbed weights before stepping. Lightning also warns that scheduler `monitor` and
#: `strict` keys are ignored; the mixin honours them.
_FIT_WARNINGS = (
    ("Using ModelCheckpoint with manual optimization", UserWarning),
    ("The lr scheduler dict contains the key", RuntimeWarning),
)


_RECORD_STEM = "slsam_layer_frequency"
_RATIO_METRIC = "slsam/mean_active_ratio"


def _record_dir(trainer: pl.Trainer) -> str:
    """Where the end-of-fit record goes: the logger's folder, or without a logger
    ``<default_root_dir>/slsam_records`` (one ``version_N`` folder per run)."""
    if trainer.loggers:
        return trainer.log_dir or trainer.default_root_dir
    return os.path.join(trainer.default_root_dir, "slsam_records")


def _fresh_stem(directory: str, versioned: bool) -> str:
    """A path stem for the record that overwrites no earlier run's: a new ``version_N``
    folder, or a ``_N`` suffix when the folder holds a record already."""
    if versioned:
        taken = glob.glob(os.path.join(directory, "version_*"))
        numbers = [int(m.group(1)) for p in taken if (m := re.search(r"version_(\d+)$", p))]
        directory = os.path.join(directory, f"version_{max(numbers, default=-1) + 1}")
    os.makedirs(directory, exist_ok=True)
    stem, k = os.path.join(directory, _RECORD_STEM), 0
    while os.path.exists(stem + ".csv") or os.path.exists(stem + ".png"):
        k += 1
        stem = os.path.join(directory, f"{_RECORD_STEM}_{k}")
    return stem


def accepted_options(cls: type) -> list[str]:
    """The keyword options ``cls(...)`` accepts: the named parameters of its ``__init__``,
    and of the base classes' while an ``__init__`` passes ``**kwargs`` on (a user's
    subclass may); a generated ``__init__`` names every option itself."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        for param in params:
            keyword = param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            if keyword and param.name not in ("self", *names):
                names.append(param.name)
        if klass is SAMCallback or not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def check_options(cls: type, options: dict[str, Any]) -> None:
    """Raise a ``TypeError`` naming ``cls``, the unknown option and the closest valid one."""
    accepted = accepted_options(cls)
    for key in options:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else f"valid options: {', '.join(sorted(accepted))}."
            )
            raise TypeError(f"{cls.__name__} has no option {key!r}; {hint}")


def _shell_init(cls: type[SAMCallback]) -> Callable[..., None]:
    """``cls.__init__``: keyword options, its spec's fields then the Lightning options, with
    a signature naming each (which jsonargparse and ``help()`` read)."""

    def __init__(self: SAMCallback, **options: Any) -> None:
        SAMCallback.__init__(self, **options)

    hints = typing.get_type_hints(cls.spec_class)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(cls.spec_class):
        if f.init:
            params.append(
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                  annotation=hints[f.name])
            )  # fmt: skip
    for name, (annotation, default) in _LIGHTNING_OPTIONS.items():
        params.append(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                              annotation=annotation)
        )  # fmt: skip
    __init__.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    spec_name = cls.spec_class.__name__
    __init__.__doc__ = f"Options of {cls.__name__}: see the class and :class:`{spec_name}`."
    return __init__


def _args_section(doc: str | None) -> dict[str, str]:
    """The entries of a Google-style docstring's ``Args:`` section, by option name."""
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Args:" not in lines:
        return {}
    entries: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Args:") + 1 :]:
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name is not None and line.strip():
            entries[name] += " " + line.strip()
    return entries


def _with_options_doc(cls: type[SAMCallback]) -> str:
    """``cls``'s docstring with an ``Args:`` section for every option: the spec's fields
    (documented on the spec classes) and the Lightning options (on :class:`SAMCallback`),
    so that ``help()`` and the CLI's ``--help`` describe each one."""
    known: dict[str, str] = {}
    for klass in cls.spec_class.__mro__:
        for key, text in _args_section(klass.__doc__).items():
            known.setdefault(key, text)
    known.update(_args_section(SAMCallback.__doc__))
    names = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    entries = [f"    {n}: {known[n]}" if n in known else f"    {n}: see {cls.spec_class.__name__}."
               for n in names]  # fmt: skip
    return inspect.cleandoc(cls.__doc__ or "") + "\n\nArgs:\n" + "\n".join(entries) + "\n"


class _ChecksOptions:
    """Names an unknown option with the class the user wrote (Python's own error would
    name ``SAMCallback.__init__``, where the keywords end up), with the closest valid name.

    A base of its own rather than ``SAMCallback.__new__``: jsonargparse reads a class's own
    ``__new__`` as its signature, and would then accept none of ``SAMCallback``'s options
    passed on by a subclass's ``**kwargs``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            check_options(cls, kwargs)
        return super().__new__(cls)


class SAMCallback(Callback, _ChecksOptions):
    """Base of the plugin's SAM methods; use a method class such as ``SparseLayerSAM``.

    A thin Lightning shell over the method's specification (:attr:`spec_class`, pure
    PyTorch): the method's options are the spec's fields -- the options every method takes
    are :class:`~lightning_slsam.specs.MethodSpec`'s -- and the callback reads them from
    it (``callback.rho``, ``callback.layer_ratio``, ...). Its own options, for the Lightning
    training step:

    Args:
        gradient_clip_val: clip the update gradient at this value after unscaling;
            ``None`` or 0 disables. Use this instead of the Trainer flag.
        gradient_clip_algorithm: ``"norm"`` (default) or ``"value"``.
        accumulate_grad_batches: micro-batches per optimizer step (>= 1). Use this
            instead of the Trainer flag: every pass runs over all micro-batches.
        plot: write the per-layer activation chart (PNG) at the end of fit.

    Attributes:
        layer_names: names of the layers, in model order (after setup).
        probs: the selection's current probabilities (float64).
        active_mask: bool mask of the layers updated in the last step.
        mean_active_ratio: mean over steps of the parameter fraction with a gradient,
            summed over the passes (the paper's "Active Ratio": AdamW 1.0, SAM 2.0).
        frequency_csv_path, frequency_plot_path: where the end-of-fit record went.
    """

    #: Short name of the method (registry key, logs).
    method: ClassVar[str] = "sam"
    #: The method's own schedule, used when ``schedule`` is ``None``.
    default_schedule: ClassVar[str] = "every_step"
    #: Whether another ``schedule`` may be chosen (RST, LookSAM and S2 methods fix theirs).
    schedule_fixed: ClassVar[bool] = False

    #: The method's specification class (its options and how it builds its engine).
    spec_class: ClassVar[type[MethodSpec]] = SAMSpec

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The spec's class-level facts, readable on the callback class too.
        cls.method = cls.spec_class.name
        cls.default_schedule = cls.spec_class.default_schedule
        cls.schedule_fixed = cls.spec_class.schedule_fixed
        if "__init__" not in cls.__dict__:
            cls.__init__ = _shell_init(cls)  # type: ignore[method-assign]
            cls.__doc__ = _with_options_doc(cls)

    def __init__(self, **options: Any) -> None:
        super().__init__()
        lightning = {k: options.pop(k, default) for k, (_, default) in _LIGHTNING_OPTIONS.items()}
        #: The method's validated options (:class:`~lightning_slsam.specs.MethodSpec`).
        self.spec = self.spec_class(**options)
        clip, algorithm = lightning["gradient_clip_val"], lightning["gradient_clip_algorithm"]
        if clip is not None and not (isinstance(clip, (int, float)) and clip >= 0):
            raise ValueError(f"`gradient_clip_val` must be None or a number >= 0, got {clip!r}.")
        check_choice("gradient_clip_algorithm", algorithm, _CLIP_ALGORITHMS)
        accumulate = lightning["accumulate_grad_batches"]
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"`accumulate_grad_batches` must be an integer >= 1, got {accumulate!r}."
            )
        self.gradient_clip_val = clip
        self.gradient_clip_algorithm = algorithm
        self.accumulate_grad_batches = accumulate
        self.plot = check_flag("plot", lightning["plot"])
        self._averager: GradientAverager | None = None
        self.partition: LayerPartition | None = None
        self.engine: SparseSAMEngine | None = None
        self.frequency_csv_path: str | None = None
        self.frequency_plot_path: str | None = None
        self._pending_state: dict[str, Any] | None = None
        self._buffer: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._fresh: StepResult | None = None
        self._warning_filters: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        # The method's options and derived values (``rho``, ``layer_ratio``,
        # ``effective_ratio``, ...) are read from its spec.
        spec = self.__dict__.get("spec") if not name.startswith("__") else None
        if spec is None or name == "spec":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(spec, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            ) from None

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps the run will take (set at fit start; ``None`` if unknown)."""
        return self.spec.total_steps

    # -- what each method logs ------------------------------------------------------------
    def selection_metrics(self) -> dict[str, float]:
        """Extra per-step metrics of the method's selection (the bandit's floor counts)."""
        return {}

    # -- public views -------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        """Names of the layers (empty before setup)."""
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
        """The run's mean "Active Ratio" (parameter fraction, summed over the passes)."""
        return self.engine.mean_active_ratio if self.engine is not None else math.nan

    # -- setup --------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        name = type(self).__name__
        if not isinstance(pl_module, SAMMixin):
            raise MisconfigurationException(
                f"{name} needs the LightningModule to inherit SAMMixin, but"
                f" {type(pl_module).__name__} does not. Declare it as"
                f" `class {type(pl_module).__name__}(SAMMixin, L.LightningModule)`"
                " (`from lightning_slsam import SAMMixin`)."
            )
        strategy = trainer.strategy
        bases = {cls.__name__ for cls in type(strategy).__mro__}
        sharded = bases & _SHARDED_STRATEGIES
        # A sharded strategy is refused on one device too: its wrapping (flat parameters,
        # DTensors, ZeRO partitions) is there whatever the world size.
        if sharded or (trainer.world_size > 1 and not isinstance(strategy, DDPStrategy)):
            raise MisconfigurationException(
                f"{name} does not support {type(strategy).__name__}: SAM methods perturb,"
                " back up and restore whole parameter tensors between two passes and sync"
                " the active layers' gradients themselves, which sharded strategies (FSDP,"
                " DeepSpeed ZeRO, model parallel, XLA) do not allow. Use strategy='ddp' or"
                " 'ddp_spawn' (any precision, gradient accumulation and clipping work there),"
                " or a single device."
            )
        # The filters hold for this fit only (removed at teardown): other Trainers in the
        # process still see these warnings.
        self._remove_warning_filters()
        for message, category in _FIT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
            self._warning_filters.append(warnings.filters[0])
        others = [cb for cb in trainer.callbacks if isinstance(cb, SAMCallback)]
        if len(others) > 1:
            raise MisconfigurationException(
                f"{len(others)} SAM callbacks are attached to the Trainer"
                f" ({', '.join(type(cb).__name__ for cb in others)}); keep exactly one."
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_warning_filters()

    def _remove_warning_filters(self) -> None:
        for entry in self._warning_filters:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        self._warning_filters = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationException(
                f"{type(self).__name__} steps one optimizer, but configure_optimizers returned"
                f" {len(trainer.optimizers)}. Put all parameters in one optimizer (use"
                " parameter groups for different learning rates)."
            )
        trainer.strategy.lr_scheduler_configs = scheduler_configs(pl_module, trainer)
        if self.spec.needs_total_steps():
            total = estimated_stepping_batches(trainer)
            self.spec.total_steps = int(total) if math.isfinite(total) else None
        partition = self._partition(pl_module)
        if (
            self.engine is not None
            and self.partition is not None
            and (self.partition.signature() == partition.signature())
        ):
            self.engine.partition = partition  # a second fit() continues the same state
        else:
            self.engine = self._build_engine(partition, pl_module, self.spec.total_steps)
        self.partition = partition
        self._averager = GradientAverager() if trainer.world_size > 1 else None
        if not self.engine.selection.always_all and is_compiled(pl_module):
            raise MisconfigurationException(
                f"{type(self).__name__} freezes a different set of layers every step, and"
                " torch.compile guards on requires_grad: the compiled model would be"
                " recompiled for each new set until torch._dynamo's recompile limit, then"
                " run uncompiled. Train this method without torch.compile; the dense methods"
                " (SAM, S2SAM, RST, LookSAM, SSAMF) compile once and work with it."
            )
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._apply_state(state)
        self._buffer = []

    def build_engine(
        self, module: torch.nn.Module, total_steps: int | None = None
    ) -> SparseSAMEngine:
        """This method's engine for ``module`` (what ``fit`` builds at its start).

        For plain PyTorch loops and benchmarks, ``SparseSAMEngine.from_method(name, module,
        ...)`` builds the same without Lightning. ``total_steps``: the run's optimizer steps,
        needed by options given as a fraction of the run (``dense_warmup``).
        """
        if total_steps is not None and not (isinstance(total_steps, int) and total_steps >= 1):
            raise ValueError(f"`total_steps` must be None or an integer >= 1, got {total_steps!r}.")
        return self._build_engine(self._partition(module), module, total_steps)

    def _partition(self, module: torch.nn.Module) -> LayerPartition:
        return self.spec.partition(module, warn=rank_zero_warn)

    def _build_engine(
        self, partition: LayerPartition, module: torch.nn.Module, total_steps: int | None
    ) -> SparseSAMEngine:
        seed = self.spec.seed if self.spec.seed is not None else default_seed()
        trainer = self._trainer_of(module)
        if trainer is not None and trainer.world_size > 1:
            # Every process must draw the same layers and coins: rank 0's seed for all.
            seed = trainer.strategy.broadcast(seed)
        try:
            return self.spec.build_engine(
                module, total_steps=total_steps, seed=seed, partition=partition,
                warn=rank_zero_warn,
            )  # fmt: skip
        except ValueError as err:  # options that do not fit this model or run
            raise MisconfigurationException(str(err)) from None

    @staticmethod
    def _trainer_of(module: torch.nn.Module | None) -> pl.Trainer | None:
        return attached_trainer(module)

    # -- the step (called by SAMMixin) ------------------------------------------------------
    def _accumulate(
        self, trainer: pl.Trainer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | None:
        """Buffer a micro-batch; return the whole group once it is complete.

        The epoch's last batch closes a partial group, as Lightning's own accumulation does.
        """
        self._buffer.append((args, kwargs))
        last = epoch_ends_with_this_batch(trainer)
        if len(self._buffer) < self.accumulate_grad_batches and not last:
            return None
        group, self._buffer = self._buffer, []
        return group

    def _run_step(
        self,
        pl_module: pl.LightningModule,
        forward_backward: Callable[..., Any],
        zero_grad: Callable[[], None],
        optimizer_step: Callable[[bool], None],
    ) -> StepResult:
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__} ran a step before on_fit_start.")
        context = StepContext(
            grad_scale=loss_scale_reader(gradient_scaler(pl_module.trainer)),
            averager=self._averager,
        )
        result = self.engine.step(forward_backward, zero_grad, optimizer_step, context)
        self._fresh = result
        return result

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Runs inside the wrapped optimizer.step(), after mixed precision has unscaled.
        if self.gradient_clip_val:
            pl_module.clip_gradients(
                optimizer,
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
            )

    # -- logging ------------------------------------------------------------------------
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        result, self._fresh = self._fresh, None
        if result is None or self.engine is None:
            return
        per_pass = [*result.active_ratio_per_pass, 0.0, 0.0]
        metrics = {
            "slsam/active_layers": float(result.active_mask.sum()),
            "slsam/active_ratio": result.active_ratio,
            "slsam/active_ratio_pass1": per_pass[0],
            "slsam/active_ratio_pass2": per_pass[1],
            "slsam/backward_passes": float(result.num_backward),
            "slsam/sam_step": float(result.kind in ("sam", "single")),
            "slsam/entropy": normalized_entropy(self.engine.selection.probs),
            "slsam/never_selected": float(self.engine.never_selected()),
            "slsam/skipped_steps": float(self.engine.num_skipped),
        }
        metrics.update(self.selection_metrics())
        if self._averager is not None:
            metrics["slsam/allreduce_bytes"] = float(result.allreduce_bytes)
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        # Short names for the progress bar only (loggers get the namespaced ones above).
        for name, key in _PROGRESS_BAR.items():
            pl_module.log(name, metrics[key], prog_bar=True, logger=False, batch_size=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.perturbation.pool = BackupPool()  # the weight backups are not needed after fit
        if self.engine is None or self.partition is None:
            return
        # trainer.log_dir is a collective under DDP: every rank asks, rank 0 writes.
        directory = _record_dir(trainer)
        if trainer.is_global_zero:
            self._write_record(_fresh_stem(directory, versioned=not trainer.loggers))
        # The summary also goes to callback_metrics: under ddp_spawn they are what the
        # launching process gets back (see summary()).
        trainer.callback_metrics[_RATIO_METRIC] = torch.tensor(self.mean_active_ratio)
        engine = self.engine
        message = (
            f"{type(self).__name__}: mean active ratio {self.mean_active_ratio:.3f}x over the"
            " passes (SAM: 2.0x, AdamW: 1.0x),"
            f" {self.partition.num_layers} layers, {engine.never_selected()} never"
            f" selected, {engine.num_skipped} skipped steps."
        )
        if self.frequency_plot_path:
            message += f" Per-layer activation chart: {self.frequency_plot_path}"
        rank_zero_info(message)

    def summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The run's mean active ratio and per-layer chart, after ``fit``.

        Works in the process that called ``fit`` under ``ddp_spawn`` too, where the training
        ran in child processes: the ratio then comes from ``trainer.callback_metrics`` and
        the chart is the newest one in the run's record folder.
        """
        ratio, chart = self.mean_active_ratio, self.frequency_plot_path
        if math.isnan(ratio) and _RATIO_METRIC in trainer.callback_metrics:
            ratio = float(trainer.callback_metrics[_RATIO_METRIC])
        if chart is None and not math.isnan(ratio):
            found = glob.glob(
                os.path.join(_record_dir(trainer), "**", f"{_RECORD_STEM}*.png"), recursive=True
            )
            chart = max(found, key=os.path.getmtime) if found else None
        return {"mean_active_ratio": ratio, "layer_frequency_png": chart}

    def _write_record(self, stem: str) -> None:
        assert self.engine is not None and self.partition is not None
        steps = self.engine.num_steps - self.engine.num_skipped
        probs = self.engine.selection.probs
        self.frequency_csv_path = write_layer_frequency_csv(
            stem + ".csv",
            self.partition.names,
            self.partition.numel,
            self.engine.counts,
            steps,
            probs,
            self.engine.mean_norms(),
        )
        if self.plot:
            self.frequency_plot_path = plot_layer_frequency(
                stem + ".png",
                self.partition.names,
                self.engine.counts,
                steps,
                probs,
                float(probs.mean()),
                title=f"{type(self).__name__}: how often each layer was trained",
            )

    # -- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.engine is None or self.partition is None:
            return dict(self._pending_state or {})
        return {
            "method": self.method,
            "engine": self.engine.state_dict(),
            "layer_names": self.partition.names,
            "layer_tensors": self.partition.signature(),
            "config": self.spec.hyperparameters(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.engine is None:
            self._pending_state = state_dict  # applied once the partition exists
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        assert self.engine is not None and self.partition is not None
        saved = state.get("layer_tensors")
        current = self.partition.signature()
        if saved is not None and saved != current:
            raise MisconfigurationException(
                f"The checkpoint's {type(self).__name__} state does not match this model's"
                f" layers: {_describe_mismatch(saved, current)}. Resume with the same model"
                " and `layers` / `always_active` / `always_frozen` options, or start the SAM"
                " state afresh by resuming without it."
            )
        engine_state = dict(state["engine"])
        engine_state["selection"] = self.spec.adopt_selection_state(
            engine_state["selection"], self.selection.state_dict(), rank_zero_warn
        )
        self.engine.load_state_dict(engine_state)


def find_sam_callback(trainer: pl.Trainer) -> SAMCallback | None:
    """The SAM callback attached to ``trainer`` (setup refuses more than one), if any."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, SAMCallback)), None)


def estimated_stepping_batches(trainer: pl.Trainer) -> float:
    """``trainer.estimated_stepping_batches``, counting the SAM callback's accumulation.

    Lightning's estimate divides by ``Trainer(accumulate_grad_batches)``, which must stay 1
    with a SAM callback; the callback's ``accumulate_grad_batches`` also merges micro-batches
    into one optimizer step. Use this to size step-based LR schedules
    (``math.inf`` when the run has no finite length).
    """
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


def _describe_mismatch(saved: list[list[str]], current: list[list[str]]) -> str:
    saved_set = {name for group in saved for name in group}
    current_set = {name for group in current for name in group}
    missing = sorted(saved_set - current_set)
    added = sorted(current_set - saved_set)
    parts = [f"checkpoint has {len(saved)} layers, model has {len(current)}"]
    if missing:
        parts.append(f"missing from the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if added:
        parts.append(f"new in the model: {added[:5]}{' ...' if len(added) > 5 else ''}")
    if not missing and not added:
        parts.append("the same tensors are grouped into layers differently")
    return "; ".join(parts)
