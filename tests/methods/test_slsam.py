"""SL-SAM's presets (:mod:`lightning_slsam.methods.presets`): what each sets, explicit options
winning, and the pinned default."""

from __future__ import annotations

import warnings

import pytest
from helpers import make_mlp

from lightning_slsam import SLS2SAM, SparseLayerSAM, make_callback


def test_presets_set_the_remedies_and_explicit_options_win():
    from lightning_slsam import PRESETS

    paper = SparseLayerSAM(preset="paper")
    assert paper.preset == "paper" and paper.bandit_loss == "shifted"
    assert (paper.dense_warmup, paper.min_updates, paper.alpha_p) == (0, 0, 1e-3)
    assert not paper.head_always_active and not paper.vectors_always_active
    robust = SparseLayerSAM(preset="robust")
    for key, value in PRESETS["robust"].items():
        assert getattr(robust, key) == value
    assert robust.alpha_p == 0.03  # the rank loss's own step size
    # No warm-up in the preset: rank + head + scale matched it at less cost (docs/results.md).
    assert robust.dense_warmup == 0 and robust.head_always_active and robust.scale_updates
    mixed = SparseLayerSAM(preset="robust", dense_warmup=0.3, bandit_loss="shifted")
    assert mixed.dense_warmup == 0.3 and mixed.bandit_loss == "shifted" and mixed.alpha_p == 1e-3
    assert mixed.head_always_active
    assert make_callback("slsam_robust").preset == "robust"
    with pytest.raises(ValueError, match="preset"):
        SparseLayerSAM(preset="fast")


def test_the_default_is_pinned():
    """``SparseLayerSAM()``'s configuration, chosen on docs/results/gpu (docs/results.md):
    changing any of it must change this test, the docs and the changelog together."""
    from lightning_slsam import PRESETS

    default = SparseLayerSAM()
    assert default.preset == "default" and PRESETS["default"] == {
        "budget": "compute",
        "bandit_loss": "rank",
        "dense_warmup": 0,
        "min_updates": 0,
        "head_always_active": True,
        "vectors_always_active": False,
        "scale_updates": True,
        "max_update_scale": 3.0,
    }
    assert (default.rho, default.layer_ratio, default.p_min, default.alpha_p) == (
        0.01, 0.2, 1e-3, 0.03)  # fmt: skip
    assert (default.budget, default.update_scale, default.backprop_depth) == ("compute", 3.0, 1.0)
    # The paper's exact method stays one argument away, and the comparisons' "slsam" is it.
    paper = SparseLayerSAM(preset="paper")
    assert (paper.budget, paper.bandit_loss, paper.head_always_active, paper.update_scale) == (
        "count", "shifted", False, None)  # fmt: skip
    assert make_callback("slsam").preset == "paper"
    assert make_callback("slsam_default").preset == "default"
    assert SLS2SAM().preset == "paper"  # only SL-SAM's default moved
    # A model with no fresh head: the default trains every layer by sampling, silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SparseLayerSAM(seed=0).spec.build_engine(make_mlp())
    from lightning_slsam.methods.subset import PRESET_WORDS

    assert set(PRESET_WORDS) == set(PRESETS)  # the run summary describes every preset
