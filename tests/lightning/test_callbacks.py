"""The method callbacks (:mod:`lightning_slsam.lightning.callbacks`): each name builds its
class with the paper's defaults."""

from __future__ import annotations

import re

import pytest

from lightning_slsam import (
    ARWP,
    ESAM,
    MESA,
    METHODS,
    RST,
    S2SAM,
    SAM,
    SLS2SAM,
    SLSAMRST,
    SSAMF,
    CostAwareSLSAM,
    LookSAM,
    MomentumSAM,
    RandomSLSAM,
    SLSAMLookSAM,
    SparseLayerSAM,
    TopSLSAM,
    make_callback,
)

#: The methods whose rho is not SAM's radius, at their authors' defaults.
OWN_RADIUS = {"momentum_sam": 1.0, "arwp": 0.001}


def test_registry_builds_every_method_with_its_paper_defaults():
    expected = {
        "sam": SAM, "slsam": SparseLayerSAM, "slsam_paper": SparseLayerSAM,
        "random_slsam": RandomSLSAM, "top_slsam": TopSLSAM, "s2sam": S2SAM, "sl_s2sam": SLS2SAM,
        "rst": RST, "esam": ESAM, "ssamf": SSAMF, "looksam": LookSAM, "slsam_rst": SLSAMRST,
        "slsam_looksam": SLSAMLookSAM, "slsam_depth": CostAwareSLSAM,
        "momentum_sam": MomentumSAM, "arwp": ARWP,
        "mesa": MESA,
    }  # fmt: skip
    for name, cls in expected.items():
        cb = make_callback(name)
        # the paper's radius; Momentum-SAM's moves along the momentum and ARWP's is its
        # noise: their authors' defaults
        assert type(cb) is cls and cb.rho == OWN_RADIUS.get(name, 0.01)
    with pytest.raises(ValueError, match="needs no callback"):
        make_callback("adamw")
    assert make_callback("SL-SAM".replace("SL-SAM", "slsam")).layer_ratio == 0.2
    assert make_callback("rst").probability == 0.5
    assert (make_callback("esam").weight_ratio, make_callback("esam").data_ratio) == (0.5, 0.5)
    assert make_callback("ssamf").sparsity == 0.5
    assert (make_callback("looksam").interval, make_callback("looksam").alpha) == (5, 0.7)
    # SparseLayerSAM() is "slsam"; the paper's method is "slsam_paper".
    assert make_callback("slsam").preset == "default"
    assert make_callback("slsam").spec.setting("bandit_loss") == "rank"
    assert make_callback("slsam_paper").preset == "paper"
    # SL-SAM on RST's coin and on LookSAM's interval: classes of their own.
    assert make_callback("slsam_rst").probability == 0.5
    assert (make_callback("slsam_looksam").interval, make_callback("slsam_looksam").alpha) == (
        5,
        0.7,
    )
    assert set(METHODS) >= set(expected) | {"adamw"}
    with pytest.raises(ValueError, match="Unknown method 'sgd'"):
        make_callback("sgd")


def test_every_class_takes_its_specs_options_with_their_defaults():
    # A default a method changes (Momentum-SAM's rho, SL-S2-SAM's preset) is declared again
    # on its class: the dataclass would take SAM's or SparseLayerSAM's otherwise.
    import dataclasses
    import inspect

    from lightning_slsam.lightning import callbacks

    for name in callbacks.__all__:
        cls = getattr(callbacks, name)
        if not isinstance(cls, type):
            continue
        spec = {f.name: f.default for f in dataclasses.fields(cls.spec_class) if f.init}
        shown = inspect.signature(cls).parameters
        assert {n: shown[n].default for n in spec} == spec, name
        assert cls().method == cls.spec_class.name


def test_sparse_layer_sam_has_the_options_users_need_each_with_the_default_that_runs():
    import inspect

    from lightning_slsam.methods.slsam import PRESETS

    options = inspect.signature(SparseLayerSAM).parameters
    assert len(options) <= 20
    # No option means "whatever the preset says": every default is a value that runs.
    allowed_none = {"seed", "gradient_clip_val"}  # the run's seed; no clipping
    assert [n for n, p in options.items() if p.default is None and n not in allowed_none] == []
    built = SparseLayerSAM()
    for name, parameter in options.items():
        value, default = getattr(built, name), parameter.default
        assert value == default or list(value) == list(default) == [], name
    # What the preset decides is stated in the help of `preset`, for each preset (the
    # options' docs are their option classes', which jsonargparse reads along the MRO).
    doc = " ".join(" ".join(c.__doc__ or "" for c in SparseLayerSAM.__mro__[::-1]).split())
    assert 'preset: ``"default"`` (beyond the paper' in doc and '``"paper"``' in doc
    assert set(PRESETS) == {"default", "paper"}
    # `layer_ratio` (SL-SAM's, the last documented) says what it budgets under each preset.
    ratio = re.findall(r"layer_ratio: (.*?) p_min:", doc)[-1]
    assert "*parameters*" in ratio and "*layers*" in ratio, ratio
    assert 'preset="default"' in ratio and '"paper"' in ratio, ratio
