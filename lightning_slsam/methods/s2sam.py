"""S2-SAM (Ji et al., 2024, "Single-step SAM"; the SL-SAM paper's Algorithm 3): one pass per
step at every layer perturbed along the previous step's gradient; the first step is plain.

>>> [SingleStepParts().kind(t) for t in range(3)]
['single', 'single', 'single']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_slsam.core.step import MethodParts, StepKind
from lightning_slsam.methods.spec import MethodSpec

__all__ = ["S2SAMSpec", "SingleStepParts"]


class SingleStepParts(MethodParts):
    """Every step a single-step SAM step (the engine makes the first one plain)."""

    def kind(self, step: int) -> StepKind:
        return "single"


@dataclass(kw_only=True, eq=False)
class S2SAMSpec(MethodSpec):
    """S2-SAM: one pass per step at weights perturbed along the previous step's gradient."""

    name: ClassVar[str] = "s2sam"
    label: ClassVar[str] = "S2SAM"

    def parts(self, generator: torch.Generator) -> MethodParts:
        return SingleStepParts()
