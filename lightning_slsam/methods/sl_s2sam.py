"""SL-S2-SAM (the SL-SAM paper's Algorithm 4): single-step SAM on bandit-sampled layers, each
perturbed along its own last computed gradient; the first step is plain, on every layer.

>>> SLS2SAMSpec().preset, SLS2SAMSpec(layer_ratio=0.3).layer_ratio
('paper', 0.3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.options import one_of
from lightning_slsam.methods.s2sam import SingleStepParts
from lightning_slsam.methods.slsam import _PRESET_HINT, PRESETS, SLSAMOptions, SLSAMSpec
from lightning_slsam.methods.spec import Preset, option

__all__ = ["SLS2SAMOptions", "SLS2SAMSpec"]


@dataclass(kw_only=True, eq=False)
class SLS2SAMOptions(SLSAMOptions):
    """SL-S2-SAM's options."""

    preset: Preset = option("paper", one_of(tuple(PRESETS), _PRESET_HINT))


@dataclass(kw_only=True, eq=False)
class SLS2SAMSpec(SLS2SAMOptions, SLSAMSpec):
    """SL-S2-SAM: single-step SAM on bandit-sampled layers (``preset="paper"`` by default)."""

    name: ClassVar[str] = "sl_s2sam"
    label: ClassVar[str] = "SLS2SAM"

    def parts(self, generator: torch.Generator) -> MethodParts:
        return SingleStepParts()
