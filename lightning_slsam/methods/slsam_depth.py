"""Cost-aware SL-SAM (beyond the paper): SL-SAM whose draw is cut at a random depth each step
(:class:`DepthCut`), so that back-propagation stops at the cut.

>>> spec = CostAwareSLSAMSpec()
>>> spec.depth, spec.preset
(0.5, 'default')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_slsam.core.partition import LayerPartition
from lightning_slsam.methods.options import RATIO
from lightning_slsam.methods.slsam import SLSAMOptions, SLSAMSpec
from lightning_slsam.methods.spec import option
from lightning_slsam.selection.rules import (
    LayerSelection,
    Seeded,
    WrappedSelection,
    seeded_generator,
)

__all__ = ["CostAwareSLSAMOptions", "CostAwareSLSAMSpec", "DepthCut"]


class DepthCut(WrappedSelection, Seeded):
    """Freeze every layer below a random cut along the parameter order, then let ``inner``
    sample above it. The cut is uniform on ``[0, 2(1 - depth) N]`` for ``depth >= 0.5``, on
    ``[(1 - 2 depth) N, N]`` below; a draw with nothing above it is redrawn. ``inner`` learns
    with the true inclusion probabilities (:meth:`inclusion`).

    Args:
        inner: the rule sampling above the cut (the bandit, for cost-aware SL-SAM).
        depth: mean fraction of the layers back-propagation reaches, in (0, 1]; 1 disables the cut.
        generator: the cut's own CPU generator.

    Example:
        >>> import torch
        >>> from lightning_slsam.selection.rules import AllLayers
        >>> rule = DepthCut(AllLayers(8), depth=0.5, generator=torch.Generator().manual_seed(0))
        >>> [(rule.sample().int().tolist(), rule.last_cut) for _ in range(2)]
        [([0, 0, 0, 0, 0, 0, 0, 1], 7), ([0, 0, 0, 0, 0, 1, 1, 1], 5)]
        >>> rule.eligible.tolist()  # P(cut <= layer): the input side is trained least
        [0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]
    """

    def __init__(
        self, inner: LayerSelection, depth: float, generator: torch.Generator | None = None
    ) -> None:
        super().__init__(inner)
        self.depth = float(depth)
        self._gen = seeded_generator(generator)
        n = self.num_layers
        if self.depth >= 0.5:
            self._low, self._high = 0.0, 2.0 * (1.0 - self.depth) * n
        else:
            self._low, self._high = (1.0 - 2.0 * self.depth) * n, float(n)
        self._index = torch.arange(n)
        self.last_cut = 0
        # cut = floor(low + u * (high - low)): P(cut = c) is the overlap of [c, c + 1) with
        # [low, high), P(cut <= l) its running sum.
        span = max(self._high - self._low, 1e-12)
        edges = torch.arange(n + 1, dtype=torch.float64)
        top = edges[1:].clamp(self._low, self._high)
        self.cut_probs = (top - edges[:-1].clamp(self._low, self._high)) / span
        self.cut_probs[-1] += 1.0 - float(self.cut_probs.sum())  # rounding, and u -> 1
        #: Probability that the cut leaves each layer eligible, ``P(cut <= l)``.
        self.eligible = torch.cumsum(self.cut_probs, 0).clamp(0.0, 1.0)

    def inclusion(self) -> Tensor:
        """``inner``'s probability times ``P(cut <= l)``, over the probability a draw is kept."""
        q = self.inner.inclusion()
        # kept = sum_c P(cut = c) * (1 - prod_{j >= c} (1 - q_j))
        none_above = torch.cumprod((1.0 - q).flip(0), 0).flip(0)
        kept = float((self.cut_probs * (1.0 - none_above)).sum())
        return (q * self.eligible / max(kept, 1e-300)).clamp(max=1.0)

    @property
    def always_all(self) -> bool:
        return False

    def sample(self) -> Tensor:
        # Redrawn while nothing above the cut was sampled: a step always trains something.
        while True:
            u = torch.rand((), generator=self._gen, dtype=torch.float64).item()
            cut = min(int(self._low + u * (self._high - self._low)), self.num_layers - 1)
            mask = self.inner.sample() & (self._index >= cut)
            if bool(mask.any()):
                self.last_cut = cut
                return mask

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), **self.generator_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.load_generator_state(state)

    def carry_state(self, state: dict[str, Any], index: list[int]) -> dict[str, Any]:
        return {**state, "inner": self.inner.carry_state(state.get("inner", {}), index)}


@dataclass(kw_only=True, eq=False)
class CostAwareSLSAMOptions(SLSAMOptions):
    """Cost-aware SL-SAM's options.

    Args:
        depth: mean fraction of the layers back-propagation reaches, in (0, 1]; 1 is
            SL-SAM. Default 0.5.
    """

    depth: float = option(0.5, RATIO)


@dataclass(kw_only=True, eq=False)
class CostAwareSLSAMSpec(CostAwareSLSAMOptions, SLSAMSpec):
    """Cost-aware SL-SAM: the bandit samples above a random cut at mean ``depth``."""

    name: ClassVar[str] = "slsam_depth"
    label: ClassVar[str] = "CostAwareSLSAM"

    def selection(self, layers: LayerPartition, generator: torch.Generator) -> LayerSelection:
        bandit = super().selection(layers, generator)
        if self.depth >= 1.0:
            return bandit
        cut = torch.Generator().manual_seed(int(generator.initial_seed()) + 2)
        return DepthCut(bandit, self.depth, cut)
