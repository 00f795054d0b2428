"""SL-SAM on LookSAM's interval: sparse along both axes -- a bandit-drawn subset of layers,
SAM's two passes every ``interval`` steps, and in between one pass that reuses the stored
orthogonal component of the SAM gradient.

>>> spec = SLSAMLookSAMSpec(interval=3)
>>> spec.interval, spec.alpha, spec.preset
(3, 0.7, 'default')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.looksam import Lookahead
from lightning_slsam.methods.options import number
from lightning_slsam.methods.slsam import SLSAMSpec
from lightning_slsam.methods.spec import option

__all__ = ["SLSAMLookSAMSpec"]


@dataclass(kw_only=True, eq=False)
class SLSAMLookSAMSpec(SLSAMSpec):
    """SL-SAM with a SAM step every ``interval`` steps and LookSAM's reuse in between.

    Args:
        interval: steps between SAM steps, >= 1 (LookSAM's 5).
        alpha: weight of the reused component, >= 0 (LookSAM's 0.7; 0: plain steps).
    """

    name: ClassVar[str] = "slsam_looksam"
    label: ClassVar[str] = "SLSAMLookSAM"
    renamed: ClassVar[dict[str, str]] = {"sam_interval": "interval", "looksam_alpha": "alpha"}

    interval: int = option(5, number(1, integer=True))
    alpha: float = option(0.7, number(0))

    def parts(self, generator: torch.Generator) -> MethodParts:
        return Lookahead(self.interval, self.alpha, self.perturbation.eps)
