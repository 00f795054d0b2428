"""SL-SAM on RST's coin: sparse along both axes -- a bandit-drawn subset of layers, and SAM's
two passes on a random share of the steps (a plain pass on the others).

>>> spec = SLSAMRSTSpec(probability=0.3)
>>> spec.probability, spec.preset
(0.3, 'default')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.options import number
from lightning_slsam.methods.rst import Coin
from lightning_slsam.methods.slsam import SLSAMSpec
from lightning_slsam.methods.spec import option

__all__ = ["SLSAMRSTSpec"]


@dataclass(kw_only=True, eq=False)
class SLSAMRSTSpec(SLSAMSpec):
    """SL-SAM whose steps are SAM steps with probability ``probability``, else plain ones.

    Args:
        probability: chance of a SAM step, in [0, 1] (RST's 0.5).
    """

    name: ClassVar[str] = "slsam_rst"
    label: ClassVar[str] = "SLSAMRST"
    renamed: ClassVar[dict[str, str]] = {"sam_probability": "probability"}

    probability: float = option(0.5, number(0, 1))

    def parts(self, generator: torch.Generator) -> MethodParts:
        return Coin(self.probability, generator)
