"""SL-SAM (:mod:`lightning_slsam.methods.slsam`): what each preset sets, the pinned default,
and the names ``"slsam"`` (what ``SparseLayerSAM()`` runs) and ``"slsam_paper"`` (the
paper's method) building exactly those."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import HeadMLP, make_data, make_mlp

from lightning_slsam import SLS2SAM, SparseLayerSAM, make_callback, make_engine
from lightning_slsam.methods.registry import method_spec
from lightning_slsam.methods.slsam import PRESET_WORDS, PRESETS, SLSAMSpec
from lightning_slsam.selection.bandit import LayerBandit


def _train(engine, net, steps=6):
    """``steps`` AdamW steps of ``engine`` on ``net``; the weights after."""
    x, y = make_data(96).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(steps):
        xb, yb = x[16 * step : 16 * step + 16], y[16 * step : 16 * step + 16]
        engine.train_step(lambda xb=xb, yb=yb: F.cross_entropy(net(xb), yb), opt)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _settings(engine) -> dict:
    """What an engine runs, besides the weights it trains."""
    return {
        "selection": type(engine.selection),
        "selection_state": engine.selection.state_dict(),
        "method": type(engine.parts),
        "rho": engine.perturbation.rho,
        "adaptive": engine.perturbation.adaptive,
        "update_scale": engine.update_scale,
        "layers": engine.partition.names,
        "always_active": engine.partition.always_active_names,
        "sync_first_pass": engine.sync_first_pass,
        "check_masks": engine.check_masks,
    }


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def test_presets_set_the_remedies_and_the_paper_preset_is_the_papers_method():
    paper = SparseLayerSAM(preset="paper")
    assert paper.preset == "paper" and paper.spec.setting("bandit_loss") == "shifted"
    assert paper.spec.setting("alpha_p") == 1e-3
    assert not paper.spec.setting("head_always_active")
    for key, value in PRESETS["paper"].items():
        assert paper.spec.setting(key) == value
    default = SparseLayerSAM()
    for key, value in PRESETS["default"].items():
        assert default.spec.setting(key) == value
    assert default.spec.setting("alpha_p") == 0.03  # the rank loss's own step size
    assert default.spec.setting("head_always_active") and default.update_scale == 3.0
    with pytest.raises(ValueError, match="preset"):
        SparseLayerSAM(preset="fast")
    with pytest.raises(ValueError, match="preset"):
        SparseLayerSAM(preset="robust")  # retired (tests/test_example_ablation.py)


def test_the_default_is_pinned():
    """``SparseLayerSAM()``'s configuration, chosen on docs/results/gpu (docs/results.md):
    changing any of it must change this test, the docs and the changelog together."""
    default = SparseLayerSAM()
    assert default.preset == "default" and PRESETS["default"] == {
        "budget": "compute",
        "bandit_loss": "rank",
        "alpha_p": 0.03,
        "head_always_active": True,
        "max_update_scale": 3.0,
    }
    assert (default.rho, default.layer_ratio, default.p_min, default.spec.setting("alpha_p")) == (
        0.01, 0.2, 1e-3, 0.03)  # fmt: skip
    assert (default.spec.setting("budget"), default.update_scale) == ("compute", 3.0)
    # No depth cut: cost-aware SL-SAM is a class of its own (CostAwareSLSAM).
    assert type(default.spec.build_engine(make_mlp(), seed=0).selection) is LayerBandit
    # The paper's exact method stays one argument away, and "slsam_paper" is it.
    paper = SparseLayerSAM(preset="paper")
    assert (paper.spec.setting("budget"), paper.spec.setting("bandit_loss"),
            paper.spec.setting("head_always_active"), paper.update_scale) == (
        "count", "shifted", False, None)  # fmt: skip
    assert make_callback("slsam_paper").preset == "paper"
    assert make_callback("slsam").preset == "default"
    assert SLS2SAM().preset == "paper"  # only SL-SAM's default moved
    # A model with no fresh head: the default trains every layer by sampling, silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SparseLayerSAM(seed=0).spec.build_engine(make_mlp())
    assert set(PRESET_WORDS) == set(PRESETS)  # the run summary describes every preset


def test_the_paper_preset_keeps_the_count_budget():
    assert SparseLayerSAM(preset="paper").spec.setting("budget") == "count"
    net = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 2))
    assert make_engine("slsam_paper", net, seed=0).selection.costs is None
    # The default budgets parameters.
    assert make_engine("slsam", net, seed=0).selection.costs.tolist() == [800.0, 16.0, 2.0]
    # `budget` is the preset's on SparseLayerSAM.
    with pytest.raises(TypeError, match="SparseLayerSAM has no option 'budget'"):
        SparseLayerSAM(budget="compute")


@pytest.mark.parametrize(
    ("name", "callback"),
    [("slsam", lambda: SparseLayerSAM(seed=3)),
     ("slsam_paper", lambda: SparseLayerSAM(preset="paper", seed=3))],
)  # fmt: skip
def test_a_name_builds_exactly_what_its_class_runs(name, callback):
    by_name, by_class = make_callback(name, seed=3), callback()
    assert type(by_name) is type(by_class) is SparseLayerSAM
    assert by_name.spec.options() == by_class.spec.options()
    assert type(method_spec(name, seed=3)) is SLSAMSpec
    assert method_spec(name, seed=3).options() == by_class.spec.options()
    torch.manual_seed(0)
    a = HeadMLP()
    torch.manual_seed(0)
    b = HeadMLP()
    engine_a, engine_b = by_name.spec.build_engine(a), by_class.spec.build_engine(b)
    assert _same(_settings(engine_a), _settings(engine_b))
    wa, wb = _train(engine_a, a), _train(engine_b, b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa), name
    assert torch.equal(engine_a.selection.probs, engine_b.selection.probs)
    assert torch.equal(engine_a.counts, engine_b.counts)


def test_slsam_and_slsam_paper_are_different_methods():
    """The check above can fail: the two names train the head model differently."""
    engines, weights = {}, {}
    for name in ("slsam", "slsam_paper"):
        torch.manual_seed(0)
        net = HeadMLP()
        engines[name] = make_engine(name, net, seed=3)
        weights[name] = _train(engines[name], net)
    default, paper = engines["slsam"], engines["slsam_paper"]
    assert default.partition.always_active_names == ["head.weight", "head.bias"]
    assert paper.partition.always_active_names == []
    assert (default.update_scale, paper.update_scale) == (3.0, None)
    assert not _same(_settings(default), _settings(paper))
    default_weights, paper_weights = weights["slsam"], weights["slsam_paper"]
    assert any(not torch.equal(default_weights[n], paper_weights[n]) for n in default_weights)


def test_tensors_named_always_active_are_trained_every_step():
    # Was `vectors_always_active=True` (retired): the same tensors named by `always_active`.
    net = make_mlp()  # 3 Linear (weight, bias) + 1 LayerNorm (weight, bias)
    vectors = [r"\.bias$", r"^2\.weight$"]
    engine = SparseLayerSAM(always_active=vectors, seed=0).spec.build_engine(net)
    assert engine.partition.always_active_names == ["0.bias", "2.weight", "2.bias", "3.bias",
                                                    "5.bias"]  # fmt: skip
    assert engine.partition.names == ["0.weight", "3.weight", "5.weight"]
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for _ in range(5):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
        for name, p in net.named_parameters():
            if p.dim() == 1:
                assert not torch.equal(p.detach(), before[name])  # updated every step
                before[name] = p.detach().clone()
