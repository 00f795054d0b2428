"""SL-SAM (the SL-SAM paper's Algorithms 1 and 2): SAM on the layers a bandit
(:class:`~lightning_slsam.selection.bandit.LayerBandit`) draws each step, learning from the
first pass's per-layer gradient norms; ``preset="paper"`` is the paper's exact method,
``preset="default"`` adds remedies beyond it (:data:`PRESETS`; docs/methods.md#the-presets).

>>> spec = SLSAMSpec()
>>> spec.preset, spec.setting("budget"), spec.setting("bandit_loss"), spec.update_scale
('default', 'compute', 'rank', 3.0)
>>> paper = SLSAMSpec(preset="paper")
>>> paper.setting("budget"), paper.setting("bandit_loss"), paper.update_scale
('count', 'shifted', None)
>>> SLSAMSpec(layer_ratio=0.01, p_min=0.05)
Traceback (most recent call last):
...
ValueError: SparseLayerSAM: `p_min` must be at most layer_ratio=0.01 (the floors alone ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.methods.options import invalid, number, one_of
from lightning_slsam.methods.spec import (
    LayerSubsetOptions,
    LayerSubsetSpec,
    Preset,
    Setting,
    Warn,
    option,
)
from lightning_slsam.selection.bandit import (
    REL_TOL,
    LayerBandit,
    kl_projection,
    weighted_kl_projection,
)
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["PRESETS", "PRESET_WORDS", "SLSAMOptions", "SLSAMSpec"]

#: What each SL-SAM preset sets: ``budget`` (the bandit counts drawn layers, ``"count"``, or
#: their parameters, ``"compute"``), the bandit's loss and step size, ``head_always_active``
#: (the fresh task head trained every step) and ``max_update_scale`` (cap on ``1 / q``).
PRESETS: dict[Preset, dict[Setting, Any]] = {
    "default": {
        "budget": "compute",
        "bandit_loss": "rank",
        "alpha_p": 0.03,
        "head_always_active": True,
        "max_update_scale": 3.0,
    },
    "paper": {
        "budget": "count",
        "bandit_loss": "shifted",
        "alpha_p": 1e-3,
        "head_always_active": False,
        "max_update_scale": 1.0,
    },
}

#: Each preset in words (the run summary and the option's help print it).
PRESET_WORDS: dict[Preset, str] = {
    "default": "parameter budget, rank bandit, head every step, updates scaled up to 3x;"
    " preset='paper' is the paper's method",
    "paper": "the SL-SAM paper's exact method",
}

_PRESET_HINT = (
    ": 'default' budgets parameters, with the rank bandit, the fresh head trained every step"
    " and updates scaled up to 3x; 'paper' is the SL-SAM paper's exact method"
)


@dataclass(kw_only=True, eq=False)
class SLSAMOptions(LayerSubsetOptions):
    """SL-SAM's options.

    Args:
        layer_ratio: the bandit's budget per step, in (0, 1] (default 0.2): the expected
            fraction of the *parameters* drawn (``preset="default"``) or of the *layers*
            (``"paper"``, the paper's ``s/N``). 1.0 is SAM on every layer.
        p_min: lower bound of every layer's probability, in (0, 1), at most
            ``layer_ratio``. Paper: 1e-3.
        preset: ``"default"`` (beyond the paper) or ``"paper"`` (the paper's exact method);
            what each sets: :data:`PRESETS`.
    """

    p_min: float = option(1e-3, number(0, 1, low_open=True, high_open=True, note=", e.g. 1e-3"))
    preset: Preset = option("default", one_of(tuple(PRESETS), _PRESET_HINT))


@dataclass(kw_only=True, eq=False)
class SLSAMSpec(SLSAMOptions, LayerSubsetSpec):
    """SL-SAM: SAM on a bandit-sampled subset of layers."""

    name: ClassVar[str] = "slsam"
    label: ClassVar[str] = "SparseLayerSAM"
    PRESETS: ClassVar[dict[Preset, dict[Setting, Any]]] = PRESETS
    PRESET_WORDS: ClassVar[dict[Preset, str]] = PRESET_WORDS

    def check_combined(self) -> None:
        super().check_combined()
        if self.p_min > self.layer_ratio * (1.0 + REL_TOL):
            raise invalid("p_min", self.p_min, f"at most layer_ratio={self.layer_ratio:g} (the"
                          " floors alone would exceed the layer budget)")  # fmt: skip

    def layer_costs(self, layers: LayerPartition) -> torch.Tensor | None:
        """The bandit's per-layer costs: ``None`` under the count budget, else each layer's
        parameter count."""
        if self.setting("budget") == "count":
            return None
        return torch.tensor(layers.numel, dtype=torch.float64)

    def selection(self, layers: LayerPartition, generator: torch.Generator) -> LayerSelection:
        return LayerBandit(
            layers.num_layers, self.layer_ratio, self.p_min, self.setting("alpha_p"),
            self.setting("bandit_loss"), generator, costs=self.layer_costs(layers),
        )  # fmt: skip

    def adopt_selection_state(self, saved: dict[str, Any], current: dict[str, Any],
                              warn: Warn) -> dict[str, Any]:  # fmt: skip
        """The current bandit options win over the checkpoint's: the learned distribution
        carries over, KL-projected onto the new budget when ``layer_ratio``, ``p_min`` or the
        budget changed; a wrapper added or removed since the checkpoint starts afresh."""
        bandit = _innermost(saved)
        costs = _innermost(current).get("costs")  # the running bandit's, from the model's layers
        wanted = {
            "layer_ratio": self.layer_ratio,
            "p_min": self.p_min,
            "alpha_p": self.setting("alpha_p"),
            "loss": self.setting("bandit_loss"),
        }
        changed = {k: (bandit[k], v) for k, v in wanted.items() if bandit.get(k) != v}
        saved_costs = bandit.get("costs")
        if (saved_costs is None) != (costs is None) or (
            costs is not None and not torch.equal(torch.as_tensor(saved_costs).double(), costs)
        ):
            changed["budget"] = ("count" if saved_costs is None else "compute",
                                 self.setting("budget"))  # fmt: skip
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
