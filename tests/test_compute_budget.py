"""The compute budget of the layer selection: the cost-weighted KL projection (against an
independent bisection solver, and its invariants)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_slsam.selection.projection import kl_projection, weighted_kl_projection


def _bisect_weighted(log_u, costs, budget: float, lower: float, upper: float) -> np.ndarray:
    """Independent reference: bisection on s for sum(c * clip(exp(s + x))) == budget, in
    NumPy, with a bracket wide enough for every entry to reach both bounds."""
    x, c = np.asarray(log_u, dtype=float), np.asarray(costs, dtype=float)
    ends = np.concatenate([math.log(lower) - x, math.log(upper) - x])
    lo, hi = ends.min() - 1.0, ends.max() + 1.0

    def q(s):
        return np.exp(np.clip(s + x, math.log(lower), math.log(upper)))

    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if (c * q(mid)).sum() < budget:
            lo = mid
        else:
            hi = mid
    return q(0.5 * (lo + hi))


def test_weighted_projection_matches_bisection_on_random_inputs():
    rng = np.random.default_rng(0)
    both_clipped = 0
    for case in range(300):
        n = int(rng.integers(1, 60))
        lower = float(10 ** rng.uniform(-4, -1.5))
        upper = float(rng.choice([1.0, 0.5]))
        spread = [0.01, 0.5, 2.0, 6.0][case % 4]
        log_u = rng.normal(size=n) * spread + math.log(0.2)
        # Costs like parameter counts: from a LayerNorm bias to a vocabulary embedding.
        costs = np.exp(rng.uniform(math.log(10), math.log(1e7), size=n))
        total = costs.sum()
        budget = float(rng.uniform(lower * total, upper * total))
        got = weighted_kl_projection(torch.tensor(log_u), torch.tensor(costs), budget, lower,
                                     upper)  # fmt: skip
        want = _bisect_weighted(log_u, costs, budget, lower, upper)
        assert got.dtype == torch.float64 and got.shape == (n,)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-11)
        assert abs(float((torch.tensor(costs) * got).sum()) - budget) <= 1e-10 * budget
        assert got.min().item() >= lower and got.max().item() <= upper
        both_clipped += bool((got == lower).any() and (got == upper).any())
    assert both_clipped > 30  # the cases really exercise clipping at both bounds


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_equal_costs_give_the_count_projection(n):
    rng = np.random.default_rng(n)
    log_u = torch.tensor(rng.normal(size=n) * 3)
    budget = 0.3 * n
    costs = torch.full((n,), 123.0)
    got = weighted_kl_projection(log_u, costs, budget * 123.0, 1e-3)
    torch.testing.assert_close(got, kl_projection(log_u, budget, 1e-3), rtol=0, atol=1e-12)


def test_a_uniform_start_is_feasible_and_kept():
    costs = torch.tensor([11_720_448.0, 384.0, 147_456.0, 384.0, 589_824.0, 2.0])
    ratio = 0.2
    start = torch.full((6,), ratio, dtype=torch.float64)
    got = weighted_kl_projection(start.log(), costs, ratio * float(costs.sum()), 1e-3)
    torch.testing.assert_close(got, start, rtol=0, atol=1e-12)


def test_the_free_entries_keep_their_proportions():
    # One common factor: what a penalised entry frees goes to the others in proportion to
    # their weights, whatever their costs (the cost-weighted divergence's property).
    costs = torch.tensor([100.0, 1.0, 1.0, 1.0])
    log_u = torch.log(torch.tensor([0.1, 0.2, 0.4, 0.001], dtype=torch.float64))
    budget = 0.2 * float(costs.sum())
    q = weighted_kl_projection(log_u, costs, budget, 1e-3)
    assert abs(float((costs * q).sum()) - budget) < 1e-9
    ratios = (q / log_u.exp())[:3]
    torch.testing.assert_close(ratios, ratios[:1].expand(3), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("costs", "budget", "match"),
    [
        ([1.0, 0.0], 0.5, "positive and finite"),
        ([1.0, float("inf")], 0.5, "positive and finite"),
        ([1.0, 2.0], 5.0, "infeasible"),
        ([1.0, 2.0], 1e-6, "infeasible"),
        ([1.0], 0.5, "same N"),
    ],
)
def test_weighted_projection_rejects_bad_input(costs, budget, match):
    with pytest.raises(ValueError, match=match):
        weighted_kl_projection(torch.zeros(2), torch.tensor(costs), budget, 1e-3)


def test_weighted_projection_degenerate_budgets():
    costs = torch.tensor([1.0, 5.0, 10.0])
    top = weighted_kl_projection(torch.zeros(3), costs, 16.0, 1e-3)
    bottom = weighted_kl_projection(torch.zeros(3), costs, 16e-3, 1e-3)
    assert top.tolist() == [1.0, 1.0, 1.0] and bottom.tolist() == [1e-3] * 3
    # Log-weights far apart and -inf stay finite and feasible.
    q = weighted_kl_projection(torch.tensor([0.0, -2000.0, -math.inf]), costs, 3.0, 1e-3)
    assert bool(torch.isfinite(q).all()) and abs(float((costs * q).sum()) - 3.0) < 1e-9


# -- the bandit under a compute budget -----------------------------------------------------
from lightning_slsam.selection.bandit import LayerBandit  # noqa: E402

COSTS = torch.tensor([11_720_448.0, 384.0, 147_456.0, 384.0, 589_824.0, 2.0, 147_456.0, 384.0])


@pytest.mark.parametrize("loss", ["shifted", "rank"])
def test_bandit_keeps_the_compute_budget_under_adversarial_updates(loss):
    bandit = LayerBandit(8, 0.2, 1e-3, alpha_p=0.5, loss=loss, costs=COSTS,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.equal(bandit.probs, torch.full((8,), 0.2, dtype=torch.float64))
    rng = torch.Generator().manual_seed(1)
    budget = 0.2 * float(COSTS.sum())
    for _ in range(200):
        active = bandit.sample()
        norms = torch.rand(8, generator=rng, dtype=torch.float64) * 10 ** torch.randint(
            -3, 3, (8,), generator=rng
        )
        assert bandit.update(active, norms)
        p = bandit.probs
        assert abs(float((COSTS.double() * p).sum()) - budget) <= 1e-9 * budget
        assert bool((p >= 1e-3).all() and (p <= 1).all())


def test_the_compute_budget_keeps_a_favoured_embedding_at_its_share():
    # The embedding has the largest gradient norm every step: under the count budget the
    # bandit draws it almost always, under the compute budget it pays for it.
    norms = torch.tensor([8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def final(costs):
        bandit = LayerBandit(8, 0.2, 1e-3, loss="rank", costs=costs,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
        for _ in range(300):
            bandit.update(bandit.sample(), norms)
        return bandit.probs

    count, compute = final(None), final(COSTS)
    assert count[0] > 0.8  # the count budget's bandit trains the embedding most steps
    active = float((COSTS.double() * compute).sum() / COSTS.sum())
    assert compute[0] < 0.25 and abs(active - 0.2) < 1e-9
    assert float((COSTS.double() * count).sum() / COSTS.sum()) > 0.75


def test_bandit_state_round_trips_and_refuses_another_budget():
    bandit = LayerBandit(8, 0.2, costs=COSTS, generator=torch.Generator().manual_seed(0))
    bandit.update(bandit.sample(), torch.arange(1.0, 9.0))
    state = bandit.state_dict()
    again = LayerBandit(8, 0.2, costs=COSTS)
    again.load_state_dict(state)
    assert torch.equal(again.probs, bandit.probs) and torch.equal(again.sample(), bandit.sample())
    with pytest.raises(ValueError, match="another budget"):
        LayerBandit(8, 0.2).load_state_dict(state)
    with pytest.raises(ValueError, match="another budget"):
        LayerBandit(8, 0.2, costs=COSTS * 2).load_state_dict(state)
    count_state = LayerBandit(8, 0.2).state_dict()
    with pytest.raises(ValueError, match="another budget"):
        LayerBandit(8, 0.2, costs=COSTS).load_state_dict(count_state)
    with pytest.raises(ValueError, match="positive finite"):
        LayerBandit(8, 0.2, costs=torch.zeros(8))


def test_the_paper_preset_keeps_the_count_budget():
    from lightning_slsam import SparseLayerSAM, make_engine

    assert SparseLayerSAM(preset="paper").budget == "count"
    assert SparseLayerSAM(preset="robust").budget == "count"
    net = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 2))
    assert make_engine("slsam", net, seed=0).selection.costs is None  # "slsam" is the paper's
    engine = make_engine("slsam", net, seed=0, budget="compute")
    assert engine.selection.costs.tolist() == [800.0, 16.0, 2.0]
    with pytest.raises(ValueError, match="`budget`"):
        SparseLayerSAM(budget="flops")


def test_a_fit_under_the_compute_budget_and_a_resume_that_switches_budget(tmp_path):
    import lightning as L
    from helpers import LitModel, loader, make_data, make_mlp, trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_slsam import SparseLayerSAM

    def fit(budget, max_epochs, ckpt_path=None, callbacks=()):
        L.seed_everything(0)
        callback = SparseLayerSAM(layer_ratio=0.3, budget=budget, bandit_loss="rank")
        t = trainer(callbacks=[callback, *callbacks], max_epochs=max_epochs,
                    enable_checkpointing=bool(callbacks))  # fmt: skip
        t.fit(LitModel(make_mlp(seed=5)), loader(make_data(64), 16), ckpt_path=ckpt_path)
        return callback

    saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    counted = fit("count", 1, callbacks=[saver])
    assert counted.bandit.costs is None
    with pytest.warns(UserWarning, match="budget 'count' -> 'compute'"):
        switched = fit("compute", 2, ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    costs = switched.bandit.costs
    assert costs.tolist() == [float(n) for n in switched.partition.numel]
    share = float((costs * switched.probs).sum() / costs.sum())
    assert abs(share - 0.3) < 1e-9 and switched.engine.num_steps == 8


def test_under_a_compute_budget_the_bandit_tracks_norm_over_root_cost():
    # The variance sum(r**2 / p) under sum(c * p) = B is least at p ~ r / sqrt(c): with fixed
    # norms the rank bandit settles near that (within the floor and its step noise).
    costs = torch.tensor([400.0, 100.0, 25.0, 1.0, 1.0, 4.0], dtype=torch.float64)
    norms = torch.tensor([8.0, 2.0, 2.0, 0.5, 0.25, 1.0], dtype=torch.float64)
    bandit = LayerBandit(6, 0.3, 1e-3, alpha_p=0.05, loss="rank", costs=costs,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    history = []
    for step in range(3000):
        bandit.update(bandit.sample(), norms)
        if step >= 1000:
            history.append(bandit.probs)
    mean = torch.stack(history).mean(0)
    target = norms / costs.sqrt()
    target = target * (0.3 * float(costs.sum()) / float((costs * target).sum()))
    assert bool(((mean - target).abs() / target < 0.35).all()), (mean, target)
    # The count budget's fixed point, p ~ r, would put the costly first layer far higher.
    assert mean[0] < 0.5 * float(norms[0] / norms.sum() * 6 * 0.3)
