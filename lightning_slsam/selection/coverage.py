"""The full updates each sampled layer can expect over a run (``min(1, q * cap)`` per step),
and the fit-start warning when they are few (docs/methods.md).

>>> import torch
>>> round(expected_updates(torch.full((10,), 0.2), steps=92, update_scale=None), 1)  # paper
18.4
>>> round(expected_updates(torch.full((10,), 0.2), steps=92, update_scale=3.0), 1)  # default
55.2
>>> coverage_message("SparseLayerSAM", 18.4, steps=92, layer_ratio=0.2, update_scale=None)[:80]
'SparseLayerSAM: each sampled layer can expect about 18 full updates over these 9'
>>> coverage_message("SparseLayerSAM", 90.8, steps=454, layer_ratio=0.2, update_scale=None)
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["DOCS", "FLOOR", "coverage_message", "expected_updates"]

#: The fewest full updates per sampled layer that the warning accepts.
FLOOR = 90.0

#: The documentation the warning links to.
DOCS = "docs/methods.md#too-short-a-run-the-coverage-check"


def expected_updates(inclusion: Tensor, steps: float, update_scale: float | None) -> float | None:
    """Median of ``steps * min(1, inclusion * update_scale)``; ``None`` if unknown."""
    if inclusion.numel() == 0 or not math.isfinite(steps):
        return None
    cap = 1.0 if update_scale is None else float(update_scale)
    share = (inclusion.double() * cap).clamp(max=1.0)
    return float(steps * share.median())


def coverage_message(
    name: str, figure: float | None, steps: float, layer_ratio: float, update_scale: float | None
) -> str | None:
    """The warning for ``figure`` expected updates (``None``: unknown or >= :data:`FLOOR`)."""
    if figure is None or figure >= FLOOR:
        return None
    cap = 1.0 if update_scale is None else float(update_scale)
    needed = FLOOR / (steps * cap)  # the layer ratio whose median layer reaches the floor
    rounded = math.ceil(needed * 20) / 20  # to 0.05
    fixes = ["a longer run", "a method that updates every layer each step (RST)"]
    if rounded < 1.0:
        fixes.insert(0, f"`layer_ratio={rounded:g}` or more")
    elif needed <= 1.0:
        fixes.insert(0, "`layer_ratio=1` (every layer, every step)")
    return (
        f"{name}: each sampled layer can expect about {figure:.0f} full updates over these"
        f" {steps:.0f} steps (median over layers; layer_ratio={layer_ratio:g}), fewer than"
        f" the {FLOOR:.0f} recommended; use {', '.join(fixes[:-1])} or {fixes[-1]}"
        f" (see {DOCS})."
    )
