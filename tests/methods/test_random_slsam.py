"""Random-SL-SAM (:mod:`lightning_slsam.methods.random_slsam`): layers drawn uniformly, its two
presets (the paper's ablation, and the default SL-SAM's head rule and update scaling)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import HeadMLP, make_data, make_mlp
from tolerance import offset_atol

from lightning_slsam import RandomSLSAM, make_callback
from lightning_slsam.selection.rules import UniformSelection


def test_the_presets():
    paper = RandomSLSAM()
    assert paper.preset == "paper" and make_callback("random_slsam").preset == "paper"
    assert not paper.spec.setting("head_always_active") and paper.update_scale is None
    default = RandomSLSAM(preset="default")  # was head_always_active + scale_updates, cap 3
    assert default.spec.setting("head_always_active") and default.update_scale == 3.0
    with pytest.raises(ValueError, match="`preset`"):
        RandomSLSAM(preset="robust")


def test_layers_are_drawn_uniformly_each_with_the_layer_ratio():
    net = make_mlp()  # 8 tensors, 8 layers
    engine = RandomSLSAM(layer_ratio=0.5, seed=1).spec.build_engine(net)
    assert type(engine.selection) is UniformSelection and engine.selection.ratio == 0.5
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    results = [engine.train_step(lambda: F.cross_entropy(net(x), y), opt) for _ in range(200)]
    assert all(r.kind == "sam" and r.num_backward == 2 and r.active_mask.any() for r in results)
    assert sum(bool(r.active_mask.all()) for r in results) < 10
    frequencies = engine.frequencies()
    assert bool(((frequencies > 0.38) & (frequencies < 0.65)).all()), frequencies


@pytest.mark.parametrize(("preset", "factor"), [("paper", 1.0), ("default", 2.0)])
def test_the_default_preset_trains_the_head_every_step_and_scales_drawn_updates(preset, factor):
    torch.manual_seed(0)
    net = HeadMLP()
    engine = RandomSLSAM(preset=preset, layer_ratio=0.5, seed=2).spec.build_engine(net)
    head = ["head.weight", "head.bias"]
    assert engine.partition.always_active_names == (head if preset == "default" else [])
    x, y = make_data(16).tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    params = dict(net.named_parameters())
    for _ in range(4):
        before = {n: p.detach().clone() for n, p in params.items()}
        result = engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
        active = {n for n, on in zip(engine.partition.names, result.active_mask.tolist()) if on}
        for name, p in params.items():
            change = p.detach() - before[name]
            if name in head and preset == "default":  # trained every step, not scaled
                torch.testing.assert_close(change, -0.1 * p.grad, rtol=1e-4, atol=offset_atol(p))
            elif name in active:  # a drawn layer moves 1 / q = 2 times the SGD step
                torch.testing.assert_close(
                    change, -0.1 * factor * p.grad, rtol=1e-4, atol=offset_atol(p)
                )
            else:
                assert not bool(change.any()), name
