"""Layer-selection rules: which layers compute gradients, are perturbed and are updated.

A rule answers two questions each step. :meth:`LayerSelection.sample` gives the layers
whose gradients the first pass computes; :meth:`LayerSelection.refine` may change that set
once the first pass's per-layer gradient norms are known, giving the layers the second
pass computes and the optimizer updates. :meth:`LayerSelection.update` learns from the
norms. The rules:

* :class:`~lightning_slsam.LayerBandit` -- SL-SAM's EXP3 bandit (Algorithm 2);
* :class:`UniformSelection` -- every layer independently with the same probability
  (Random-SL-SAM; ESAM's stochastic weight perturbation);
* :class:`AllLayers` -- every layer (SAM and the dense baselines);
* :class:`TopKSelection` -- first pass on every layer, then the ``k`` layers with the
  largest gradient norms (Top-SL-SAM);
* :class:`ExpandToAll` -- wraps a rule for the first pass and trains every layer after
  it (ESAM: sparse perturbation, dense update);
* :class:`DepthCut` -- wraps a rule and freezes every layer below a random cut along the
  model's layer order each step, so back-propagation stops at the cut (cost-aware
  SL-SAM, beyond the paper);
* :class:`DenseWarmup` -- wraps a rule and adds every layer with a probability that
  anneals from 1 to 0 over the first steps, so the layer ratio falls from 1 to the rule's
  own (beyond the paper).

A wrapper changes how likely each layer is to be drawn. A learning rule (the bandit)
weights what it learns by the inverse of that *true* inclusion probability
(:meth:`LayerSelection.inclusion`), which each wrapper passes down in :meth:`update`.

All draws come from the rule's own seeded ``torch.Generator``, never the global stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_slsam.checks import check_ratio
from lightning_slsam.seeding import Seeded, seeded_generator

__all__ = [
    "AllLayers",
    "DenseWarmup",
    "DepthCut",
    "ExpandToAll",
    "LayerSelection",
    "TopKSelection",
    "UniformSelection",
    "WrappedSelection",
]


class LayerSelection:
    """Base of the selection rules; subclasses override what differs.

    Attributes:
        num_layers: number of layers ``N`` the rule chooses among.
    """

    num_layers: int
    #: Whether :meth:`refine` reads the norms (then they are copied to the host mid-step).
    refine_uses_norms: bool = False

    @property
    def probs(self) -> Tensor:
        """Probability of each layer being sampled for the first pass (float64 ``[N]``)."""
        return torch.ones(self.num_layers, dtype=torch.float64)

    @property
    def always_all(self) -> bool:
        """Whether every pass always computes every layer (no per-step freezing)."""
        return False

    def sample(self) -> Tensor:
        """Bool ``[N]`` mask of the layers of the first pass."""
        return torch.ones(self.num_layers, dtype=torch.bool)

    def refine(self, active: Tensor, norms: Tensor | None) -> Tensor:
        """Layers of the second pass and of the update, given the first pass's norms
        (float64 ``[N]``, 0 for layers without gradient; ``None`` unless
        :attr:`refine_uses_norms`). Default: unchanged."""
        return active

    def inclusion(self) -> Tensor:
        """Probability that the last :meth:`sample` drew each layer (float64 ``[N]``): the
        importance weights' denominators. Default: :attr:`probs`."""
        return self.probs

    def update(self, active: Tensor, norms: Tensor, inclusion: Tensor | None = None) -> bool:
        """Learn from the norms of the active layers; returns whether anything changed.

        ``inclusion``: the true probability that each layer was drawn, when a wrapper
        changed the draw (``None``: :meth:`inclusion`).
        """
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class WrappedSelection(LayerSelection):
    """A rule that changes the draw of another rule, ``inner``: its probabilities are
    ``inner``'s, and ``inner`` learns with this rule's true inclusion probabilities."""

    def __init__(self, inner: LayerSelection) -> None:
        self.inner = inner
        self.num_layers = inner.num_layers

    @property
    def probs(self) -> Tensor:
        return self.inner.probs

    @property
    def always_all(self) -> bool:
        return self.inner.always_all

    def update(self, active: Tensor, norms: Tensor, inclusion: Tensor | None = None) -> bool:
        return self.inner.update(
            active, norms, self.inclusion() if inclusion is None else inclusion
        )


class AllLayers(LayerSelection):
    """Every layer, every step: vanilla SAM and the dense baselines."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = int(num_layers)

    @property
    def always_all(self) -> bool:
        return True


class UniformSelection(LayerSelection, Seeded):
    """Each layer independently with probability ``ratio`` (redrawn while empty).

    Args:
        num_layers: number of layers.
        ratio: probability of each layer, in (0, 1].
        generator: the rule's own CPU generator (default: seeded with
            ``torch.initial_seed()``).
    """

    def __init__(
        self, num_layers: int, ratio: float, generator: torch.Generator | None = None
    ) -> None:
        self.num_layers = int(num_layers)
        self.ratio = check_ratio("layer_ratio", ratio)
        self._gen = seeded_generator(generator)

    @property
    def probs(self) -> Tensor:
        return torch.full((self.num_layers,), self.ratio, dtype=torch.float64)

    @property
    def always_all(self) -> bool:
        return self.ratio >= 1.0

    def sample(self) -> Tensor:
        while True:
            draw = torch.rand(self.num_layers, generator=self._gen, dtype=torch.float64)
            mask = draw < self.ratio
            if bool(mask.any()):
                return mask

    def state_dict(self) -> dict[str, Any]:
        return self.generator_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_generator_state(state)


class TopKSelection(LayerSelection):
    """Greedy: the first pass computes every layer, then the ``k`` largest norms are kept.

    This is the paper's Top-SL-SAM ablation. It has no exploration: a layer whose gradient
    is small for a while is never trained again, which the paper reports stalls training
    (137 of 200 DeiT-Small layers never selected in an epoch).

    Args:
        num_layers: number of layers.
        k: layers kept for the second pass and the update, ``1 <= k <= num_layers``.
    """

    def __init__(self, num_layers: int, k: int) -> None:
        self.num_layers = int(num_layers)
        if not (isinstance(k, int) and 1 <= k <= self.num_layers):
            raise ValueError(f"Top-k selection needs 1 <= k <= {self.num_layers}, got k={k!r}.")
        self.k = k

    refine_uses_norms = True

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


class ExpandToAll(WrappedSelection):
    """First pass on ``first``'s sample, then every layer (ESAM's SWP with a dense update).
    ``first`` does not learn."""

    def __init__(self, first: LayerSelection) -> None:
        super().__init__(first)

    @property
    def first(self) -> LayerSelection:
        return self.inner

    def sample(self) -> Tensor:
        return self.inner.sample()

    def refine(self, active: Tensor, norms: Tensor | None) -> Tensor:
        return torch.ones(self.num_layers, dtype=torch.bool)

    def update(self, active: Tensor, norms: Tensor, inclusion: Tensor | None = None) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


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
