"""A method as a pure-PyTorch specification: a name plus validated options.

A :class:`MethodSpec` builds its :class:`~lightning_slsam.core.engine.SAMEngine`; the
Lightning callbacks are thin shells over it, and a plain PyTorch loop uses it directly::

    engine = make_engine("slsam", model, layer_ratio=0.2)
    for batch in loader:
        engine.train_step(lambda: loss_fn(model, batch), optimizer)

Each option is a field with its check (:func:`option`); methods are known by name through
:mod:`lightning_slsam.methods.registry`.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, TypeVar

import torch

from lightning_slsam.core.engine import SAMEngine
from lightning_slsam.core.isolation import BN_STATS
from lightning_slsam.core.partition import (
    LayerPartition,
    LayerSpec,
    build_partition,
    describe_change,
    find_new_head,
)
from lightning_slsam.core.perturbation import PERTURBATION_NORMS, SAMPerturbation
from lightning_slsam.core.regions import compiled_regions
from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.options import (
    FLAG,
    RATIO,
    Rule,
    number,
    one_of,
    patterns,
    unknown_option,
)
from lightning_slsam.selection.coverage import coverage_message, expected_updates
from lightning_slsam.selection.rules import AllLayers, LayerSelection

__all__ = [
    "LAYERS",
    "SAM_RHO",
    "LayerSubsetOptions",
    "LayerSubsetSpec",
    "MethodOptions",
    "MethodSpec",
    "Preset",
    "Setting",
    "default_seed",
    "option",
]

#: The presets a layer sampler may offer: its defaults beyond the paper, or the paper's method.
Preset = Literal["default", "paper"]
#: What a method fixes or its preset decides (:meth:`MethodSpec.setting`).
Setting = Literal["budget", "bandit_loss", "alpha_p", "head_always_active", "max_update_scale"]

#: Default radius of every method: the SL-SAM paper's.
SAM_RHO = 0.01

Warn = Callable[[str], None]
_Spec = TypeVar("_Spec", bound="MethodSpec")


def default_seed() -> int:
    """The run's seed: ``seed_everything``'s (``PL_GLOBAL_SEED``) when set, else
    ``torch.initial_seed()`` (why: the "Options" section of docs/extending.md)."""
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value not in (None, "") else torch.initial_seed()


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def option(default: Any, rule: Rule) -> Any:
    """A spec field that is an option: its default and its check (a
    :class:`~lightning_slsam.methods.options.Rule`, run by :meth:`MethodSpec.__post_init__`)."""
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


@dataclass(kw_only=True, eq=False)
class MethodOptions:
    """The options every method takes (checked by :class:`MethodSpec`).

    Args:
        rho: SAM perturbation radius (> 0; default 0.01, the SL-SAM paper's). With
            ``adaptive=True`` it is relative to the weights (ASAM's reference: 0.5).
        adaptive: ASAM's weight-scaled perturbation ``rho * T_w^2 g / ||T_w g||``,
            ``T_w = |w| + 0.01`` (1 on biases; Kwon et al., 2021); default ``False``.
        perturbation_norm: ``"global"`` (default; one norm over all perturbed tensors,
            as SAM) or ``"layer"`` (one norm per layer, as SL-SAM's Algorithm 1 reads).
        layers: what a layer is: ``"tensor"`` (default, paper), ``"module"``, a list of
            regular expressions (one group per distinct match) or a callable
            ``(name, param) -> key | None``.
        always_active: regular expressions of parameter names trained every step.
        always_frozen: regular expressions of parameter names never trained.
        seed: seed of the method's own generators (layer sampling, RST's coin); ``None``
            (default): ``seed_everything``'s seed, else ``torch.initial_seed()``.
        bn_stats: which pass's BatchNorm running statistics a SAM step keeps:
            ``"first"`` (default; the unperturbed pass, as official SAM code),
            ``"second"`` or ``"both"`` (updated twice, as the SL-SAM reference code).
        replay_dropout: give the second pass the first pass's dropout masks (default
            ``False``: fresh masks, as official SAM code).
        sync_first_pass: under multi-process training, average the first pass's gradient
            before the ascent (default ``True``); ``False``: each process perturbs with its
            own (SAM's m-sharpness), only the per-layer norms are averaged.
        check_masks: multi-process debug mode: check every step that all processes drew
            the same layers and step kind. Default ``False``.
    """

    rho: float = option(
        SAM_RHO, number(0, low_open=True, note=" (the SAM radius; the SL-SAM paper uses 0.01)")
    )
    adaptive: bool = option(False, FLAG)
    perturbation_norm: str = option("global", one_of(PERTURBATION_NORMS))
    layers: LayerSpec = option("tensor", LAYERS)
    always_active: Sequence[str] = option((), patterns(r"['^classifier\\.']"))
    always_frozen: Sequence[str] = option((), patterns(r"['^embeddings\\.']"))
    seed: int | None = option(None, number(None, integer=True).or_none())
    bn_stats: str = option(
        "first", one_of(BN_STATS, ": which pass's BatchNorm running statistics a SAM step keeps")
    )
    replay_dropout: bool = option(False, FLAG)
    sync_first_pass: bool = option(True, FLAG)
    check_masks: bool = option(False, FLAG)


@dataclass(kw_only=True, eq=False)
class MethodSpec(MethodOptions):
    """A method: its checked options and how it builds its engine (as is: SAM on every layer).

    Example:
        >>> import torch
        >>> spec = MethodSpec(adaptive=True, rho=0.5)  # ASAM at its reference radius
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
    #: Whether the layers a step trains vary (each compiled region is then one layer).
    samples_layers: ClassVar[bool] = False
    #: How a method that does not ascend along the gradient moves the weights (a clause for its
    #: message); it refuses ``adaptive``, ``perturbation_norm`` and (unless sized by it) ``rho``.
    own_move: ClassVar[str | None] = None
    #: Whether ``rho`` sizes the method (``False``: it perturbs nothing).
    sized_by_rho: ClassVar[bool] = True

    def __new__(cls: type[_Spec], *args: Any, **options: Any) -> _Spec:
        # An unknown option's message names the method's class, as a bad value's does.
        accepted = cls.option_names()
        for key in (key for key in options if key not in accepted):
            raise unknown_option(cls.label, key, accepted)
        return super().__new__(cls)

    @classmethod
    def option_names(cls) -> list[str]:
        """The options this method takes (its fields made by :func:`option`)."""
        return [f.name for f in fields(cls) if f.init]  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        try:
            for f in fields(self):
                if f.init and "rule" in f.metadata:
                    value = f.metadata["rule"](f.name, getattr(self, f.name))
                    object.__setattr__(self, f.name, value)
            self._check_own_move()
            self.check_combined()
        except ValueError as err:
            raise ValueError(f"{self.label}: {err}") from None
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_validated", False):
            raise AttributeError(
                f"{self.label}'s options are fixed once checked: build another"
                f" ({self.label}(..., {name}=...), or dataclasses.replace(spec, {name}=...))."
            )
        object.__setattr__(self, name, value)

    def _check_own_move(self) -> None:
        if self.own_move is None:
            return
        shaping = ("adaptive", "perturbation_norm")
        if not self.sized_by_rho:
            shaping = ("rho", *shaping)
        defaults = {f.name: f.default for f in fields(self)}
        if any(getattr(self, name) != defaults[name] for name in shaping):
            named = ", ".join(f"`{name}`" for name in shaping[:-1]) + f" and `{shaping[-1]}`"
            raise ValueError(
                f"{named} shape SAM's ascent along a gradient; {self.own_move}: leave them at"
                " their defaults."
            )

    def make_perturbation(self) -> SAMPerturbation:
        """The ascent an engine of this method applies (a new one per engine)."""
        return SAMPerturbation(self.rho, norm=self.perturbation_norm, adaptive=self.adaptive)

    def check_combined(self) -> None:
        """Check the rules between options (none here); raise
        :func:`~lightning_slsam.methods.options.invalid`'s error."""

    def selection(self, layers: LayerPartition, generator: torch.Generator) -> LayerSelection:
        """The layer-selection rule over ``layers`` (default: every layer)."""
        return AllLayers(layers.num_layers)

    def parts(self, generator: torch.Generator) -> MethodParts:
        """What the method adds to the steps (default: nothing, SAM on every step);
        ``generator``: the method's own (RST's coin)."""
        return MethodParts()

    def setting(self, name: Setting) -> Any:
        """A setting the method fixes or its ``preset`` decides: ``"head_always_active"``
        (``False`` here) or ``"max_update_scale"`` (the cap on ``1 / q``; 1 here: none)."""
        return {"head_always_active": False, "max_update_scale": 1.0}[name]

    @property
    def update_scale(self) -> float | None:
        """The engine's update scaling cap (``None``: no update scaling)."""
        cap = self.setting("max_update_scale")
        return None if cap <= 1.0 else float(cap)

    def coverage_warning(
        self, engine: SAMEngine, steps: float, name: str | None = None
    ) -> str | None:
        """The warning, said by ``name`` (default :attr:`label`), for a run of ``steps`` more
        steps whose sampled layers expect too few updates; ``None`` here (every layer trains)."""
        return None

    def options(self) -> dict[str, Any]:
        """The method's options as given (after validation), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def hyperparameters(self) -> dict[str, Any]:
        """The options saved with the checkpoint state: those whose value is plain data."""
        return {k: v for k, v in self.options().items() if _plain(v)}

    def adopt_selection_state(self, saved: dict[str, Any], current: dict[str, Any],
                              warn: Warn) -> dict[str, Any]:  # fmt: skip
        """Adapt a checkpoint's selection state to the current options (default: as is)."""
        return saved

    def partition(self, module: torch.nn.Module, warn: Warn = warnings.warn) -> LayerPartition:
        """``module``'s layers under the ``layers`` / ``always_*`` options."""
        extra = find_new_head(module) if self.setting("head_always_active") else []
        # Exact-name patterns for the head, minus what the user's patterns place.
        placed = [re.compile(p) for p in (*self.always_frozen, *self.always_active)]
        found = dict.fromkeys(n for n in extra if not any(p.search(n) for p in placed))
        active = [*self.always_active, *(f"^{re.escape(name)}$" for name in found)]
        # A sampling method freezes a compiled region whole.
        regions = compiled_regions(module) if self.samples_layers else []
        return build_partition(module, self.layers, active, self.always_frozen, regions)

    def follow_trainable(
        self, engine: SAMEngine, module: torch.nn.Module, warn: Warn = warnings.warn
    ) -> tuple[SAMEngine, str]:
        """``engine`` carried over to ``module``'s current trainable set (e.g. after
        ``BackboneFinetuning``), the kept tensors with their state, and a sentence saying what
        changed."""
        old, partition = engine.partition, self.partition(module, warn)
        new = self.build_engine(module, seed=0, partition=partition, warn=warn)
        state = new.carry_state(engine.state_dict(), old.names, old.tensor_names())
        new.load_state_dict(state)
        new.last_grad.update(engine.last_grad)  # tensors kept: the same objects, by id
        new.planned_steps = engine.planned_steps
        return new, describe_change(old, partition)

    def build_engine(
        self,
        module: torch.nn.Module,
        seed: int | None = None,
        partition: LayerPartition | None = None,
        warn: Warn = warnings.warn,
    ) -> SAMEngine:
        """This method's engine for ``module``.

        Args:
            module: the model.
            seed: the generators' seed (default: ``seed``, else :func:`default_seed`).
            partition: the layers, if already built (default: :meth:`partition`).
            warn: how warnings are reported (Lightning passes its rank-zero warning).
        """
        if partition is None:
            partition = self.partition(module, warn)
        if seed is None:
            seed = self.seed if self.seed is not None else default_seed()
        try:
            selection = self.selection(partition, torch.Generator().manual_seed(seed))
        except ValueError as err:
            raise ValueError(
                f"{err} (the model has {partition.num_layers} layers with layers={self.layers!r})"
            ) from None
        parts = self.parts(torch.Generator().manual_seed(seed + 1))
        parts.warn = warn
        return SAMEngine(
            partition,
            selection,
            self.make_perturbation(),
            parts,
            module=module,
            bn_stats=self.bn_stats,
            replay_dropout=self.replay_dropout,
            sync_first_pass=self.sync_first_pass,
            check_masks=self.check_masks,
            update_scale=self.update_scale,
        )


@dataclass(kw_only=True, eq=False)
class LayerSubsetOptions(MethodOptions):
    """The options of the methods that train a subset of layers each step.

    Args:
        layer_ratio: expected fraction of layers active per step, in (0, 1]. Paper: 0.2.
    """

    layer_ratio: float = option(0.2, RATIO)


@dataclass(kw_only=True, eq=False)
class LayerSubsetSpec(LayerSubsetOptions, MethodSpec):
    """What the methods that train a subset of layers each step share.

    A method with presets declares them in :attr:`PRESETS` (preset name -> settings, see
    :meth:`~MethodSpec.setting`) and a ``preset`` option choosing one.

    Example:
        SAM on a uniformly drawn ``layer_ratio`` of the layers, as a method of one's own:

        >>> import torch
        >>> from typing import ClassVar
        >>> from lightning_slsam.selection.rules import UniformSelection
        >>> class UniformSAMSpec(LayerSubsetSpec):
        ...     name: ClassVar[str] = "uniform_sam"
        ...     label: ClassVar[str] = "UniformSAM"
        ...     def selection(self, layers, generator):
        ...         return UniformSelection(layers.num_layers, self.layer_ratio, generator)
        >>> spec = UniformSAMSpec(layer_ratio=0.5)
        >>> engine = spec.build_engine(torch.nn.Linear(4, 2), seed=0)
        >>> engine.selection.ratio, spec.samples_layers, spec.update_scale
        (0.5, True, None)
        >>> UniformSAMSpec(layer_ratio=2)
        Traceback (most recent call last):
        ...
        ValueError: UniformSAM: `layer_ratio` must be in (0, 1], got 2.
    """

    samples_layers: ClassVar[bool] = True
    #: What each value of the ``preset`` option sets (empty: the method has no presets),
    #: and each in words (the run summary prints them).
    PRESETS: ClassVar[dict[Preset, dict[Setting, Any]]] = {}
    PRESET_WORDS: ClassVar[dict[Preset, str]] = {}

    def coverage_warning(
        self, engine: SAMEngine, steps: float, name: str | None = None
    ) -> str | None:
        if engine.selection.always_all:
            return None
        figure = expected_updates(engine.selection.inclusion(), steps, self.update_scale)
        return coverage_message(
            name or self.label, figure, steps, self.layer_ratio, self.update_scale
        )

    def setting(self, name: Setting) -> Any:
        if self.PRESETS:
            return self.PRESETS[self.preset][name]  # type: ignore[attr-defined]
        return super().setting(name)
