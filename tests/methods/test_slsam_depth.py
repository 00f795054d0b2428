"""Cost-aware SL-SAM (:mod:`lightning_slsam.methods.slsam_depth`): what its depth cut
(:class:`DepthCut`) draws, what the bandit behind it is told, and the method it builds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_mlp
from torch import nn

from lightning_slsam import CostAwareSLSAM, SparseLayerSAM, make_callback
from lightning_slsam.core.partition import build_partition
from lightning_slsam.methods.slsam_depth import DepthCut
from lightning_slsam.selection.bandit import LayerBandit
from lightning_slsam.selection.rules import LayerSelection, UniformSelection


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Spy(LayerSelection):
    """A fixed-probability rule that records what update() is told."""

    def __init__(self, probs: torch.Tensor, seed: int = 0) -> None:
        self.num_layers = probs.numel()
        self._p = probs.double()
        self._gen = _gen(seed)
        self.seen: list[torch.Tensor | None] = []

    @property
    def probs(self) -> torch.Tensor:
        return self._p.clone()

    def sample(self) -> torch.Tensor:
        return torch.rand(self.num_layers, generator=self._gen, dtype=torch.float64) < self._p

    def update(self, active, norms, inclusion=None) -> bool:
        self.seen.append(None if inclusion is None else inclusion.clone())
        return True


def _importance_means(rule: LayerSelection, draws: int) -> torch.Tensor:
    """Mean over draws of 1[drawn] / q: 1 for every layer when q is the true probability."""
    total = torch.zeros(rule.num_layers, dtype=torch.float64)
    for _ in range(draws):
        mask = rule.sample()
        total += mask.double() / rule.inclusion()
    return total / draws


@pytest.mark.parametrize("depth", [0.3, 0.5, 0.8])
def test_depth_cut_reports_the_true_inclusion_probability(depth):
    n = 12
    inner = UniformSelection(n, 0.6, _gen(0))
    cut = DepthCut(inner, depth, _gen(1))
    draws = 20000
    means = _importance_means(cut, draws)
    reachable = cut.eligible > 0
    # Each reachable layer's importance-weighted count is unbiased: 1 up to sampling noise,
    # within 5 standard errors (1[drawn] / q has variance (1 - q) / q per draw; the least
    # likely layer is drawn ~1000 times in 20000 draws).
    q = cut.inclusion()[reachable]
    error = torch.sqrt((1 - q) / (q * draws))
    assert bool(((means[reachable] - 1).abs() < 5 * error).all()), (means, error)
    assert not bool(means[~reachable].nan_to_num(0.0).any())  # 0 / 0: never drawn
    # With the inner rule's probability alone (the old weights), the count of the lowest
    # reachable layer would be far from 1.
    lowest = int(torch.nonzero(reachable)[0])
    assert abs(means[lowest] * cut.inclusion()[lowest] / 0.6 - 1) > 0.5


def test_depth_cut_passes_the_true_inclusion_to_the_inner_rule():
    probs = torch.full((10,), 0.5)
    spy = _Spy(probs)
    cut = DepthCut(spy, 0.5, _gen(3))
    mask = cut.sample()
    cut.update(mask, torch.ones(10))
    kept = 1 - sum(float(cut.cut_probs[c]) * 0.5 ** (10 - c) for c in range(10))
    torch.testing.assert_close(spy.seen[-1], probs.double() * cut.eligible / kept)
    assert abs(cut.eligible[-1] - 1.0) < 1e-12 and cut.eligible[0] < 0.2


def test_depth_cut_bandit_update_differs_from_the_uncorrected_one():
    """The bandit behind a cut learns with 1 / (p * P(eligible)) weights (it used 1 / p)."""
    n = 20
    bandit = LayerBandit(n, 0.3, p_min=1e-3, alpha_p=0.05, loss="rank", generator=_gen(0))
    cut = DepthCut(bandit, 0.5, _gen(1))
    mask = cut.sample()
    norms = torch.linspace(0.1, 2.0, n)
    reference = LayerBandit(n, 0.3, p_min=1e-3, alpha_p=0.05, loss="rank")
    uncorrected = LayerBandit(n, 0.3, p_min=1e-3, alpha_p=0.05, loss="rank")
    reference.update(mask, norms, inclusion=cut.inclusion())
    uncorrected.update(mask, norms)
    cut.update(mask, norms)
    torch.testing.assert_close(bandit.probs, reference.probs, rtol=0, atol=1e-15)
    assert not torch.allclose(bandit.probs, uncorrected.probs)


def test_depth_cut_freezes_everything_below_the_cut_and_shortens_backprop():
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(20)])  # 40 tensors, input first
    cb = CostAwareSLSAM(preset="paper", layer_ratio=0.2, depth=0.5, seed=1)
    engine = cb.spec.build_engine(net)
    assert isinstance(engine.selection, DepthCut)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    reached = []
    for _ in range(300):
        result = engine.train_step(lambda: F.cross_entropy(net(x), y), opt)
        cut = engine.selection.last_cut
        mask = result.active_mask
        assert not bool(mask[:cut].any()) and bool(mask.any())
        reached.append(1 - int(torch.nonzero(mask)[0]) / 40)
    assert 0.4 < sum(reached) / len(reached) < 0.6  # half the depth on average
    assert engine.selection.inner.num_updates == 300  # the bandit still learns
    state = engine.selection.state_dict()
    again = cb.spec.build_engine(net)
    again.selection.load_state_dict(state)
    assert [again.selection.sample().tolist() for _ in range(5)] == [
        engine.selection.sample().tolist() for _ in range(5)
    ]


def test_the_name_and_the_options():
    assert make_callback("slsam_depth").preset == "default"  # was the paper's before 0.3
    assert CostAwareSLSAM().depth == 0.5 and CostAwareSLSAM(depth=0.25).depth == 0.25
    for bad in (0.0, 1.5, "half"):
        with pytest.raises(ValueError, match=r"^CostAwareSLSAM: `depth` must be in \(0, 1\]"):
            CostAwareSLSAM(depth=bad)


def _train(spec, steps=8):
    net = make_mlp(seed=2)
    engine = spec.build_engine(net)
    x, y = make_data(64).tensors
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    masks = []
    for step in range(steps):
        xb, yb = x[16 * (step % 4) :][:16], y[16 * (step % 4) :][:16]
        result = engine.train_step(lambda xb=xb, yb=yb: F.cross_entropy(net(xb), yb), opt)
        masks.append(result.active_mask.tolist())
    return masks, [p.detach().clone() for p in net.parameters()], engine


@pytest.mark.parametrize("preset", ["default", "paper"])
def test_cost_aware_sl_sam_is_sl_sam_with_a_depth_cut(preset):
    # A depth of 1 cuts nothing: SparseLayerSAM of the same preset, bit for bit.
    whole = CostAwareSLSAM(preset=preset, depth=1.0, seed=4).spec
    masks, weights, engine = _train(whole)
    ref_masks, ref_weights, ref_engine = _train(SparseLayerSAM(preset=preset, seed=4).spec)
    assert type(engine.selection) is LayerBandit
    assert masks == ref_masks and engine.update_scale == ref_engine.update_scale
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert torch.equal(engine.selection.probs, ref_engine.selection.probs)
    # A cut: the same bandit behind a DepthCut drawing from its own generator (the bandit's
    # seed + 2), which a cut built here reproduces.
    cut_masks, _, cut_engine = _train(CostAwareSLSAM(preset=preset, depth=0.5, seed=4).spec)
    assert isinstance(cut_engine.selection, DepthCut) and cut_masks != ref_masks
    bandit = SparseLayerSAM(preset=preset, seed=4).spec
    layers = build_partition(make_mlp(seed=2))  # the layers' sizes, for the compute budget
    inner = bandit.selection(layers, torch.Generator().manual_seed(4))
    by_hand = DepthCut(inner, 0.5, torch.Generator().manual_seed(6))
    first = by_hand.sample()
    assert first.tolist() == cut_masks[0]
    assert not bool(first[: by_hand.last_cut].any())
