"""How much update each sampled layer can expect over a run, and the guard rail built on it.

A layer drawn with probability ``q`` in a step, its update scaled by ``min(1 / q, cap)`` when
drawn (``SparseLayerSAM()``'s update scaling, cap 3; no scaling is cap 1, the paper's
method), receives in expectation ``min(1, q * cap)`` of a full update per step. Over ``T``
steps that is ``T * min(1, q * cap)`` *full updates*; :func:`expected_updates` gives the
median over the sampled layers (the layers trained every step are not counted).

Where that figure is small, layer sampling lost accuracy in the committed comparisons: the
evidence is ``docs/results/choosing/coverage.md`` (``examples/scripts/coverage_table.py``
recomputes it from the runs' records), and :data:`FLOOR` is the line it draws. A figure
under the floor is said once at fit start, with what to change (:func:`coverage_message`).

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

#: Full updates per sampled layer under which layer sampling lost accuracy against SAM in the
#: committed comparisons (the evidence: ``docs/results/choosing/coverage.md``).
FLOOR = 90.0

#: Where the message sends the reader for the evidence and the choices.
DOCS = "docs/methods.md#too-short-a-run-the-coverage-check"


def expected_updates(inclusion: Tensor, steps: float, update_scale: float | None) -> float | None:
    """Median over the layers of ``steps * min(1, q * cap)``: the full updates a sampled
    layer can expect over ``steps`` steps when drawn with probability ``q`` (``inclusion``,
    one per sampled layer) and its update scaled by at most ``cap`` (``update_scale``;
    ``None``: no scaling). ``None`` when no layer is sampled or the run has no end."""
    if inclusion.numel() == 0 or not math.isfinite(steps):
        return None
    cap = 1.0 if update_scale is None else float(update_scale)
    share = (inclusion.double() * cap).clamp(max=1.0)
    return float(steps * share.median())


def coverage_message(
    name: str, figure: float | None, steps: float, layer_ratio: float, update_scale: float | None
) -> str | None:
    """The guard rail's line for a run whose sampled layers expect ``figure`` full updates
    (:func:`expected_updates`) over ``steps`` steps, or ``None`` when the figure is at
    least :data:`FLOOR` (or unknown)."""
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
        f" {steps:.0f} steps (median over layers; layer_ratio={layer_ratio:g}), under the"
        f" {FLOOR:.0f} below which layer sampling lost accuracy against SAM; use"
        f" {', '.join(fixes[:-1])} or {fixes[-1]} (see {DOCS})."
    )
