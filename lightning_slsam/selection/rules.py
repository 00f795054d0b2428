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
* :class:`WrappedSelection` -- the base of a rule that reshapes another's draw.

A method may bring a rule of its own, in its own module: Top-SL-SAM's
(:class:`~lightning_slsam.methods.top_slsam.TopKSelection`), ESAM's
(:class:`~lightning_slsam.methods.esam.ExpandToAll`), cost-aware SL-SAM's
(:class:`~lightning_slsam.methods.slsam_depth.DepthCut`).

A wrapper changes how likely each layer is to be drawn. A learning rule (the bandit)
weights what it learns by the inverse of that *true* inclusion probability
(:meth:`LayerSelection.inclusion`), which each wrapper passes down in :meth:`update`.

All draws come from the rule's own seeded ``torch.Generator``, never the global stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AllLayers",
    "LayerSelection",
    "Seeded",
    "UniformSelection",
    "WrappedSelection",
    "seeded_generator",
]


def seeded_generator(generator: torch.Generator | None, offset: int = 0) -> torch.Generator:
    """``generator``, or a new CPU generator seeded with ``torch.initial_seed() + offset``."""
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(torch.initial_seed() + offset)
    return generator


class Seeded:
    """A part that draws from its own generator ``_gen`` and saves it with its state, so
    a resumed run draws what the uninterrupted one would have.

    >>> part = Seeded()
    >>> part._gen = seeded_generator(None)
    >>> state = part.generator_state()
    >>> first = torch.rand(1, generator=part._gen)
    >>> part.load_generator_state(state)
    >>> torch.equal(torch.rand(1, generator=part._gen), first)
    True
    """

    _gen: torch.Generator

    def generator_state(self) -> dict[str, Any]:
        return {"generator": self._gen.get_state()}

    def load_generator_state(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            self._gen.set_state(state["generator"])


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
    #: Whether :meth:`refine` may change the draw after the first pass (else it is not
    #: called) and whether it reads the norms (then they are copied to the host mid-step).
    refines: bool = False
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
        :attr:`refine_uses_norms`). Called only when :attr:`refines`. Default: unchanged."""
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

    def carry_state(self, state: dict[str, Any], index: list[int]) -> dict[str, Any]:
        """:meth:`state_dict`'s output of this rule over other layers, for these layers:
        ``index[i]`` is layer ``i``'s position there (-1: a new layer). Default: the state
        holds nothing per layer, and is kept as it is."""
        return state


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

    def carry_state(self, state: dict[str, Any], index: list[int]) -> dict[str, Any]:
        return self.inner.carry_state(state, index)  # a wrapper's state is its inner's


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
        ratio: probability of each layer, in (0, 1] (not checked here: a method's
            specification checks its options).
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
        self.ratio = float(ratio)
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
