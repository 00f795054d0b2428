"""Methods as pure-PyTorch specifications: a name plus validated options.

A :class:`MethodSpec` holds one method's options, checked once when it is built, and
builds the method's parts -- the layer partition, the selection, the schedule, the
perturbation and the optional extras -- and from them the
:class:`~lightning_slsam.SparseSAMEngine`. No Lightning anywhere: the Lightning callbacks
(:mod:`lightning_slsam.lightning.callbacks`) are thin shells over these, and a plain PyTorch loop
uses them directly::

    engine = make_engine("slsam", model, layer_ratio=0.2)
    for batch in loader:
        engine.train_step(lambda: loss_fn(model, batch), optimizer)

Each option is stated once, as a field of its spec class; the options every method
takes are :class:`MethodSpec`'s.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from lightning_slsam.core.engine import SparseSAMEngine
from lightning_slsam.core.partition import (
    LayerPartition,
    LayerSpec,
    build_partition,
    find_new_head,
    validate_layer_spec,
)
from lightning_slsam.core.perturbation import SAMPerturbation
from lightning_slsam.core.running import BN_STATS
from lightning_slsam.core.schedules import (
    EveryStep,
    IntervalSchedule,
    RandomSchedule,
    Schedule,
    SingleStepSchedule,
)
from lightning_slsam.core.step_kinds import SAMStep, StepKind
from lightning_slsam.core.step_parts import StepHook
from lightning_slsam.core.validation import check_choice, check_flag
from lightning_slsam.methods.looksam import LookSAMReuse
from lightning_slsam.selection.rules import AllLayers, LayerSelection

__all__ = ["ASAM_RHO", "SAM_RHO", "SCHEDULES", "MethodSpec", "default_seed"]

#: The step-kind schedules a method can run (``schedule`` option).
SCHEDULES = ("every_step", "random", "interval", "single")
#: Default radius of SAM (the SL-SAM paper's, for every method) and of ASAM (its reference's).
SAM_RHO = 0.01
ASAM_RHO = 0.5

Warn = Callable[[str], None]


def default_seed() -> int:
    """The run's seed: ``seed_everything``'s when set (it survives later ``manual_seed``
    calls, e.g. in model constructors, and is what DDP workers are seeded with), else
    ``torch.initial_seed()``."""
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value not in (None, "") else torch.initial_seed()


def make_schedule(
    name: str, probability: float, interval: int, alpha: float, generator: torch.Generator | None
) -> Schedule:
    """The step-kind schedule called ``name`` (see :data:`SCHEDULES`)."""
    if name == "random":
        return RandomSchedule(probability, generator)
    if name == "interval":
        return IntervalSchedule(interval, alpha)
    if name == "single":
        return SingleStepSchedule()
    return EveryStep()


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


@dataclass(kw_only=True, eq=False)
class MethodSpec:
    """The options every method takes (SAM on every layer when used as is).

    Args:
        rho: SAM perturbation radius (> 0). ``None`` (default): 0.01, the SL-SAM paper's
            value for every method, or 0.5 with ``adaptive=True`` (ASAM's reference radius,
            which is relative to the weights).
        adaptive: ASAM's weight-scaled perturbation ``rho * T_w^2 g / ||T_w g||`` with
            ``T_w = |w| + adaptive_eta`` on weight tensors and 1 on biases (Kwon et al.,
            2021, as their reference code); default ``False``.
        adaptive_eta: ASAM's ``eta`` (>= 0; default 0.01, its reference value).
        perturbation_norm: ``"global"`` (default; one norm over all perturbed tensors,
            as SAM) or ``"layer"`` (one norm per layer, as SL-SAM's Algorithm 1 reads).
        layers: what a layer is: ``"tensor"`` (default, paper), ``"module"``, a list of
            regular expressions (one group per distinct match) or a callable
            ``(name, param) -> key | None``.
        always_active: regular expressions of parameter names trained every step.
        always_frozen: regular expressions of parameter names never trained.
        head_always_active: also train the model's freshly initialised task head every
            step (found by :func:`~lightning_slsam.core.partition.find_new_head`: timm and
            Transformers classifiers, or the module's ``sam_head_parameters()``). Default
            ``False`` (the paper samples the head like any layer).
        vectors_always_active: also train every 1-D parameter tensor (biases and
            normalisation weights) every step. Their gradients cost almost nothing next to
            a matrix's, but as sampled layers they take a share of the layer budget.
            Default ``False`` (the paper samples them like any layer).
        schedule: the iteration axis: ``"every_step"`` (SAM every step), ``"random"``
            (RST's coin, ``sam_probability``), ``"interval"`` (LookSAM: SAM every
            ``sam_interval`` steps, the stored SAM component reused in between with weight
            ``looksam_alpha``) or ``"single"`` (single-step SAM: perturb along the previous
            step's gradient, one pass per step). ``None`` (default): the method's own.
        sam_probability: with ``schedule="random"``, chance of a SAM step (RST: 0.5).
        sam_interval: with ``schedule="interval"``, steps between SAM steps (LookSAM: 5).
        looksam_alpha: with ``schedule="interval"``, weight of the reused component
            (LookSAM: 0.7; 0 makes the steps in between plain steps).
        seed: seed of the method's own generators (layer sampling, RST's coin); ``None``
            uses the seed given to ``seed_everything`` (``PL_GLOBAL_SEED``), else
            ``torch.initial_seed()``.
        bn_stats: which pass's BatchNorm running statistics a SAM step keeps:
            ``"first"`` (default; the unperturbed pass, as official SAM code),
            ``"second"`` or ``"both"`` (updated twice, as the SL-SAM reference code).
        replay_dropout: give the second pass the first pass's dropout masks (default
            ``False``: fresh masks, as official SAM code).
        sync_first_pass: under multi-process training, average the first pass's gradient
            across processes before the ascent (default). ``False``: every process perturbs
            with its own gradient (SAM's m-sharpness); only the per-layer norms are averaged.
        check_masks: debug mode for multi-process training: every step, check that all
            processes drew the same layers and step kind. Default ``False``.
        dense_one_pass: with ``schedule="random"`` or ``"interval"``, the steps that run
            one pass train every layer; only the SAM steps are sparse. Default ``False``.

    Example:
        >>> import torch
        >>> spec = MethodSpec(adaptive=True)  # ASAM
        >>> spec.rho, spec.schedule  # resolved: ASAM's radius, the method's schedule
        (0.5, 'every_step')
        >>> engine = spec.build_engine(torch.nn.Linear(4, 2), seed=0)
        >>> type(engine.selection).__name__, engine.perturbation.adaptive
        ('AllLayers', True)
        >>> MethodSpec(bn_stats="third")
        Traceback (most recent call last):
        ...
        ValueError: `bn_stats` must be one of ('first', 'second', 'both'), got 'third': ...
    """

    #: Registry name of the method.
    name: ClassVar[str] = "sam"
    #: The class name users write (the Lightning callback's), used in messages.
    label: ClassVar[str] = "SAM"
    #: The method's own schedule, used when ``schedule`` is ``None``.
    default_schedule: ClassVar[str] = "every_step"
    #: Whether another ``schedule`` may be chosen (RST, LookSAM and S2 methods fix theirs).
    schedule_fixed: ClassVar[bool] = False

    rho: float | None = None
    adaptive: bool = False
    adaptive_eta: float = 0.01
    perturbation_norm: str = "global"
    layers: LayerSpec = "tensor"
    always_active: Sequence[str] = ()
    always_frozen: Sequence[str] = ()
    head_always_active: bool = False
    vectors_always_active: bool = False
    schedule: str | None = None
    sam_probability: float = 0.5
    sam_interval: int = 5
    looksam_alpha: float = 0.7
    seed: int | None = None
    bn_stats: str = "first"
    replay_dropout: bool = False
    sync_first_pass: bool = True
    check_masks: bool = False
    dense_one_pass: bool = False
    #: Optimizer steps the run will take, for options given as a fraction of the run
    #: (set by :meth:`build_engine`; ``None`` if unknown).
    total_steps: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_choice(
            "bn_stats", self.bn_stats, BN_STATS,
            ": which pass's BatchNorm running statistics a SAM step keeps",
        )  # fmt: skip
        for name in ("replay_dropout", "sync_first_pass", "check_masks", "dense_one_pass",
                     "head_always_active", "vectors_always_active"):  # fmt: skip
            check_flag(name, getattr(self, name))
        if self.rho is None:
            self.rho = ASAM_RHO if self.adaptive is True else SAM_RHO
        # Validates rho, perturbation_norm, adaptive and adaptive_eta.
        self.perturbation = SAMPerturbation(
            self.rho, norm=self.perturbation_norm, adaptive=self.adaptive, eta=self.adaptive_eta
        )
        self.rho = float(self.rho)
        self.adaptive_eta = float(self.adaptive_eta)
        validate_layer_spec(self.layers)
        self.always_active = list(self.always_active)
        self.always_frozen = list(self.always_frozen)
        if self.schedule is None:
            self.schedule = self.default_schedule
        check_choice("schedule", self.schedule, SCHEDULES)
        if self.schedule_fixed and self.schedule != self.default_schedule:
            raise ValueError(
                f"{self.label} fixes schedule={self.default_schedule!r}; use SAM or"
                f" SparseLayerSAM with schedule={self.schedule!r} for another one."
            )
        # Validates every schedule option now (also those the chosen schedule ignores: a
        # typo there would otherwise pass silently) rather than at setup.
        for name in (self.schedule, "random", "interval"):
            make_schedule(name, self.sam_probability, self.sam_interval, self.looksam_alpha, None)
        self.sam_probability = float(self.sam_probability)
        self.looksam_alpha = float(self.looksam_alpha)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"`seed` must be an integer or None, got {self.seed!r}.")

    # -- what each method chooses -------------------------------------------------------
    def selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        """The layer-selection rule (default: every layer)."""
        return AllLayers(num_layers)

    def needs_total_steps(self) -> bool:
        """Whether an option depends on the run's length (then pass ``total_steps``)."""
        return False

    def engine_options(self) -> dict[str, Any]:
        """Extra engine options (the subset methods' ``update_scale``)."""
        return {}

    def engine_steps(self) -> tuple[dict[str, StepKind], list[StepHook]]:
        """The step kinds this method adds to the engine's defaults, and its hooks.

        The ``"interval"`` schedule adds LookSAM's reuse step (and, with ``alpha > 0``, a
        SAM step that keeps the first pass's gradients for it); ESAM and SSAM-F plug their
        parts into the SAM step. A new method overrides this to bring its own kinds.
        """
        if self.schedule != "interval":
            return {}, []
        reuse = LookSAMReuse(self.looksam_alpha, self.perturbation.eps)
        store = reuse.store if reuse.keeps_first_grads else None
        return {"reuse": reuse, "sam": SAMStep(after_second_pass=store)}, []

    def options(self) -> dict[str, Any]:
        """The method's options as given (after validation), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def hyperparameters(self) -> dict[str, Any]:
        """The options saved with the method's checkpoint state: every option whose value
        is plain data (a ``layers`` callable, say, is left out)."""
        return {k: v for k, v in self.options().items() if _plain(v)}

    def adopt_selection_state(self, saved: dict[str, Any], current: dict[str, Any],
                              warn: Warn) -> dict[str, Any]:  # fmt: skip
        """Adapt a checkpoint's selection state to the current options (default: as is)."""
        return saved

    # -- building -----------------------------------------------------------------------
    def partition(self, module: torch.nn.Module, warn: Warn = warnings.warn) -> LayerPartition:
        """``module``'s layers under the ``layers`` / ``always_*`` options."""
        extra: list[str] = []
        if self.head_always_active:
            head = find_new_head(module)
            if not head and "head_always_active" not in getattr(self, "_from_preset", ()):
                warn(
                    f"{self.label}(head_always_active=True) found no freshly initialised head"
                    f" in {type(module).__name__}; every layer is sampled. Name the head with"
                    " `always_active` or a `sam_head_parameters()` method."
                )
            extra += head
        if self.vectors_always_active:
            extra += [n for n, p in module.named_parameters() if p.requires_grad and p.dim() <= 1]
        # Exact-name patterns for what the options found, minus what the user's own
        # patterns already place (always_frozen wins).
        placed = [re.compile(p) for p in (*self.always_frozen, *self.always_active)]
        found = dict.fromkeys(n for n in extra if not any(p.search(n) for p in placed))
        active = [*self.always_active, *(f"^{re.escape(name)}$" for name in found)]
        return build_partition(module, self.layers, active, self.always_frozen)

    def build_engine(
        self,
        module: torch.nn.Module,
        total_steps: int | None = None,
        seed: int | None = None,
        partition: LayerPartition | None = None,
        warn: Warn = warnings.warn,
    ) -> SparseSAMEngine:
        """This method's engine for ``module``.

        Args:
            module: the model.
            total_steps: the run's optimizer steps, needed by options given as a fraction
                of the run (``dense_warmup``, ``min_updates``).
            seed: the generators' seed (default: ``seed``, else :func:`default_seed`).
            partition: the layers, if already built (default: :meth:`partition`).
            warn: how warnings are reported (Lightning passes its rank-zero warning).
        """
        if total_steps is not None and not (isinstance(total_steps, int) and total_steps >= 1):
            raise ValueError(f"`total_steps` must be None or an integer >= 1, got {total_steps!r}.")
        self.total_steps = total_steps
        if partition is None:
            partition = self.partition(module, warn)
        if seed is None:
            seed = self.seed if self.seed is not None else default_seed()
        self.layer_numel = list(partition.numel)  # a compute budget's per-layer costs
        selection_gen = torch.Generator().manual_seed(seed)
        schedule_gen = torch.Generator().manual_seed(seed + 1)
        try:
            selection = self.selection(partition.num_layers, selection_gen)
        except ValueError as err:
            raise ValueError(
                f"{err} (the model has {partition.num_layers} layers with layers={self.layers!r})"
            ) from None
        schedule = make_schedule(
            self.schedule, self.sam_probability, self.sam_interval, self.looksam_alpha,
            schedule_gen,
        )  # fmt: skip
        kinds, hooks = self.engine_steps()
        return SparseSAMEngine(
            partition,
            selection,
            self.perturbation,
            schedule,
            module=module,
            bn_stats=self.bn_stats,
            replay_dropout=self.replay_dropout,
            sync_first_pass=self.sync_first_pass,
            check_masks=self.check_masks,
            dense_one_pass=self.dense_one_pass,
            kinds=kinds,
            hooks=hooks,
            **self.engine_options(),
        )
