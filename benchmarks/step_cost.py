"""The step-time figure of the benchmark tables: a method's mean cost per step.

Some methods mix step kinds: RST (and SL-SAM on RST's coin) runs a SAM step with
probability ``p``, else a plain one; LookSAM (and SL-SAM on LookSAM's interval) a SAM step
every ``interval`` steps and cheaper reuse steps between. The median of such a method's step
times is the time of one kind (LookSAM's cheap step, RST's SAM step when ``p > 0.5``), not
what the method costs. Others draw a different cost every step (the layer-sampling methods'
subsets, cost-aware SL-SAM's depth cut). So every method's figure is :func:`summarize`'s:

* the **mean** of its timed step times,
* over **whole periods** of its step schedule (:func:`schedule_of`): for an interval, the
  window starts at a SAM step and holds a whole number of intervals; the steps before the
  first boundary and after the last whole period are left out;
* for a coin, every timed step, with the count: a window is *enough* when it holds at least
  ``10 / min(p, 1 - p)`` steps (ten of the rarer kind expected).

Every method gets the same statistic, so the ratios between rows compare like with like
(the mean of a one-kind method would sit a little above its median on a noisy machine).

>>> sequence = [2.0, 1.0, 1.0, 1.0, 1.0] * 4  # an interval of 5: one SAM step, four reuses
>>> summarize(sequence, schedule=Schedule(period=5))["mean_s"]
1.2
>>> # timed from step 2 (after two warm-up steps): the window starts at step 5
>>> row = summarize(sequence[2:], first_step=2, schedule=Schedule(period=5))
>>> row["mean_s"], row["steps"], row["first_step"]
(1.2, 15, 5)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RULE", "Schedule", "kinds_text", "schedule_of", "summarize"]

#: The rule, as the tables' header texts state it.
RULE = (
    "mean step time per method, over whole periods of its step schedule (LookSAM's interval:"
    " a whole number of intervals starting at a SAM step; RST's coin: every timed step), so"
    " that a method mixing step kinds is reported at its mean cost per step, not at one"
    " kind's time"
)


@dataclass(frozen=True)
class Schedule:
    """How a method's step kinds recur.

    Args:
        period: steps in one period of the kinds (LookSAM's ``interval``; 1 when every
            window is whole: one kind, or a coin).
        probability: the chance of a SAM step when a coin picks each step's kind (RST).
    """

    period: int = 1
    probability: float | None = None

    @property
    def min_steps(self) -> int:
        """Timed steps that represent the schedule: one period, or for a coin
        ``10 / min(p, 1 - p)`` (ten of the rarer kind expected)."""
        p = self.probability
        if p is not None and 0 < p < 1:
            return max(self.period, math.ceil(10 / min(p, 1 - p) - 1e-9))
        return self.period


def schedule_of(engine: Any) -> Schedule:
    """The step schedule of an engine's method (``None``, plain AdamW: one kind)."""
    parts = getattr(engine, "parts", None)
    interval = getattr(parts, "interval", None)
    probability = getattr(parts, "probability", None)
    return Schedule(
        period=int(interval) if interval else 1,
        probability=None if probability is None else float(probability),
    )


def summarize(
    times: Sequence[float],
    first_step: int = 0,
    schedule: Schedule = Schedule(),
    kinds: Sequence[str | None] | None = None,
) -> dict[str, Any]:
    """The figure of a method whose timed steps took ``times`` seconds, the first of them its
    step ``first_step`` (0-based, warm-up steps counted): the mean over whole periods of
    ``schedule``, the steps it counts and the first of them, whether they are enough
    (:attr:`Schedule.min_steps`), the counted steps' kinds (``kinds``: each timed step's,
    ``None`` for a step without one), and their median, minimum and maximum for reference."""
    period = max(int(schedule.period), 1)
    start = (-first_step) % period
    whole = max(len(times) - start, 0) // period * period
    window = [float(t) for t in times[start : start + whole]]
    if not window:
        raise ValueError(
            f"{len(times)} timed steps from step {first_step} hold no whole period of"
            f" {period} steps"
        )
    counts: dict[str, int] = {}
    for kind in (kinds or [])[start : start + whole]:
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return {
        "mean_s": statistics.fmean(window),
        "steps": len(window),
        "first_step": first_step + start,
        "enough": len(window) >= schedule.min_steps,
        "kinds": counts,
        "median_s": statistics.median(window),
        "min_s": min(window),
        "max_s": max(window),
    }


def kinds_text(steps: int, kinds: dict[str, int]) -> str:
    """``steps`` timed steps, with each kind's count when there are several
    (``"20: 9 sam + 11 plain"``): a :func:`summarize` row's ``steps`` and ``kinds``."""
    if len(kinds) < 2:
        return str(steps)
    return f"{steps}: " + " + ".join(f"{n} {k}" for k, n in kinds.items())
