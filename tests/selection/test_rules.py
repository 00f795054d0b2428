"""Selection rules (:mod:`lightning_slsam.selection.rules`): uniform sampling (Random-SL-SAM)
and the greedy top-k (Top-SL-SAM), and what each rule draws and learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from probes import RHO, Recorder, gradients, setup_engine
from torch import nn

from lightning_slsam import RandomSLSAM, TopSLSAM
from lightning_slsam.selection.rules import AllLayers, ExpandToAll, TopKSelection, UniformSelection


def test_random_sl_sam_frequencies_are_uniform_and_fixed():
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])  # 10 tensors
    cb = RandomSLSAM(layer_ratio=0.3, seed=4)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
    steps = 500
    for _ in range(steps):
        engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
    # Marginal of Bernoulli(0.3) per layer, redrawn while empty.
    marginal = 0.3 / (1 - 0.7**10)
    sd = (marginal * (1 - marginal) / steps) ** 0.5
    freq = engine.frequencies()
    assert (freq - marginal).abs().max() < 4 * sd
    assert torch.equal(engine.selection.probs, torch.full((10,), 0.3, dtype=torch.float64))


def test_top_sl_sam_picks_exactly_the_k_largest_first_pass_norms():
    cb = TopSLSAM(rho=RHO, layer_ratio=0.25)  # k = 2 of 8
    net, x, y, engine, opt = setup_engine(cb)
    for _ in range(6):
        g = gradients(net, x, y)
        expected = torch.tensor([gi.norm() for gi in g]).topk(2).indices.sort().values
        rec = Recorder(net, x, y)
        result = engine.train_step(rec, opt)
        assert torch.nonzero(result.active_mask).flatten().tolist() == expected.tolist()
        assert all(rec.passes[0]["trainable"])  # the first pass computes every layer
        assert rec.passes[1]["trainable"] == result.active_mask.tolist()
        assert result.active_ratio_per_pass[0] == 1.0
    assert engine.never_selected() >= 4  # greedy: most layers are never trained


# -- the rules, directly ------------------------------------------------------------------------


def test_top_k_keeps_the_largest_norms_with_ties_broken_by_model_order():
    rule = TopKSelection(5, k=2)
    first = rule.sample()
    assert first.tolist() == [True] * 5 and rule.refine_uses_norms and not rule.always_all
    norms = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0], dtype=torch.float64)
    assert rule.refine(first, norms).tolist() == [False, True, True, False, False]
    assert TopKSelection(3, k=3).always_all
    for k in (0, 6, 2.0):
        with pytest.raises(ValueError, match=r"1 <= k <= 5"):
            TopKSelection(5, k=k)  # type: ignore[arg-type]


def test_uniform_selection_never_draws_an_empty_set_and_resumes_its_stream():
    rule = UniformSelection(3, 0.05, generator=torch.Generator().manual_seed(0))
    draws = torch.stack([rule.sample() for _ in range(300)])
    assert bool(draws.any(dim=1).all())  # redrawn while empty (P(empty) = 0.95**3 here)
    assert rule.probs.tolist() == [0.05] * 3 and not rule.always_all
    assert UniformSelection(4, 1.0).always_all
    again = UniformSelection(3, 0.05)
    again.load_state_dict(rule.state_dict())
    assert [again.sample().tolist() for _ in range(20)] == [
        rule.sample().tolist() for _ in range(20)
    ]
    with pytest.raises(ValueError, match="layer_ratio"):
        UniformSelection(3, 0.0)


def test_expand_to_all_trains_every_layer_after_its_draw_and_never_learns():
    first = UniformSelection(6, 0.5, generator=torch.Generator().manual_seed(1))
    rule = ExpandToAll(first)
    drawn = rule.sample()
    assert 0 < int(drawn.sum()) < 6
    assert rule.refine(drawn, None).tolist() == [True] * 6
    assert rule.probs.tolist() == [0.5] * 6 and rule.inner is first
    assert rule.update(drawn, torch.ones(6, dtype=torch.float64)) is False
    state = rule.state_dict()
    twin = ExpandToAll(UniformSelection(6, 0.5))
    twin.load_state_dict(state)
    assert twin.sample().tolist() == rule.sample().tolist()


def test_every_layer_every_step_and_the_base_rules_defaults():
    rule = AllLayers(4)
    assert rule.sample().tolist() == [True] * 4 and rule.always_all
    assert rule.inclusion().tolist() == [1.0] * 4 and rule.update(rule.sample(), None) is False
    mask = torch.tensor([True, False, True, False])
    assert rule.refine(mask, None) is mask  # unchanged by default
