"""SL-SAM's presets and the choices its options name: what ``SparseLayerSAM(preset=...)``
sets, in options and in words.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BANDIT_LOSSES", "BUDGETS", "PRESETS", "PRESET_WORDS"]

BANDIT_LOSSES = ("shifted", "paper", "rank")
#: What the bandit's budget counts: drawn layers (the paper), or their parameters.
BUDGETS = ("count", "compute")

#: What each SL-SAM preset sets; an option given explicitly wins. ``"default"`` (beyond the
#: paper, the default of :class:`SLSAMSpec`): the bandit budgets parameters, not layers
#: (``budget="compute"``), with the scale-free rank loss, the fresh task head trained every
#: step and each drawn layer's update scaled by ``1 / q`` capped at 3; chosen on the
#: multi-seed comparisons of ``docs/results/gpu`` (what it wins and loses:
#: ``docs/results.md``). ``"paper"``: the SL-SAM paper and its released code. ``"robust"``:
#: the earlier short-fine-tune remedies under the paper's count budget (the update factor
#: capped at ``1 / layer_ratio``). A dense warm-up (``dense_warmup=0.3``) added to them was
#: as accurate on every measured budget and costlier, so no preset has it.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "budget": "compute",
        "bandit_loss": "rank",
        "dense_warmup": 0,
        "min_updates": 0,
        "head_always_active": True,
        "vectors_always_active": False,
        "scale_updates": True,
        "max_update_scale": 3.0,
    },
    "paper": {
        "budget": "count",
        "bandit_loss": "shifted",
        "dense_warmup": 0,
        "min_updates": 0,
        "head_always_active": False,
        "vectors_always_active": False,
        "scale_updates": False,
        "max_update_scale": None,
    },
    "robust": {
        "budget": "count",
        "bandit_loss": "rank",
        "dense_warmup": 0,
        "min_updates": 0,
        "head_always_active": True,
        "vectors_always_active": False,
        "scale_updates": True,
        "max_update_scale": None,
    },
}

#: Each preset in words, beside its options (the run summary prints it).
PRESET_WORDS = {
    "default": "parameter budget, rank bandit, head every step, updates scaled up to 3x;"
    " preset='paper' is the paper's method",
    "paper": "the SL-SAM paper's exact method",
    "robust": "rank bandit, head every step, scaled updates, the paper's layer-count budget",
}
