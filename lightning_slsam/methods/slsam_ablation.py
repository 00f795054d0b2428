"""SL-SAM with each setting of its presets given alone, for ablations and the results scripts
(``--option x.budget=count``); for training, choose a preset.

>>> spec = SLSAMAblationSpec(preset="paper", bandit_loss="rank", max_update_scale=5.0)
>>> spec.setting("budget"), spec.setting("bandit_loss"), spec.setting("alpha_p")
('count', 'rank', 0.03)
>>> spec.update_scale
5.0
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_slsam.core.partition import LayerPartition, find_new_head
from lightning_slsam.methods.options import FLAG, number, one_of
from lightning_slsam.methods.slsam import SLSAMOptions, SLSAMSpec
from lightning_slsam.methods.spec import Setting, Warn, option
from lightning_slsam.selection.bandit import DEFAULT_ALPHA

__all__ = ["SLSAMAblationOptions", "SLSAMAblationSpec"]


@dataclass(kw_only=True, eq=False)
class SLSAMAblationOptions(SLSAMOptions):
    """SLSAMAblation's options.

    Args:
        budget: ``"count"`` (drawn layers, the paper's) or ``"compute"`` (their parameters).
        bandit_loss: ``"shifted"`` (released code), ``"paper"`` (Algorithm 2) or ``"rank"``.
        alpha_p: the bandit's step size (>= 0); ``None`` with a loss given: that loss's
            own (1e-3 for ``"shifted"`` and ``"paper"``, 0.03 for ``"rank"``).
        head_always_active: train the fresh task head every step.
        max_update_scale: the cap on each drawn layer's update factor ``1 / q`` (>= 1; 1
            disables the scaling).
    """

    budget: str | None = option(None, one_of(("count", "compute")).or_none(" (the preset's)"))
    bandit_loss: str | None = option(
        None, one_of(("shifted", "paper", "rank")).or_none(" (the preset's)")
    )
    alpha_p: float | None = option(None, number(0).or_none(" (the preset's or the loss's)"))
    head_always_active: bool | None = option(None, FLAG.or_none(" (the preset's)"))
    max_update_scale: float | None = option(None, number(1).or_none(" (the preset's)"))


@dataclass(kw_only=True, eq=False)
class SLSAMAblationSpec(SLSAMAblationOptions, SLSAMSpec):
    """SL-SAM with its preset's settings overridable one by one (``None``: the preset's)."""

    name: ClassVar[str] = "slsam_ablation"
    label: ClassVar[str] = "SLSAMAblation"

    def setting(self, name: Setting) -> Any:
        given = getattr(self, name)
        if given is not None:
            return given
        if name == "alpha_p" and self.bandit_loss is not None:
            return DEFAULT_ALPHA[self.bandit_loss]
        return super().setting(name)

    def partition(self, module: torch.nn.Module, warn: Warn = warnings.warn) -> LayerPartition:
        if self.head_always_active and not find_new_head(module):
            warn(
                f"{self.label}(head_always_active=True) found no freshly initialised head"
                f" in {type(module).__name__}; every layer is sampled. Name the head with"
                " `always_active` or a `sam_head_parameters()` method."
            )
        return super().partition(module, warn)
