"""Every method by name (:mod:`lightning_slsam.methods.registry`): the lookup, the options a
name implies, and the engine each name builds."""

from __future__ import annotations

import pytest
from helpers import make_mlp

from lightning_slsam.core.schedules import IntervalSchedule, RandomSchedule, SingleStepSchedule
from lightning_slsam.methods.dense import ESAMSpec, LookSAMSpec, SAMSpec
from lightning_slsam.methods.registry import SPECS, lookup, make_engine, method_spec
from lightning_slsam.methods.ssamf import FisherRefresh
from lightning_slsam.methods.subset import SLSAMSpec, TopSLSAMSpec
from lightning_slsam.selection.bandit import LayerBandit
from lightning_slsam.selection.rules import AllLayers, ExpandToAll, TopKSelection


def test_lookup_ignores_case_and_dashes_and_suggests_the_closest_name():
    assert lookup("SLSAM") == (SLSAMSpec, {"preset": "paper"})
    assert lookup("Top-SLSAM") == (TopSLSAMSpec, {})
    assert lookup("slsam-looksam") == (SLSAMSpec, {"preset": "paper", "schedule": "interval"})
    assert lookup("adasam") == lookup("sam") == (SAMSpec, {})
    assert lookup("adamw") == (None, {})
    with pytest.raises(ValueError, match=r"Unknown method 'slsamm'\. Did you mean 'slsam'\?"):
        lookup("slsamm")
    with pytest.raises(ValueError, match=r"Unknown method 'zzz'\. Choose one of \['adamw', "):
        lookup("zzz")


def test_method_spec_applies_the_options_a_name_implies_and_given_ones_win():
    assert method_spec("slsam").preset == "paper"
    assert method_spec("slsam_default").preset == "default"
    assert (method_spec("slsam_robust").preset, method_spec("slsam_robust").bandit_loss) == (
        "robust", "rank")  # fmt: skip
    assert method_spec("slsam_rst").schedule == "random"
    assert method_spec("slsam_depth").backprop_depth == 0.5
    assert method_spec("slsam_depth", backprop_depth=0.25).backprop_depth == 0.25
    assert method_spec("looksam", interval=3).sam_interval == 3
    assert type(method_spec("looksam")) is LookSAMSpec and type(method_spec("esam")) is ESAMSpec
    with pytest.raises(ValueError, match="plain AdamW: there is no SAM method to build"):
        method_spec("adamw")
    assert set(SPECS) >= {"sam", "slsam", "esam", "ssamf", "looksam", "rst", "s2sam"}


def test_each_name_builds_the_engine_of_its_parts():
    def built(name, **options):
        return make_engine(name, make_mlp(), seed=0, **options)  # 8 tensors, 8 layers

    sam = built("sam")
    assert type(sam.selection) is AllLayers and sam.selection.always_all
    assert sam.perturbation.rho == 0.01 and not sam.perturbation.adaptive
    assert built("adasam").perturbation.adaptive is False  # an alias of sam
    slsam = built("slsam", layer_ratio=0.25)
    assert type(slsam.selection) is LayerBandit
    assert float(slsam.selection.probs.sum()) == pytest.approx(0.25 * 8)
    top = built("top_slsam", layer_ratio=0.25)
    assert type(top.selection) is TopKSelection and top.selection.k == 2
    esam = built("esam")
    assert type(esam.selection) is ExpandToAll and esam.needs_per_sample
    assert type(built("rst").schedule) is RandomSchedule
    looksam = built("looksam", interval=4)
    assert type(looksam.schedule) is IntervalSchedule and looksam.schedule.interval == 4
    assert "reuse" in looksam.kinds
    assert type(built("s2sam").schedule) is SingleStepSchedule
    (hook,) = built("ssamf").hooks
    assert isinstance(hook, FisherRefresh)
