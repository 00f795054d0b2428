"""Selection rules that reshape another rule's draw: where back-propagation stops
(:class:`DepthCut`, cost-aware SL-SAM) and how many layers the first steps train
(:class:`DenseWarmup`, the short-run warm-up). Both are beyond the SL-SAM paper.

Each wraps an ``inner`` rule (the bandit, for SL-SAM) and passes the layers' true
inclusion probabilities down to it, so a learning rule's importance weights stay exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_slsam.core.seeding import Seeded, seeded_generator
from lightning_slsam.core.validation import check_ratio
from lightning_slsam.selection.rules import LayerSelection, WrappedSelection

__all__ = ["DenseWarmup", "DepthCut"]


class DepthCut(WrappedSelection, Seeded):
    """Freeze every layer below a random cut, then let ``inner`` sample above it.

    With independent per-layer sampling some layer near the input is almost always
    active, so back-propagation runs through the whole network even when few layers are
    trained. Each step this rule draws a cut along the layer order (the model's parameter
    order: input to output for Transformers and timm models) and samples only above it, so
    the activation-gradient pass stops at the cut. The cut is uniform on an interval
    chosen so that, on average, a ``depth`` fraction of the layers lies above it:
    ``[0, 2(1 - depth) N]`` for ``depth >= 0.5``, ``[(1 - 2 depth) N, N]`` below.

    ``inner`` learns only from the layers it sampled above the cut; its ``probs`` are the
    probabilities of a layer that the cut leaves eligible. A layer's true inclusion
    probability is that times the probability that the cut lies at or below it, divided by
    the probability that a draw is kept (a draw with nothing above the cut is redrawn), and
    the inner rule's importance weights use it.

    Args:
        inner: the rule sampling above the cut (the bandit, for cost-aware SL-SAM).
        depth: mean fraction of the layers back-propagation reaches, in (0, 1]; 1 disables
            the cut.
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
        self.depth = check_ratio("backprop_depth", depth)
        self._gen = seeded_generator(generator)
        n = self.num_layers
        if self.depth >= 0.5:
            self._low, self._high = 0.0, 2.0 * (1.0 - self.depth) * n
        else:
            self._low, self._high = (1.0 - 2.0 * self.depth) * n, float(n)
        self._index = torch.arange(n)
        self.last_cut = 0
        # The cut is floor(low + u * (high - low)) with u uniform (high <= n): P(cut = c) is
        # the overlap of [c, c + 1) with [low, high), and P(cut <= l) its running sum.
        span = max(self._high - self._low, 1e-12)
        edges = torch.arange(n + 1, dtype=torch.float64)
        top = edges[1:].clamp(self._low, self._high)
        self.cut_probs = (top - edges[:-1].clamp(self._low, self._high)) / span
        self.cut_probs[-1] += 1.0 - float(self.cut_probs.sum())  # rounding, and u -> 1
        #: Probability that the cut leaves each layer eligible, ``P(cut <= l)``.
        self.eligible = torch.cumsum(self.cut_probs, 0).clamp(0.0, 1.0)

    def inclusion(self) -> Tensor:
        q = self.inner.inclusion()
        # A draw is kept when something above the cut was drawn: P = sum_c P(cut = c) *
        # (1 - prod_{j >= c} (1 - q_j)).
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


class DenseWarmup(WrappedSelection, Seeded):
    """Anneal the layer ratio from 1 to ``inner``'s over the first ``steps`` steps.

    Short fine-tunes lose accuracy to sparse updates: a layer active in a fifth of the
    steps gets a fifth of the updates, and the first steps, where a fine-tune moves
    furthest, are where that hurts most. At step ``t < steps`` this rule adds each layer
    that ``inner`` did not draw with probability ``w_t = 1 - t / steps`` (a linear
    anneal), so a layer is active with probability ``q = p + (1 - p) * w_t``: every layer at
    the first step, ``inner``'s own ratio from step ``steps`` on. The expected extra work is
    ``(1 - ratio) / 2`` of a dense step per warm-up step.

    ``inner`` keeps learning throughout, with importance weights ``1 / q`` (its loss still
    compares the norms against its own probabilities).

    Args:
        inner: the rule drawing the sparse set (the bandit for SL-SAM).
        steps: warm-up length in steps, ``>= 0`` (0 disables the warm-up).
        generator: the warm-up coins' own CPU generator.

    Example:
        >>> import torch
        >>> from lightning_slsam.selection.rules import UniformSelection
        >>> sparse = UniformSelection(5, 0.2, generator=torch.Generator().manual_seed(0))
        >>> rule = DenseWarmup(sparse, steps=4, generator=torch.Generator().manual_seed(1))
        >>> [rule.weight(t) for t in range(5)]
        [1.0, 0.75, 0.5, 0.25, 0.0]
        >>> for _ in range(5):  # each layer's chance falls from 1 to the inner ratio
        ...     _ = rule.sample()
        ...     print(round(float(rule.inclusion()[0]), 2))
        1.0
        0.8
        0.6
        0.4
        0.2
    """

    def __init__(
        self, inner: LayerSelection, steps: int, generator: torch.Generator | None = None
    ) -> None:
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
            raise ValueError(f"`steps` must be an integer >= 0, got {steps!r}.")
        super().__init__(inner)
        self.steps = steps
        self._gen = seeded_generator(generator)
        self.num_sampled = 0
        self._weight = 0.0

    @property
    def refine_uses_norms(self) -> bool:  # type: ignore[override]
        return self.inner.refine_uses_norms

    def weight(self, step: int) -> float:
        """Probability with which an undrawn layer is added at ``step``."""
        return max(0.0, 1.0 - step / self.steps) if self.steps else 0.0

    def sample(self) -> Tensor:
        self._weight = self.weight(self.num_sampled)
        self.num_sampled += 1
        mask = self.inner.sample()
        if self._weight > 0.0:
            coins = torch.rand(self.num_layers, generator=self._gen, dtype=torch.float64)
            mask = mask | (coins < self._weight)
        return mask

    def inclusion(self) -> Tensor:
        q = self.inner.inclusion()
        return q + (1.0 - q) * self._weight

    def refine(self, active: Tensor, norms: Tensor | None) -> Tensor:
        return self.inner.refine(active, norms)

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            **self.generator_state(),
            "num_sampled": self.num_sampled,
            "weight": self._weight,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self.load_generator_state(state)
        self.num_sampled = int(state.get("num_sampled", 0))
        self._weight = float(state.get("weight", 0.0))
