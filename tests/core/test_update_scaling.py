"""Inverse-inclusion update scaling (:mod:`lightning_slsam.core.update_scaling`): each drawn
layer's update times min(1 / q, cap), dense steps unscaled, and the options."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from probes import RHO
from torch import nn

from lightning_slsam import RandomSLSAM, SparseLayerSAM


def _one_step(cb, seed=0, lr=0.1, steps_before=0):
    """Weights change of one engine step of ``cb`` on a 20-tensor MLP (SGD), after
    ``steps_before`` steps; returns (deltas, result, inclusion used for the draw)."""
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    engine = cb.spec.build_engine(net, total_steps=50)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))

    def loss():
        return F.cross_entropy(net(x), y)

    for _ in range(steps_before):
        engine.train_step(loss, opt)
    before = [p.detach().clone() for p in net.parameters()]
    selection = engine.selection
    result = engine.train_step(loss, opt)
    q = selection.inclusion()
    return [p.detach() - b for p, b in zip(net.parameters(), before)], result, q


def test_scale_updates_multiplies_each_drawn_layers_update_by_one_over_q():
    kwargs = dict(rho=RHO, layer_ratio=0.3, seed=4)
    plain, r0, _ = _one_step(SparseLayerSAM(preset="paper", **kwargs))
    scaled, r1, _ = _one_step(SparseLayerSAM(preset="paper", scale_updates=True, **kwargs))
    assert torch.equal(r0.active_mask, r1.active_mask) and 0 < int(r0.active_mask.sum()) < 20
    for layer, (a, b) in enumerate(zip(plain, scaled)):  # one layer per tensor
        if r0.active_mask[layer]:
            torch.testing.assert_close(b, a / 0.3, rtol=1e-5, atol=1e-7)
        else:
            assert not a.any() and not b.any()


def test_scale_updates_uses_the_probability_of_the_draw_capped():
    """After the bandit has moved, one step's update of each drawn layer is SAM's SGD step
    times min(1 / p, cap), p the probabilities the step drew with."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    cb = SparseLayerSAM(rho=RHO, layer_ratio=0.3, bandit_loss="rank", alpha_p=0.5,
                        scale_updates=True, max_update_scale=2.5, seed=4)  # fmt: skip
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))

    def loss():
        return F.cross_entropy(net(x), y)

    for _ in range(8):
        engine.train_step(loss, opt)
    p = engine.selection.probs
    assert float(p.max() - p.min()) > 0.2  # the bandit has moved: factors differ by layer
    reference = copy.deepcopy(net)
    before = [t.detach().clone() for t in net.parameters()]
    mask = engine.train_step(loss, opt).active_mask
    # The same SAM step by hand on the drawn tensors: ascent along the first-pass
    # gradient (one global norm), SGD along the second-pass gradient.
    drawn = [t for t, on in zip(reference.parameters(), mask) if on]
    g = torch.autograd.grad(F.cross_entropy(reference(x), y), drawn)
    norm = torch.sqrt(sum(gi.square().sum() for gi in g))
    with torch.no_grad():
        for t, gi in zip(drawn, g):
            t.add_(RHO * gi / norm)
    g2 = iter(torch.autograd.grad(F.cross_entropy(reference(x), y), drawn))
    factors = (1.0 / p).clamp(max=2.5)
    for layer, (t, b) in enumerate(zip(net.parameters(), before)):
        delta = t.detach() - b
        if not mask[layer]:
            assert not delta.any()
            continue
        expected = -0.1 * next(g2) * float(factors[layer])
        torch.testing.assert_close(delta, expected, rtol=1e-4, atol=1e-6)
    used = set(factors[mask].tolist())
    assert len(used) > 1 and used - {2.5}  # per-layer factors, some below the cap


def test_scale_updates_leaves_dense_and_warmup_steps_unscaled():
    # Dense warm-up: the first step draws every layer with probability 1 -> factor 1.
    plain, _, _ = _one_step(RandomSLSAM(rho=RHO, layer_ratio=0.25, dense_warmup=10, seed=1))
    scaled, r1, q = _one_step(
        RandomSLSAM(rho=RHO, layer_ratio=0.25, dense_warmup=10, scale_updates=True, seed=1)
    )
    assert bool(r1.active_mask.all()) and bool((q == 1).all())
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # A dense plain step of RST's coin (dense_one_pass) is not a draw: not scaled.
    def rst(seed: int, **extra) -> SparseLayerSAM:
        return SparseLayerSAM(rho=RHO, schedule="random", dense_one_pass=True, seed=seed, **extra)

    seed = next(s for s in range(50) if not _one_step(rst(s))[1].drawn)
    plain, _, _ = _one_step(rst(seed))
    scaled, r1, _ = _one_step(rst(seed, scale_updates=True))
    assert not r1.drawn and bool(r1.active_mask.all())
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scaled_updates_move_each_layer_as_far_as_dense_training_in_expectation():
    """A linear loss has a constant gradient: dense SGD moves every weight by lr * g per
    step. With scaling, sparse steps move each layer that far on average; without, by q."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(3, 3, bias=False) for _ in range(8)])
    c = [torch.randn_like(p) for p in net.parameters()]

    def linear_loss():
        return (
            sum((p * ci).sum() for p, ci in zip(net.parameters(), c))
            + 0 * net(torch.zeros(1, 3)).sum()
        )

    def travel(scale):
        start = [p.detach().clone() for p in net.parameters()]
        cb = RandomSLSAM(rho=1e-6, layer_ratio=0.25, scale_updates=scale, seed=7)
        engine = cb.spec.build_engine(net)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        for _ in range(400):
            engine.train_step(linear_loss, opt)
        moved = [(s - p.detach()) / (1e-3 * 400 * ci) for p, s, ci in zip(net.parameters(),
                                                                         start, c)]  # fmt: skip
        with torch.no_grad():
            for p, s in zip(net.parameters(), start):
                p.copy_(s)
        return torch.stack([m.mean() for m in moved])

    unscaled, scaled = travel(False), travel(True)
    assert abs(float(unscaled.mean()) - 0.25) < 0.05  # a quarter of the dense distance
    assert abs(float(scaled.mean()) - 1.0) < 0.12  # the dense distance, in expectation


def test_scale_updates_options_are_validated_and_in_the_presets():
    from lightning_slsam import PRESETS

    assert PRESETS["robust"]["scale_updates"] and not PRESETS["paper"]["scale_updates"]
    assert SparseLayerSAM(preset="robust").update_scale == pytest.approx(5.0)
    assert SparseLayerSAM(preset="paper").update_scale is None
    assert SparseLayerSAM().update_scale == 3.0  # the default preset's cap
    assert SparseLayerSAM(preset="paper", scale_updates=True, layer_ratio=0.5).update_scale == 2.0
    assert SparseLayerSAM(max_update_scale=5).update_scale == 5.0  # explicit wins
    assert RandomSLSAM(scale_updates=True, max_update_scale=3).update_scale == 3.0
    for bad in ({"scale_updates": "yes"}, {"max_update_scale": 0.5},
                {"max_update_scale": float("inf")}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            SparseLayerSAM(**bad)
    from lightning_slsam.core.engine import SparseSAMEngine

    with pytest.raises(ValueError, match="update_scale"):
        SparseSAMEngine.__init__(object.__new__(SparseSAMEngine), None, None, None,
                                 update_scale=0.9)  # fmt: skip
