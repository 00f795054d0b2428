"""Every method of the SL-SAM paper's comparison, as a Lightning callback.

Each class configures the same engine and :class:`~lightning_slsam.SAMMixin` training step, so
their metrics are comparable; the options all share (``rho``, ``adaptive``, ``layers``, clipping,
accumulation, ...) are :class:`~lightning_slsam.lightning.callback.SAMCallback`'s. Plain AdamW is
the mixin without a callback. Each method's name, defaults and cost: docs/methods.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import field, fields
from typing import Any, TypeVar

from lightning_slsam.lightning.callback import SAMCallback
from lightning_slsam.lightning.signatures import field_types, options_class
from lightning_slsam.methods import (
    arwp,
    esam,
    looksam,
    mesa,
    momentum_sam,
    random_slsam,
    rst,
    s2sam,
    saf,
    sl_s2sam,
    slsam,
    slsam_depth,
    slsam_looksam,
    slsam_rst,
    ssamf,
    top_slsam,
)
from lightning_slsam.methods.registry import SPECS, lookup
from lightning_slsam.methods.spec import LayerSubsetOptions, MethodSpec, Preset
from lightning_slsam.selection.rules import WrappedSelection


@options_class
class SAM(SAMCallback):
    """Vanilla SAM on every layer (Foret et al., 2021): two passes, Active Ratio 2.0x; with
    AdamW as the module's optimizer, the SL-SAM paper's "AdaSAM" baseline.

    Example:
        >>> SAM().rho, SAM(adaptive=True, rho=0.5).adaptive  # ASAM at its reference radius
        (0.01, True)
        >>> SAM(rho=-1)
        Traceback (most recent call last):
        ...
        ValueError: SAM: `rho` must be a finite number > 0 (the SAM radius; ...), got -1.
    """

    spec_class = MethodSpec


@options_class
class SparseLayerSAM(SAMCallback, slsam.SLSAMOptions):
    """Sparse Layer SAM (SL-SAM): SAM on a bandit-sampled subset of layers each step.

    The other layers are frozen; SAM's two passes run on the drawn ones, whose first-pass
    gradient norms the EXP3 bandit learns from (the paper's Algorithms 1-2; docs/algorithm.md).
    ``preset="paper"`` is the paper's exact method; ``"default"`` adds a parameter budget, a
    scale-free bandit loss, the fresh task head trained every step and updates scaled by
    ``1 / q`` up to 3 (docs/methods.md#the-presets).

    Example:
        ``trainer = L.Trainer(callbacks=[SparseLayerSAM(rho=0.01, layer_ratio=0.2)])``
        (a whole run: :mod:`lightning_slsam.lightning.mixin`).

        >>> default = SparseLayerSAM()
        >>> default.preset, default.spec.setting("budget"), default.spec.update_scale
        ('default', 'compute', 3.0)
        >>> paper = SparseLayerSAM(preset="paper")  # the paper's exact method
        >>> paper.spec.setting("budget"), paper.spec.setting("bandit_loss")
        ('count', 'shifted')
        >>> SparseLayerSAM(layer_ratio=1.5)
        Traceback (most recent call last):
        ...
        ValueError: SparseLayerSAM: `layer_ratio` must be in (0, 1], got 1.5.
    """

    spec_class = slsam.SLSAMSpec

    @property
    def bandit(self) -> Any:
        """The layer-selection bandit (available after setup)."""
        selection = self.selection
        while isinstance(selection, WrappedSelection):
            selection = selection.inner
        return selection

    def selection_metrics(self) -> dict[str, float]:
        # A wrapper's probabilities (a depth cut's) are the bandit's.
        probs = self.engine.selection.probs  # type: ignore[union-attr]
        return {
            "slsam/floor_layers": float((probs <= self.spec.p_min * (1 + 1e-9)).sum()),
            "slsam/full_layers": float((probs >= 1 - 1e-9).sum()),
        }


@options_class
class RandomSLSAM(SAMCallback, random_slsam.RandomSLSAMOptions):
    """Random-SL-SAM, the SL-SAM paper's ablation: SL-SAM with each layer drawn uniformly with
    probability ``layer_ratio`` every step, no bandit. ``preset="default"`` adds the fresh task
    head trained every step and each drawn layer's update scaled up to 3x.

    Example:
        >>> RandomSLSAM().layer_ratio, RandomSLSAM().method, RandomSLSAM().preset
        (0.2, 'random_slsam', 'paper')
    """

    spec_class = random_slsam.RandomSLSAMSpec


@options_class
class TopSLSAM(SAMCallback, LayerSubsetOptions):
    """Top-SL-SAM, the SL-SAM paper's greedy ablation: after a full first pass, SAM's ascent,
    second pass and update on the ``k = max(1, round(layer_ratio * N))`` layers of largest
    gradient norm. No exploration: ``slsam/never_selected`` logs the layers never selected.

    Example:
        >>> TopSLSAM(layer_ratio=0.3).layer_ratio
        0.3
    """

    spec_class = top_slsam.TopSLSAMSpec


@options_class
class S2SAM(SAM):
    """S2-SAM (Ji et al., 2024, "Single-step SAM"; the SL-SAM paper's Algorithm 3): one pass per
    step (Active Ratio 1.0x) at every layer perturbed along the previous step's gradient, whose
    gradient updates the weights and is kept for the next step; the first step is plain.

    Example:
        >>> S2SAM(rhoo=0.05)
        Traceback (most recent call last):
        ...
        TypeError: S2SAM has no option 'rhoo'; did you mean 'rho'?
    """

    spec_class = s2sam.S2SAMSpec


@options_class
class MomentumSAM(SAM, momentum_sam.MomentumSAMOptions):
    """Momentum-SAM (Becker, Altrock and Risse, 2024): one pass per step (Active Ratio 1.0x,
    the first plain) at the weights moved by ``rho`` against the optimizer's normalised
    momentum, undone before the update (:mod:`~lightning_slsam.methods.momentum_sam`).

    Example:
        >>> MomentumSAM().rho, MomentumSAM(rho=3.0).rho
        (1.0, 3.0)
        >>> MomentumSAM(adaptive=True)
        Traceback (most recent call last):
        ...
        ValueError: MomentumSAM: `adaptive` and `perturbation_norm` shape SAM's ascent ...
    """

    spec_class = momentum_sam.MomentumSAMSpec
    rho: float = momentum_sam.MomentumSAMOptions.rho  # its own default, not SAM's


@options_class
class ARWP(SAM, arwp.ARWPOptions):
    """ARWP (Li et al., 2024): one pass per step (Active Ratio 1.0x) at the weights moved by
    Gaussian noise, each row's scaled by its norm and shrunk where the running squared gradients
    are large, from ``rho`` to ``rho * (1 + growth)`` over the trainer's planned steps; undone
    before the update (:mod:`~lightning_slsam.methods.arwp`).

    Example:
        >>> ARWP().rho, ARWP().growth, ARWP(rho=0.01, growth=0).rho
        (0.001, 10.0, 0.01)
    """

    spec_class = arwp.ARWPSpec
    rho: float = arwp.ARWPOptions.rho  # its own default, not SAM's


@options_class
class MESA(SAM, mesa.MESAOptions):
    """MESA (Du et al., 2022): one training pass per step, its loss plus ``weight * tau^2 * KL``
    between the logits of the weights' moving average (one forward without gradients, in
    evaluation mode) and the model's own, from ``start`` of the trainer's planned steps on.
    ``training_step`` returns ``{"loss": loss, "logits": logits}``.

    Example:
        >>> MESA().weight, MESA().tau, MESA(weight=0.3).weight
        (0.8, 5.0, 0.3)
    """

    spec_class = mesa.MESASpec


@options_class
class SAF(SAM, saf.SAFOptions):
    """SAF (Du et al., 2022): one training pass per step, its loss plus ``weight * tau^2 * KL``
    between each sample's logits now and ``delay`` epochs ago, after ``start_epoch`` visits.
    ``training_step`` returns ``{"loss": loss, "logits": logits, "index": index}``, ``index``
    each sample's position in the training set.

    Example:
        >>> SAF().weight, SAF().delay, SAF(start_epoch=2).start_epoch
        (0.3, 3, 2)
    """

    spec_class = saf.SAFSpec


@options_class
class SLS2SAM(SparseLayerSAM, sl_s2sam.SLS2SAMOptions):
    """SL-S2-SAM (the SL-SAM paper's Algorithm 4; ``preset="paper"`` by default): single-step
    SAM on bandit-sampled layers, each perturbed along its own last computed gradient, the bandit
    learning from the step's (perturbed) gradient norms; the first step is plain, on every layer.

    Example:
        >>> SLS2SAM(layer_ratio=0.3).preset, SLS2SAM(layer_ratio=0.3).layer_ratio
        ('paper', 0.3)
    """

    spec_class = sl_s2sam.SLS2SAMSpec
    preset: Preset = sl_s2sam.SLS2SAMOptions.preset  # its own default, not SparseLayerSAM's


@options_class
class RST(SAM, rst.RSTOptions):
    """RST (Zhao et al., 2022): each step is a SAM step with probability ``probability``, else
    a plain step, drawn from a seeded generator (Active Ratio ``1 + probability``).

    Example:
        >>> RST().probability
        0.5
    """

    spec_class = rst.RSTSpec


@options_class
class LookSAM(SAM, looksam.LookSAMOptions):
    """LookSAM (Liu et al., 2022): a SAM step every ``interval`` steps stores ``g_v``, the part
    of the SAM gradient orthogonal to the plain one; the one-pass steps between add ``alpha *
    ||g|| / ||g_v|| * g_v`` to their gradient (Active Ratio ``1 + 1/interval``).

    Example:
        >>> LookSAM().interval, LookSAM().alpha  # LookSAM's own values
        (5, 0.7)
    """

    spec_class = looksam.LookSAMSpec


@options_class
class ESAM(SAMCallback, esam.ESAMOptions):
    """ESAM (Du et al., 2022): SAM perturbing a random ``weight_ratio`` of the layers, its second
    pass, which updates every layer, on the ``data_ratio`` of the batch whose loss the
    perturbation raised most (Active Ratio ``weight_ratio + 1``).

    ``training_step`` returns per-sample losses: a 1-D tensor (averaged for the update) or
    ``{"loss": ..., "per_sample_loss": ...}``; ``SAMMixin.sam_subset_batch`` cuts the batch
    (override it for other batch types). ``data_ratio=1.0`` turns the selection off.

    Example:
        >>> ESAM().weight_ratio, ESAM().data_ratio  # the paper's values
        (0.5, 0.5)
    """

    spec_class = esam.ESAMSpec


@options_class
class SSAMF(SAMCallback, ssamf.SSAMFOptions):
    """SSAM-F (Mi et al., 2022): SAM (both passes dense, Active Ratio 2.0x) whose ascent is zeroed
    outside the ``1 - sparsity`` of the coordinates of largest empirical Fisher information
    (squared per-sample gradients), recomputed every ``mask_interval`` steps from
    ``fisher_samples`` samples of the batch (one backward each, in ``slsam/backward_passes``).

    Example:
        >>> SSAMF().sparsity, SSAMF().mask_interval
        (0.5, 100)
        >>> SSAMF(sparsity=1.0)
        Traceback (most recent call last):
        ...
        ValueError: SSAMF: `sparsity` must be in [0, 1), got 1.0.
    """

    spec_class = ssamf.SSAMFSpec


@options_class
class SLSAMRST(SparseLayerSAM, rst.RSTOptions):
    """SL-SAM on RST's coin: sparse along both axes. Each step is SL-SAM's SAM step on the
    drawn layers with probability ``probability``, otherwise a plain step on them.

    Example:
        >>> SLSAMRST(probability=0.3).probability, SLSAMRST().method
        (0.3, 'slsam_rst')
    """

    spec_class = slsam_rst.SLSAMRSTSpec


@options_class
class SLSAMLookSAM(SparseLayerSAM, looksam.LookSAMOptions):
    """SL-SAM on LookSAM's interval: a SAM step on the drawn layers every ``interval`` steps; in
    between, one pass reusing the stored orthogonal part of the SAM gradient, weight ``alpha``.

    Example:
        >>> SLSAMLookSAM().interval, SLSAMLookSAM().alpha
        (5, 0.7)
    """

    spec_class = slsam_looksam.SLSAMLookSAMSpec


@options_class
class CostAwareSLSAM(SparseLayerSAM, slsam_depth.CostAwareSLSAMOptions):
    """Cost-aware SL-SAM (beyond the paper): each step freezes every layer below a random
    cut along the model's layer order, so back-propagation stops there and reaches a
    ``depth`` fraction of the layers on average; the bandit samples above the cut.

    Example:
        >>> CostAwareSLSAM().depth, CostAwareSLSAM().method
        (0.5, 'slsam_depth')
    """

    spec_class = slsam_depth.CostAwareSLSAMSpec


_CLASSES: tuple[type[SAMCallback], ...] = (
    SAM, SparseLayerSAM, RandomSLSAM, TopSLSAM, S2SAM, SLS2SAM, RST, LookSAM, ESAM, SSAMF,
    SLSAMRST, SLSAMLookSAM, CostAwareSLSAM, MomentumSAM, ARWP, MESA, SAF,
)  # fmt: skip

#: Specification class -> its callback class (the package's, registered or built).
_CALLBACKS: dict[type[MethodSpec], type[SAMCallback]] = {cls.spec_class: cls for cls in _CLASSES}

_Callback = TypeVar("_Callback", bound=type[SAMCallback])


def register_callback(cls: _Callback) -> _Callback:
    """Make ``cls`` the callback class of its ``spec_class`` for :func:`make_callback` and
    :data:`METHODS`; returns ``cls``, so it works as a decorator.

    Example:
        >>> class EchoSpec(MethodSpec):
        ...     pass
        >>> @register_callback
        ... @options_class
        ... class EchoSAM(SAMCallback):
        ...     spec_class = EchoSpec
        >>> callback_for(EchoSpec) is EchoSAM
        True
    """
    if not (isinstance(cls, type) and issubclass(cls, SAMCallback)):
        raise TypeError(f"register_callback takes a SAMCallback subclass, got {cls!r}.")
    _CALLBACKS[cls.spec_class] = cls
    return cls


def callback_for(spec_class: type[MethodSpec]) -> type[SAMCallback]:
    """The callback class of a method's specification: the package's, the one given to
    :func:`register_callback`, else a ``SAMCallback`` subclass named after the spec's
    ``label`` whose fields are the spec's options (built once).

    Example:
        >>> from lightning_slsam.methods import rst
        >>> callback_for(rst.RSTSpec) is RST
        True
    """
    if spec_class not in _CALLBACKS:
        options = [f for f in fields(spec_class) if f.init]  # type: ignore[arg-type]
        types = field_types(spec_class)
        namespace: dict[str, Any] = {
            "__annotations__": {f.name: types[f.name] for f in options},
            **{f.name: field(default=f.default, metadata=f.metadata) for f in options},
            "spec_class": spec_class,
        }
        register_callback(options_class(type(spec_class.label, (SAMCallback,), namespace)))
    return _CALLBACKS[spec_class]


class _Methods(Mapping):
    """:data:`METHODS`: a live view of :data:`~lightning_slsam.methods.registry.SPECS`, so
    methods added with ``register_method`` appear too."""

    def __getitem__(self, name: str) -> tuple[type[SAMCallback] | None, dict[str, Any]]:
        spec, implied = SPECS[name]
        return (callback_for(spec) if spec is not None else None), implied

    def __iter__(self) -> Iterator[str]:
        return iter(SPECS)

    def __len__(self) -> int:
        return len(SPECS)

    def __repr__(self) -> str:
        return f"METHODS({sorted(SPECS)})"


#: Method name -> (callback class or ``None`` for plain AdamW, the options the name
#: implies): ``"slsam"`` is ``SparseLayerSAM()``, ``"slsam_paper"`` the paper's method.
METHODS: Mapping[str, tuple[type[SAMCallback] | None, dict[str, Any]]] = _Methods()


def class_path(cls: type[SAMCallback]) -> str:
    """The class path a YAML config names ``cls`` by: ``lightning_slsam.<Class>`` for the
    classes the package exports, else the module's path.

    Example:
        >>> class_path(SparseLayerSAM)
        'lightning_slsam.SparseLayerSAM'
    """
    import lightning_slsam

    if cls.__name__ in lightning_slsam.__all__ and getattr(lightning_slsam, cls.__name__) is cls:
        return f"lightning_slsam.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def make_callback(name: str, **kwargs: Any) -> SAMCallback:
    """The callback of method ``name`` (see :data:`METHODS`), ``kwargs`` overriding its
    defaults. Plain AdamW has none: ``"adamw"`` raises (:func:`make_callbacks` gives ``[]``).

    Example:
        >>> callback = make_callback("slsam_paper", layer_ratio=0.3)
        >>> type(callback).__name__, callback.layer_ratio, callback.preset
        ('SparseLayerSAM', 0.3, 'paper')
        >>> make_callback("adamw")
        Traceback (most recent call last):
        ...
        ValueError: Method 'adamw' is plain AdamW, which needs no callback: ...
    """
    spec, implied = lookup(name)
    if spec is None:
        raise ValueError(
            f"Method {name!r} is plain AdamW, which needs no callback: leave it out of"
            f" Trainer(callbacks=...), or use make_callbacks({name!r}), which returns []."
        )
    return callback_for(spec)(**{**implied, **kwargs})


def make_callbacks(name: str, **kwargs: Any) -> list[SAMCallback]:
    """``[make_callback(name, **kwargs)]``, or ``[]`` for plain AdamW (``Trainer(callbacks=...)``).

    Example:
        >>> make_callbacks("adamw"), [type(c).__name__ for c in make_callbacks("rst")]
        ([], ['RST'])
    """
    spec, _ = lookup(name)
    if spec is None:
        if kwargs:
            raise ValueError(f"Method {name!r} (plain AdamW) takes no options, got {kwargs}.")
        return []
    return [make_callback(name, **kwargs)]


__all__ = [
    "METHODS",
    "callback_for",
    "class_path",
    "make_callback",
    "make_callbacks",
    "register_callback",
    *(cls.__name__ for cls in _CLASSES),
]
