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

Each option is stated once, as a field of its spec class with its check (:func:`option`);
the options every method takes are :class:`MethodSpec`'s.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import torch

from lightning_slsam.core.engine import SparseSAMEngine
from lightning_slsam.core.partition import (
    LayerPartition,
    LayerSpec,
    build_partition,
    find_new_head,
)
from lightning_slsam.core.perturbation import PERTURBATION_NORMS, SAMPerturbation
from lightning_slsam.core.regions import compiled_regions
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
from lightning_slsam.core.validation import FLAG, Rule, number, one_of, patterns, unknown_option
from lightning_slsam.methods.looksam import LookSAMReuse
from lightning_slsam.selection.rules import AllLayers, LayerSelection

__all__ = [
    "ASAM_RHO",
    "LAYERS",
    "SAM_RHO",
    "SCHEDULES",
    "SCHEDULE_OPTIONS",
    "MethodSpec",
    "default_seed",
    "option",
    "option_hint",
]

#: The step-kind schedules a method can run (its ``schedule``).
SCHEDULES = ("every_step", "random", "interval", "single")
#: The options of SL-SAM's schedule (every other method runs its own).
SCHEDULE_OPTIONS = (
    "schedule",
    "sam_probability",
    "sam_interval",
    "looksam_alpha",
    "dense_one_pass",
)
#: Default radius of SAM (the SL-SAM paper's, for every method) and of ASAM (its reference's).
SAM_RHO = 0.01
ASAM_RHO = 0.5

Warn = Callable[[str], None]
_Spec = TypeVar("_Spec", bound="MethodSpec")


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


def option(default: Any, rule: Rule) -> Any:
    """A spec field that is an option: its default and its check (a
    :class:`~lightning_slsam.core.validation.Rule`), run by :meth:`MethodSpec.__post_init__`."""
    return field(default=default, metadata={"rule": rule})


def _layer_spec(value: Any) -> bool:
    if isinstance(value, str):
        return value in ("tensor", "module")
    return callable(value) or patterns("").ok(value)


#: The ``layers`` option's check.
LAYERS = Rule(
    "'tensor', 'module', a list of regular expressions or a callable (name, parameter) -> key",
    _layer_spec,
)


def option_hint(spec_class: type[MethodSpec], name: str) -> str | None:
    """What to say of an option ``spec_class`` does not take: the name it has there
    (:attr:`MethodSpec.renamed`) or where it belongs; ``None``: the closest valid name."""
    if name in spec_class.renamed:
        return f"did you mean {spec_class.renamed[name]!r}?"
    if name in SCHEDULE_OPTIONS:
        return (
            f"{spec_class.label} runs its own step schedule. The schedule options are"
            " SparseLayerSAM's; RST, LookSAM and S2SAM are SAM on RST's coin, LookSAM's"
            " interval and single steps."
        )
    return None


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

    Each option is a field made by :func:`option`, with its check, run in
    :meth:`__post_init__` (a bad value's message names :attr:`label` and the option). The
    step schedule is the method's own: SL-SAM's alone is an option.

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
        ValueError: SAM: `bn_stats` must be one of ('first', 'second', 'both'), got 'third': ...
    """

    #: Registry name of the method.
    name: ClassVar[str] = "sam"
    #: The class name users write (the Lightning callback's), used in messages.
    label: ClassVar[str] = "SAM"
    #: Options of other methods this one takes under another name (RST's ``probability``
    #: is ``sam_probability``), named when the other name is given.
    renamed: ClassVar[dict[str, str]] = {}
    #: Whether the layers a step trains vary (each compiled region is then one layer).
    samples_layers: ClassVar[bool] = False

    rho: float | None = option(
        None, number(0, low_open=True, note=" (the SAM radius; the SL-SAM paper uses 0.01)")
    )
    adaptive: bool = option(False, FLAG)
    adaptive_eta: float = option(0.01, number(0, note=" (ASAM's eta)"))
    perturbation_norm: str = option("global", one_of(PERTURBATION_NORMS))
    layers: LayerSpec = option("tensor", LAYERS)
    always_active: Sequence[str] = option((), patterns(r"['^classifier\\.']"))
    always_frozen: Sequence[str] = option((), patterns(r"['^embeddings\\.']"))
    head_always_active: bool = option(False, FLAG)
    vectors_always_active: bool = option(False, FLAG)
    seed: int | None = option(None, number(None, integer=True).or_none())
    bn_stats: str = option(
        "first", one_of(BN_STATS, ": which pass's BatchNorm running statistics a SAM step keeps")
    )
    replay_dropout: bool = option(False, FLAG)
    sync_first_pass: bool = option(True, FLAG)
    check_masks: bool = option(False, FLAG)
    # The step schedule: the method's own, not options (SL-SAM redeclares them as options).
    #: What kind each step is (one of :data:`SCHEDULES`).
    schedule: str = field(default="every_step", init=False)
    sam_probability: float = field(default=0.5, init=False, repr=False)
    sam_interval: int = field(default=5, init=False, repr=False)
    looksam_alpha: float = field(default=0.7, init=False, repr=False)
    dense_one_pass: bool = field(default=False, init=False, repr=False)
    #: Optimizer steps the run will take, for options given as a fraction of the run
    #: (set by :meth:`build_engine`; ``None`` if unknown).
    total_steps: int | None = field(default=None, init=False, repr=False)

    def __new__(cls: type[_Spec], *args: Any, **options: Any) -> _Spec:
        # An unknown option's message names the method's class, as a bad value's does.
        accepted = cls.option_names()
        for key in (key for key in options if key not in accepted):
            raise unknown_option(cls.label, key, accepted, option_hint(cls, key))
        return super().__new__(cls)

    @classmethod
    def option_names(cls) -> list[str]:
        """The options this method takes (its fields made by :func:`option`)."""
        return [f.name for f in fields(cls) if f.init]  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        # The one place a method's options are checked: defaults resolved, then each
        # option's rule, then the rules between options. Every message names the class.
        try:
            self.resolve_defaults()
            for f in fields(self):
                if f.init and "rule" in f.metadata:
                    setattr(self, f.name, f.metadata["rule"](f.name, getattr(self, f.name)))
            self.check_combined()
        except ValueError as err:
            raise ValueError(f"{self.label}: {err}") from None
        self.perturbation = SAMPerturbation(
            self.rho, norm=self.perturbation_norm, adaptive=self.adaptive, eta=self.adaptive_eta
        )

    def resolve_defaults(self) -> None:
        """Fill the options whose default depends on others (``rho=None``), before the
        checks."""
        if self.rho is None:
            self.rho = ASAM_RHO if self.adaptive is True else SAM_RHO

    def check_combined(self) -> None:
        """Check the rules between options, after each option's own (none here); raise
        :func:`~lightning_slsam.core.validation.invalid`'s error."""

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
        # A method that freezes other layers each step freezes a compiled region whole.
        regions = compiled_regions(module) if self.samples_layers else []
        return build_partition(module, self.layers, active, self.always_frozen, regions)

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
        self.total_steps = number(1, integer=True).or_none()("total_steps", total_steps)
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
