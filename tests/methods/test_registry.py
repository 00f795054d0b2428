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
from lightning_slsam.methods.slsam import SLSAMSpec
from lightning_slsam.methods.slsam_depth import CostAwareSLSAMSpec, DepthCut
from lightning_slsam.methods.slsam_looksam import SLSAMLookSAMSpec
from lightning_slsam.methods.slsam_rst import SLSAMRSTSpec
from lightning_slsam.methods.spec import MethodSpec
from lightning_slsam.methods.ssamf import FisherMask
from lightning_slsam.methods.top_slsam import TopKSelection, TopSLSAMSpec
from lightning_slsam.selection.bandit import LayerBandit
from lightning_slsam.selection.rules import AllLayers


def test_lookup_ignores_case_and_dashes_and_suggests_the_closest_name():
    assert lookup("SLSAM") == (SLSAMSpec, {})
    assert lookup("SLSAM-Paper") == (SLSAMSpec, {"preset": "paper"})
    assert lookup("Top-SLSAM") == (TopSLSAMSpec, {})
    assert lookup("slsam-looksam") == (SLSAMLookSAMSpec, {})
    assert lookup("sam") == (MethodSpec, {})
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


def _steps(name: str, n: int, **options) -> list[tuple[str, list[int], list[int]]]:
    # A two-layer net (58 parameters) in a plain loop: each step's kind, the layers updated
    # and the parameters each backward pass computed.
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = make_engine(name, net, seed=0, **options)

    def loss(index=slice(None)):  # per-sample losses: ESAM and SSAM-F pick samples
        return torch.nn.functional.cross_entropy(net(x[index]), y[index], reduction="none")

    out = []
    for _ in range(n):
        r = engine.train_step(loss, opt, batch_size=16)
        out.append((r.kind, r.active_mask.int().tolist(), list(r.pass_numel)))
    return out


ALL = [1, 1, 1, 1]


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("sam", {}, [("sam", ALL, [58, 58])] * 2),  # two passes on every layer
        # one pass, perturbed along the last step's gradient
        ("s2sam", {}, [("plain", ALL, [58]), ("single", ALL, [58]), ("single", ALL, [58])]),
        # SAM every 2 steps, reuse in between
        ("looksam", {"interval": 2},
         [("sam", ALL, [58, 58]), ("reuse", ALL, [58]), ("sam", ALL, [58, 58])]),
        # the first pass on a random half of the layers
        ("esam", {}, [("sam", ALL, [16, 58]), ("sam", ALL, [18, 58])]),
        # RST's coin: SAM with probability 0.5, else a plain step
        ("rst", {}, [("sam", ALL, [58, 58])] * 4 + [("plain", ALL, [58])]),
        # both passes on the sampled layers only
        ("slsam_paper", {"layer_ratio": 0.5},
         [("sam", [0, 0, 1, 0], [16, 16]), ("sam", [0, 0, 1, 1], [18, 18]),
          ("sam", [0, 1, 1, 1], [26, 26])]),
        # first pass dense, then the 2 largest norms
        ("top_slsam", {"layer_ratio": 0.5}, [("sam", [0, 0, 1, 1], [58, 18])] * 2),
        # a dense first step, then one sparse pass
        ("sl_s2sam", {"layer_ratio": 0.5},
         [("plain", ALL, [58]), ("single", [0, 0, 1, 0], [16]), ("single", [0, 0, 1, 1], [18])]),
    ],
)  # fmt: skip
def test_each_method_steps_with_its_kinds_layers_and_pass_sizes(name, options, expected):
    assert _steps(name, len(expected), **options) == expected
