"""Specifications of the methods that train a subset of layers each step: SL-SAM, its
ablations (Random-SL-SAM, Top-SL-SAM) and SL-S2-SAM, with the short-run remedies
(dense warm-up, a floor on each layer's updates, update scaling, the scale-free bandit).

Each specification builds an engine for a plain loop; the examples of
:mod:`lightning_slsam.methods.registry` run every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lightning_slsam.core.validation import FLAG, RATIO, Rule, invalid, number, one_of
from lightning_slsam.methods.presets import BANDIT_LOSSES, BUDGETS, PRESET_WORDS, PRESETS
from lightning_slsam.methods.spec import MethodSpec, Warn, option
from lightning_slsam.selection.bandit import DEFAULT_ALPHA, LayerBandit, kl_projection
from lightning_slsam.selection.projection import REL_TOL, weighted_kl_projection
from lightning_slsam.selection.rules import LayerSelection, TopKSelection, UniformSelection
from lightning_slsam.selection.wrappers import DenseWarmup, DepthCut

__all__ = [
    "BANDIT_LOSSES",
    "BUDGETS",
    "PRESETS",
    "PRESET_WORDS",
    "LayerSubsetSpec",
    "RandomSLSAMSpec",
    "SLS2SAMSpec",
    "SLSAMSpec",
    "TopSLSAMSpec",
]


def _warmup(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return (isinstance(value, int) and value >= 0) or (isinstance(value, float) and 0 <= value < 1)


_PRESET_WORDS = (
    ": 'default' budgets parameters with the short-fine-tune remedies, 'paper' is the SL-SAM"
    " paper's method, 'robust' the remedies under the paper's budget"
)
_BUDGET_WORDS = (
    ": 'count' is the paper's (expected drawn layers), 'compute' counts their parameters"
)
_LOSS_WORDS = (
    ": 'shifted' is the released code's loss, 'paper' Algorithm 2 literally, 'rank' the"
    " scale-free loss"
)
_SCHEDULE_WORDS = ": 'random' is RST's coin, 'interval' LookSAM's; single-step SL-SAM is SLS2SAM"

#: ``dense_warmup``'s check.
WARMUP = Rule("an integer number of steps >= 0 or a fraction of the run in [0, 1)", _warmup)
#: The schedules SL-SAM can run (single-step SL-SAM is :class:`SLS2SAMSpec`).
SLSAM_SCHEDULES = ("every_step", "random", "interval")


@dataclass(kw_only=True, eq=False)
class LayerSubsetSpec(MethodSpec):
    """What the methods that sample a subset of layers share.

    Args:
        layer_ratio: expected fraction of layers active per step, in (0, 1]. Paper: 0.2.
        dense_warmup: anneal the layer ratio linearly from 1 (every layer) to
            ``layer_ratio`` over this many steps (an int), or this fraction of the run (a
            float in [0, 1)). 0 disables it.
        min_updates: raise the layer ratio, for this run, to ``min_updates / total_steps``
            when that is larger (0 disables it).
        scale_updates: multiply each drawn layer's update by ``1 / q``, ``q`` its
            probability of being drawn that step, capped at ``max_update_scale``.
        max_update_scale: the cap on that factor (>= 1); ``None``: ``1 / layer_ratio``.
    """

    samples_layers: ClassVar[bool] = True

    layer_ratio: float = option(0.2, RATIO)
    dense_warmup: int | float = option(0, WARMUP)
    min_updates: int = option(0, number(0, integer=True))
    scale_updates: bool = option(False, FLAG)
    max_update_scale: float | None = option(None, number(1).or_none(" (1 / layer_ratio)"))

    @property
    def update_scale(self) -> float | None:
        """The cap on the update factor ``1 / q`` in use (``None``: no scaling)."""
        if not self.scale_updates:
            return None
        if self.max_update_scale is not None:
            return self.max_update_scale
        return 1.0 / self.effective_ratio

    def engine_options(self) -> dict[str, Any]:
        return {**super().engine_options(), "update_scale": self.update_scale}

    def needs_total_steps(self) -> bool:
        return (
            isinstance(self.dense_warmup, float) and self.dense_warmup > 0
        ) or self.min_updates > 0

    def _run_length(self, option: str) -> int:
        if self.total_steps is None:
            raise ValueError(
                f"{self.label}({option}) depends on the run's length, which is"
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


@dataclass(kw_only=True, eq=False)
class SLSAMSpec(LayerSubsetSpec):
    """SL-SAM: SAM on a bandit-sampled subset of layers each step.

    Args:
        p_min: lower bound of every layer's probability, in (0, 1), at most
            ``layer_ratio``. Paper: 1e-3.
        alpha_p: bandit step size (>= 0). ``None``: the loss's own (1e-3 for ``"shifted"``
            and ``"paper"``, 0.03 for ``"rank"``).
        bandit_loss: ``"shifted"`` (released code), ``"paper"`` (Algorithm 2 literally) or
            ``"rank"`` (scale-free). ``None``: the preset's.
        budget: what the bandit's budget counts (beyond the paper). ``"count"``: the
            paper's ``sum(p) = layer_ratio * N``, an expected number of drawn layers, whatever
            their size. ``"compute"``: ``sum(numel * p) = layer_ratio * sum(numel)``, an
            expected fraction of the parameters, which bounds the weight-gradient,
            perturbation and update work per step whichever layers the bandit favours (a
            vocabulary embedding costs its size, a LayerNorm bias almost nothing).
            ``None``: the preset's.
        backprop_depth: cost-aware SL-SAM: freeze every layer below a random cut so
            back-propagation reaches a ``backprop_depth`` fraction of the layers on average.
            1.0 (default) disables it.
        preset: ``"default"`` (beyond the paper: the compute budget, the rank loss, the
            head trained every step, update scaling capped at 3), ``"paper"`` (the paper's
            exact method) or ``"robust"``; the options left at ``None`` take its values
            (:data:`PRESETS`).

        schedule: the iteration axis, SAM's steps among all: ``"every_step"`` (``None``,
            the default), ``"random"`` (RST's coin: a SAM step with chance
            ``sam_probability``, else a plain step) or ``"interval"`` (LookSAM's: a SAM
            step every ``sam_interval`` steps, the stored SAM component reused in between
            with weight ``looksam_alpha``). Single-step SL-SAM is :class:`SLS2SAMSpec`.
        sam_probability: with ``schedule="random"``, chance of a SAM step, in [0, 1].
        sam_interval: with ``schedule="interval"``, steps between SAM steps (>= 1).
        looksam_alpha: with ``schedule="interval"``, weight of the reused component
            (>= 0; 0 makes the steps in between plain steps).
        dense_one_pass: with ``schedule="random"`` or ``"interval"``, the steps that run
            one pass train every layer; only the SAM steps are sparse. Default ``False``.

    ``dense_warmup``, ``min_updates``, ``head_always_active``, ``vectors_always_active``,
    ``scale_updates`` and ``max_update_scale`` default to ``None``: the preset's value (a
    ``max_update_scale`` the preset leaves at ``None`` means ``1 / layer_ratio``).
    """

    name: ClassVar[str] = "slsam"
    label: ClassVar[str] = "SparseLayerSAM"

    p_min: float = option(1e-3, number(0, 1, low_open=True, high_open=True, note=", e.g. 1e-3"))
    alpha_p: float | None = option(None, number(0, note=", e.g. 1e-3").or_none(" (the loss's)"))
    bandit_loss: str | None = option(None, one_of(BANDIT_LOSSES, _LOSS_WORDS))
    budget: str | None = option(None, one_of(BUDGETS, _BUDGET_WORDS))
    backprop_depth: float = option(1.0, RATIO)
    dense_warmup: int | float | None = option(None, WARMUP)  # type: ignore[assignment]
    min_updates: int | None = option(None, number(0, integer=True))  # type: ignore[assignment]
    head_always_active: bool | None = option(None, FLAG)  # type: ignore[assignment]
    vectors_always_active: bool | None = option(None, FLAG)  # type: ignore[assignment]
    scale_updates: bool | None = option(None, FLAG)  # type: ignore[assignment]
    preset: str = option("default", one_of(tuple(PRESETS), _PRESET_WORDS))
    schedule: str | None = option(None, one_of(SLSAM_SCHEDULES, _SCHEDULE_WORDS))  # type: ignore[assignment]
    sam_probability: float = option(0.5, number(0, 1))
    sam_interval: int = option(5, number(1, integer=True))
    looksam_alpha: float = option(0.7, number(0))
    dense_one_pass: bool = option(False, FLAG)

    def resolve_defaults(self) -> None:
        super().resolve_defaults()
        if self.schedule is None:
            self.schedule = "every_step"
        one_of(tuple(PRESETS), _PRESET_WORDS)("preset", self.preset)
        #: The options the preset decided (left at None); warnings about an option the
        #: user did not set stay quiet (a model with no fresh head under the default, say).
        self._from_preset = tuple(n for n in PRESETS[self.preset] if getattr(self, n) is None)
        for name in self._from_preset:
            setattr(self, name, PRESETS[self.preset][name])

    def check_combined(self) -> None:
        super().check_combined()
        # The floors alone must fit the budget: p_min * N <= layer_ratio * N for every N.
        if self.p_min > self.layer_ratio * (1.0 + REL_TOL):
            raise invalid("p_min", self.p_min, f"at most layer_ratio={self.layer_ratio:g} (the"
                          " floors alone would exceed the layer budget)")  # fmt: skip
        if self.alpha_p is None:
            self.alpha_p = DEFAULT_ALPHA[self.bandit_loss]

    def layer_costs(self, num_layers: int) -> torch.Tensor | None:
        """The bandit's per-layer costs: ``None`` under the count budget, else each layer's
        parameter count (known once :meth:`build_engine` has partitioned the model)."""
        if self.budget == "count":
            return None
        numel = getattr(self, "layer_numel", None)
        if numel is None or len(numel) != num_layers:
            raise ValueError(
                f"{self.label}(budget='compute') needs each layer's parameter count: build the"
                " engine with build_engine (or make_engine), which partitions the model."
            )
        return torch.tensor(numel, dtype=torch.float64)

    def selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        bandit = LayerBandit(
            num_layers, self.effective_ratio, self.p_min, self.alpha_p, self.bandit_loss,
            generator, costs=self.layer_costs(num_layers),
        )  # fmt: skip
        rule: LayerSelection = bandit
        if self.backprop_depth < 1.0:
            cut = torch.Generator().manual_seed(int(generator.initial_seed()) + 2)
            rule = DepthCut(bandit, self.backprop_depth, cut)
        return self._with_warmup(rule, generator)

    def adopt_selection_state(self, saved: dict[str, Any], current: dict[str, Any],
                              warn: Warn) -> dict[str, Any]:  # fmt: skip
        """The current bandit options win over the checkpoint's.

        The learned distribution carries over; when ``layer_ratio`` or ``p_min`` changed it
        is KL-projected onto the new constraint set, exactly as an update would be. Wrappers
        added or removed since the checkpoint (a depth cut, a dense warm-up) start afresh.
        """
        bandit = _innermost(saved)
        costs = self.layer_costs(bandit["probs"].numel())
        wanted = {
            "layer_ratio": self.effective_ratio,
            "p_min": self.p_min,
            "alpha_p": self.alpha_p,
            "loss": self.bandit_loss,
        }
        changed = {k: (bandit[k], v) for k, v in wanted.items() if bandit.get(k) != v}
        saved_costs = bandit.get("costs")
        if (saved_costs is None) != (costs is None) or (
            costs is not None and not torch.equal(torch.as_tensor(saved_costs).double(), costs)
        ):
            changed["budget"] = ("count" if saved_costs is None else "compute", self.budget)
        if changed:
            warn(
                "Resuming SL-SAM with options that differ from the checkpoint's: "
                + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
                + ". The new options apply from now on; the learned layer distribution is kept"
                " (projected onto the new budget where needed)."
            )
            probs = bandit["probs"].double()
            ratio, log_p = wanted["layer_ratio"], probs.log()
            if costs is None:
                probs = kl_projection(log_p, ratio * probs.numel(), self.p_min)
            else:
                probs = weighted_kl_projection(log_p, costs, ratio * float(costs.sum()), self.p_min)
            bandit = {**bandit, **wanted, "costs": costs, "probs": probs}
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


@dataclass(kw_only=True, eq=False)
class RandomSLSAMSpec(LayerSubsetSpec):
    """Random-SL-SAM, the paper's ablation: layers drawn uniformly with probability
    ``layer_ratio`` each, no bandit."""

    name: ClassVar[str] = "random_slsam"
    label: ClassVar[str] = "RandomSLSAM"

    def selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        return self._with_warmup(
            UniformSelection(num_layers, self.effective_ratio, generator), generator
        )


@dataclass(kw_only=True, eq=False)
class TopSLSAMSpec(MethodSpec):
    """Top-SL-SAM, the paper's greedy ablation: SAM on the ``round(layer_ratio * N)``
    layers with the largest first-pass gradient norms.

    Args:
        layer_ratio: fraction of layers kept, in (0, 1]. Paper: 0.2.
    """

    name: ClassVar[str] = "top_slsam"
    label: ClassVar[str] = "TopSLSAM"
    samples_layers: ClassVar[bool] = True

    layer_ratio: float = option(0.2, RATIO)

    def selection(self, num_layers: int, generator: torch.Generator) -> LayerSelection:
        return TopKSelection(num_layers, max(1, round(self.layer_ratio * num_layers)))


@dataclass(kw_only=True, eq=False)
class SLS2SAMSpec(SLSAMSpec):
    """SL-S2-SAM (Algorithm 4): single-step SAM on bandit-sampled layers (its schedule is
    fixed: SL-SAM's schedule options are not its options)."""

    name: ClassVar[str] = "sl_s2sam"
    label: ClassVar[str] = "SLS2SAM"

    #: SL-S2-SAM keeps the paper's method by default (only SL-SAM's default moved).
    preset: str = option("paper", one_of(tuple(PRESETS), _PRESET_WORDS))
    schedule: str = field(default="single", init=False)
    sam_probability: float = field(default=0.5, init=False, repr=False)
    sam_interval: int = field(default=5, init=False, repr=False)
    looksam_alpha: float = field(default=0.7, init=False, repr=False)
    dense_one_pass: bool = field(default=False, init=False, repr=False)
