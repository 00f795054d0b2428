"""SL-SAM on RST's coin (beyond the paper): SL-SAM's options and RST's ``probability``.

>>> spec = SLSAMRSTSpec(probability=0.3)
>>> spec.probability, spec.preset
(0.3, 'default')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lightning_slsam.methods.rst import RSTSpec
from lightning_slsam.methods.slsam import SLSAMSpec

__all__ = ["SLSAMRSTSpec"]


@dataclass(kw_only=True, eq=False)
class SLSAMRSTSpec(SLSAMSpec, RSTSpec):
    """SL-SAM whose steps are SAM steps with probability ``probability``, else plain ones."""

    name: ClassVar[str] = "slsam_rst"
    label: ClassVar[str] = "SLSAMRST"
