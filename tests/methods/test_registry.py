"""Every method by name (:mod:`lightning_slsam.methods.registry`): the lookup, the options a
name implies, and the engine each name builds."""

from __future__ import annotations

import pytest
from helpers import make_mlp

from lightning_slsam.core.step import MethodParts
from lightning_slsam.methods.esam import ESAMSpec, ExpandToAll
from lightning_slsam.methods.looksam import Lookahead, LookSAMSpec
from lightning_slsam.methods.registry import (
    SPECS,
    lookup,
    make_engine,
    method_spec,
    spec_from,
)
from lightning_slsam.methods.rst import Coin
from lightning_slsam.methods.s2sam import SingleStepParts
from lightning_slsam.methods.sam import SAMSpec
from lightning_slsam.methods.slsam import SLSAMSpec
from lightning_slsam.methods.slsam_ablation import SLSAMAblationSpec
from lightning_slsam.methods.slsam_depth import CostAwareSLSAMSpec, DepthCut
from lightning_slsam.methods.slsam_looksam import SLSAMLookSAMSpec
from lightning_slsam.methods.slsam_rst import SLSAMRSTSpec
from lightning_slsam.methods.ssamf import FisherMask
from lightning_slsam.methods.top_slsam import TopKSelection, TopSLSAMSpec
from lightning_slsam.selection.bandit import LayerBandit
from lightning_slsam.selection.rules import AllLayers


def test_lookup_ignores_case_and_dashes_and_suggests_the_closest_name():
    assert lookup("SLSAM") == (SLSAMSpec, {})
    assert lookup("SLSAM-Paper") == (SLSAMSpec, {"preset": "paper"})
    assert lookup("Top-SLSAM") == (TopSLSAMSpec, {})
    assert lookup("slsam-looksam") == (SLSAMLookSAMSpec, {})
    assert lookup("sam") == (SAMSpec, {})
    assert lookup("adamw") == (None, {})
    with pytest.raises(ValueError, match=r"Unknown method 'slsamm'\. Did you mean 'slsam'\?"):
        lookup("slsamm")
    with pytest.raises(ValueError, match=r"Unknown method 'zzz'\. Choose one of \['adamw', "):
        lookup("zzz")


def test_a_front_end_takes_a_name_with_options_or_a_spec_alone():
    kw = {"owner": "FabricSAM", "instead": "step the optimizer."}
    spec = spec_from("slsam_paper", {"rho": 0.1}, **kw)
    assert (type(spec), spec.preset, spec.rho) == (SLSAMSpec, "paper", 0.1)
    given = method_spec("rst", probability=0.25)
    assert spec_from(given, {}, **kw) is given
    with pytest.raises(TypeError, match=r"FabricSAM takes options with a method name, not with"):
        spec_from(given, {"rho": 0.1}, **kw)
    with pytest.raises(TypeError, match=r"FabricSAM's method must be a method name or a Method"):
        spec_from(3, {}, **kw)
    with pytest.raises(ValueError, match=r"'AdamW' is plain AdamW, which needs no FabricSAM: step"):
        spec_from("AdamW", {}, **kw)
    with pytest.raises(ValueError, match=r"rho"):  # each value validated by the spec
        spec_from("sam", {"rho": -1.0}, **kw)


def test_method_spec_applies_the_options_a_name_implies_and_given_ones_win():
    assert method_spec("slsam").preset == "default"
    assert method_spec("slsam_paper").preset == "paper"
    assert method_spec("slsam_paper", layer_ratio=0.3).layer_ratio == 0.3
    assert type(method_spec("slsam_rst")) is SLSAMRSTSpec
    assert method_spec("slsam_rst").preset == "default"  # the paper's before 0.3
    assert type(method_spec("slsam_ablation")) is SLSAMAblationSpec
    assert type(method_spec("slsam_depth")) is CostAwareSLSAMSpec
    assert method_spec("slsam_depth").depth == 0.5
    assert method_spec("slsam_depth", depth=0.25).depth == 0.25
    assert method_spec("slsam_depth", preset="paper").preset == "paper"
    assert method_spec("looksam", interval=3).interval == 3
    assert type(method_spec("looksam")) is LookSAMSpec and type(method_spec("esam")) is ESAMSpec
    with pytest.raises(ValueError, match="plain AdamW: there is no SAM method to build"):
        method_spec("adamw")
    assert set(SPECS) >= {"sam", "slsam", "slsam_paper", "esam", "ssamf", "looksam", "rst",
                          "s2sam"}  # fmt: skip


def test_each_name_builds_the_engine_of_its_parts():
    def built(name, **options):
        return make_engine(name, make_mlp(), seed=0, **options)  # 8 tensors, 8 layers

    sam = built("sam")
    assert type(sam.selection) is AllLayers and sam.selection.always_all
    assert sam.perturbation.rho == 0.01 and not sam.perturbation.adaptive
    assert type(sam.parts) is MethodParts
    slsam = built("slsam_paper", layer_ratio=0.25)
    assert type(slsam.selection) is LayerBandit and slsam.selection.costs is None
    assert float(slsam.selection.probs.sum()) == pytest.approx(0.25 * 8)
    default = built("slsam", layer_ratio=0.25)
    assert type(default.selection) is LayerBandit and default.update_scale == 3.0
    assert default.selection.costs is not None  # the parameter budget
    top = built("top_slsam", layer_ratio=0.25)
    assert type(top.selection) is TopKSelection and top.selection.k == 2
    esam = built("esam")
    assert type(esam.selection) is ExpandToAll and esam.needs_per_sample
    assert type(built("rst").parts) is Coin
    looksam = built("looksam", interval=4)
    assert type(looksam.parts) is Lookahead and looksam.parts.interval == 4
    assert looksam.parts.kind(1) == "reuse"
    assert type(built("s2sam").parts) is SingleStepParts
    assert type(built("sl_s2sam").parts) is SingleStepParts
    assert isinstance(built("ssamf").parts, FisherMask)
    assert type(built("slsam_rst").parts) is Coin
    assert type(built("slsam_looksam").parts) is Lookahead
    assert type(built("slsam_depth").selection) is DepthCut
