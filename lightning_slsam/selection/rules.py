"""Layer-selection rules: which layers compute gradients, are perturbed and are updated.

Each step :meth:`LayerSelection.sample` draws the layers, :meth:`LayerSelection.refine` may
change them for the second pass and :meth:`LayerSelection.update` learns from the norms. Draws
come from the rule's own seeded ``torch.Generator``, never the global stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["AllLayers", "LayerSelection", "Seeded", "UniformSelection", "WrappedSelection",
           "seeded_generator"]  # fmt: skip


def seeded_generator(generator: torch.Generator | None, offset: int = 0) -> torch.Generator:
    """``generator``, or a new CPU generator seeded with ``torch.initial_seed() + offset``."""
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(torch.initial_seed() + offset)
    return generator


class Seeded:
    """A part drawing from its own generator ``_gen``, saved with its state for exact resume.

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

    Example (even layers on even steps, odd layers on odd steps):
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
    #: Whether :meth:`refine` is called after the first pass, and whether it reads the norms.
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
        """Layers of the second pass and the update, given first-pass norms (default: same)."""
        return active

    def inclusion(self) -> Tensor:
        """Probability that the last :meth:`sample` drew each layer (default :attr:`probs`)."""
        return self.probs

    def update(self, active: Tensor, norms: Tensor, inclusion: Tensor | None = None) -> bool:
        """Learn from the active layers' norms and ``inclusion``; whether anything changed."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def carry_state(self, state: dict[str, Any], index: list[int]) -> dict[str, Any]:
        """Another state mapped onto these layers (``index[i]``: position there, -1: new)."""
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
        ratio: probability of each layer, in (0, 1] (not checked here).
        generator: the rule's own CPU generator (default: seeded by ``torch.initial_seed()``).

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
