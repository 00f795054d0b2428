"""RST (Zhao et al., 2022, "Randomized Sharpness-Aware Training"): each step is a SAM step
with probability ``probability``, else a plain step, drawn from the method's own generator.

>>> import torch
>>> coin = Coin(0.5, torch.Generator().manual_seed(0))
>>> kinds = [coin.kind(t) for t in range(1000)]
>>> sorted(set(kinds)), round(kinds.count("sam") / 1000, 1)
(['plain', 'sam'], 0.5)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.step import MethodParts, StepKind
from lightning_slsam.methods.options import number
from lightning_slsam.methods.spec import MethodOptions, MethodSpec, option

__all__ = ["Coin", "RSTOptions", "RSTSpec"]


class Coin(MethodParts):
    """RST's coin (its generator's state is saved, so a resumed run flips the same coins)."""

    def __init__(self, probability: float, generator: torch.Generator) -> None:
        self.probability = float(probability)
        self.generator = generator

    def kind(self, step: int) -> StepKind:
        draw = torch.rand((), generator=self.generator, dtype=torch.float64)
        return "sam" if bool(draw < self.probability) else "plain"

    def state_dict(self, index: dict[int, int]) -> dict[str, Any]:
        return {"schedule": {"generator": self.generator.get_state()}}

    def load_state_dict(self, state: dict[str, Any], tensors: list[Tensor]) -> None:
        saved = state.get("schedule") or {}
        if "generator" in saved:
            self.generator.set_state(saved["generator"])


@dataclass(kw_only=True, eq=False)
class RSTOptions(MethodOptions):
    """RST's options.

    Args:
        probability: chance of a SAM step, in [0, 1]. Paper: 0.5.
    """

    probability: float = option(0.5, number(0, 1))


@dataclass(kw_only=True, eq=False)
class RSTSpec(RSTOptions, MethodSpec):
    """RST: each step is a SAM step with probability ``probability``, else a plain one."""

    name: ClassVar[str] = "rst"
    label: ClassVar[str] = "RST"

    def parts(self, generator: torch.Generator) -> MethodParts:
        return Coin(self.probability, generator)
