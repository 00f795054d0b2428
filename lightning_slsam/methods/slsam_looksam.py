"""SL-SAM on LookSAM's interval (beyond the paper): SL-SAM's options and LookSAM's
``interval`` and ``alpha``.

>>> spec = SLSAMLookSAMSpec(interval=3)
>>> spec.interval, spec.alpha, spec.preset
(3, 0.7, 'default')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lightning_slsam.methods.looksam import LookSAMSpec
from lightning_slsam.methods.slsam import SLSAMSpec

__all__ = ["SLSAMLookSAMSpec"]


@dataclass(kw_only=True, eq=False)
class SLSAMLookSAMSpec(SLSAMSpec, LookSAMSpec):
    """SL-SAM with a SAM step every ``interval`` steps and LookSAM's reuse in between."""

    name: ClassVar[str] = "slsam_looksam"
    label: ClassVar[str] = "SLSAMLookSAM"
