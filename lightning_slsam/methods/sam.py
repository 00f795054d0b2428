"""SAM (Foret et al., 2021, "Sharpness-Aware Minimization for Efficiently Improving
Generalization"): two passes on every layer (AdaSAM with AdamW); ``adaptive=True`` is ASAM.

>>> import torch
>>> engine = SAMSpec(rho=0.05).build_engine(torch.nn.Linear(4, 2), seed=0)
>>> engine.perturbation.rho, type(engine.selection).__name__
(0.05, 'AllLayers')
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_slsam.methods.spec import MethodSpec

__all__ = ["SAMSpec"]


@dataclass(kw_only=True, eq=False)
class SAMSpec(MethodSpec):
    """Vanilla SAM on every layer (AdaSAM with AdamW as the optimizer)."""
