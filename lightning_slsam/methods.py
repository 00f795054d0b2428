"""Every method of the SL-SAM paper's comparison, as a Lightning callback.

Each class is a configuration of the same parts -- a layer selection, a perturbation and
a schedule -- run by the same engine and the same :class:`~lightning_slsam.SAMMixin`
training step, so their metrics are directly comparable. Options common to all (``rho``,
``adaptive``, ``perturbation_norm``, ``layers``, clipping, accumulation, ...) are those of
:class:`~lightning_slsam.callback.SAMCallback`. Plain AdamW is the mixin without any
callback.

========================  ==========================  ====================================
name (``make_callback``)  class                       paper defaults
========================  ==========================  ====================================
``adamw``                 (no callback)               --
``sam`` / ``adasam``      :class:`SAM`                rho 0.01
``slsam``                 :class:`SparseLayerSAM`     layer_ratio 0.2, p_min = alpha_p = 1e-3
``random_slsam``          :class:`RandomSLSAM`        layer_ratio 0.2
``top_slsam``             :class:`TopSLSAM`           layer_ratio 0.2
``s2sam``                 :class:`S2SAM`              --
``sl_s2sam``              :class:`SLS2SAM`            layer_ratio 0.2 (0.3 DeiT, 0.5 Llama)
``rst``                   :class:`RST`                probability 0.5
``esam``                  :class:`ESAM`               weight_ratio 0.5, data_ratio 0.5
``ssamf``                 :class:`SSAMF`              sparsity 0.5
``looksam``               :class:`LookSAM`            interval 5, alpha 0.7
``slsam_rst``             SL-SAM + RST's coin         both axes of sparsity
``slsam_looksam``         SL-SAM + LookSAM interval   both axes of sparsity
``slsam_depth``           cost-aware SL-SAM           backprop_depth 0.5 (opt-in)
``slsam_robust``          SL-SAM, robust preset       short-fine-tune remedies (opt-in)
========================  ==========================  ====================================
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_slsam.bandit import LayerBandit, kl_projection
from lightning_slsam.callback import SAMCallback
from lightning_slsam.checks import check_ratio, is_ratio
from lightning_slsam.perturbation import FisherMask
from lightning_slsam.selection import (
    DenseWarmup,
    DepthCut,
    ExpandToAll,
    LayerSelection,
    TopKSelection,
    UniformSelection,
)

__all__ = [
    "ESAM",
    "METHODS",
    "PRESETS",
    "RST",
    "S2SAM",
    "SAM",
    "SLS2SAM",
    "SSAMF",
    "LookSAM",
    "RandomSLSAM",
    "SparseLayerSAM",
    "TopSLSAM",
    "make_callback",
    "make_callbacks",
]

BANDIT_LOSSES = ("shifted", "paper", "rank")

#: What each :class:`SparseLayerSAM` preset sets; an option given explicitly wins.
#: ``"paper"``: the SL-SAM paper and its released code. ``"robust"``: the short-fine-tune
#: remedies measured in ``docs/results.md``: the scale-free bandit, a dense warm-up over
#: the first 30% of the run, the fresh task head trained every step and inverse-inclusion
#: update scaling.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "bandit_loss": "shifted",
        "dense_warmup": 0,
        "min_updates": 0,
        "head_always_active": False,
        "vectors_always_active": False,
        "scale_updates": False,
    },
    "robust": {
        "bandit_loss": "rank",
        "dense_warmup": 0.3,
        "min_updates": 0,
        "head_always_active": True,
        "vectors_always_active": False,
        "scale_updates": True,
    },
}


def _warmup(value: int | float) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`dense_warmup` must be a number, got {value!r}.")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, float) and 0 <= value < 1:
        return value
    raise ValueError(
        f"`dense_warmup` must be an integer number of steps >= 0 or a fraction of the run in"
        f" [0, 1), got {value!r}."
    )


class _LayerSubset(SAMCallback):
    """What the methods that sample a subset of layers share: the layer ratio, and the
    short-run remedies that do not depend on how the subset is drawn (a dense warm-up, a
    floor on each layer's updates, update scaling)."""

    layer_ratio: float
    dense_warmup: int | float
    min_updates: int
    scale_updates: bool
    max_update_scale: float | None

    def _init_subset(
        self,
        layer_ratio: float,
        dense_warmup: int | float,
        min_updates: int,
        scale_updates: bool,
        max_update_scale: float | None,
    ) -> None:
        self.layer_ratio = check_ratio("layer_ratio", layer_ratio)
        self.dense_warmup = _warmup(dense_warmup)
        if isinstance(min_updates, bool) or not (isinstance(min_updates, int) and min_updates >= 0):
            raise ValueError(f"`min_updates` must be an integer >= 0, got {min_updates!r}.")
        self.min_updates = min_updates
        if not isinstance(scale_updates, bool):
            raise ValueError(f"`scale_updates` must be True or False, got {scale_updates!r}.")
        self.scale_updates = scale_updates
        cap = max_update_scale
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 1 <= cap < math.inf
        ):
            raise ValueError(
                f"`max_update_scale` must be None (1 / layer_ratio) or a finite number >= 1,"
                f" got {cap!r}."
            )
        self.max_update_scale = None if cap is None else float(cap)

    @property
    def update_scale(self) -> float | None:
        """The cap on the update factor ``1 / q`` in use (``None``: no scaling):
        ``max_update_scale``, by default ``1 / layer_ratio`` (the ratio in use)."""
        if not self.scale_updates:
            return None
        if self.max_update_scale is not None:
            return self.max_update_scale
        return 1.0 / self.effective_ratio

    def _engine_options(self) -> dict[str, Any]:
        return {**super()._engine_options(), "update_scale": self.update_scale}

    def _needs_total_steps(self) -> bool:
        return (
            isinstance(self.dense_warmup, float) and self.dense_warmup > 0
        ) or self.min_updates > 0

    def _run_length(self, option: str) -> int:
        if self.total_steps is None:
            raise MisconfigurationException(
                f"{type(self).__name__}({option}) depends on the run's length, which is"
                " unknown here (no max_steps, or an unsized train dataloader with no"
                " max_steps). Set trainer.max_steps, or give dense_warmup as a number of steps"
                " and min_updates=0."
            )
        return self.total_steps

    @property
    def effective_ratio(self) -> float:
        """The layer ratio in use: ``layer_ratio``, raised to ``min_updates / total_steps``
        (at most 1) when ``min_updates`` is set."""
        if not self.min_updates:
            return self.layer_ratio
        steps = self._run_length(f"min_updates={self.min_updates}")
        return max(self.layer_ratio, min(1.0, self.min_updates / steps))

    @property
    def warmup_steps(self) -> int:
        """Length of the dense warm-up in steps."""
        if isinstance(self.dense_warmup, float):
            if self.dense_warmup == 0:
                return 0
            steps = self._run_length(f"dense_warmup={self.dense_warmup}")
            return round(self.dense_warmup * steps)
        return self.dense_warmup

    def _with_warmup(self, rule: LayerSelection, generator: torch.Generator) -> LayerSelection:
        steps = self.warmup_steps
        if steps == 0 or rule.always_all:
            return rule
        coins = torch.Generator().manual_seed(int(generator.initial_seed()) + 3)
        return DenseWarmup(rule, steps, coins)

    def _hyperparameters(self) -> dict[str, Any]:
        return {
            **super()._hyperparameters(),
            "layer_ratio": self.layer_ratio,
            "dense_warmup": self.dense_warmup,
            "min_updates": self.min_updates,
            "scale_updates": self.scale_updates,
            "max_update_scale": self.max_update_scale,
        }


class SAM(SAMCallback):
    """Vanilla SAM on every layer (Foret et al., 2021, "Sharpness-Aware Minimization for
    Efficiently Improving Generalization"); with AdamW as the module's optimizer this is
    the SL-SAM paper's "AdaSAM" baseline. Two passes on every layer: Active Ratio 2.0x.

    Args:
        rho: perturbation radius; ``None``: the paper's 0.01 (0.5 with ``adaptive=True``).
        **kwargs: the common options of :class:`~lightning_slsam.callback.SAMCallback`.
    """

    method = "sam"

    def __init__(self, rho: float | None = None, **kwargs: Any) -> None:
        super().__init__(rho=rho, **kwargs)


class SparseLayerSAM(_LayerSubset):
    """Sparse Layer SAM (SL-SAM): SAM on a bandit-sampled subset of layers each step.

    Each step samples the active layers (independent Bernoulli draws with the bandit's
    probabilities), freezes the rest, runs SAM's two passes on the active layers only,
    steps the optimizer on the second-pass gradients and feeds the first-pass per-layer
    gradient norms back to the EXP3 bandit (the SL-SAM paper's Algorithms 1 and 2).

    The defaults are the paper's (``preset="paper"``). Beyond the paper, for short
    fine-tunes (see ``docs/results.md``): a scale-free bandit loss (``bandit_loss="rank"``),
    a dense warm-up (``dense_warmup``), the fresh task head and the 1-D tensors trained
    every step (``head_always_active``, ``vectors_always_active``), a floor on each
    layer's updates (``min_updates``) and inverse-inclusion update scaling
    (``scale_updates``); ``preset="robust"`` switches on the measured combination
    (:data:`PRESETS`).

    Args:
        rho: SAM perturbation radius (> 0). ``None``: the paper's 0.01 (0.5 with
            ``adaptive=True``, ASAM's radius).
        layer_ratio: expected fraction of layers active per step, ``s/N`` in (0, 1].
            Paper: 0.2 (0.25 on RTE). ``1.0`` makes every layer active: vanilla SAM.
        p_min: lower bound of every layer's probability, in (0, 1), at most
            ``layer_ratio``. Paper: 1e-3.
        alpha_p: bandit step size (>= 0). ``None`` (default): the loss's own, the paper's
            1e-3 for ``"shifted"`` and ``"paper"``, 0.03 for ``"rank"``.
        bandit_loss: ``"shifted"`` (the authors' released code; the ``"paper"`` preset),
            ``"paper"`` (Algorithm 2 literally, which with the paper's constants pushes
            every sampled layer to ``p_min``) or ``"rank"`` (scale-free: the same step
            whatever the units of the gradient norms; the ``"robust"`` preset). See
            :class:`~lightning_slsam.LayerBandit`. ``None``: the preset's.
        backprop_depth: cost-aware SL-SAM (beyond the paper; opt-in): each step freezes
            every layer below a random cut of the layer order, so back-propagation reaches
            only a ``backprop_depth`` fraction of the layers on average
            (:class:`~lightning_slsam.selection.DepthCut`). 1.0 (default) disables it.
        dense_warmup: anneal the layer ratio linearly from 1 (every layer) to
            ``layer_ratio`` over this many steps (an int), or this fraction of the run (a
            float in [0, 1)) (:class:`~lightning_slsam.selection.DenseWarmup`). 0 disables
            it. ``None``: the preset's (``"paper"``: 0, ``"robust"``: 0.3).
        min_updates: raise the layer ratio, for this run, to ``min_updates / total_steps``
            when that is larger, so each layer expects at least that many updates (0
            disables it). ``None``: the preset's (0 in both).
        head_always_active: train the freshly initialised task head every step (see
            :class:`~lightning_slsam.callback.SAMCallback`). ``None``: the preset's.
        vectors_always_active: train every 1-D tensor (biases, normalisation weights)
            every step. ``None``: the preset's.
        scale_updates: multiply each drawn layer's update (the optimizer's change to its
            weights) by ``1 / q``, ``q`` its probability of being drawn that step, capped at
            ``max_update_scale``: every layer then moves as far per step, in expectation,
            as in dense training, at no extra gradient work. ``None``: the preset's
            (``"paper"``: off, ``"robust"``: on).
        max_update_scale: the cap on that factor (>= 1); ``None`` (default): ``1 /
            layer_ratio``.
        preset: ``"paper"`` (default: the paper's SL-SAM) or ``"robust"``; the options
            left at ``None`` take its values (:data:`PRESETS`).
        **kwargs: the common options of :class:`~lightning_slsam.callback.SAMCallback`,
            including ``schedule`` to combine SL-SAM with RST's coin or LookSAM's interval.

    Example::

        trainer = L.Trainer(callbacks=[SparseLayerSAM(rho=0.01, layer_ratio=0.2)])
    """

    method = "slsam"

    def __init__(
        self,
        rho: float | None = None,
        layer_ratio: float = 0.2,
        p_min: float = 1e-3,
        alpha_p: float | None = None,
        bandit_loss: str | None = None,
        backprop_depth: float = 1.0,
        dense_warmup: int | float | None = None,
        min_updates: int | None = None,
        head_always_active: bool | None = None,
        vectors_always_active: bool | None = None,
        scale_updates: bool | None = None,
        max_update_scale: float | None = None,
        preset: str = "paper",
        **kwargs: Any,
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(
                f"`preset` must be one of {tuple(PRESETS)}, got {preset!r}: 'paper' is the"
                " SL-SAM paper's method, 'robust' adds the short-fine-tune remedies."
            )
        chosen = PRESETS[preset]
        bandit_loss = chosen["bandit_loss"] if bandit_loss is None else bandit_loss
        dense_warmup = chosen["dense_warmup"] if dense_warmup is None else dense_warmup
        min_updates = chosen["min_updates"] if min_updates is None else min_updates
        if head_always_active is None:
            head_always_active = chosen["head_always_active"]
        if vectors_always_active is None:
            vectors_always_active = chosen["vectors_always_active"]
        if scale_updates is None:
            scale_updates = chosen["scale_updates"]
        check_ratio("backprop_depth", backprop_depth)
        if bandit_loss not in BANDIT_LOSSES:
            raise ValueError(
                f"`bandit_loss` must be one of {BANDIT_LOSSES}, got {bandit_loss!r}: 'shifted'"
                " is the released code's loss (default), 'paper' Algorithm 2 literally, 'rank'"
                " the scale-free loss."
            )
        # A throw-away bandit validates the bandit options now rather than at setup
        # (p_min * N <= s reduces to p_min <= layer_ratio for every N).
        probe = max(1, math.ceil(1.0 / layer_ratio)) if is_ratio(layer_ratio) else 1
        probe_bandit = LayerBandit(probe, layer_ratio, p_min, alpha_p, bandit_loss)
        super().__init__(
            rho=rho,
            head_always_active=head_always_active,
            vectors_always_active=vectors_always_active,
            **kwargs,
        )
        self.preset = preset
        self._init_subset(layer_ratio, dense_warmup, min_updates, scale_updates, max_update_scale)
        self.p_min = float(p_min)
        self.alpha_p = probe_bandit.alpha_p
        self.bandit_loss = bandit_loss
        self.backprop_depth = float(backprop_depth)

    @property
    def bandit(self) -> LayerBandit:
        """The layer-selection bandit (available after setup)."""
        selection = self.selection
        while isinstance(selection, (DepthCut, DenseWarmup)):
            selection = selection.inner
        return selection  # type: ignore[return-value]

    def _selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        bandit = LayerBandit(
            num_layers, self.effective_ratio, self.p_min, self.alpha_p, self.bandit_loss,
            generator,
        )  # fmt: skip
        rule: LayerSelection = bandit
        if self.backprop_depth < 1.0:
            cut = torch.Generator().manual_seed(int(generator.initial_seed()) + 2)
            rule = DepthCut(bandit, self.backprop_depth, cut)
        return self._with_warmup(rule, generator)

    def _selection_metrics(self) -> dict[str, float]:
        probs = self.bandit.probs
        return {
            "slsam/floor_layers": float((probs <= self.p_min * (1 + 1e-9)).sum()),
            "slsam/full_layers": float((probs >= 1 - 1e-9).sum()),
        }

    def _hyperparameters(self) -> dict[str, Any]:
        return {
            **super()._hyperparameters(),
            "preset": self.preset,
            "p_min": self.p_min,
            "alpha_p": self.alpha_p,
            "bandit_loss": self.bandit_loss,
            "backprop_depth": self.backprop_depth,
        }

    def _adopt_selection_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The constructor's bandit options win over the checkpoint's.

        The learned distribution carries over; when ``layer_ratio`` or ``p_min`` changed it
        is KL-projected onto the new constraint set, exactly as an update would be. Wrappers
        added or removed since the checkpoint (a depth cut, a dense warm-up) start afresh.
        """
        from lightning.pytorch.utilities import rank_zero_warn

        bandit = _innermost(saved)
        wanted = {
            "layer_ratio": self.effective_ratio,
            "p_min": self.p_min,
            "alpha_p": self.alpha_p,
            "loss": self.bandit_loss,
        }
        changed = {k: (bandit[k], v) for k, v in wanted.items() if bandit.get(k) != v}
        if changed:
            rank_zero_warn(
                "Resuming SL-SAM with options that differ from the checkpoint's: "
                + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
                + ". The new options apply from now on; the learned layer distribution is kept"
                " (projected onto the new budget where needed)."
            )
            probs = bandit["probs"].double()
            budget = wanted["layer_ratio"] * probs.numel()
            bandit = {**bandit, **wanted, "probs": kl_projection(probs.log(), budget, self.p_min)}
        current = self.selection.state_dict()
        if _depth(current) == _depth(saved):
            return _replace_innermost(saved, bandit)
        return _replace_innermost(current, bandit)


def _innermost(state: dict[str, Any]) -> dict[str, Any]:
    """The bandit's state inside wrapper states (``{"inner": ...}``)."""
    while "probs" not in state and "inner" in state:
        state = state["inner"]
    return state


def _depth(state: dict[str, Any]) -> int:
    return 0 if "probs" in state or "inner" not in state else 1 + _depth(state["inner"])


def _replace_innermost(state: dict[str, Any], bandit: dict[str, Any]) -> dict[str, Any]:
    if "probs" in state or "inner" not in state:
        return bandit
    return {**state, "inner": _replace_innermost(state["inner"], bandit)}


class RandomSLSAM(_LayerSubset):
    """Random-SL-SAM, the SL-SAM paper's ablation: layers sampled uniformly, each with
    probability ``layer_ratio`` every step, no bandit (then SAM on them, as SL-SAM).

    Args:
        layer_ratio: probability of each layer per step, in (0, 1]. Paper: 0.2.
        dense_warmup: as :class:`SparseLayerSAM` (default 0).
        min_updates: as :class:`SparseLayerSAM` (default 0).
        scale_updates: as :class:`SparseLayerSAM` (default ``False``); with uniform
            sampling every drawn layer's update is scaled by ``1 / layer_ratio``.
        max_update_scale: as :class:`SparseLayerSAM`.
        **kwargs: the common options of :class:`~lightning_slsam.callback.SAMCallback`.
    """

    method = "random_slsam"

    def __init__(
        self,
        layer_ratio: float = 0.2,
        dense_warmup: int | float = 0,
        min_updates: int = 0,
        scale_updates: bool = False,
        max_update_scale: float | None = None,
        **kwargs: Any,
    ) -> None:
        self._init_subset(layer_ratio, dense_warmup, min_updates, scale_updates, max_update_scale)
        super().__init__(**kwargs)

    def _selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        return self._with_warmup(
            UniformSelection(num_layers, self.effective_ratio, generator), generator
        )


class TopSLSAM(SAMCallback):
    """Top-SL-SAM, the SL-SAM paper's greedy ablation: the first pass computes every
    layer's gradient, then SAM's ascent and second pass run on the ``k`` layers with the
    largest gradient norms (``k = round(layer_ratio * N)``, at least 1), which alone are
    updated. No exploration: the paper reports it stalls with most layers never selected;
    ``slsam/never_selected`` logs that count.

    Args:
        layer_ratio: fraction of layers kept, in (0, 1]. Paper: 0.2.
        **kwargs: the common options of :class:`~lightning_slsam.callback.SAMCallback`.
    """

    method = "top_slsam"

    def __init__(self, layer_ratio: float = 0.2, **kwargs: Any) -> None:
        self.layer_ratio = check_ratio("layer_ratio", layer_ratio)
        super().__init__(**kwargs)

    def _selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        return TopKSelection(num_layers, max(1, round(self.layer_ratio * num_layers)))

    def _hyperparameters(self) -> dict[str, Any]:
        return {**super()._hyperparameters(), "layer_ratio": self.layer_ratio}


class S2SAM(SAM):
    """S2-SAM (Ji et al., 2024, "Single-step SAM"; Algorithm 3 of the SL-SAM paper): each
    step perturbs every layer along the gradient of the previous step and runs one
    forward/backward there; that gradient updates the weights and is kept for the next
    step. One pass per step (Active Ratio 1.0x); the first step is a plain step.

    Args:
        rho: perturbation radius (paper: 0.01).
        **kwargs: the common options of :class:`~lightning_slsam.callback.SAMCallback`
            (the schedule is ``"single"``).
    """

    method = "s2sam"
    default_schedule = "single"
    schedule_fixed = True


class SLS2SAM(SparseLayerSAM):
    """SL-S2-SAM (Algorithm 4 of the SL-SAM paper): single-step SAM on bandit-sampled
    layers. Each active layer perturbs along its own last computed gradient; the bandit
    learns from the norms of the step's (perturbed) gradients. The first step is a plain
    step on every layer, which records every layer's first gradient.

    Args:
        rho: perturbation radius (paper: 0.01).
        layer_ratio: expected fraction of active layers. Paper: 0.3 on DeiT-Small, 0.2 on
            GLUE (default), 0.5 on Llama-3.2-3B.
        p_min: as :class:`SparseLayerSAM`.
        alpha_p: as :class:`SparseLayerSAM`.
        bandit_loss: as :class:`SparseLayerSAM`.
        **kwargs: the common options (the schedule is ``"single"``).
    """

    method = "sl_s2sam"
    default_schedule = "single"
    schedule_fixed = True


class RST(SAM):
    """RST (Zhao et al., 2022, "Randomized Sharpness-Aware Training"): each step is a SAM
    step with probability ``probability``, otherwise a plain step, drawn from a seeded
    generator (Active Ratio ``1 + probability``: 1.5x at the paper's 0.5).

    Args:
        probability: chance of a SAM step, in [0, 1]. Paper: 0.5.
        **kwargs: the common options (the schedule is ``"random"``).
    """

    method = "rst"
    default_schedule = "random"
    schedule_fixed = True

    def __init__(self, probability: float = 0.5, **kwargs: Any) -> None:
        super().__init__(sam_probability=probability, **kwargs)


class LookSAM(SAM):
    """LookSAM (Liu et al., 2022, "Towards Efficient and Scalable Sharpness-Aware
    Minimization"): a full SAM step every ``interval`` steps, which stores ``g_v``, the
    part of the SAM gradient orthogonal to the plain gradient; the steps in between run
    one pass and add ``alpha * ||g|| / ||g_v|| * g_v`` to their gradient (Active Ratio
    ``1 + 1/interval``: 1.2x at 5).

    Args:
        interval: steps between SAM steps, >= 1. LookSAM: 5.
        alpha: weight of the reused component, >= 0. LookSAM: 0.7.
        **kwargs: the common options (the schedule is ``"interval"``).
    """

    method = "looksam"
    default_schedule = "interval"
    schedule_fixed = True

    def __init__(self, interval: int = 5, alpha: float = 0.7, **kwargs: Any) -> None:
        super().__init__(sam_interval=interval, looksam_alpha=alpha, **kwargs)


class ESAM(SAMCallback):
    """ESAM (Du et al., 2022, "Efficient Sharpness-aware Minimization for Improved
    Training of Neural Networks").

    * Stochastic weight perturbation: the first pass computes the gradient of a random
      ``weight_ratio`` of the layers (each independently), and only they are perturbed.
    * Sharpness-sensitive data selection: a forward pass at the perturbed point (no
      gradient) measures each sample's loss increase; the second pass runs on the
      ``data_ratio`` fraction of the batch whose loss rose most. It updates every layer.

    Active Ratio ``weight_ratio + 1`` (1.5x at the paper's 0.5). The data selection needs
    per-sample losses: ``training_step`` returns a 1-D tensor of them (the mixin averages
    it for the update), or ``{"loss": ..., "per_sample_loss": ...}``; the batch is cut to
    the selected samples by ``SAMMixin.sam_subset_batch`` (override it for custom batch
    types). ``data_ratio=1.0`` turns the selection off.

    Args:
        weight_ratio: fraction of layers perturbed, in (0, 1]. Paper: 0.5.
        data_ratio: fraction of each batch in the second pass, in (0, 1]. Paper: 0.5.
        **kwargs: the common options of :class:`~lightning_slsam.callback.SAMCallback`.
    """

    method = "esam"

    def __init__(self, weight_ratio: float = 0.5, data_ratio: float = 0.5, **kwargs: Any) -> None:
        self.weight_ratio = check_ratio("weight_ratio", weight_ratio)
        self.data_ratio = check_ratio("data_ratio", data_ratio)
        super().__init__(**kwargs)

    def _selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        return ExpandToAll(UniformSelection(num_layers, self.weight_ratio, generator))

    def _engine_options(self) -> dict[str, Any]:
        return {"data_ratio": self.data_ratio}

    def _hyperparameters(self) -> dict[str, Any]:
        return {
            **super()._hyperparameters(),
            "weight_ratio": self.weight_ratio,
            "data_ratio": self.data_ratio,
        }


class SSAMF(SAMCallback):
    """SSAM-F (Mi et al., 2022, "Make Sharpness-Aware Minimization Stronger: A Sparsified
    Perturbation Approach"): SAM whose ascent is zeroed outside a mask of the coordinates
    with the largest empirical Fisher information (squared per-sample gradients), keeping
    ``1 - sparsity`` of all coordinates. The mask is recomputed every ``mask_interval``
    steps from ``fisher_samples`` samples of the current batch (one backward each,
    counted in ``slsam/backward_passes``). Both passes are dense: Active Ratio 2.0x.

    The reference implementation estimates the Fisher from 1024 samples every 5 epochs of
    training from scratch; for fine-tuning runs of a few epochs the defaults refresh more
    often from fewer samples.

    Args:
        sparsity: fraction of coordinates not perturbed, in [0, 1). Paper: 0.5.
        fisher_samples: per-sample gradients per refresh (capped at the batch size).
        mask_interval: optimizer steps between refreshes (the first step included).
        **kwargs: the common options of :class:`~lightning_slsam.callback.SAMCallback`.
    """

    method = "ssamf"

    def __init__(
        self,
        sparsity: float = 0.5,
        fisher_samples: int = 16,
        mask_interval: int = 100,
        **kwargs: Any,
    ) -> None:
        FisherMask(sparsity, fisher_samples, mask_interval)  # validates now
        self.sparsity = float(sparsity)
        self.fisher_samples = fisher_samples
        self.mask_interval = mask_interval
        super().__init__(**kwargs)

    def _engine_options(self) -> dict[str, Any]:
        return {"fisher": FisherMask(self.sparsity, self.fisher_samples, self.mask_interval)}

    def _hyperparameters(self) -> dict[str, Any]:
        return {
            **super()._hyperparameters(),
            "sparsity": self.sparsity,
            "fisher_samples": self.fisher_samples,
            "mask_interval": self.mask_interval,
        }


#: Method name -> (callback class or ``None`` for plain AdamW, preset options). The SL-SAM
#: methods name ``preset="paper"``: comparisons and the paper's recipes run the paper's
#: SL-SAM whatever the class's default.
METHODS: dict[str, tuple[type[SAMCallback] | None, dict[str, Any]]] = {
    "adamw": (None, {}),
    "sam": (SAM, {}),
    "adasam": (SAM, {}),
    "slsam": (SparseLayerSAM, {"preset": "paper"}),
    "random_slsam": (RandomSLSAM, {}),
    "top_slsam": (TopSLSAM, {}),
    "s2sam": (S2SAM, {}),
    "sl_s2sam": (SLS2SAM, {"preset": "paper"}),
    "rst": (RST, {}),
    "esam": (ESAM, {}),
    "ssamf": (SSAMF, {}),
    "looksam": (LookSAM, {}),
    "slsam_rst": (SparseLayerSAM, {"preset": "paper", "schedule": "random"}),
    "slsam_looksam": (SparseLayerSAM, {"preset": "paper", "schedule": "interval"}),
    "slsam_depth": (SparseLayerSAM, {"preset": "paper", "backprop_depth": 0.5}),
    "slsam_robust": (SparseLayerSAM, {"preset": "robust"}),
}


def make_callback(name: str, **kwargs: Any) -> SAMCallback:
    """The callback of method ``name`` (see :data:`METHODS`).

    ``kwargs`` override the method's defaults, e.g. ``make_callback("slsam", layer_ratio=0.3)``.
    Plain AdamW has no callback: ``make_callback("adamw")`` raises, and
    :func:`make_callbacks` gives a list that is empty for it.
    """
    cls, preset = _lookup(name)
    if cls is None:
        raise ValueError(
            f"Method {name!r} is plain AdamW, which needs no callback: leave it out of"
            f" Trainer(callbacks=...), or use make_callbacks({name!r}), which returns []."
        )
    return cls(**{**preset, **kwargs})


def make_callbacks(name: str, **kwargs: Any) -> list[SAMCallback]:
    """``[make_callback(name, **kwargs)]``, or ``[]`` for plain AdamW: ready for
    ``Trainer(callbacks=...)`` whatever the method."""
    cls, _ = _lookup(name)
    if cls is None:
        if kwargs:
            raise ValueError(f"Method {name!r} (plain AdamW) takes no options, got {kwargs}.")
        return []
    return [make_callback(name, **kwargs)]


def _lookup(name: str) -> tuple[type[SAMCallback] | None, dict[str, Any]]:
    key = name.lower().replace("-", "_")
    if key not in METHODS:
        close = difflib.get_close_matches(key, METHODS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown method {name!r}.{hint} Choose one of {sorted(METHODS)}.")
    return METHODS[key]
