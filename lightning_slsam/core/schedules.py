"""Iteration-axis schedules: what kind of step each training step is.

Layer selection makes SAM sparse along the parameter axis; a schedule makes it sparse
along the iteration axis. Each step is one of:

* ``"sam"`` -- SAM's two passes (ascent along the first pass's gradient, update with the
  second's);
* ``"plain"`` -- one pass and a plain optimizer step;
* ``"reuse"`` -- one pass plus LookSAM's stored component of the SAM gradient;
* ``"single"`` -- one pass at a point perturbed along the previous step's gradient
  (single-step SAM).

Schedules:

* :class:`EveryStep` -- SAM every step (default);
* :class:`RandomSchedule` -- RST's coin: SAM with probability ``p``, else plain;
* :class:`IntervalSchedule` -- LookSAM: SAM every ``k`` steps, reuse in between;
* :class:`SingleStepSchedule` -- S2-SAM / SL-S2-SAM.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_slsam.core.seeding import Seeded, seeded_generator

__all__ = [
    "STEP_KINDS",
    "EveryStep",
    "IntervalSchedule",
    "RandomSchedule",
    "Schedule",
    "SingleStepSchedule",
]

STEP_KINDS = ("sam", "plain", "reuse", "single")


class Schedule:
    """Base: SAM on every step. A schedule of one's own overrides :meth:`kind`.

    Example:
        >>> class SAMEveryThird(Schedule):  # a plain step between SAM steps
        ...     def kind(self, step):
        ...         return "sam" if step % 3 == 0 else "plain"
        >>> [SAMEveryThird().kind(t) for t in range(4)]
        ['sam', 'plain', 'plain', 'sam']
    """

    def kind(self, step: int) -> str:
        """The kind of training step ``step`` (0-based count of optimizer steps)."""
        return "sam"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class EveryStep(Schedule):
    """SAM on every step (SAM, SL-SAM and the other two-pass methods).

    Example:
        >>> {EveryStep().kind(t) for t in range(100)}
        {'sam'}
    """


class RandomSchedule(Schedule, Seeded):
    """RST (Zhao et al., 2022, "Randomized Sharpness-Aware Training"): each step is a SAM
    step with probability ``probability``, otherwise a plain step.

    Args:
        probability: chance of a SAM step, in [0, 1]; the SL-SAM paper uses 0.5.
        generator: the schedule's own CPU generator (default: seeded with
            ``torch.initial_seed()``), so the pattern is reproducible from the seed.

    Example:
        >>> import torch
        >>> coin = RandomSchedule(0.5, generator=torch.Generator().manual_seed(0))
        >>> kinds = [coin.kind(t) for t in range(1000)]
        >>> sorted(set(kinds)), round(kinds.count("sam") / 1000, 1)
        (['plain', 'sam'], 0.5)
    """

    def __init__(self, probability: float = 0.5, generator: torch.Generator | None = None) -> None:
        if not (isinstance(probability, (int, float)) and 0 <= probability <= 1):
            raise ValueError(f"`sam_probability` must be in [0, 1], got {probability!r}.")
        self.probability = float(probability)
        self._gen = seeded_generator(generator, offset=1)

    def kind(self, step: int) -> str:
        draw = torch.rand((), generator=self._gen, dtype=torch.float64)
        return "sam" if bool(draw < self.probability) else "plain"

    def state_dict(self) -> dict[str, Any]:
        return self.generator_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_generator_state(state)


class IntervalSchedule(Schedule):
    """LookSAM (Liu et al., 2022, "Towards Efficient and Scalable Sharpness-Aware
    Minimization"): a SAM step every ``interval`` steps (the first step included); in
    between, one pass plus the stored component of the SAM gradient orthogonal to the
    plain gradient, scaled by ``alpha * ||g|| / ||g_v||`` (``alpha=0``: plain steps).

    Args:
        interval: steps between SAM steps, ``>= 1`` (LookSAM: 5).
        alpha: weight of the reused component, ``>= 0`` (LookSAM: 0.7).

    Example:
        >>> [IntervalSchedule(interval=3).kind(t) for t in range(5)]
        ['sam', 'reuse', 'reuse', 'sam', 'reuse']
    """

    def __init__(self, interval: int = 5, alpha: float = 0.7) -> None:
        if not (isinstance(interval, int) and interval >= 1):
            raise ValueError(f"`sam_interval` must be an integer >= 1, got {interval!r}.")
        if not (isinstance(alpha, (int, float)) and alpha >= 0):
            raise ValueError(f"`looksam_alpha` must be >= 0, got {alpha!r}.")
        self.interval = interval
        self.alpha = float(alpha)

    def kind(self, step: int) -> str:
        return "sam" if step % self.interval == 0 else "reuse"


class SingleStepSchedule(Schedule):
    """S2-SAM (Ji et al., 2024, "Single-step SAM"): every step perturbs along the gradient
    computed in the previous step and runs one pass there. The very first step, with no
    previous gradient, is a plain step on every layer (as the SL-SAM paper does for
    SL-S2-SAM; the engine makes that step plain).

    Example:
        >>> [SingleStepSchedule().kind(t) for t in range(3)]
        ['single', 'single', 'single']
    """

    def kind(self, step: int) -> str:
        return "single"
