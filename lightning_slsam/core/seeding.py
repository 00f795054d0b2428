"""The random generators the plugin's parts own, and how they are saved with their state.

>>> part = Seeded()
>>> part._gen = seeded_generator(None)
>>> state = part.generator_state()
>>> first = torch.rand(1, generator=part._gen)
>>> part.load_generator_state(state)
>>> torch.equal(torch.rand(1, generator=part._gen), first)
True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Seeded", "seeded_generator"]


def seeded_generator(generator: torch.Generator | None, offset: int = 0) -> torch.Generator:
    """``generator``, or a new CPU generator seeded with ``torch.initial_seed() + offset``."""
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(torch.initial_seed() + offset)
    return generator


class Seeded:
    """A part that draws from its own generator ``_gen`` and saves it with its state, so
    a resumed run draws what the uninterrupted one would have."""

    _gen: torch.Generator

    def generator_state(self) -> dict[str, Any]:
        return {"generator": self._gen.get_state()}

    def load_generator_state(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            self._gen.set_state(state["generator"])
