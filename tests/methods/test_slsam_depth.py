"""Selection rules that reshape another's draw (:mod:`lightning_slsam.selection.wrappers`):
what DepthCut and DenseWarmup draw, and what the learning rule behind them is told."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from probes import RHO
from torch import nn

from lightning_slsam import SparseLayerSAM
from lightning_slsam.selection.bandit import LayerBandit
from lightning_slsam.selection.rules import LayerSelection, UniformSelection
from lightning_slsam.selection.wrappers import DenseWarmup, DepthCut


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
    means = _importance_means(cut, 20000)
    reachable = cut.eligible > 0
    # Each reachable layer's importance-weighted count is unbiased: 1 up to sampling noise
    # (the least likely layer is drawn ~1000 times in 20000 draws).
    torch.testing.assert_close(
        means[reachable], torch.ones(int(reachable.sum()), dtype=torch.float64), atol=0.1, rtol=0
    )
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


def test_dense_warmup_anneals_from_every_layer_to_the_inner_ratio():
    n, steps = 200, 50
    rule = DenseWarmup(UniformSelection(n, 0.2, _gen(0)), steps, _gen(1))
    sizes = [int(rule.sample().sum()) for _ in range(steps + 20)]
    assert sizes[0] == n  # every layer at the first step
    for t in (10, 25, 40):
        want = n * (0.2 + 0.8 * (1 - t / steps))
        assert abs(sizes[t] - want) < 4 * math.sqrt(n * 0.25)
    late = sum(sizes[steps:]) / 20
    assert abs(late - 0.2 * n) < 6  # the inner ratio from the end of the warm-up on
    assert rule.weight(0) == 1.0 and rule.weight(steps) == 0.0


def test_dense_warmup_reports_the_true_inclusion_probability():
    probs = torch.linspace(0.05, 0.9, 8)
    rule = DenseWarmup(_Spy(probs), 10, _gen(2))
    total = torch.zeros(8, dtype=torch.float64)
    draws = 0
    for _ in range(4000):
        rule.num_sampled = 6  # hold the warm-up at step 6: weight 0.4
        total += rule.sample().double() / rule.inclusion()
        draws += 1
    want = probs.double() + (1 - probs.double()) * 0.4
    torch.testing.assert_close(rule.inclusion(), want)
    torch.testing.assert_close(total / draws, torch.ones(8, dtype=torch.float64), atol=0.06, rtol=0)
    rule.update(torch.ones(8, dtype=torch.bool), torch.ones(8))
    torch.testing.assert_close(rule.inner.seen[-1], want)


def test_dense_warmup_state_round_trip_continues_identically():
    def make():
        bandit = LayerBandit(30, 0.2, p_min=1e-3, loss="rank", generator=_gen(5))
        return DenseWarmup(bandit, 20, _gen(6))

    a = make()
    for _ in range(7):
        mask = a.sample()
        a.update(mask, torch.rand(30, generator=_gen(int(mask.sum()))))
    b = make()
    b.load_state_dict(a.state_dict())
    for _ in range(20):
        ma, mb = a.sample(), b.sample()
        assert torch.equal(ma, mb)
        norms = torch.rand(30, generator=_gen(int(ma.sum())))
        a.update(ma, norms)
        b.update(mb, norms)
    torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=0)


def test_dense_warmup_rejects_bad_steps():
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="steps"):
            DenseWarmup(UniformSelection(4, 0.5), bad)  # type: ignore[arg-type]


def test_depth_cut_freezes_everything_below_the_cut_and_shortens_backprop():
    from lightning_slsam.selection.wrappers import DepthCut

    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(20)])  # 40 tensors, input first
    cb = SparseLayerSAM(preset="paper", layer_ratio=0.2, backprop_depth=0.5, seed=1)
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


def test_warmup_layer_ratio_falls_from_one_to_the_target():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(25)])  # 50 tensors
    cb = SparseLayerSAM(rho=RHO, dense_warmup=20, seed=1)
    engine = cb.spec.build_engine(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.randint(0, 4, (8,))
    sizes = [
        int(engine.train_step(lambda: F.cross_entropy(net(x), y), opt).active_mask.sum())
        for _ in range(60)
    ]
    assert sizes[0] == 50
    assert sum(sizes[:5]) / 5 > 40 and abs(sum(sizes[30:]) / 30 - 10) < 3
    assert engine.selection.inner.num_updates == 60  # the bandit learns through the warm-up
