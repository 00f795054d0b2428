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
* :class:`~lightning_slsam.selection.wrappers.DepthCut` -- wraps a rule and freezes
  every layer below a random cut along the model's layer order each step, so
  back-propagation stops at the cut (cost-aware SL-SAM, beyond the paper);
* :class:`~lightning_slsam.selection.wrappers.DenseWarmup` -- wraps a rule and adds every
  layer with a probability that anneals from 1 to 0 over the first steps, so the layer
  ratio falls from 1 to the rule's own (beyond the paper).

A wrapper changes how likely each layer is to be drawn. A learning rule (the bandit)
weights what it learns by the inverse of that *true* inclusion probability
(:meth:`LayerSelection.inclusion`), which each wrapper passes down in :meth:`update`.

All draws come from the rule's own seeded ``torch.Generator``, never the global stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_slsam.core.seeding import Seeded, seeded_generator
from lightning_slsam.core.validation import check_ratio

__all__ = [
    "AllLayers",
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

    Example:
        A rule of one's own: even layers on even steps, odd layers on odd steps (every
        layer has probability 1/2, which the engine's update scaling and logs read from
        :attr:`probs`).

        >>> import torch
        >>> class Alternate(LayerSelection):
        ...     def __init__(self, num_layers):
        ...         self.num_layers, self.step = num_layers, 0
        ...     @property
        ...     def probs(self):
        ...         return torch.full((self.num_layers,), 0.5, dtype=torch.float64)
        ...     def sample(self):
        ...         self.step += 1
        ...         return torch.arange(self.num_layers) % 2 == self.step % 2
        >>> rule = Alternate(4)
        >>> rule.sample().tolist(), rule.sample().tolist()
        ([False, True, False, True], [True, False, True, False])
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
    ``inner``'s, and ``inner`` learns with this rule's true inclusion probabilities.

    Example:
        >>> import torch
        >>> class Skip(WrappedSelection):  # never the first layer
        ...     def sample(self):
        ...         mask = self.inner.sample()
        ...         mask[0] = False
        ...         return mask
        >>> rule = Skip(AllLayers(3))
        >>> rule.sample().tolist(), rule.probs.tolist()
        ([False, True, True], [1.0, 1.0, 1.0])
    """

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
    """Every layer, every step: vanilla SAM and the dense baselines.

    Example:
        >>> rule = AllLayers(3)
        >>> rule.sample().tolist(), rule.always_all
        ([True, True, True], True)
    """

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

    Example:
        >>> import torch
        >>> rule = UniformSelection(6, 0.5, generator=torch.Generator().manual_seed(0))
        >>> rule.probs.tolist()
        [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
        >>> draws = torch.stack([rule.sample() for _ in range(2000)])
        >>> round(float(draws.double().mean()), 1)  # never empty, about half the layers
        0.5
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

    Example:
        >>> import torch
        >>> rule = TopKSelection(4, k=2)
        >>> first = rule.sample()  # every layer
        >>> norms = torch.tensor([0.1, 3.0, 0.2, 1.0], dtype=torch.float64)
        >>> first.tolist(), rule.refine(first, norms).tolist()
        ([True, True, True, True], [False, True, False, True])
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
    ``first`` (the wrapped rule, ``inner``) does not learn.

    Example:
        >>> import torch
        >>> first_pass = UniformSelection(4, 0.25, generator=torch.Generator().manual_seed(0))
        >>> rule = ExpandToAll(first_pass)
        >>> first = rule.sample()
        >>> first.tolist(), rule.refine(first, None).tolist()
        ([False, False, True, False], [True, True, True, True])
    """

    def __init__(self, first: LayerSelection) -> None:
        super().__init__(first)

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
