"""Top-SL-SAM, the SL-SAM paper's greedy ablation: SAM's ascent, second pass and update on
the ``k = max(1, round(layer_ratio * N))`` layers with the largest first-pass gradient norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.methods.spec import LayerSubsetSpec
from lightning_slsam.selection.rules import LayerSelection

__all__ = ["TopKSelection", "TopSLSAMSpec"]


class TopKSelection(LayerSelection):
    """Greedy: the first pass computes every layer, then the ``k`` largest norms are kept
    (no exploration: a layer whose gradient stays small is never trained again).

    Args:
        num_layers: number of layers.
        k: layers kept for the second pass and the update, ``1 <= k <= num_layers``.

    Example:
        >>> import torch
        >>> rule = TopKSelection(4, k=2)
        >>> first = rule.sample()  # every layer
        >>> norms = torch.tensor([0.1, 3.0, 0.2, 1.0], dtype=torch.float64)
        >>> first.tolist(), rule.refine(first, norms).tolist()
        ([True, True, True, True], [False, True, False, True])
    """

    refines = True
    refine_uses_norms = True

    def __init__(self, num_layers: int, k: int) -> None:
        self.num_layers = int(num_layers)
        self.k = int(k)

    @property
    def always_all(self) -> bool:
        return self.k >= self.num_layers

    def refine(self, active: Tensor, norms: Tensor | None) -> Tensor:
        assert norms is not None
        # Ties broken by model order (stable sort): deterministic for equal norms.
        order = torch.sort(norms.double(), descending=True, stable=True).indices[: self.k]
        mask = torch.zeros(self.num_layers, dtype=torch.bool)
        mask[order] = True
        return mask


@dataclass(kw_only=True, eq=False)
class TopSLSAMSpec(LayerSubsetSpec):
    """Top-SL-SAM: SAM on the ``k`` layers with the largest first-pass gradient norms."""

    name: ClassVar[str] = "top_slsam"
    label: ClassVar[str] = "TopSLSAM"

    def selection(self, layers: LayerPartition, generator: torch.Generator) -> LayerSelection:
        n = layers.num_layers
        return TopKSelection(n, max(1, round(self.layer_ratio * n)))

    def coverage_warning(self, engine: object, steps: float, name: str | None = None) -> None:
        """Nothing to check: the greedy pick has no draw whose updates could be counted."""
        return None
