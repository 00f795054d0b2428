"""Random-SL-SAM, the SL-SAM paper's ablation: SL-SAM with each layer drawn uniformly with
probability ``layer_ratio`` every step, no bandit.

>>> RandomSLSAMSpec().preset, RandomSLSAMSpec(preset="default").update_scale
('paper', 3.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.methods.options import one_of
from lightning_slsam.methods.spec import (
    LayerSubsetOptions,
    LayerSubsetSpec,
    Preset,
    Setting,
    option,
)
from lightning_slsam.selection.rules import LayerSelection, UniformSelection

__all__ = ["RandomSLSAMOptions", "RandomSLSAMSpec"]

#: What each preset sets (see :meth:`~lightning_slsam.methods.spec.MethodSpec.setting`).
PRESETS: dict[Preset, dict[Setting, Any]] = {
    "paper": {"head_always_active": False, "max_update_scale": 1.0},
    "default": {"head_always_active": True, "max_update_scale": 3.0},
}


@dataclass(kw_only=True, eq=False)
class RandomSLSAMOptions(LayerSubsetOptions):
    """Random-SL-SAM's options.

    Args:
        preset: ``"paper"`` (default: the paper's ablation) or ``"default"`` (the fresh
            task head trained every step, updates scaled by ``1 / layer_ratio`` up to 3).
    """

    preset: Preset = option("paper", one_of(tuple(PRESETS)))


@dataclass(kw_only=True, eq=False)
class RandomSLSAMSpec(RandomSLSAMOptions, LayerSubsetSpec):
    """Random-SL-SAM: layers drawn uniformly with probability ``layer_ratio`` each."""

    name: ClassVar[str] = "random_slsam"
    label: ClassVar[str] = "RandomSLSAM"
    PRESETS: ClassVar[dict[Preset, dict[Setting, Any]]] = PRESETS
    PRESET_WORDS: ClassVar[dict[Preset, str]] = {
        "paper": "the SL-SAM paper's ablation",
        "default": "head every step, updates scaled up to 3x",
    }

    def selection(self, layers: LayerPartition, generator: torch.Generator) -> LayerSelection:
        return UniformSelection(layers.num_layers, self.layer_ratio, generator)
