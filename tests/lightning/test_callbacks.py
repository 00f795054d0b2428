"""The method callbacks (:mod:`lightning_slsam.lightning.callbacks`): each name builds its
class with the paper's defaults."""

from __future__ import annotations

import pytest

from lightning_slsam import (
    ESAM,
    METHODS,
    RST,
    S2SAM,
    SAM,
    SLS2SAM,
    SSAMF,
    LookSAM,
    RandomSLSAM,
    SparseLayerSAM,
    TopSLSAM,
    make_callback,
)


def test_registry_builds_every_method_with_its_paper_defaults():
    expected = {
        "sam": SAM, "adasam": SAM, "slsam": SparseLayerSAM, "random_slsam": RandomSLSAM,
        "top_slsam": TopSLSAM, "s2sam": S2SAM, "sl_s2sam": SLS2SAM, "rst": RST, "esam": ESAM,
        "ssamf": SSAMF, "looksam": LookSAM,
    }  # fmt: skip
    for name, cls in expected.items():
        cb = make_callback(name)
        assert type(cb) is cls and cb.rho == 0.01
    with pytest.raises(ValueError, match="needs no callback"):
        make_callback("adamw")
    assert make_callback("SL-SAM".replace("SL-SAM", "slsam")).layer_ratio == 0.2
    assert make_callback("rst").sam_probability == 0.5
    assert (make_callback("esam").weight_ratio, make_callback("esam").data_ratio) == (0.5, 0.5)
    assert make_callback("ssamf").sparsity == 0.5
    assert (make_callback("looksam").sam_interval, make_callback("looksam").looksam_alpha) == (
        5,
        0.7,
    )
    assert make_callback("slsam_rst").schedule == "random"
    assert make_callback("slsam_looksam").schedule == "interval"
    assert make_callback("slsam_robust").bandit_loss == "rank"
    assert set(METHODS) >= set(expected) | {"adamw", "slsam_rst", "slsam_looksam", "slsam_robust"}
    with pytest.raises(ValueError, match="Unknown method 'sgd'"):
        make_callback("sgd")
    with pytest.raises(TypeError, match=r"^RST has no option 'schedule'; RST runs its own"):
        RST(schedule="interval")
