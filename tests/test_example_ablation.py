"""SL-SAM with each preset setting alone (examples/methods.py's ``slsam_ablation``):
``None`` is the preset's, a given setting wins, and the retired ``"robust"`` preset is one
of its configurations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import HeadMLP, make_data, make_mlp

from examples.methods import SLSAMAblation, SLSAMAblationSpec
from lightning_slsam import SparseLayerSAM
from lightning_slsam.methods.slsam import PRESETS

SETTINGS = ("budget", "bandit_loss", "alpha_p", "head_always_active", "max_update_scale")


def _train(callback, steps=6):
    """``steps`` AdamW steps of ``callback``'s engine on a fresh HeadMLP: the weights, the
    bandit's probabilities and the layers' update counts."""
    torch.manual_seed(0)
    net = HeadMLP()
    engine = callback.spec.build_engine(net)
    x, y = make_data(96).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(steps):
        xb, yb = x[16 * step : 16 * step + 16], y[16 * step : 16 * step + 16]
        engine.train_step(lambda xb=xb, yb=yb: F.cross_entropy(net(xb), yb), opt)
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    return weights, engine


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_setting_none_is_the_preset(preset):
    ablation = SLSAMAblation(preset=preset, seed=3)
    assert all(getattr(ablation.spec, name) is None for name in SETTINGS)
    reference = SparseLayerSAM(preset=preset, seed=3)
    for name in SETTINGS:
        assert ablation.spec.setting(name) == reference.spec.setting(name) == PRESETS[preset][name]
    assert ablation.update_scale == reference.update_scale
    wa, ea = _train(ablation)
    wb, eb = _train(reference)
    assert ea.partition.always_active_names == eb.partition.always_active_names
    assert ea.update_scale == eb.update_scale
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert torch.equal(ea.selection.probs, eb.selection.probs)
    assert torch.equal(ea.counts, eb.counts)


def test_a_setting_given_alone_changes_what_trains():
    """The equality above can fail: one setting away from the preset trains otherwise."""
    _, ea = _train(SLSAMAblation(preset="paper", bandit_loss="rank", seed=3))
    wb, eb = _train(SparseLayerSAM(preset="paper", seed=3))
    assert ea.selection.state_dict()["loss"] == "rank" != eb.selection.state_dict()["loss"]
    assert not torch.equal(ea.selection.probs, eb.selection.probs)
    wc, _ = _train(SLSAMAblation(preset="paper", head_always_active=True, seed=3))
    assert any(not torch.equal(wc[n], wb[n]) for n in wb)


def test_given_settings_win_over_the_preset():
    # What the retired "robust" preset ran: the remedies under the paper's count budget,
    # the update factor capped at 1 / layer_ratio.
    robust = SLSAMAblation(budget="count", bandit_loss="rank", head_always_active=True,
                           max_update_scale=1 / 0.2)  # fmt: skip
    assert robust.spec.setting("budget") == "count"
    assert robust.spec.setting("alpha_p") == 0.03  # the rank loss's own step size
    assert robust.spec.setting("head_always_active") and robust.update_scale == 5.0
    # A loss given alone brings its own step size; the other settings stay the preset's.
    mixed = SLSAMAblation(bandit_loss="shifted")
    assert mixed.spec.setting("bandit_loss") == "shifted" and mixed.spec.setting("alpha_p") == 1e-3
    assert mixed.spec.setting("head_always_active") and mixed.spec.setting("budget") == "compute"
    assert SLSAMAblation(bandit_loss="rank", alpha_p=0.5).spec.setting("alpha_p") == 0.5
    assert SLSAMAblation(preset="paper", alpha_p=0.5).spec.setting("alpha_p") == 0.5
    # A cap of 1 is no scaling.
    assert SLSAMAblation(max_update_scale=1.0).update_scale is None
    spec = SLSAMAblationSpec(preset="paper", bandit_loss="rank", max_update_scale=5.0)
    assert (spec.setting("budget"), spec.setting("alpha_p"), spec.update_scale) == (
        "count", 0.03, 5.0)  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value"),
    [("budget", "flops"), ("bandit_loss", "l2"), ("alpha_p", -1.0),
     ("head_always_active", 1), ("max_update_scale", 0.5)],
)  # fmt: skip
def test_each_setting_is_checked_naming_it(option, value):
    with pytest.raises(ValueError, match=rf"^SLSAMAblation: `{option}` must be"):
        SLSAMAblation(**{option: value})


def test_a_head_rule_without_a_head_warns():
    with pytest.warns(UserWarning, match="found no freshly initialised head"):
        SLSAMAblation(head_always_active=True, seed=0).spec.build_engine(make_mlp())
