"""Selection rules (:mod:`lightning_slsam.selection.rules`): uniform sampling (Random-SL-SAM),
every layer, the wrapper base and the seeded generators; with the rules methods bring (the
greedy top-k of Top-SL-SAM, ESAM's expansion to every layer), what each rule draws and
learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from probes import RHO, Recorder, gradients, setup_engine
from torch import nn

from lightning_slsam import RandomSLSAM, TopSLSAM
from lightning_slsam.core.partition import build_partition
from lightning_slsam.methods.esam import ExpandToAll
from lightning_slsam.methods.registry import method_spec
from lightning_slsam.methods.top_slsam import TopKSelection
from lightning_slsam.selection.rules import (
    AllLayers,
    LayerSelection,
    Seeded,
    UniformSelection,
    WrappedSelection,
    seeded_generator,
)


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
    assert TopKSelection(3, k=3).always_all and rule.refines
    # Top-SL-SAM's k is round(layer_ratio * N), at least 1; the spec checks layer_ratio.
    gen = torch.Generator()
    five = build_partition(nn.Sequential(*(nn.Linear(2, 2, bias=False) for _ in range(5))))
    assert method_spec("top_slsam", layer_ratio=0.01).selection(five, gen).k == 1
    assert method_spec("top_slsam", layer_ratio=0.5).selection(five, gen).k == 2
    assert method_spec("top_slsam", layer_ratio=1.0).selection(five, gen).k == 5
    for ratio in (0, 1.5, "0.2"):
        with pytest.raises(ValueError, match=r"`layer_ratio` must be in \(0, 1\]"):
            method_spec("top_slsam", layer_ratio=ratio)


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
    with pytest.raises(ValueError, match="`layer_ratio`"):  # the spec checks the ratio
        method_spec("random_slsam", layer_ratio=0.0)


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


class Halved(WrappedSelection):
    """Draws half of its inner rule's layers (the even ones), so their true inclusion
    probability is the inner rule's."""

    def sample(self):
        mask = self.inner.sample()
        mask[1::2] = False
        return mask


class Learning(LayerSelection):
    """Records the inclusion probabilities it is taught with."""

    def __init__(self, n):
        self.num_layers = n
        self.taught = []

    @property
    def probs(self):
        return torch.full((self.num_layers,), 0.5, dtype=torch.float64)

    def update(self, active, norms, inclusion=None):
        self.taught.append(None if inclusion is None else inclusion.tolist())
        return True


def test_a_wrapped_rule_passes_its_inner_rules_probabilities_and_teaches_it_its_own():
    inner = Learning(4)
    rule = Halved(inner)
    assert rule.num_layers == 4 and rule.probs.tolist() == [0.5] * 4 and not rule.always_all
    assert Halved(AllLayers(3)).always_all and not rule.refines
    assert rule.update(torch.ones(4, dtype=torch.bool), torch.ones(4)) is True
    assert rule.update(torch.ones(4, dtype=torch.bool), torch.ones(4), torch.ones(4)) is True
    # The wrapper's inclusion (by default its probs, here the inner rule's), or the one given.
    assert inner.taught == [[0.5] * 4, [1.0] * 4]


def test_seeded_rules_follow_the_global_seed_and_resume_their_stream():
    torch.manual_seed(11)
    first = seeded_generator(None, offset=3)
    assert first.initial_seed() == 11 + 3
    given = torch.Generator().manual_seed(5)
    assert seeded_generator(given) is given
    part = Seeded()
    part._gen = seeded_generator(None)
    state = part.generator_state()
    drawn = torch.rand(4, generator=part._gen)
    part.load_generator_state({})  # nothing saved: the stream goes on
    assert not torch.equal(torch.rand(4, generator=part._gen), drawn)
    part.load_generator_state(state)
    assert torch.equal(torch.rand(4, generator=part._gen), drawn)
